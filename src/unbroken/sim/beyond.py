"""What the simulator models that the runtime cannot do yet: the one list, kept in one place.

Owns: BEYOND_RUNTIME (each capability the simulator assumes and the runtime lacks today, with the words
that say so) and `beyond_runtime(scenario, replans)`, the entries a run actually relies on. Every simulated
run states them in its `run_start` record, and benchmarks/paper_scenarios.py prints them beside its
figures, so no simulated number passes for something the runtime has shown. Does not own: the models
themselves (strategies/, cluster.py). When the runtime gains one of these, delete its entry here.
"""
from __future__ import annotations

from unbroken.sim.scenario import Scenario

BEYOND_RUNTIME: dict[str, str] = {
    # (rejoin left this list: the runtime admits restarted or new groups and heals them from a live
    # peer, with the same policy.membership.admit the simulator uses)
    "replica_groups": "replica groups of TP x PP ranks (the runtime's groups shard with FSDP2 only)",
    # the scheduler itself is policy code the runtime can call (policy/scheduling.py); what it lacks is
    # executing a plan change inside a group, and locating a slow rank inside a group
    "replanning": "re-planning a replica group around a lost or slow rank: shrinking TP x PP, moving layers "
                  "off a slow stage, growing back (the runtime has the scheduler, policy/scheduling.py, but "
                  "cannot change a group's plan yet), with the slow rank inside a group located exactly (the "
                  "runtime's detector times whole groups)",
    "hosts": "many hosts (the runtime's cluster path, one torchrun job per host, is tested on one machine)",
}


def beyond_runtime(sc: Scenario, replans: bool = False) -> list[str]:
    """The BEYOND_RUNTIME entries a run of `sc` relies on, as sentences: replica groups if TP x PP > 1,
    re-planning if the strategy re-plans groups (`replans`) of more than one rank, hosts if the cluster
    has more GPUs than one node holds."""
    c = sc.cluster
    uses = {
        "replica_groups": c.tp * c.pp > 1,
        "replanning": replans and c.tp * c.pp > 1,
        "hosts": c.gpus > c.gpus_per_node,
    }
    return [text for key, text in BEYOND_RUNTIME.items() if uses[key]]
