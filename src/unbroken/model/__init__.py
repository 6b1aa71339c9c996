"""Models, their data and their optimizer step: what a user's training job is made of.

Owns: the built-in GPT (gpt.py, one file, nanoGPT style, with the hooks the parallel mechanics ask of a
model: its blocks, `no_weight_decay`), the data (data/: token files, corpora, microbatch (seed, step, i)),
and the optimizer step's pure parts (optim.py: lr schedules, parameter groups, clipping a whole model).
May import: torch, config; never runtime/ (the runtime imports the model, not the other way round).
"""
