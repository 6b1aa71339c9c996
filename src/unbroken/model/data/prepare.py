"""`unbroken prepare-data`: text files into llm.c token shards, offline, so a run's data is a pure
function of the sample index (docs/design.md, "Data").

Owns: tokenizing with a Hugging Face `tokenizers` tokenizer.json (or byte-level: ids 0..255, the bytes,
when none is given), documents and their end-of-document id, and writing shards in the llm.c layout
(formats.py's: uint16 tokens, or llm.c's uint32 variant where the vocabulary exceeds 65,535). Does not
own: reading shards back (formats.py) or the command line (commands.py).

Documents: each input file is one document, or, with split="blank-lines", each block of text between
blank lines is one. Every document is followed by the end-of-document id: the tokenizer's
`<|endoftext|>`, `</s>`, `<eos>` or `<|end_of_text|>` token, or `eos` where given; byte-level, 0 (the NUL
byte, which text does not hold). Nothing is downloaded: the tokenizer is a local file.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from unbroken.model.data.formats import LLMC, LLMC_HEADER

END_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
BYTE_EOS = 0


@dataclass(frozen=True)
class Prepared:
    """What prepare-data wrote."""
    shards: list[Path]
    tokens: int
    documents: int
    vocab_size: int
    eos: int
    dtype: str


class Tokenizer:
    """Text -> token ids: a tokenizer.json through `tokenizers`, or bytes where `path` is None."""

    def __init__(self, path: str | None, eos: int | None = None):
        if path is None:
            self.vocab_size, self._encode = 256, lambda text: list(text.encode())
            self.eos = BYTE_EOS if eos is None else eos
            return
        try:
            from tokenizers import Tokenizer as HF
        except ImportError:
            raise ValueError("--tokenizer needs the tokenizers package (pip install 'unbroken[data]')") from None
        try:
            hf = HF.from_file(path)
        except Exception as e:  # its own exception type for a missing or malformed file
            raise ValueError(f"--tokenizer {path!r}: not a tokenizer.json ({str(e).splitlines()[0]})") from None
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._encode = lambda text: hf.encode(text, add_special_tokens=False).ids
        found = next((i for i in map(hf.token_to_id, END_TOKENS) if i is not None), None)
        self.eos = found if eos is None else eos
        if self.eos is None:
            raise ValueError(f"--tokenizer {path!r} has none of {', '.join(END_TOKENS)}: give --eos ID")
        if not 0 <= self.eos < self.vocab_size:
            raise ValueError(f"--eos {self.eos} is not a token id of {path!r} (vocabulary {self.vocab_size})")

    def encode(self, text: str) -> list[int]:
        return self._encode(text)


def documents(path: Path, split: str) -> Iterator[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if split == "file":
        yield text
        return
    for block in re.split(r"\n[ \t]*\n", text):
        if block.strip():
            yield block


def prepare(files: list[Path], out: Path, tokenizer: Tokenizer, *, split: str = "file",
            shard_tokens: int = 100_000_000, progress: Callable[[int], None] = lambda n: None) -> Prepared:
    """Tokenize `files` (in order) into `out`/shard_000000.bin, ... of at most `shard_tokens` tokens each,
    each document followed by the tokenizer's eos; `progress(n)` after each file with its size in bytes.
    `out` is created; shards already there are overwritten."""
    out.mkdir(parents=True, exist_ok=True)
    wide = tokenizer.vocab_size > 1 << 16  # ids up to 65,535 fit uint16
    (magic, version), item = next((k, v) for k, v in LLMC.items() if v.itemsize == (4 if wide else 2))
    writer = _ShardWriter(out, magic, version, item, shard_tokens)
    docs = 0
    for path in files:
        for doc in documents(path, split):
            writer.add(tokenizer.encode(doc) + [tokenizer.eos])
            docs += 1
        progress(path.stat().st_size)
    writer.close()
    return Prepared(writer.paths, writer.total, docs, tokenizer.vocab_size, tokenizer.eos, item.name)


class _ShardWriter:
    """Tokens into llm.c shards of at most `limit` tokens, a new shard when one fills."""

    def __init__(self, out: Path, magic: int, version: int, item: np.dtype, limit: int):
        self.out, self.magic, self.version, self.item, self.limit = out, magic, version, item, limit
        self.buffer: list[int] = []
        self.paths: list[Path] = []
        self.total = 0

    def add(self, ids: list[int]) -> None:
        self.buffer.extend(ids)
        while len(self.buffer) >= self.limit:
            self._write(self.buffer[:self.limit])
            self.buffer = self.buffer[self.limit:]

    def close(self) -> None:
        if self.buffer or not self.paths:
            self._write(self.buffer)
        self.buffer = []

    def _write(self, ids: list[int]) -> None:
        header = np.zeros(LLMC_HEADER // 4, dtype=np.int32)
        header[:3] = self.magic, self.version, len(ids)
        path = self.out / f"shard_{len(self.paths):06d}.bin"
        with open(path, "wb") as f:
            f.write(header.tobytes())
            f.write(np.asarray(ids, dtype=self.item).tobytes())
        self.paths.append(path)
        self.total += len(ids)
