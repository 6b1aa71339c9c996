"""Trainer state leaving and re-entering a trainer process.

Runs in the trainer. Owns: the flat view of parameters, optimizer state and RNG (state.py), the
trainer's persistence hooks for in-memory snapshots and restores (persistence.py), DCP checkpoints on
disk (checkpoint.py), and a heal's transfer (healing.py). May import: store/, parallel/, snapshot/'s
client; never trainer/, coordinator/ or launcher/. Does not own: the bytes in CPU memory (snapshot/, a
separate agent process), the donor's side of a heal (trainer/donor.py) or when to restart (launcher/).
"""
