"""Data: token files and text corpora, and microbatch (seed, step, i) -> tokens as a pure function.

Owns, by module: formats.py (reading token files from disk: llm.c shards, Megatron-LM `.bin`/`.idx`, raw
token arrays, all memory-mapped), sampling.py (the seed mixer, sequence lengths, the seeded permutation of
windows over all shards), corpus.py (text corpora: the Python standard library's source, a text file),
batch.py (the `Microbatch` value, a rank's part of it, seeding its randomness), source.py (`DataSource`,
which draws microbatches from either), check.py (the checks `unbroken train` makes before anything
starts) and prepare.py (`unbroken prepare-data`: text into llm.c shards). Does not own: who computes a
microbatch (policy) or loss weights (policy.workload).

Microbatch (s, i) depends only on (seed, s, i): which replica asks, and when, never changes it. That is
invariant 1 of docs/design.md.

The names other modules import from here load their module on first use (PEP 562): the launcher's
checks read token files through formats.py without importing torch (~2 s) for batch.py and source.py.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unbroken.model.data.batch import Microbatch, part, seed_microbatch
    from unbroken.model.data.corpus import Corpus
    from unbroken.model.data.sampling import mix
    from unbroken.model.data.source import DataSource

_EXPORTS = {"mix": "sampling", "seed_microbatch": "batch", "Microbatch": "batch", "part": "batch",
            "Corpus": "corpus", "DataSource": "source"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
