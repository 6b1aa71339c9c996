"""excuse(): a coordinator that could not look for `gap` seconds blames nobody for that silence."""
from unbroken.policy.membership import Beat, excuse, stale


def test_a_gap_the_coordinator_could_not_see_is_not_silence():
    beats = {0: Beat(5, 3, "compute", 1, seen_at=10.0, progress_at=9.0),
             1: Beat(7, 3, "compute", 2, seen_at=10.5, progress_at=10.5)}
    now = 16.0  # 5.5 s after the last beats: stale for a 5 s timeout ...
    assert set(stale(beats, (0, 1), now, 5.0, 60.0, 120.0)) == {0, 1}
    excused = excuse(beats, 5.0)  # ... but the coordinator's own store calls hung for 5 s of it
    assert stale(excused, (0, 1), now, 5.0, 60.0, 120.0) == {}
    assert excused[0].seen_at == 15.0 and excused[0].progress_at == 14.0 and excused[0].seq == 5
    assert set(stale(excused, (0, 1), now + 5.1, 5.0, 60.0, 120.0)) == {0, 1}  # silence after it still counts
