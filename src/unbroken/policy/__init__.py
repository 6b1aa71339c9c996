"""Pure decisions: who computes which microbatch, what a failure changes, when a step commits.

Owns: quota arithmetic, redistribution of lost microbatches, loss weights, the in-step recovery state
machine, and (added by later issues) the time predictor, the detector and the schedulers.
Does not own: processes, clocks, I/O, tensors. Nothing here imports torch, the runtime or the simulator,
so the trainer and the simulator call the very same functions (a test enforces this).
"""
