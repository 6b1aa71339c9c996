"""Of a group's survivors, one claims to stand in for the group it belonged to (membership.claim_standin):
found by a run where a rank broke 30 s late (stuck in its group's first rendezvous, EADDRINUSE at its
peer) while its peer had long since shrunk and finished; it claimed for the stand-in's incarnation, won,
and waited for an admission the finished run never gave until the launcher's run timeout (150 s)."""
from __future__ import annotations

from torch.distributed import HashStore

from unbroken.runtime.store import keys
from unbroken.runtime.trainer.membership import Coordination


def test_a_survivor_claims_for_its_own_incarnation_not_the_group_s_newest():
    store = HashStore()
    first, late = Coordination(store, 1, rank=0), Coordination(store, 1, rank=1)  # group 1's two ranks at start
    assert first.claim_standin()  # rank 1 lost: rank 0 goes on as the group ...
    store.set(keys.joined(1), "3")  # ... admitted shrunk in epoch 3
    standin = Coordination(store, 1, rank=0)
    standin.incarnation = "3"  # as admission.join sets it on admission
    assert not late.claim_standin()  # the late survivor of the first incarnation leaves
    assert standin.claim_standin()  # the stand-in's own incarnation, were it to break: its claim is new


def test_a_survivor_s_report_of_its_broken_group_spares_the_other_survivors():
    """Under parallel.on_rank_loss=replan a survivor that finds its group's process group broken reports
    BROKE, not an exit code: the verdict names some rank (-1), so every rank reading it is a survivor and
    claims (worker's `spared`, trainer.fence) rather than leaving as a fenced group's rank would (CI at
    bca5810: rank 0 fenced 0.1 s after an exit-code report, its TP team unable to re-form). A verdict on a
    named rank or an exit keeps its meaning."""
    from unbroken.runtime.store.reasons import BROKE, lost_rank

    assert lost_rank(BROKE) == -1
    assert lost_rank("rank 3: no heartbeat for 2.0 s") == 3
    assert lost_rank("process exited with code 4") is None
    store = HashStore()
    Coordination(store, 1, rank=2).leave(BROKE)
    assert store.get(keys.exited(1)).decode() == BROKE  # the coordinator words a phrase as it is


def test_a_late_survivor_does_not_report_the_re_formed_group_broken():
    """A survivor that wakes after its group was admitted again (blocked on a peer's socket until that
    peer's process ended) finds its incarnation superseded and reports nothing: its report would declare
    the re-formed group dead (seen: 3 late survivors of a 3-D group fenced its stand-in)."""
    store = HashStore()
    late = Coordination(store, 1, rank=6)
    assert not late.superseded()  # its group as it started: a report is due
    store.set(keys.joined(1), "2")  # the survivors' plan admitted in epoch 2
    assert late.superseded()
    standin = Coordination(store, 1, rank=0)
    standin.incarnation = "2"  # as admission.join sets it on admission
    assert not standin.superseded()
