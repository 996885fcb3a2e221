"""Frozen parameters read in place from a checkpoint's own safetensors files: a read-only
store behind the same ``read(key, dst) -> handle`` verb as ``NvmeStore``, so a frozen part's
home can be the byte ranges of the checkpoint instead of a copy in a swap file.

Layout. A key is one frozen part of a block: a list of page-aligned ranges of checkpoint
files (``SourceRange``: file, start, end, and where the range lands in the part's buffer)
whose concatenation *is* the part's flat buffer; each tensor sits in it at its offset inside
its range (``in_place_layout`` computes this from the tensors' extents). The ranges are
supersets of the unaligned safetensors extents, so reads are O_DIRECT straight into the
staging buffer, with no bounce copy; the extra bytes (at most a page each side, and the
small gaps between neighbouring tensors) are read and ignored.

Verification. Every tensor's CRC32C (the loader's ``checksum``, taken when the engine read
the checkpoint at ``initialize``) is checked on every read, as swap files check theirs, and
each file's identity (inode, size, modification time, recorded when the key was added) is
checked before each read: a checkpoint rewritten or modified under the run raises
``SourceChangedError`` (an ``OSError``, errno ESTALE) naming the file and the fix, never a
silent use of other bytes. Nothing is ever written: ``write`` refuses.

Lifetimes and threads. ``read`` returns a handle at once; the read runs on one of the store's
threads (``preadv`` and the CRC release the GIL); ``dst`` must not be used until the handle is
done. ``close(timeout)`` waits (bounded) for reads in flight.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from offload.core.errors import OffloadError
from offload.units import PAGE


class SourceChangedError(OSError, OffloadError):
    """A checkpoint file read in place changed since the engine loaded it."""


@dataclass(frozen=True)
class SourceRange:
    """``[start, end)`` of ``file`` (page-aligned) lands at byte ``pos`` of the part's buffer."""
    file: str
    start: int
    end: int
    pos: int


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a key: ``length`` bytes at byte ``pos`` of the part's buffer, CRC ``crc``."""
    name: str
    pos: int
    length: int
    crc: int


def in_place_layout(extents: Sequence, merge_gap: int = 16 * PAGE) -> Tuple[List[SourceRange], List[int], int]:
    """For tensors at ``extents`` (``SourceExtent``: file, offset, length), the page-aligned
    file ranges that cover them (neighbours in one file closer than ``merge_gap`` share a
    range), each tensor's byte offset in the concatenated buffer, and that buffer's size."""
    order = sorted(range(len(extents)), key=lambda i: (extents[i].file, extents[i].offset))
    ranges: List[list] = []
    where = [0] * len(extents)
    for i in order:
        e = extents[i]
        a = e.offset // PAGE * PAGE
        b = -(-(e.offset + e.length) // PAGE) * PAGE
        cur = ranges[-1] if ranges else None
        if cur is not None and cur[0] == e.file and a <= cur[2] + merge_gap:
            cur[2] = max(cur[2], b)
        else:
            cur = [e.file, a, b, 0]
            ranges.append(cur)
        where[i] = len(ranges) - 1
    pos = 0
    for r in ranges:
        r[3] = pos
        pos += r[2] - r[1]
    out = [SourceRange(f, a, b, p) for f, a, b, p in ranges]
    offsets = [out[where[i]].pos + extents[i].offset - out[where[i]].start for i in range(len(extents))]
    return out, offsets, pos


def _identity(path: str) -> Tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


class _Read:
    """A read in flight: ``done()`` never waits, ``wait(timeout)`` raises its error."""

    def __init__(self, fut: cf.Future, what: str):
        self._fut, self._what = fut, what

    def done(self) -> bool:
        return self._fut.done()

    def wait(self, timeout: Optional[float] = None) -> None:
        try:
            self._fut.result(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"read of {self._what} from the checkpoint not done after {timeout} s") from None


class SourceStore:
    """Keys read in place from checkpoint files. ``crc(uint8 tensor) -> int`` must be the
    function that computed the recorded checksums (``offload.io.loader.checksum``'s value)."""

    def __init__(self, crc: Callable[[torch.Tensor], int], read_range: Callable[[str, int, torch.Tensor], int], *,
                 threads: int = 2, name: str = "source"):
        self._crc = crc
        self._read_range = read_range
        self.name = name
        self._keys: Dict[str, Tuple[List[SourceRange], List[SourceTensor]]] = {}
        self._ident: Dict[str, Tuple[int, int, int]] = {}     # file -> identity at add()
        self._pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"offload-{name}")
        self._lock = threading.Lock()
        self._inflight: Dict[str, cf.Future] = {}
        self.bytes_read = 0
        self.read_seconds = 0.0
        self._closed = False

    # ---- keys ---------------------------------------------------------------------------
    def add(self, key: str, ranges: Sequence[SourceRange], tensors: Sequence[SourceTensor]) -> None:
        """Make ``key`` readable: its buffer is ``ranges`` concatenated; ``tensors`` are
        checked on each read. Records each file's identity now."""
        for r in ranges:
            if r.start % PAGE or r.end % PAGE or r.pos % PAGE:
                raise ValueError(f"{key}: range {r} is not page-aligned")
            if r.file not in self._ident:
                self._ident[r.file] = _identity(r.file)
        self._keys[key] = (list(ranges), list(tensors))

    def nbytes(self, key: str) -> int:
        ranges, _ = self._keys[key]
        return sum(r.end - r.start for r in ranges)

    def keys(self) -> List[str]:
        return list(self._keys)

    # ---- I/O ------------------------------------------------------------------------------
    def read(self, key: str, dst: torch.Tensor) -> _Read:
        """Start reading ``key`` into ``dst`` (1-D uint8, page-aligned, at least ``nbytes(key)``)."""
        if self._closed:
            raise RuntimeError(f"the {self.name} store is closed")
        if key not in self._keys:
            raise KeyError(f"{key!r} is not a key of the {self.name} store")
        need = self.nbytes(key)
        if dst.dtype != torch.uint8 or dst.numel() < need or dst.data_ptr() % PAGE:
            raise ValueError(f"reading {key!r} needs a page-aligned uint8 buffer of {need} bytes")
        with self._lock:
            prev = self._inflight.get(key)
            if prev is not None and not prev.done():
                raise RuntimeError(f"{key!r}: a read is already in flight")
            fut = self._pool.submit(self._read, key, dst)
            self._inflight[key] = fut
        return _Read(fut, key)

    def write(self, key: str, src: torch.Tensor):
        raise PermissionError(errno.EROFS, f"{key!r} is read in place from the checkpoint's own files, which the "
                                           f"engine never writes: a frozen parameter read in place cannot change")

    def _read(self, key: str, dst: torch.Tensor) -> None:
        ranges, tensors = self._keys[key]
        t0 = time.perf_counter()
        for f in {r.file for r in ranges}:
            self._check_file(f)
        for r in ranges:
            n = r.end - r.start
            got = self._read_range(r.file, r.start, dst[r.pos:r.pos + n])
            need = max(t.pos + t.length - r.pos for t in tensors if r.pos <= t.pos < r.pos + n)
            if got < need:                 # the file ends before a tensor does
                raise SourceChangedError(errno.ESTALE, f"{r.file} is shorter than when the run loaded it: it "
                                                       f"changed under the run", r.file)
        for t in tensors:
            c = self._crc(dst[t.pos:t.pos + t.length])
            if c != t.crc:
                f = next(r.file for r in ranges if r.pos <= t.pos < r.pos + r.end - r.start)
                raise SourceChangedError(errno.ESTALE, f"tensor {t.name!r} read in place from {f} does not match "
                                                       f"the checksum taken when the run loaded it (crc {c:#010x}, "
                                                       f"expected {t.crc:#010x}): the checkpoint changed under the "
                                                       f"run; restore it, or restart from it", f)
        with self._lock:
            self.bytes_read += sum(r.end - r.start for r in ranges)
            self.read_seconds += time.perf_counter() - t0

    def _check_file(self, path: str) -> None:
        try:
            now = _identity(path)
        except OSError as exc:
            raise SourceChangedError(exc.errno or errno.ENOENT, f"checkpoint file {path}, read in place for frozen "
                                                                f"parameters, is gone: {exc.strerror}", path) from None
        if now != self._ident[path]:
            was = self._ident[path]
            raise SourceChangedError(errno.ESTALE, f"checkpoint file {path}, read in place for frozen parameters, "
                                                   f"changed under the run (inode, size, mtime {was} -> {now}): "
                                                   f"restore it, or restart from it", path)

    def stats(self) -> dict:
        return {"bytes_read": self.bytes_read, "read_seconds": self.read_seconds, "bytes_written": 0,
                "write_seconds": 0.0, "source_bytes": sum(self.nbytes(k) for k in self._keys)}

    def close(self, timeout: float = 60.0) -> bool:
        """Wait (bounded) for reads in flight and stop the threads; True when none was left."""
        self._closed = True
        with self._lock:
            futs = list(self._inflight.values())
            self._inflight.clear()
        _, left = cf.wait(futs, timeout=timeout)
        self._pool.shutdown(wait=not left, cancel_futures=True)
        return not left
