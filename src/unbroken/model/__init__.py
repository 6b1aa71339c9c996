"""Models, their data and their optimizer step: what a user's training job is made of.

Owns: the built-in models, each one file with its parallel plan (plan.py: what FSDP2, TP and the
pipeline act on, by module path) and `no_weight_decay`: the GPT (gpt.py, nanoGPT style) and a
Llama-3-style model (llama.py, torchtitan style), `built_in` picks one by model.arch; the data (data/: token files, corpora, microbatch (seed, step, i)),
and the optimizer step's pure parts (optim.py: lr schedules, parameter groups, clipping a whole model).
May import: torch, config; never runtime/ (the runtime imports the model, not the other way round).
"""


def built_in(cfg):
    """The built-in model that `cfg.arch` names (a ModelConfig): "gpt" or "llama". Call after seeding."""
    if cfg.arch == "llama":
        from unbroken.model.llama import Llama
        return Llama(cfg)
    from unbroken.model.gpt import GPT
    return GPT(cfg)
