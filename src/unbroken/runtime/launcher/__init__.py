"""The launching process: what `unbroken train` runs on the host that starts a job.

Owns: starting the coordinator, the snapshot agents and the workers (launch.py, agents.py), the
launcher-side faults that a process cannot fire on itself (chaos.py: node loss, torn or corrupted
snapshots), whole-job restarts, and summary.json. Does not own: liveness verdicts (control/), training
(trainer.py) or what a restart loads (persist/).
"""
