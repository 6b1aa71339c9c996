"""The launching process: what `unbroken train` runs on the host that starts a job.

Owns: starting the coordinator, the snapshot agents and one torchrun per replica group (launch.py,
agents.py, starting.py, zygote.py's fork server), the launcher-side faults that a process cannot fire on
itself (chaos.py: node loss, torn or corrupted snapshots), whole-job restarts and `unbroken resume`
(resume.py), and summary.json. May import: store/, coordinator/ (it forks the coordinator), snapshot/'s
agent control, observe/; never trainer/, parallel/ or persist/: it starts trainers, it does not run them.
"""
