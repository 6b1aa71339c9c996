"""The trainer process: one per rank, started by torchrun (or forked by forkrun's agent).

Owns: the process's lifecycle from connection to exit code (lifecycle.py), one step of the protocol read
top to bottom (step.py, on the step's data in stepwork.py), commit pipelining (speculation.py), the
member's view of the store (membership.py, sidecar.py, heartbeat.py), the donor side of a heal
(donor.py), a group re-forming on its survivors (replan_reform.py), injected faults (faults.py) and the
device-time clock (devicetime.py). `python -m unbroken.runtime.trainer` runs it (__main__.py); forkrun.py
is torchrun's agent with this package imported once, its ranks forked from it. May import: store/,
parallel/, persist/, snapshot/ (the client), policy/, model/; never coordinator/ or launcher/.
"""
