"""The coordinator process: one per job (`unbroken coordinator`, or forked by the local launcher).

Owns: membership epochs, heartbeat verdicts and fencing, commit bookkeeping and the step records' home
(coordinator.py), the fail-slow detector's runtime (slowness.py), re-planning a group that loses ranks or
slows (replan.py, measured by replan_measure.py; the choice itself is policy/replan_scheduler.py), metrics
(metrics.py), the standby election (election.py) and the standalone command (standalone.py). May import:
store/, policy/, observe/; never trainer/, launcher/, parallel/ or torch.nn: a trainer's death never takes
the coordinator with it, and the coordinator holds no model.
"""
