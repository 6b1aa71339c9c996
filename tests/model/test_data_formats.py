"""Token files read from disk: every format written here with numpy and struct (not the project's own
writer) and read back exactly; windows through a seeded permutation that covers every window of every
shard once an epoch, a pure function of (seed, step, i) in another process too; documents from a Megatron
index or an end-of-document id (variable lengths end there, positions restart there); a 2 GiB token
file sampled without the process's resident memory growing by 50 MiB; and each bad input one line
naming the file, exit 2, with no run directory."""
from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import unbroken
from unbroken.config import DataConfig
from unbroken.model.data import DataSource
from unbroken.model.data.formats import open_shards
from unbroken.model.data.sampling import permute

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_llmc(path: Path, tokens: np.ndarray, magic: int = 20240520, version: int = 1,
               dtype=np.uint16, count: int | None = None) -> Path:
    """llm.c's `write_datafile`: 256 int32 (magic, version, token count, zeros), then the tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + tokens.astype(dtype).tobytes())
    return path


def write_megatron(prefix: Path, docs: list[list[np.ndarray]], dtype=np.uint16) -> Path:
    """Megatron-LM's `_IndexWriter`: sequences end to end in PREFIX.bin; PREFIX.idx holds the header,
    sizes, byte pointers and the document index (first sequence of each document, then the count)."""
    seqs = [s for doc in docs for s in doc]
    sizes = np.array([len(s) for s in seqs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]) * np.dtype(dtype).itemsize
    index = np.cumsum([0] + [len(doc) for doc in docs], dtype=np.int64)
    prefix.with_suffix(".bin").write_bytes(b"".join(np.asarray(s, dtype=dtype).tobytes() for s in seqs))
    prefix.with_suffix(".idx").write_bytes(
        b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype])
        + struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(index))
        + sizes.tobytes() + pointers.astype(np.int64).tobytes() + index.tobytes())
    return prefix.with_suffix(".bin")


def tokens(n: int, vocab: int = 50257, salt: int = 0) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) + salt) * 7919 % vocab)


def source(path, seq_len="16", batch_size=4, seed=0, microbatches=2, **kw) -> DataSource:
    return DataSource(DataConfig(path=str(path), seq_len=seq_len, batch_size=batch_size, **kw), 64, seed,
                      microbatches=microbatches)


# -- each format read back exactly ---------------------------------------------------------------------

def test_llmc_uint16_and_uint32_shards(tmp_path):
    small = tokens(3000)
    big = tokens(3000, vocab=128_256, salt=5) + 65_536  # Llama 3 sized ids need uint32
    a = write_llmc(tmp_path / "a.bin", small)
    b = write_llmc(tmp_path / "b.bin", big, magic=20240801, version=7, dtype=np.uint32)
    [sa] = open_shards(str(a))
    [sb] = open_shards(str(b))
    assert sa.format == sb.format == "llmc" and sa.tokens.dtype == np.uint16 and sb.tokens.dtype == np.uint32
    assert np.array_equal(sa.tokens, small) and np.array_equal(sb.tokens, big)
    mb = source(b).microbatch(0, 0)
    assert mb.x.max() > 65_535 and _is_window(big, mb.x[0], mb.y[0])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_megatron_dataset_and_its_documents(tmp_path, dtype):
    vocab = 250 if dtype == np.uint8 else 50257
    rng = np.random.default_rng(1)
    docs = [[rng.integers(0, vocab, int(rng.integers(5, 40))) for _ in range(int(rng.integers(1, 3)))]
            for _ in range(60)]
    path = write_megatron(tmp_path / "corpus_text_document", docs, dtype)
    flat = np.concatenate([s for d in docs for s in d])
    for spec in (path, path.with_suffix(".idx"), tmp_path / "corpus_*"):  # the .bin, the .idx or a glob of both
        [s] = open_shards(str(spec))
        assert s.format == "megatron" and s.tokens.dtype == dtype and np.array_equal(s.tokens, flat)
    starts = np.cumsum([0] + [sum(len(q) for q in d) for d in docs[:-1]])
    assert np.array_equal(s.doc_starts, starts)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_raw_token_arrays(tmp_path, dtype):
    t = tokens(4000, vocab=100_000 if dtype == "uint32" else 50257)
    path = tmp_path / "train.bin"
    t.astype(dtype).tofile(path)
    [s] = open_shards(str(path), dtype=dtype)
    assert s.format == "raw" and np.array_equal(s.tokens, t)
    mb = source(path, dtype=dtype).microbatch(3, 1)
    assert all(_is_window(t, mb.x[r], mb.y[r]) for r in range(4))


def _is_window(t: np.ndarray, x: torch.Tensor, y: torch.Tensor) -> bool:
    """x, y are tokens [k*L, k*L + L) and [k*L + 1, k*L + L] of t for some k: a window, its targets shifted."""
    L = len(x)
    for k in range((len(t) - 1) // L):
        if t[k * L:k * L + L].tolist() == x.tolist():
            return t[k * L + 1:k * L + L + 1].tolist() == y.tolist()
    return False


# -- the permutation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 100, 1000, 4097])
def test_permute_is_a_bijection_for_every_key(n):
    for key in (0, 1, 2 ** 62 + 3):
        assert sorted(permute(i, n, key) for i in range(n)) == list(range(n))
    if n >= 64:
        assert [permute(i, n, 0) for i in range(n)] != [permute(i, n, 1) for i in range(n)]
        assert [permute(i, n, 0) for i in range(n)] != list(range(n))


def three_shards(tmp_path: Path) -> list[np.ndarray]:
    """An llm.c shard, a raw one and a Megatron one, in a glob: 3 formats, one dataset."""
    parts = [tokens(16 * 20 + 1, salt=0), tokens(16 * 13 + 9, salt=100_000), tokens(16 * 7 + 1, salt=200_000)]
    write_llmc(tmp_path / "s0.bin", parts[0])
    parts[1].astype(np.uint16).tofile(tmp_path / "s1.bin")
    write_megatron(tmp_path / "s2", [[parts[2]]])
    return parts


def test_an_epoch_reads_every_window_of_every_shard_once(tmp_path):
    parts = three_shards(tmp_path)
    total = 20 + 13 + 7  # windows of 17 tokens, end to end
    ds = source(tmp_path / "s*.bin", batch_size=2, microbatches=4)
    assert ds.windows.total == total
    seen = []
    for step in range(total // 8):  # 8 samples a step
        for i in range(4):
            mb = ds.microbatch(step, i)
            for r in range(2):
                seen.append(next((k, j) for k, t in enumerate(parts) for j in range((len(t) - 1) // 16)
                                 if t[j * 16:j * 16 + 17].tolist() == mb.x[r].tolist() + [mb.y[r, -1].item()]))
    assert sorted(seen) == sorted({(k, j) for k, t in enumerate(parts) for j in range((len(t) - 1) // 16)})
    assert len({k for k, _ in seen[:8]}) > 1  # shards interleave, not one after another


def digest(path: str, keys) -> str:
    ds = source(path, seq_len="variable", eos=3)
    h = hashlib.sha256()
    for s, i in keys:
        mb = ds.microbatch(s, i)
        h.update(mb.x.numpy().tobytes() + mb.y.numpy().tobytes() + mb.positions.numpy().tobytes())
    return h.hexdigest()


KEYS = [(s, i) for s in range(4) for i in range(2)]


@pytest.mark.timeout(60)
def test_a_pure_function_of_seed_step_and_index(tmp_path):
    three_shards(tmp_path)
    glob = str(tmp_path / "s*.bin")
    code = ("import sys; from tests.model.test_data_formats import digest, KEYS; "
            "print(digest(sys.argv[1], list(reversed(KEYS))))")
    r = subprocess.run([sys.executable, "-c", code, glob], capture_output=True, text=True, timeout=50,
                       cwd=Path(__file__).parents[2], env={**os.environ, "PYTHONHASHSEED": "7"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == digest(glob, KEYS[::-1]) == digest(glob, KEYS[::-1])
    a, b = source(glob), source(glob)
    assert torch.equal(a.microbatch(2, 1).x, b.microbatch(2, 1).x)
    base = a.microbatch(1, 1).x
    for other in (source(glob, seed=1).microbatch(1, 1), a.microbatch(2, 1), a.microbatch(1, 0)):
        assert not torch.equal(base, other.x)


# -- documents ------------------------------------------------------------------------------------------

def test_eos_ends_variable_sequences_and_restarts_positions(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(10, 500, int(rng.integers(3, 30))), 3) for _ in range(300)]  # 3 = eos
    write_llmc(tmp_path / "docs.bin", np.concatenate(docs))
    fixed = source(tmp_path / "docs.bin", seq_len="32", eos=3).microbatch(0, 0)
    for r in range(4):
        x, pos = fixed.x[r], fixed.positions[r]
        for p in range(32):  # 0 at the window's start and right after each eos, counting up between
            assert pos[p] == (0 if p == 0 or x[p - 1] == 3 else pos[p - 1] + 1)
    ds = source(tmp_path / "docs.bin", seq_len="4-32", eos=3, batch_size=8)
    for s, i in KEYS:
        mb = ds.microbatch(s, i)
        n = (mb.y != -1).sum(dim=1)
        for r, k in enumerate(n.tolist()):
            eos_at = (mb.x[r, :k] == 3).nonzero().flatten().tolist()
            # a sequence ends at its window's first document end, no shorter than 4, at most 32
            assert k == (max(4, eos_at[0] + 1) if eos_at else 32)
            assert (mb.y[r, k:] == -1).all()
        assert ds.features(s, i) == (mb.tokens, mb.sumsq) == (int(n.sum()), int((n * n).sum()))
    assert source(tmp_path / "docs.bin").microbatch(0, 0).positions is None  # no eos, no documents


def test_megatron_documents_restart_positions(tmp_path):
    docs = [[tokens(n, salt=n)] for n in (5, 30, 2, 17, 40, 9, 26) * 5]
    write_megatron(tmp_path / "m", docs)
    ds = source(tmp_path / "m.bin", seq_len="16")
    starts = set(open_shards(str(tmp_path / "m.bin"))[0].doc_starts.tolist())
    flat = np.concatenate([d[0] for d in docs])
    mb = ds.microbatch(0, 0)
    for r in range(4):
        shard, start = ds.windows.locate(0, r)
        assert mb.x[r].tolist() == flat[start:start + 16].tolist()
        want = [0] * 16
        for p in range(1, 16):
            want[p] = 0 if start + p in starts else want[p - 1] + 1
        assert mb.positions[r].tolist() == want


# -- 2 GiB, never read whole ----------------------------------------------------------------------------

def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.timeout(120)
def test_a_2_gib_token_file_is_sampled_without_reading_it(tmp_path):
    path = tmp_path / "huge.bin"
    with open(path, "wb") as f:
        f.truncate(2 << 30)  # sparse: 1 Gi uint16 tokens, all 0, no disk used
    small = tmp_path / "warm.bin"
    tokens(1000).astype(np.uint16).tofile(small)
    source(small, seq_len="64").microbatch(0, 0)  # what the first microbatch allocates once, before
    before = _rss()
    ds = source(path, seq_len="64", batch_size=8, microbatches=4)
    assert ds.windows.total == ((1 << 30) - 1) // 64
    for step in range(100):
        for i in range(4):
            mb = ds.microbatch(step, i)
    grown = _rss() - before
    print(f"2 GiB token file, 400 microbatches of 8 x 64: VmRSS grew {grown / 2**20:.1f} MiB")
    assert mb.x.shape == (8, 64) and grown < 50 << 20


# -- bad input: one line naming the file, exit 2, nothing started ----------------------------------------

def _bad(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """The arguments of one bad input and the token its error line must hold."""
    d = tmp_path
    if case == "missing shard":
        return [f"--data.path={d / 'nope.bin'}"], str(d / "nope.bin")
    if case == "empty glob":
        return [f"--data.path={d / 'none_*.bin'}"], str(d / "none_*.bin")
    if case == "wrong llm.c magic":
        write_llmc(d / "x.bin", tokens(500, 256), magic=20240521)
        return [f"--data.path={d / 'x.bin'}", "--data.format=llmc"], "x.bin"
    if case == "wrong Megatron magic":
        write_megatron(d / "m", [[tokens(500, 256)]])
        raw = (d / "m.idx").read_bytes()
        (d / "m.idx").write_bytes(b"MMIDIDY\x00\x00" + raw[9:])
        return [f"--data.path={d / 'm.bin'}"], "m.idx"
    if case == "truncated .idx":
        write_megatron(d / "m", [[tokens(500, 256)], [tokens(300, 256)]])
        raw = (d / "m.idx").read_bytes()
        (d / "m.idx").write_bytes(raw[:-5])
        return [f"--data.path={d / 'm.bin'}"], "m.idx"
    if case == "token id >= vocab":
        write_llmc(d / "big.bin", tokens(500, 300))  # ids up to 299, model.vocab_size 256
        return [f"--data.path={d / 'big.bin'}"], "big.bin"
    if case == "shorter than one window":
        write_llmc(d / "ok.bin", tokens(500, 256))
        write_llmc(d / "short.bin", tokens(40, 256))
        return [f"--data.path={d / '*.bin'}"], "short.bin"
    if case == "raw size not a multiple of the dtype":
        tokens(501, 256).astype(np.uint16).tofile(d / "odd.bin")
        return [f"--data.path={d / 'odd.bin'}", "--data.dtype=uint32"], "odd.bin"
    if case == "llm.c count disagrees with the size":
        write_llmc(d / "c.bin", tokens(500, 256), count=250)  # a uint32 count read as uint16 tokens, say
        return [f"--data.path={d / 'c.bin'}"], "c.bin"
    raise AssertionError(case)


BAD = ["missing shard", "empty glob", "wrong llm.c magic", "wrong Megatron magic", "truncated .idx",
       "token id >= vocab", "shorter than one window", "raw size not a multiple of the dtype",
       "llm.c count disagrees with the size"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", BAD)
def test_bad_token_files_are_one_line_and_exit_2(tmp_path, case):
    args, token = _bad(tmp_path, case)
    out = tmp_path / "run"
    r = unbroken("train", *args, "--steps", "1", "--out", str(out), "--run.progress=false")
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("unbroken: error: ") and token in lines[0], r.stderr
    assert not out.exists()  # nothing started
