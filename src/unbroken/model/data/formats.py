"""Token files on disk, memory-mapped and never read whole: llm.c shards, Megatron-LM indexed datasets
and raw token arrays, recognised from the files themselves.

Owns: resolving `--data.path` (a file or a glob of shards) into shards, each format's layout and its
consistency checks (magic, version, sizes against the header), and mapping tokens read-only with random
access advice. Does not own: which windows a run reads (sampling.py), vocabulary checks (check.py) or
writing shards (prepare.py). Imports no torch.

Layouts:
- llm.c (`dev/data/data_common.py`): a header of 256 int32 (magic, version, token count), then the
  tokens: magic 20240520 version 1 holds uint16 tokens; magic 20240801 version 7 (llm.c's Llama 3
  layout) holds uint32 tokens, for vocabularies over 65,535.
- Megatron-LM (`megatron/core/datasets/indexed_dataset.py`): PREFIX.idx = b"MMIDIDX\\x00\\x00", version
  (uint64, 1), dtype code (uint8), sequence count (uint64), document count (uint64), sizes (int32 per
  sequence), pointers (int64 byte offsets into PREFIX.bin per sequence), document index (int64 per
  entry: the first sequence of each document, then the sequence count); PREFIX.bin = the tokens.
- raw (nanoGPT's `train.bin`): the tokens and nothing else, as `--data.dtype` says.

Recognised (format "auto"): a `.idx` file, or a file with a `.idx` beside it sharing its stem, is
Megatron; a file opening with an llm.c magic is llm.c; other `.bin` files are raw; anything else is
text (corpus.py), taken only as a single file.
"""
from __future__ import annotations

import glob
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LLMC = {(20240520, 1): np.dtype(np.uint16), (20240801, 7): np.dtype(np.uint32)}
LLMC_HEADER = 256 * 4
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                   7: np.float32, 8: np.uint16}
_MEGATRON_HEAD = struct.Struct("<9sQBQQ")


class DataFileError(ValueError):
    """A token file that cannot be read as asked: the message is one line naming the file."""


@dataclass(frozen=True)
class Shard:
    """One token file, mapped read-only: its tokens (1-D), where they start in the file (bytes), and the
    token offsets where documents start, ascending, where the file says (Megatron), else None."""
    path: Path
    format: str  # "llmc", "megatron" or "raw"
    tokens: np.ndarray
    offset: int
    doc_starts: np.ndarray | None = None


def is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def resolve(spec: str) -> list[Path]:
    """The files `--data.path` names, sorted: the file itself, or every file its glob matches (a
    Megatron pair once, by its `.bin`). DataFileError: a missing file or a glob matching none."""
    if not is_glob(spec):
        p = Path(spec)
        if not p.is_file():
            raise DataFileError(f"data.path={spec!r}: no such file")
        return [p]
    files = sorted(Path(f) for f in glob.glob(spec, recursive=True) if Path(f).is_file())
    if not files:
        raise DataFileError(f"data.path={spec!r}: the glob matches no file")
    names = set(files)
    # a Megatron dataset is its .bin and .idx: a glob like data/* matches both, the pair is one shard
    return [f for f in files if not (f.suffix == ".idx" and f.with_suffix(".bin") in names)]


def kind(path: Path, fmt: str = "auto") -> str:
    """The format of `path`: `fmt` itself unless "auto", else recognised as the module docstring says;
    "text" for a file that is no token file."""
    if fmt != "auto":
        return fmt
    if path.suffix == ".idx" or path.with_suffix(".idx").is_file():
        return "megatron"
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) == 8 and struct.unpack("<ii", head) in LLMC:
        return "llmc"
    return "raw" if path.suffix == ".bin" else "text"


def is_text(spec: str, fmt: str = "auto") -> bool:
    """Whether `--data.path` names a single text file (read by corpus.py) rather than token files."""
    return fmt == "auto" and not is_glob(spec) and Path(spec).is_file() and kind(Path(spec)) == "text"


def open_shards(spec: str, fmt: str = "auto", dtype: str = "uint16") -> list[Shard]:
    """Every shard `--data.path` names, mapped. `dtype` is the raw files' token type (the other formats
    say theirs). DataFileError (one line naming the file) for anything unreadable or inconsistent."""
    shards = []
    for path in resolve(spec):
        k = kind(path, fmt)
        if k == "text":
            raise DataFileError(f"{path}: not a token file (llm.c, Megatron .bin/.idx or raw .bin); "
                                f"tokenize text with `unbroken prepare-data`")
        shards.append({"llmc": open_llmc, "megatron": open_megatron, "raw": open_raw}[k](path, dtype))
    return shards


def open_raw(path: Path, dtype: str = "uint16") -> Shard:
    item = np.dtype(dtype)
    size = path.stat().st_size
    if size % item.itemsize:
        raise DataFileError(f"{path}: {size} bytes is not a whole number of {dtype} tokens "
                            f"(--data.dtype does not match the file)")
    return Shard(path, "raw", _map(path, item, 0, size // item.itemsize), 0)


def open_llmc(path: Path, dtype: str = "") -> Shard:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(12)
    if len(head) < 12 or size < LLMC_HEADER:
        raise DataFileError(f"{path}: {size} bytes, shorter than an llm.c header ({LLMC_HEADER} bytes)")
    magic, version, count = struct.unpack("<iii", head)
    if (magic, version) not in LLMC:
        raise DataFileError(f"{path}: not an llm.c shard (magic {magic} version {version}; expected "
                            + " or ".join(f"{m} version {v}" for m, v in LLMC) + ")")
    item = LLMC[magic, version]
    if count < 0 or LLMC_HEADER + count * item.itemsize != size:
        raise DataFileError(f"{path}: the llm.c header says {count} {item.name} tokens "
                            f"({LLMC_HEADER + count * item.itemsize} bytes) but the file has {size} bytes")
    return Shard(path, "llmc", _map(path, item, LLMC_HEADER, count), LLMC_HEADER)


def open_megatron(path: Path, dtype: str = "") -> Shard:
    idx, bin_ = path.with_suffix(".idx"), path.with_suffix(".bin")
    for p in (idx, bin_):
        if not p.is_file():
            raise DataFileError(f"{p}: no such file (a Megatron dataset is PREFIX.bin with PREFIX.idx)")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(_MEGATRON_HEAD.size)
    if head[:9] != MEGATRON_MAGIC[:len(head[:9])]:  # a shorter prefix of it: truncated, below
        raise DataFileError(f"{idx}: not a Megatron index (magic {head[:9]!r}, expected {MEGATRON_MAGIC!r})")
    if len(head) < _MEGATRON_HEAD.size:
        raise DataFileError(f"{idx}: truncated ({size} bytes, shorter than the {_MEGATRON_HEAD.size}-byte header)")
    _, version, code, sequences, documents = _MEGATRON_HEAD.unpack(head)
    if version != 1:
        raise DataFileError(f"{idx}: Megatron index version {version}, expected 1")
    if code not in MEGATRON_DTYPES or np.dtype(MEGATRON_DTYPES[code]).kind == "f":
        raise DataFileError(f"{idx}: dtype code {code} is no integer token type "
                            f"(1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)")
    need = _MEGATRON_HEAD.size + 12 * sequences + 8 * documents
    if size < need:
        raise DataFileError(f"{idx}: truncated ({size} bytes; its header's {sequences} sequences and "
                            f"{documents} document entries need {need})")
    if sequences == 0:
        raise DataFileError(f"{idx}: holds no sequence")
    item = np.dtype(MEGATRON_DTYPES[code])
    sizes = np.memmap(idx, np.int32, "r", _MEGATRON_HEAD.size, (sequences,))
    pointers = np.memmap(idx, np.int64, "r", _MEGATRON_HEAD.size + 4 * sequences, (sequences,))
    # the sequences lie end to end, as Megatron's writer puts them: windows may then cross them freely
    expected = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]) * item.itemsize
    if not np.array_equal(pointers, expected):
        raise DataFileError(f"{idx}: sequence pointers are not end to end (a .bin with gaps is not read)")
    count = int(np.sum(sizes, dtype=np.int64))
    if bin_.stat().st_size != count * item.itemsize:
        raise DataFileError(f"{bin_}: {bin_.stat().st_size} bytes, but its index says {count} {item.name} "
                            f"tokens ({count * item.itemsize} bytes)")
    starts = None
    if documents:
        index = np.memmap(idx, np.int64, "r", _MEGATRON_HEAD.size + 12 * sequences, (documents,))
        first = index[(index >= 0) & (index < sequences)]
        starts = np.unique(expected[first] // item.itemsize)
    return Shard(bin_, "megatron", _map(bin_, item, 0, count), 0, starts)


def _map(path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    """`count` tokens of `path` from byte `offset`, mapped read-only. The mapping is advised random:
    windows are drawn from all over the file, and read-ahead around each would fill the process's
    resident memory with pages no window reads."""
    if count == 0:
        return np.zeros(0, dtype)
    arr = np.memmap(path, dtype, "r", offset, (count,))
    m = getattr(arr, "_mmap", None)
    if m is not None and hasattr(mmap, "MADV_RANDOM"):
        m.madvise(mmap.MADV_RANDOM)
    return arr
