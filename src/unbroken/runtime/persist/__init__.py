"""Trainer state leaving and re-entering a trainer process.

Owns: the flat view of parameters, optimizer state and RNG (state.py), the trainer's persistence hooks
for in-memory snapshots and restores (persistence.py), and DCP checkpoints on disk (checkpoint.py).
Does not own: the bytes in CPU memory (snapshot/, a separate agent process) or when to restart (the
launcher).
"""
