"""Of a group's survivors, one claims to stand in for the group it belonged to (coordination.claim_standin):
found by a run where a rank broke 30 s late (stuck in its group's first rendezvous, EADDRINUSE at its
peer) while its peer had long since shrunk and finished; it claimed for the stand-in's incarnation, won,
and waited for an admission the finished run never gave until the launcher's run timeout (150 s)."""
from __future__ import annotations

from torch.distributed import HashStore

from unbroken.runtime.control import keys
from unbroken.runtime.control.coordination import Coordination


def test_a_survivor_claims_for_its_own_incarnation_not_the_group_s_newest():
    store = HashStore()
    first, late = Coordination(store, 1, rank=0), Coordination(store, 1, rank=1)  # group 1's two ranks at start
    assert first.claim_standin()  # rank 1 lost: rank 0 goes on as the group ...
    store.set(keys.joined(1), "3")  # ... admitted shrunk in epoch 3
    standin = Coordination(store, 1, rank=0)
    standin.incarnation = "3"  # as worker.join sets it on admission
    assert not late.claim_standin()  # the late survivor of the first incarnation leaves
    assert standin.claim_standin()  # the stand-in's own incarnation, were it to break: its claim is new
