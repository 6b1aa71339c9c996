"""What runs: one folder per process, plus the mechanics the trainer uses.

  store/        the coordination store every process talks to: every key (keys.py), the TCPStore and etcd
                clients, watches, the words of a dead verdict. Imports nothing else of runtime/.
  coordinator/  the coordinator process: membership epochs, verdicts, commit bookkeeping, the fail-slow
                detector, re-planning, metrics, the standby election, `unbroken coordinator`.
  trainer/      the trainer process (one per rank, under torchrun): its lifecycle, the step, the member's
                view of the store (membership, sidecar, heartbeat), commit pipelining, faults, device time.
  launcher/     the launching process of `unbroken train`: the coordinator, snapshot agents and one torchrun
                per replica group, chaos and whole-job restarts.
  snapshot/     the snapshot agent process (one per node, outlives the trainers) and its client.
  parallel/     mechanics the trainer runs, never a model's module names: meshes, parallelize, pipeline
                stages, accumulators, cross-group collectives, stand-ins.
  persist/      trainer state leaving and re-entering a trainer: snapshots' hooks, DCP, heals.

Does not own: decisions (policy/), the simulator (sim/), or what the user types (cli.py, commands.py).
"""
