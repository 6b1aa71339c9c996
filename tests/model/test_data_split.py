"""eval.split holds data out: training's microbatches never read the held-out tail (token files: the last
windows of the tiling; text: the corpus's last bytes), evaluation's read only it, and both stay pure
functions of (seed, step, i)."""
from __future__ import annotations

import numpy as np
import pytest

from unbroken.config import DataConfig
from unbroken.model.data import DataSource
from unbroken.model.data.corpus import Corpus, from_bytes

pytestmark = pytest.mark.timeout(60)


def test_token_files_hold_out_their_last_windows(tmp_path):
    tokens = np.arange(10_000, dtype=np.uint16) % 60_000
    (tmp_path / "a.bin").write_bytes(tokens[:6000].tobytes())
    (tmp_path / "b.bin").write_bytes(tokens[6000:].tobytes())
    cfg = DataConfig(path=str(tmp_path / "*.bin"), format="raw", seq_len="16", batch_size=4)
    train = DataSource(cfg, 16, 0, microbatches=8, held_out=0.25)
    held = DataSource(cfg, 16, 0, microbatches=8, held_out=0.25, part="eval")
    # windows of 17 tokens tile a.bin (374 windows) then b.bin (249); the last 156 of 623 are held out:
    # b.bin's windows 93.. , i.e. tokens from 6000 + 93 * 16 = 7488 on (the values are the token offsets)
    seen_train = {int(mb.x[r, 0]) for s in range(40) for i in range(8) for r in range(4)
                  for mb in [train.microbatch(s, i)]}
    seen_eval = {int(mb.x[r, 0]) for i in range(8) for r in range(4) for mb in [held.microbatch(0, i)]}
    assert max(seen_train) < 7488 <= min(seen_eval)
    assert len(seen_train) == 623 - 156  # 1,280 samples: every training window, epochs wrap
    assert np.array_equal(held.microbatch(0, 3).x, held.microbatch(0, 3).x)


def test_a_text_corpus_holds_out_its_tail():
    raw = bytes(range(32, 127)) * 200
    corpus = from_bytes(raw)
    head, tail = corpus.split(0.2, "train"), corpus.split(0.2, "eval")
    assert len(head.tokens) + len(tail.tokens) == len(raw) and len(tail.tokens) == int(np.ceil(0.2 * len(raw)))
    cfg = DataConfig(seq_len="16", batch_size=4)
    train = DataSource(cfg, 16, 0, corpus=Corpus(corpus.tokens, corpus.starts), held_out=0.2)
    assert len(train.corpus.tokens) == len(head.tokens)
    assert np.array_equal(train.corpus.tokens, corpus.tokens[:len(head.tokens)])
