"""Pure decisions: who computes which microbatch, what a failure changes, when a step commits.

Owns: quota arithmetic, redistribution of lost microbatches and loss weights (workload), the in-step
recovery state machine (recovery), membership epochs (membership), the microbatch time predictor
(predictor), the fail-slow detector (detection), snapshot/restart choices (snapshotting), and
re-planning a replica group (replan_scheduler: which plan; replan_plans: TP x PP plan shapes; stepcost:
their cost).
Does not own: processes, clocks, I/O, tensors. Nothing here imports torch, the runtime or the simulator,
so the trainer and the simulator call the very same functions (a test enforces this).
"""
