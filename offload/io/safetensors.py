"""Hugging Face weight files in and out: safetensors extents read with O_DIRECT, torch
state-dict files read through a memory map, streamed safetensors shards (the key names PEFT
writes are in io/peft_names.py).

A ``WeightFiles`` opens a checkpoint the way ``from_pretrained`` finds one: a ``.safetensors``
file, a sharded ``*.index.json``, a directory holding either (``model.safetensors``,
``model.safetensors.index.json``, ``pytorch_model.bin[.index.json]``), or a torch state-dict
file. Nothing is read but the headers until ``read(keys)``.

Safetensors layout (parsed here, no library call)::

    [ u64 little-endian N | N bytes of JSON header | data ]
    header: {"key": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
             "__metadata__": {...}}        offsets are relative to the start of the data

Each tensor is therefore a ``SourceExtent`` (file, absolute offset, length, dtype, shape): what
``read`` fetches, and what a frozen parameter can use as its home without a copy. ``read``
merges a group's extents into a few aligned ranges per file and reads them with O_DIRECT into
a buffer the caller owns (page cache untouched, no mapped pages: host memory holds the
buffer and nothing else). Filesystems without O_DIRECT get buffered reads followed by
``posix_fadvise(DONTNEED)``. Torch state-dict files are loaded with ``mmap=True``; the pages
a group touched are dropped from the process (``madvise(MADV_DONTNEED)``) when the group is
released, so they stop counting as resident memory.
"""
from __future__ import annotations

import collections
import ctypes
import json
import mmap
import os
import queue
import re
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from offload.core.errors import OffloadError
from offload.units import PAGE

_MERGE_GAP = 1 << 20          # extents closer than this in one file are read as one range
_CHUNK = 64 << 20             # the largest single read call

ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
for _n, _d in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _d):
        ST_DTYPES[_n] = getattr(torch, _d)
        ST_NAMES[getattr(torch, _d)] = _n


class WeightsError(ValueError, OffloadError):
    """A weights file or directory is unreadable, or does not match the model; the message
    names the file or key and the fix."""


@dataclass(frozen=True)
class SourceExtent:
    """Where one tensor's bytes lie in a checkpoint file: ``length`` bytes at absolute
    ``offset`` of ``file``, little-endian ``dtype`` of ``shape``, C-contiguous."""
    file: str
    offset: int
    length: int
    dtype: torch.dtype
    shape: Tuple[int, ...]


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def read_header(path: str) -> Tuple[Dict[str, SourceExtent], dict]:
    """The extents of every tensor of one safetensors file, and its ``__metadata__``."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
            n = struct.unpack("<Q", head)[0]
            if n > min(size - 8, 100 << 20):
                raise WeightsError(f"{path} is not a safetensors file (header length {n} does not fit its "
                                   f"{size} bytes)")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise WeightsError(f"cannot read weights file {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path} is not a safetensors file (its header is not JSON: {exc})") from None
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out = {}
    for key, info in header.items():
        dt = ST_DTYPES.get(info.get("dtype"))
        if dt is None:
            raise WeightsError(f"{path}: tensor {key!r} has dtype {info.get('dtype')!r}, which torch cannot hold")
        b, e = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        numel = 1
        for s in shape:
            numel *= s
        if e - b != numel * _itemsize(dt) or base + e > size:
            raise WeightsError(f"{path}: tensor {key!r} has offsets [{b}, {e}) that do not match its shape "
                               f"{list(shape)} and dtype, or run past the end of the file: the file is damaged")
        out[key] = SourceExtent(os.path.abspath(path), base + b, e - b, dt, shape)
    return out, meta


class ReadGroup:
    """The tensors of one ``WeightFiles.read`` call, in the file's dtype, on the CPU.

    Lifetime: the tensors are views into the caller's buffer (safetensors) or into the
    torch file's memory map; they are valid until ``release()``, which gives the buffer
    back / drops the mapped pages."""

    def __init__(self, tensors: Dict[str, torch.Tensor], buffer=None, mapped: Sequence[torch.Tensor] = ()):
        self.tensors = tensors
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._buffer = buffer
        self._mapped = list(mapped)

    def release(self) -> None:
        for t in self._mapped:
            drop_pages(t)
        self._mapped = []
        self.tensors = {}
        buf, self._buffer = self._buffer, None
        if buf is not None:
            buf.release()


class WeightFiles:
    """A pretrained checkpoint on disk: its keys, their shapes, dtypes and extents, and
    grouped reads. ``path``: see the module docstring."""

    def __init__(self, path: str):
        self.path = os.path.abspath(str(path))
        self.files: List[str] = []                      # every weight file, absolute
        self.extents: Dict[str, SourceExtent] = {}      # safetensors keys
        self._torch: Dict[str, torch.Tensor] = {}       # torch-file keys: mmapped tensors
        self.source_dir = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
        for f in self._resolve(self.path):
            self._open(f)
        if not self.extents and not self._torch:
            raise WeightsError(f"{self.path} holds no tensors")

    # ---- opening -------------------------------------------------------------------------
    @staticmethod
    def _resolve(path: str) -> List[str]:
        if not os.path.exists(path):
            raise WeightsError(f"weights path {path} does not exist: give a .safetensors file, a "
                               f"model.safetensors.index.json, a torch state-dict file or a directory holding one")
        if os.path.isdir(path):
            for name in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                         "pytorch_model.bin"):
                if os.path.isfile(os.path.join(path, name)):
                    return WeightFiles._resolve(os.path.join(path, name))
            found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if len(found) == 1:
                return [os.path.join(path, found[0])]
            raise WeightsError(f"{path} holds no model.safetensors, model.safetensors.index.json or "
                               f"pytorch_model.bin[.index.json]" + (f" (but {len(found)} .safetensors files: give "
                                                                   f"one of them, or their index)" if found else ""))
        if path.endswith(".index.json"):
            try:
                with open(path) as f:
                    wmap = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise WeightsError(f"{path} is not a weights index (a JSON file with a 'weight_map'): {exc}") from None
            d = os.path.dirname(path)
            files = list(dict.fromkeys(os.path.join(d, v) for v in wmap.values()))
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise WeightsError(f"{path} names shard {missing[0]}, which does not exist "
                                   f"({len(missing)} of {len(files)} shards missing)")
            return files
        return [path]

    def _open(self, f: str) -> None:
        self.files.append(os.path.abspath(f))
        with open(f, "rb") as fh:
            head = fh.read(9)
        is_st = f.endswith(".safetensors") or (len(head) == 9 and head[8:9] == b"{")
        if is_st:
            ext, _ = read_header(f)
            dup = set(ext) & (set(self.extents) | set(self._torch))
            if dup:
                raise WeightsError(f"tensor {sorted(dup)[0]!r} is in more than one weight file (again in {f})")
            self.extents.update(ext)
            return
        try:
            sd = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:
            raise WeightsError(f"cannot load {f} as a torch state dict (torch.load(mmap=True, "
                               f"weights_only=True)): {exc}") from None
        if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
            sd = sd["state_dict"]
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise WeightsError(f"{f} does not hold a state dict (a dict of tensor name -> tensor)")
        self._torch.update(sd)

    def close(self) -> None:
        """Let go of torch-file memory maps (safetensors files are opened per read)."""
        self._torch = {}

    # ---- what is in it -------------------------------------------------------------------
    def keys(self) -> List[str]:
        return list(self.extents) + list(self._torch)

    def __contains__(self, key: str) -> bool:
        return key in self.extents or key in self._torch

    def shape(self, key: str) -> Tuple[int, ...]:
        e = self.extents.get(key)
        return e.shape if e is not None else tuple(self._torch[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        e = self.extents.get(key)
        return e.dtype if e is not None else self._torch[key].dtype

    def nbytes(self, key: str) -> int:
        e = self.extents.get(key)
        return e.length if e is not None else self._torch[key].numel() * self._torch[key].element_size()

    def extent(self, key: str) -> Optional[SourceExtent]:
        """The tensor's bytes in its file (safetensors only; None for torch files)."""
        return self.extents.get(key)

    # ---- reading -------------------------------------------------------------------------
    def plan(self, keys: Iterable[str]) -> List[Tuple[str, int, int, List[Tuple[str, int]]]]:
        """The aligned ranges that cover the safetensors ``keys``: ``(file, start, end,
        [(key, byte offset inside the range)])``, merged when closer than 1 MiB."""
        by_file: Dict[str, List[SourceExtent]] = {}
        names = {}
        for k in keys:
            e = self.extents.get(k)
            if e is not None:
                by_file.setdefault(e.file, []).append(e)
                names[(e.file, e.offset)] = k
        ranges = []
        for f, exts in by_file.items():
            exts.sort(key=lambda e: e.offset)
            cur = None
            for e in exts:
                a = e.offset // PAGE * PAGE
                b = -(-(e.offset + e.length) // PAGE) * PAGE
                if cur is not None and a <= cur[2] + _MERGE_GAP:
                    cur[2] = max(cur[2], b)
                    cur[3].append(e)
                else:
                    cur = [f, a, b, [e]]
                    ranges.append(cur)
        return [(f, a, b, [(names[(f, e.offset)], e.offset - a) for e in exts]) for f, a, b, exts in ranges]

    def read_bytes_needed(self, keys: Iterable[str]) -> int:
        """Buffer bytes ``read(keys)`` needs (the aligned ranges)."""
        return sum(b - a for _, a, b, _ in self.plan(keys))

    def read(self, keys: Sequence[str], buffer=None) -> ReadGroup:
        """The tensors of ``keys`` (file dtype, CPU). Safetensors bytes are read with O_DIRECT
        into ``buffer`` (a HostBuffer of at least ``read_bytes_needed(keys)`` bytes, released
        with the group); torch-file tensors are the mmapped ones."""
        keys = list(keys)
        out: Dict[str, torch.Tensor] = {}
        ranges = self.plan(keys)
        if ranges:
            need = sum(b - a for _, a, b, _ in ranges)
            if buffer is None or buffer.nbytes < need:
                raise ValueError(f"reading {len(keys)} tensors needs a buffer of {need} bytes")
            raw = buffer.view(torch.uint8, need)
            pos = 0
            for f, a, b, members in ranges:
                read_range(f, a, raw[pos:pos + b - a])
                for k, off in members:
                    e = self.extents[k]
                    t = raw[pos + off:pos + off + e.length]
                    if (pos + off) % _itemsize(e.dtype):
                        t = t.clone()              # misaligned for its dtype: one copy
                    out[k] = t.view(e.dtype).view(e.shape)
                pos += b - a
        elif buffer is not None:
            buffer.release()
            buffer = None
        mapped = []
        for k in keys:
            if k in self._torch:
                out[k] = self._torch[k]
                mapped.append(self._torch[k])
        return ReadGroup(out, buffer, mapped)


class ReadAhead:
    """One reader thread going through scheduled groups of keys in order, each into a free
    buffer of a two-slot pool, so it is always one group ahead without waiting to be asked;
    ``take`` hands the groups out in the same order. A buffer goes back to the pool when its
    group is released. Pages of both buffers are touched at construction (reads then go at
    the disk's rate instead of faulting pages in). Every wait is bounded (600 s)."""

    TIMEOUT = 600.0

    def __init__(self, files: "WeightFiles", slot_bytes: int):
        from offload.storage.pool import HostPool
        self.files = files
        self.slot = max(int(slot_bytes), PAGE)
        self.pool = HostPool([self.slot, self.slot], pin=False, name="offload-load")
        for _ in range(2):
            with self.pool.acquire(self.slot) as buf:
                buf.view(torch.uint8, self.slot).zero_()
        self.wait_seconds = 0.0                       # the consumer's waits for reads
        self._expected: collections.deque = collections.deque()   # scheduled key lists not yet taken
        self._work: queue.Queue = queue.Queue()       # key lists for the thread (None: stop)
        self._ready: queue.Queue = queue.Queue()      # its ReadGroups (or exceptions), in order
        self._thread = threading.Thread(target=self._run, name="offload-load", daemon=True)
        self._thread.start()

    def enqueue(self, key_lists: Sequence[Sequence[str]]) -> None:
        for keys in key_lists:
            if keys:
                self._expected.append(list(keys))
                self._work.put(list(keys))

    def take(self, keys: Sequence[str]) -> ReadGroup:
        """The group of ``keys``: from the thread if it is the next scheduled one, else read now."""
        keys = list(keys)
        if not (self._expected and self._expected[0] == keys):
            return self.read_once(self.files, keys)
        self._expected.popleft()
        t0 = time.perf_counter()
        try:
            result = self._ready.get(timeout=self.TIMEOUT)
        except queue.Empty:
            raise WeightsError(f"reading {len(keys)} tensors of {self.files.path} did not complete within "
                               f"{self.TIMEOUT:.0f} s (first: {keys[0]!r})") from None
        self.wait_seconds += time.perf_counter() - t0
        if isinstance(result, BaseException):
            raise result
        return result

    def _run(self) -> None:
        while True:
            keys = self._work.get()
            if keys is None:
                return
            try:
                need = self.files.read_bytes_needed(keys)
                if need > self.slot:
                    result = self.read_once(self.files, keys)
                else:
                    result = self.files.read(keys, self.pool.acquire(need, timeout=self.TIMEOUT) if need else None)
            except BaseException as exc:         # handed to the consumer, raised there
                result = exc
            self._ready.put(result)

    @staticmethod
    def read_once(files: "WeightFiles", keys: Sequence[str]) -> ReadGroup:
        """An unscheduled read into a buffer of its own (the values are copied out of it)."""
        from offload.storage.pool import HostPool
        need = files.read_bytes_needed(keys)
        if not need:
            return files.read(keys)
        pool = HostPool([need], pin=False, name="offload-load-once")
        try:
            g = files.read(keys, pool.acquire(need))
            own = {k: v.clone() for k, v in g.tensors.items()}
            g.release()
            return ReadGroup(own)
        finally:
            pool.close()

    def _drain(self) -> None:
        while True:
            try:
                r = self._ready.get_nowait()
            except queue.Empty:
                return
            if isinstance(r, ReadGroup):
                r.release()

    def close(self) -> None:
        """Stop the thread (after the read in flight) and free the buffers."""
        while True:
            try:
                self._work.get_nowait()
            except queue.Empty:
                break
        self._work.put(None)
        deadline = time.monotonic() + self.TIMEOUT
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._drain()                    # frees buffers a blocked read waits for
            self._thread.join(timeout=0.05)
        self._drain()
        self._expected.clear()
        self.pool.close()


# ---- raw I/O -----------------------------------------------------------------------------
_O_DIRECT_OK: Dict[str, bool] = {}


def _open_direct(path: str) -> Tuple[int, bool]:
    """An fd for reading ``path``, with O_DIRECT where the filesystem allows it."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag and _O_DIRECT_OK.get(os.path.dirname(path), True):
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError:
            _O_DIRECT_OK[os.path.dirname(path)] = False
    return os.open(path, os.O_RDONLY), False


def read_range(path: str, start: int, out: torch.Tensor) -> int:
    """Read ``out.numel()`` bytes of ``path`` from ``start`` (both 4 KiB-aligned, ``out`` a
    page-aligned uint8 tensor) with O_DIRECT; bytes past the end of the file are left as they
    are. Returns the bytes read. Releases the GIL while reading."""
    n = out.numel()
    view = out.numpy()
    try:
        fd, direct = _open_direct(path)
    except OSError as exc:
        raise WeightsError(f"cannot open weights file {path}: {exc.strerror}") from None
    done = 0
    try:
        while done < n:
            want = min(_CHUNK, n - done)
            try:
                got = os.preadv(fd, [view[done:done + want]], start + done)
            except OSError as exc:
                if direct and exc.errno == 22:          # EINVAL: this file refuses O_DIRECT
                    os.close(fd)
                    _O_DIRECT_OK[os.path.dirname(path)] = False
                    fd, direct = os.open(path, os.O_RDONLY), False
                    continue
                raise WeightsError(f"reading {want} bytes at offset {start + done} of {path} failed: "
                                   f"{exc.strerror} (errno {exc.errno})") from None
            done += got
            if got < want:                # the end of the file (a regular file reads short only there)
                break
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, start, n, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return done


def raw_read(files: Sequence[str], buffer) -> int:
    """Read every byte of ``files`` with O_DIRECT into ``buffer`` (re-used per chunk): the
    reference rate for loading. Returns the bytes read."""
    raw = buffer.view(torch.uint8, buffer.nbytes // PAGE * PAGE)
    total = 0
    for f in files:
        size = os.path.getsize(f)
        pos = 0
        while pos < size:
            n = min(raw.numel(), -(-(size - pos) // PAGE) * PAGE)
            read_range(f, pos, raw[:n])
            pos += n
        total += size
    return total


_libc = None


def drop_pages(t: torch.Tensor) -> None:
    """Drop the pages of a memory-mapped tensor from this process (they are re-read from the
    file if used again): ``madvise(MADV_DONTNEED)`` over the pages it spans."""
    global _libc
    n = t.numel() * t.element_size()
    if not n:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    a = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    b = -(-(t.data_ptr() + n) // mmap.PAGESIZE) * mmap.PAGESIZE
    _libc.madvise(a, b - a, 4)          # MADV_DONTNEED; failure only leaves the pages resident


# ---- writing -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a safetensors file about to be written."""
    key: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _itemsize(self.dtype)


def write_safetensors(path: str, specs: Sequence[TensorSpec], produce: Callable[[TensorSpec], torch.Tensor],
                      metadata: Optional[Dict[str, str]] = None) -> int:
    """Write a safetensors file whose header is known up front (``specs``), asking
    ``produce(spec)`` for each tensor in order, so only one tensor is in memory at a time.
    Written to ``path.tmp``, fsynced, then renamed. Returns the file's size."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    off = 0
    for s in specs:
        if s.dtype not in ST_NAMES:
            raise WeightsError(f"tensor {s.key!r} has dtype {s.dtype}, which safetensors cannot hold")
        header[s.key] = {"dtype": ST_NAMES[s.dtype], "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for s in specs:
            t = produce(s)
            if tuple(t.shape) != tuple(s.shape) or t.dtype != s.dtype:
                raise AssertionError(f"{s.key}: produced {t.dtype}{list(t.shape)}, planned {s.dtype}{list(s.shape)}")
            t = t.detach().to("cpu").contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return 8 + len(hb) + off


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors$")


def shard_names(n: int) -> List[str]:
    """The files of ``n`` shards as ``save_pretrained`` names them: ``model.safetensors``
    alone (no index), else ``model-0000i-of-0000n.safetensors`` beside an index."""
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def stale_weight_files(out_dir: str, keep: Sequence[str]) -> List[str]:
    """Weight files of an earlier save in ``out_dir`` that a save writing ``keep`` replaces
    (``save_pretrained`` removes them too, so the folder holds one model)."""
    if not os.path.isdir(out_dir):
        return []
    names = [f for f in os.listdir(out_dir) if f in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.match(f)]
    return [os.path.join(out_dir, f) for f in names if f not in keep]


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> List[List[TensorSpec]]:
    """Consecutive runs of ``specs`` of at most ``max_shard_bytes`` each (a larger tensor
    gets a shard of its own), as ``save_pretrained`` splits."""
    shards: List[List[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return [s for s in shards if s]
