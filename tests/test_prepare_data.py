"""`unbroken prepare-data`: text files into llm.c shards with a real tokenizer (a tiny BPE trained here
with the `tokenizers` package: nothing downloads), byte-level without one, uint32 shards for a vocabulary
over 65,535; every shard read back here with numpy, not with the project's reader; bad input one line and
exit 2; and a run that trains on what it wrote."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import unbroken

tokenizers = pytest.importorskip("tokenizers")

pytestmark = pytest.mark.timeout(120)

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 12,
         "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int\n    y: int\n" * 6,
         "Pack my box with five dozen liquor jugs.\n\nSphinx of black quartz, judge my vow.\n" * 8]


def tiny_bpe(path: Path, vocab: int = 320) -> "tokenizers.Tokenizer":
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    tok.save(str(path))
    return tok


def read_llmc(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(header, tokens) of an llm.c shard, as llm.c's and modded-nanogpt's loaders read one."""
    header = np.fromfile(path, dtype=np.int32, count=256)
    dtype = {20240520: np.uint16, 20240801: np.uint32}[int(header[0])]
    tokens = np.fromfile(path, dtype=dtype, offset=256 * 4)
    assert len(tokens) == header[2]
    return header, tokens


@pytest.fixture
def texts(tmp_path):
    files = []
    for n, text in enumerate(TEXTS):
        files.append(tmp_path / f"doc{n}.txt")
        files[-1].write_text(text)
    return files


def test_a_trained_tokenizer_one_document_a_file(tmp_path, texts):
    tok = tiny_bpe(tmp_path / "tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>")
    r = unbroken("prepare-data", *map(str, texts), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--out", str(tmp_path / "out"), timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    want = np.concatenate([tok.encode(t, add_special_tokens=False).ids + [eos] for t in TEXTS])
    header, got = read_llmc(tmp_path / "out" / "shard_000000.bin")
    assert tuple(header[:2]) == (20240520, 1) and np.array_equal(got, want)
    assert [tok.decode(list(map(int, d))) for d in np.split(got, np.flatnonzero(got == eos) + 1)[:-1]] == TEXTS
    assert f"wrote {len(want):,} tokens, 3 documents" in r.stdout and f"--data.eos={eos}" in r.stdout


def test_byte_level_blank_line_documents_and_small_shards(tmp_path, texts):
    r = unbroken("prepare-data", str(texts[2]), "--split", "blank-lines", "--shard-tokens", "100",
                 "--out", str(tmp_path / "out"), timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    blocks = [b for b in TEXTS[2].split("\n\n") if b.strip()]
    want = np.concatenate([list(b.encode()) + [0] for b in blocks])
    shards = sorted((tmp_path / "out").glob("shard_*.bin"))
    assert len(shards) == -(-len(want) // 100) and all(read_llmc(s)[0][2] <= 100 for s in shards)
    assert np.array_equal(np.concatenate([read_llmc(s)[1] for s in shards]), want)
    assert f"{len(blocks)} documents" in r.stdout


def test_a_vocabulary_over_65535_writes_uint32(tmp_path, texts):
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = sorted(set(" ".join(TEXTS).split()))
    vocab = {"[UNK]": 0, "</s>": 66_000} | {w: 69_000 + n for n, w in enumerate(words)}
    used = set(vocab.values())
    vocab |= {f"w{n}": n for n in range(70_000) if n not in used}  # 70,000 ids, each once
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "wide.json"))
    r = unbroken("prepare-data", str(texts[0]), "--tokenizer", str(tmp_path / "wide.json"),
                 "--out", str(tmp_path / "out"), timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    header, got = read_llmc(tmp_path / "out" / "shard_000000.bin")
    assert tuple(header[:2]) == (20240801, 7) and got.dtype == np.uint32
    assert got.tolist() == [vocab[w] for w in TEXTS[0].split()] + [66_000]


@pytest.mark.parametrize("case", ["no tokenizer file", "no end token", "no input"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, texts, case):
    from tokenizers import Tokenizer, models
    args = [str(texts[0]), "--tokenizer", str(tmp_path / "missing.json")]
    if case == "no end token":
        Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(tmp_path / "t.json"))
        args = [str(texts[0]), "--tokenizer", str(tmp_path / "t.json")]
    if case == "no input":
        args = [str(tmp_path / "absent.txt")]
    r = unbroken("prepare-data", *args, "--out", str(tmp_path / "out"), timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("unbroken: error: "), r.stderr
    assert ("missing.json" if case == "no tokenizer file" else "--eos" if case == "no end token"
            else "absent.txt") in lines[0]


@pytest.mark.timeout(240)
def test_train_on_what_prepare_data_wrote(tmp_path, texts):
    tok = tiny_bpe(tmp_path / "tokenizer.json")
    r = unbroken("prepare-data", *map(str, texts), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--out", str(tmp_path / "data"), timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "run"
    r = unbroken("train", f"--data.path={tmp_path / 'data'}/shard_*.bin", f"--model.vocab_size={tok.get_vocab_size()}",
                 f"--data.eos={tok.token_to_id('<|endoftext|>')}", "--data.seq_len=32", "--replicas", "1",
                 "--microbatches", "2", "--steps", "2", "--run.progress=false", "--out", str(out), timeout=200)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_committed"] == 2 and summary["final_loss"] > 0
