"""The control plane: the coordinator process and every member's view of its store.

Runs in two processes: the coordinator (coordinator.py, slowness.py: membership epochs, dead verdicts,
fencing, the fail-slow detector) and each trainer (coordination.py, epochwatch.py, heartbeat.py,
sidecar.py: the member's reads, writes, watches and background threads). keys.py names every store key;
store.py connects to the store and reads it. Does not own: the step's arithmetic (trainer.py) or any
decision logic (policy/).
"""
