"""Models, their data and their optimizer step: what a user's training job is made of.

Owns: the built-in models, each one file with its parallel plan (plan.py: what FSDP2, TP and the
pipeline act on, by module path) and `no_weight_decay`: the GPT (gpt.py, nanoGPT style) and a
Llama-3-style model (llama.py, torchtitan style), builtin.py picks one by model.arch; a Hugging Face
adapter (hf.py); the data (data/: token files, corpora, microbatch (seed, step, i)),
and the optimizer step's pure parts (optim.py: lr schedules, parameter groups, clipping a whole model).
May import: torch, config; never runtime/ (the runtime imports the model, not the other way round).
"""

