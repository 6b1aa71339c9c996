"""Invariant 1 for data: microbatch (seed, step, i) is a pure function — the same tensors in another
process and in any order, different for another seed; variable lengths pad targets with -1 and report
tokens/sumsq that match the tensors; `--data PATH` reads text and uint16 `.bin` files; a step's loss
weights sum to one."""
from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from unbroken.config import DataConfig
from unbroken.model.data import DataSource
from unbroken.policy.workload import loss_weight

TEXT = "".join(f"def f{n}(x):\n    return x * {n} + {'y' * (n % 37)}\n\n" for n in range(400))


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text(TEXT)
    return str(p)


def source(path: str, seed: int = 0, seq_len: str = "32", batch_size: int = 4) -> DataSource:
    return DataSource(DataConfig(path=path, seq_len=seq_len, batch_size=batch_size), 64, seed)


def digest(ds: DataSource, keys) -> str:
    h = hashlib.sha256()
    for s, i in keys:
        mb = ds.microbatch(s, i)
        h.update(mb.x.numpy().tobytes() + mb.y.numpy().tobytes() + f"{mb.tokens},{mb.sumsq}".encode())
    return h.hexdigest()


KEYS = [(s, i) for s in range(3) for i in range(4)]


@pytest.mark.timeout(30)
def test_same_microbatches_in_another_process(corpus):
    """Another interpreter (its own hash seed), asking in reverse order, for fixed and variable lengths."""
    code = ("import sys; from tests.model.test_data import source, digest, KEYS; "
            "print(*(digest(source(sys.argv[1], seq_len=n), list(reversed(KEYS))) for n in ('32', 'variable')))")
    r = subprocess.run([sys.executable, "-c", code, corpus], capture_output=True, text=True, timeout=25,
                       cwd=Path(__file__).parents[2], env={**os.environ, "PYTHONHASHSEED": "123"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [digest(source(corpus, seq_len=n), list(reversed(KEYS))) for n in ("32", "variable")]


def test_order_and_instance_do_not_matter(corpus):
    a, b = source(corpus), source(corpus)
    forward = {k: a.microbatch(*k) for k in KEYS}
    for k in reversed(KEYS):
        mb = b.microbatch(*k)
        assert torch.equal(mb.x, forward[k].x) and torch.equal(mb.y, forward[k].y)
    assert torch.equal(a.microbatch(2, 3).x, forward[(2, 3)].x)  # asking again changes nothing


def test_seed_step_and_index_all_matter(corpus):
    base = source(corpus, seed=0).microbatch(1, 1).x
    assert not torch.equal(base, source(corpus, seed=1).microbatch(1, 1).x)
    assert not torch.equal(base, source(corpus).microbatch(2, 1).x)
    assert not torch.equal(base, source(corpus).microbatch(1, 2).x)


def test_fixed_length_targets_are_inputs_shifted(corpus):
    mb = source(corpus).microbatch(0, 0)
    assert mb.x.shape == mb.y.shape == (4, 32) and mb.x.dtype == torch.int64
    assert torch.equal(mb.x[:, 1:], mb.y[:, :-1]) and mb.tokens == 4 * 32 and mb.sumsq == 4 * 32 * 32


def test_variable_lengths_pad_with_minus_one(corpus):
    ds = source(corpus, seq_len="variable", batch_size=8)
    lengths = set()
    for s, i in KEYS:
        mb = ds.microbatch(s, i)
        n = (mb.y != -1).sum(dim=1)  # counted targets per row; padding only at the end of a row
        for row, k in enumerate(n.tolist()):
            assert (mb.y[row, k:] == -1).all() and (mb.y[row, :k] >= 0).all() and (mb.x[row, k:] == 0).all()
        assert mb.tokens == int(n.sum()) and mb.sumsq == int((n * n).sum())
        assert ds.features(s, i) == (mb.tokens, mb.sumsq)
        assert 8 <= n.min() and n.max() <= 64 and mb.x.shape[1] == n.max()
        lengths.update(n.tolist())
    assert len(lengths) > 3  # really variable
    assert ds.step_tokens(1, 4) == sum(ds.microbatch(1, i).tokens for i in range(4))


def test_min_max_range(corpus):
    n = (source(corpus, seq_len="10-20", batch_size=16).microbatch(0, 0).y != -1).sum(dim=1)
    assert 10 <= n.min() and n.max() <= 20
    with pytest.raises(ValueError, match="seq_len"):
        source(corpus, seq_len="20-10")


def test_text_file_is_byte_tokens(corpus):
    ds = source(corpus)
    mb = ds.microbatch(0, 0)
    row = bytes(mb.x[0].tolist()).decode()
    assert row in TEXT and len(ds.corpus.tokens) == len(TEXT.encode())
    assert len(ds.corpus.starts) > 100  # documents split at blank lines


def test_uint16_bin_file(tmp_path):
    tokens = (np.arange(5000, dtype=np.int64) * 7919 % 50257).astype(np.uint16)  # GPT-2 sized vocabulary
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    mb = source(str(path)).microbatch(3, 1)
    assert mb.x.max() > 255  # not bytes
    start = int(np.flatnonzero(tokens == mb.x[0, 0].item())[0])
    assert mb.x[0].tolist() == tokens[start:start + 32].tolist()
    assert mb.y[0].tolist() == tokens[start + 1:start + 33].tolist()


def test_too_small_corpus_is_an_error(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text("short")
    with pytest.raises(ValueError, match="fewer than one sequence"):
        source(str(p))


@pytest.mark.parametrize("seq_len", ["32", "variable"])
def test_loss_weights_of_a_step_sum_to_one(corpus, seq_len):
    ds = source(corpus, seq_len=seq_len)
    for step in range(3):
        total = ds.step_tokens(step, 8)
        weights = [loss_weight(ds.microbatch(step, i).tokens, total) for i in range(8)]
        assert math.isclose(sum(weights), 1.0, rel_tol=1e-12) and min(weights) > 0
    with pytest.raises(ValueError):
        loss_weight(0, 0)
