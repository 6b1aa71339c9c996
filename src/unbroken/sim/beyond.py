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
    # peer, with the same policy.membership.admit the simulator uses; so did TP x PP replica groups:
    # the runtime runs TP inside pipeline stages, rank = stage x tp + TP index, as the simulator's groups;
    # and so did their snapshots and DCP checkpoints: tests/runtime/persist/test_pp_tp_persist.py)
    # the runtime's coordinator calls the same scheduler (runtime/coordinator/replan.py) when its detector
    # declares a group Slow or Healthy again (executing keep or reweight, and under --run.quotas=drop
    # dropping a Slow group: parked for good, tests/runtime/coordinator/test_slow_pp.py) and when a group of 2 pipeline
    # stages, 2 TP ranks or 2 FSDP2 shards, or a TP x FSDP2 x PP group, loses a rank (executing drop, shrink
    # onto one survivor or, for a pipeline, onto its survivors as merged full stages, each one rank (every
    # TP index and FSDP2 shard of its stages) or a whole TP team (each rank every FSDP2 shard of its part):
    # runtime/trainer/replan_reform.py, and growing back), or has one slow rank located (shrinking around it onto one
    # healthy rank)
    "replanning": "re-planning a replica group around a lost or slow rank beyond what the runtime executes: "
                  "re-forming several survivors into a smaller plan of several ranks other than a pipeline of "
                  "merged full stages, each one rank or a TP team of the full degree, unsharded by FSDP2 "
                  "(which the runtime executes: runtime/trainer/replan_reform.py), "
                  "moving layers off a slow stage, "
                  "taking a group dropped for slowness back onto the step once it recovers (the runtime "
                  "executes keep and reweight for a slow group, and under --run.quotas=drop drops it for good: "
                  "a parked group computes nothing, so nothing measures it back; for a group that lost a rank, "
                  "drop, shrink onto one survivor or onto a pipeline of merged stages, and grow back tested for groups of 2 ranks and of 2 stages "
                  "x 2 TP ranks), with the slow rank inside a group located exactly (the runtime locates it "
                  "from its ranks' own device times against the same rank of the peer groups, and only below "
                  "0.7 of their speed: policy/locating.py), and a grow back that moves only what the returning "
                  "ranks lack (the runtime's grow restarts the whole group under torchrun, and every rank "
                  "re-pulls its state: about 2x the predicted bytes, measured in its group_plan_measured "
                  "events)",
    "hosts": "many hosts (the runtime's cluster path, one torchrun job per host, is tested on one machine)",
}


def beyond_runtime(sc: Scenario, replans: bool = False) -> list[str]:
    """The BEYOND_RUNTIME entries a run of `sc` relies on, as sentences: re-planning if the strategy
    re-plans groups (`replans`) of more than one rank, hosts if the cluster has more GPUs than one node
    holds."""
    c = sc.cluster
    uses = {
        "replanning": replans and c.tp * c.pp > 1,
        "hosts": c.gpus > c.gpus_per_node,
    }
    return [text for key, text in BEYOND_RUNTIME.items() if uses[key]]
