"""Slot files in shared memory: plain files under /dev/shm, mmap'd by the agent and the trainer.

Owns the on-file format (a fixed header, a JSON document, then the payload), creating and
pre-faulting files, and reading or updating header fields. Does not own the protocol (which process
moves a slot through which state: see client.py and agent.py).

Why plain files: Python 3.11 `multiprocessing.shared_memory` registers segments with a resource
tracker that unlinks them when a killed process's tracker exits; a file in /dev/shm lives until
someone removes it, so the agent's memory outlives every trainer.

File layout (bytes): [0, 256) fixed header (struct below), [4096, DOC_END) JSON document
(layout, meta, shard bounds, manifest), [HEADER_BYTES, HEADER_BYTES + capacity) payload.
States: EMPTY -> WRITING (trainer) -> COPIED (trainer) -> COMMITTED (agent, checksum verified).
A SIGKILL mid-copy leaves WRITING, which is never restored; the other slot stays whole.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch

from .errors import ForeignSnapshot

MAGIC = b"UNBKSLT2"  # v2: 64-bit XXH3 checksum field (v1 held a 32-bit CRC32)
DOC_OFF = 4096
HEADER_BYTES = 1 << 20  # header + JSON document; payload starts here (page aligned)
DOC_MAX = HEADER_BYTES - DOC_OFF
RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class State(IntEnum):
    EMPTY = 0
    WRITING = 1
    COPIED = 2
    COMMITTED = 3


class Kind(IntEnum):
    DATA = 0
    PARITY = 1


# name -> (byte offset, struct format). Fields are updated one at a time with pack_into.
_FIELDS = {
    "magic": (0, "8s"), "kind": (8, "<I"), "state": (12, "<I"), "gen": (16, "<Q"),
    "step": (24, "<q"), "length": (32, "<Q"), "capacity": (40, "<Q"), "checksum": (48, "<Q"),
    "doc_len": (56, "<I"), "rank": (60, "<I"), "world": (64, "<I"), "node": (68, "<I"),
    "run_id": (72, "64s"),
}
_FIXED = 256  # bytes of the fixed header


@dataclass(frozen=True)
class Header:
    kind: Kind
    state: State
    gen: int  # commit counter: bumped each time a writer starts on this slot
    step: int
    length: int  # payload bytes in use
    capacity: int  # payload bytes available
    checksum: int  # checksum.checksum(payload[:length]) (XXH3-64), valid in COMMITTED
    rank: int  # data: trainer rank; parity: layer (local rank index)
    world: int
    node: int
    run_id: str


def check_run_id(run_id: str) -> str:
    if not RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r} must match {RUN_ID_RE.pattern}")
    return run_id


def data_path(shm_dir: str | Path, run_id: str, rank: int, slot: int) -> Path:
    return Path(shm_dir) / run_id / f"rank{rank}.slot{slot}"


def parity_path(shm_dir: str | Path, run_id: str, layer: int, slot: int) -> Path:
    return Path(shm_dir) / run_id / f"parity{layer}.slot{slot}"


class SlotFile:
    """One mapped slot file. Not thread-safe for writes; reads of single fields are atomic enough
    (each field is written with one aligned store and the state field is written last)."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap) -> None:
        self.path, self._fd, self._mm = path, fd, mm
        self._payload: torch.Tensor | None = None

    @classmethod
    def create(cls, path: Path, capacity: int, *, kind: Kind, run_id: str, rank: int, world: int,
               node: int) -> SlotFile:
        """Create (or replace) a slot file, allocate its pages up front and map it populated."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        size = HEADER_BYTES + capacity
        # fallocate on tmpfs allocates the pages now, so the first snapshot does not pay ~0.5 s/GiB
        # of page faults; MAP_POPULATE then fills this process's page tables.
        os.posix_fallocate(fd, 0, size)
        slot = cls(path, fd, _map(fd, size))
        slot.set(magic=MAGIC, kind=int(kind), state=int(State.EMPTY), gen=0, step=-1, length=0,
                 capacity=capacity, checksum=0, doc_len=0, rank=rank, world=world, node=node,
                 run_id=check_run_id(run_id).encode())
        os.replace(tmp, path)  # appears whole or not at all
        return slot

    @classmethod
    def open(cls, path: Path) -> SlotFile:
        """Map an existing slot file. Raises FileNotFoundError or ForeignSnapshot (bad magic)."""
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            os.close(fd)
            raise ForeignSnapshot(f"{path} is {size} bytes, too small to be an unbroken slot")
        slot = cls(path, fd, _map(fd, size))
        if slot.get("magic") != MAGIC:
            slot.close()
            raise ForeignSnapshot(f"{path} is not an unbroken snapshot slot (bad magic)")
        return slot

    def get(self, name: str):
        off, fmt = _FIELDS[name]
        return struct.unpack_from(fmt, self._mm, off)[0]

    def set(self, **fields) -> None:
        for name, value in fields.items():
            off, fmt = _FIELDS[name]
            struct.pack_into(fmt, self._mm, off, value)

    def header(self) -> Header:
        return _header(self._mm)

    def doc(self) -> dict:
        n = self.get("doc_len")
        return json.loads(bytes(self._mm[DOC_OFF:DOC_OFF + n])) if n else {}

    def set_doc(self, doc: dict) -> None:
        raw = json.dumps(doc, separators=(",", ":")).encode()
        if len(raw) > DOC_MAX:
            raise ValueError(f"snapshot layout+meta is {len(raw)} bytes, over the {DOC_MAX} limit")
        self._mm[DOC_OFF:DOC_OFF + len(raw)] = raw
        self.set(doc_len=len(raw))

    def payload(self) -> torch.Tensor:
        """1-D uint8 tensor over the payload area (capacity bytes), sharing memory with the file."""
        if self._payload is None:
            cap = self.get("capacity")
            self._payload = torch.frombuffer(self._mm, dtype=torch.uint8, offset=HEADER_BYTES,
                                             count=cap) if cap else torch.empty(0, dtype=torch.uint8)
        return self._payload

    def close(self) -> None:
        self._payload = None
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a payload view; the mapping dies with it
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_header(path: Path) -> Header:
    """The header of a slot file, read without mapping the file (mapping a GiB-sized slot with
    MAP_POPULATE costs tens of ms). Raises FileNotFoundError or ForeignSnapshot like SlotFile.open."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(_FIXED)
    if size < HEADER_BYTES:
        raise ForeignSnapshot(f"{path} is {size} bytes, too small to be an unbroken slot")
    if raw[:len(MAGIC)] != MAGIC:
        raise ForeignSnapshot(f"{path} is not an unbroken snapshot slot (bad magic)")
    return _header(raw)


def _header(buf) -> Header:
    def g(name: str):
        off, fmt = _FIELDS[name]
        return struct.unpack_from(fmt, buf, off)[0]
    return Header(Kind(g("kind")), State(g("state")), g("gen"), g("step"), g("length"),
                  g("capacity"), g("checksum"), g("rank"), g("world"), g("node"),
                  g("run_id").rstrip(b"\0").decode())


def _map(fd: int, size: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
