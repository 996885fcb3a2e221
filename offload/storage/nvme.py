"""The NVMe store: flat tensors in preallocated swap files, moved with O_DIRECT.

One noun, three parts, in this order below: the on-disk extent layout of a key, the I/O
backends that move extents, and ``NvmeStore`` (keys, swap files, handles).

Layout. Each ``reserve()`` call creates one swap file in this store's private run directory
and preallocates it; every key gets a 4096-aligned region of ``round_up(N, 4096)`` bytes for
N bytes, stored as (``ExtentLayout``):

* its **body**, the first ``N // 4096 * 4096`` bytes, cut into extents of ``block_size``
  bytes (the last may be shorter); body extent ``i`` covers
  ``[offset + i * block_size, offset + min((i + 1) * block_size, body))`` and moves straight
  between the caller's buffer and the file;
* its **tail**, the last ``N % 4096`` bytes (when there are any), stored zero-padded in one
  4096-byte page right after the body; it is the last extent and moves through a small
  bounce page owned by the key, because the bytes after the caller's tensor may belong to
  someone else and must be neither read nor clobbered.

Extents are the unit of I/O and of checksums: each has a crc32c, computed by the I/O worker
that writes it and checked by the worker that reads it. The store sizes its reservations and
checksum arrays and locates failed extents from this description; the portable backend
moves exactly these extents; the native engine (native/aio.c) implements the same geometry
in C from the same ``block_size`` (``tests/storage/test_tier.py`` checks that the two agree on the
extent count and the bytes at every offset). The native request struct
(``offload._native.IoReq``) carries ``nbytes`` (the body) and ``tail_len``.

Backends. Both take the same request, ``IoReq``: the body moved straight between a caller's
buffer and a file, an optional tail page moved through the bounce page, and an optional
array of per-extent checksums (written by a write, checked by a read).

  * ``NativeBackend``: the C engine (native/aio.c): io_uring rings where the kernel allows
    them, else a pthread pool of pread/pwrite. ``OFFLOAD_IO_URING=auto|on|off`` (or the
    ``io_uring`` argument) chooses; ``name`` reports what runs.
  * ``PortableBackend``: a Python thread pool of os.preadv/os.pwritev (which release the GIL);
    one extent in flight per thread. Checksums use the native crc32c when the library loads,
    else zlib's crc32 (the store never mixes the two).

The I/O threads of both run under SCHED_BATCH where the OS has it (Linux) and the process
runs under the default policy: same CPU share, but a thread woken by a submit does not
preempt the submitter or its neighbour (a write-back's checksum would otherwise hold a core
in the middle of the optimizer's chain); see native/aio.c. Both start all their threads when
created and return once each has switched, so no request is moved under the caller's
policy. After ``submit(req)`` the request struct and every buffer it points to belong to the
backend until ``done(req)`` is true; ``close()`` finishes every queued request first.

Lifetimes. ``write(key, src)`` and ``read(key, dst)`` return an IOHandle at once; ``src``
must not be modified and ``dst`` not used until the handle is done. The store keeps both
tensors alive until then. One I/O per key at a time: starting a second before the first is
done is an error, not a silent reorder.

Safety. Free space is checked before files are allocated; short transfers, errno failures
and checksum mismatches are raised by ``IOHandle.wait()``; a key whose last write failed or
that was never written refuses to be read. The run directory is removed on ``close()``,
when the store is collected and at interpreter exit; one left behind by a crashed process is
reported (never reused) by the next store created under the same path.
"""
from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import re
import secrets
import shutil
import socket
import threading
import time
import warnings
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Mapping

import psutil
import torch
from torch.profiler import record_function

from offload import _native
from offload._native import IO_PAGE, IO_READ, IO_WRITE, IoReq
from offload.core.errors import BudgetError, OffloadError
from offload.units import PAGE, fmt_exact, round_up


# ---- the extent layout of a key ----------------------------------------------------------------

@dataclass(frozen=True)
class Extent:
    """One unit of I/O and checksum of a key, offsets relative to the key's start."""
    index: int
    offset: int       # in the file, from the key's offset; in the caller's buffer for the body
    length: int       # bytes moved to or from the file (the tail: one whole page)
    tail: bool        # the zero-padded last page, moved through the bounce page


class ExtentLayout:
    """The extents of a key of ``nbytes`` bytes for a given ``block_size``."""

    def __init__(self, block_size: int):
        if not isinstance(block_size, int) or block_size <= 0 or block_size % PAGE:
            raise ValueError(f"block_size={block_size!r} must be a positive multiple of {PAGE}")
        self.block_size = block_size

    @staticmethod
    def split(nbytes: int) -> tuple:
        """(body bytes, tail bytes) of a key of ``nbytes``."""
        body = nbytes // PAGE * PAGE
        return body, nbytes - body

    @staticmethod
    def reserved(nbytes: int) -> int:
        """Bytes a key of ``nbytes`` occupies in its file."""
        return round_up(nbytes)

    def body_extents(self, body: int) -> int:
        return -(-body // self.block_size)

    def count(self, body: int, tail_len: int) -> int:
        """Extents of one transfer: the body's, plus the tail page."""
        return self.body_extents(body) + (1 if tail_len else 0)

    def max_extents(self, nbytes: int) -> int:
        """Checksum slots a key reserved with ``nbytes`` needs at most (body extents + tail)."""
        return self.body_extents(self.split(nbytes)[0]) + 1

    def extent(self, body: int, tail_len: int, i: int) -> Extent:
        nbody = self.body_extents(body)
        if i < nbody:
            start = i * self.block_size
            return Extent(i, start, min(self.block_size, body - start), False)
        if i == nbody and tail_len:
            return Extent(i, body, PAGE, True)
        raise IndexError(f"extent {i} of a transfer with {self.count(body, tail_len)} extents")

    def extents(self, body: int, tail_len: int) -> Iterator[Extent]:
        for i in range(self.count(body, tail_len)):
            yield self.extent(body, tail_len, i)


# ---- I/O backends ------------------------------------------------------------------------------

BACKENDS = ("native", "portable")

ENODATA_SHORT = 61  # errno.ENODATA: the file gave no more bytes (short transfer)


def crc_function():
    """(name, fn(address, nbytes) -> int) of the checksum in use in this process."""
    if _native.lib() is not None:
        return "crc32c", _native.crc32c

    def _zlib(address: int, nbytes: int) -> int:
        return zlib.crc32((ctypes.c_char * nbytes).from_address(address))

    return "crc32(zlib)", _zlib


def _uring_setting(io_uring: bool | None) -> int:
    """-1 auto, 0 off, 1 required; the argument wins over OFFLOAD_IO_URING."""
    if io_uring is not None:
        return 1 if io_uring else 0
    value = os.environ.get("OFFLOAD_IO_URING", "auto").strip().lower()
    table = {"auto": -1, "on": 1, "1": 1, "off": 0, "0": 0}
    if value not in table:
        raise ValueError(f"OFFLOAD_IO_URING={value!r} is not valid: use auto, on or off")
    return table[value]


_START_TIMEOUT_S = 30.0   # for the portable backend's threads to start


def no_wake_preempt() -> None:
    """The calling thread to SCHED_BATCH when it runs under SCHED_OTHER (best effort; as the
    native workers do, see the module docstring)."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None:
        return
    try:
        if os.sched_getscheduler(0) == os.SCHED_OTHER:
            os.sched_setscheduler(0, batch, os.sched_param(0))
    except OSError:
        pass


class Backend:
    """The interface both backends implement."""

    name: str
    closed: bool     # close() was called: submit raises StoreClosedError, wait answers from the request

    def submit(self, req: IoReq) -> None: ...
    def wait(self, req: IoReq, timeout: float | None) -> bool: ...   # True when done
    def done(self, req: IoReq) -> bool: ...
    def stats(self) -> dict: ...
    def close(self) -> None: ...


class NativeBackend(Backend):
    """The C engine behind a liveness guard: the native context is freed by ``close()`` only
    once no thread is inside a call into it (each call holds a use, taken under ``_lock`` while
    the context is open), so a ``wait`` from one thread and a ``close`` from another (a
    finalizer, the cyclic collector) never meet on freed memory. After ``close()`` every
    request has completed (destroy drains the queue): ``wait``/``done`` answer from the request
    itself, ``submit`` raises ``StoreClosedError``, ``stats`` gives the last figures."""

    _CLOSE_WAIT_S = 30.0     # for calls in flight to leave the context (each waits in slices)

    def __init__(self, block_size: int, queue_depth: int, threads: int, io_uring: bool | None = None):
        if _native.lib() is None:
            raise RuntimeError(f"the native I/O backend needs the native library: {_native.load_error()}; "
                               "use backend='portable' or build it with `make native`")
        self._engine, cfg = _native.aio_create(block_size, queue_depth, threads, _uring_setting(io_uring))
        self.io_uring = bool(cfg.uring_active)
        self.uring_error = os.strerror(cfg.uring_error) if cfg.uring_error else None
        self.in_flight = cfg.ring_depth * threads
        self.name = "native-io_uring" if self.io_uring else "native-threads"
        self._lock = threading.Condition(threading.Lock())
        self._users = 0                  # calls inside the native context now
        self._closing = False
        self._last_stats = None

    @property
    def closed(self) -> bool:
        return self._closing

    def _enter(self):
        with self._lock:
            if self._closing:
                return None
            self._users += 1
            return self._engine

    def _leave(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._lock.notify_all()

    def submit(self, req: IoReq) -> None:
        engine = self._enter()
        if engine is None:
            raise StoreClosedError("the I/O engine is closed: the store was closed or collected")
        try:
            _native.aio_submit(engine, req)
        finally:
            self._leave()

    def wait(self, req: IoReq, timeout: float | None) -> bool:
        # Wait in slices so that Ctrl-C reaches Python between them, and close() from another
        # thread waits at most one slice for this call to leave the context.
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = 0.25 if deadline is None else min(0.25, max(0.0, deadline - time.monotonic()))
            engine = self._enter()
            if engine is None:
                return bool(req.done)    # closed: every request submitted has completed
            try:
                if _native.aio_wait(engine, req, int(step * 1e9)):
                    return True
            finally:
                self._leave()
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def done(self, req: IoReq) -> bool:
        return _native.aio_done(req)

    def stats(self) -> dict:
        engine = self._enter()
        if engine is None:
            return dict(self._last_stats or {"bytes_read": 0, "bytes_written": 0, "read_seconds": 0.0,
                                              "write_seconds": 0.0, "reads": 0, "writes": 0})
        try:
            s = _native.aio_stats(engine)
        finally:
            self._leave()
        return {"bytes_read": s.bytes[IO_READ], "bytes_written": s.bytes[IO_WRITE],
                "read_seconds": s.busy_ns[IO_READ] / 1e9, "write_seconds": s.busy_ns[IO_WRITE] / 1e9,
                "reads": s.requests[IO_READ], "writes": s.requests[IO_WRITE]}

    def close(self) -> None:
        """Finish every queued request and free the context, once no call is inside it (at
        most ``_CLOSE_WAIT_S``; a call still inside after that keeps the context alive for the
        process's life rather than free it under the caller). Idempotent, any thread."""
        with self._lock:
            if self._closing:
                return
            stats_first = self._users == 0
        last = self.stats() if stats_first else None
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._last_stats = last
            engine, self._engine = self._engine, None
            if not self._lock.wait_for(lambda: self._users == 0, self._CLOSE_WAIT_S):
                keep_alive(engine)       # never freed under a caller: leaked, not crashed
                return
        if engine:
            _native.aio_destroy(engine)


class PortableBackend(Backend):
    """os.preadv / os.pwritev on a thread pool; the same extents and checksums as native."""

    def __init__(self, block_size: int, queue_depth: int, threads: int, io_uring: bool | None = None):
        del queue_depth, io_uring  # one extent in flight per thread
        self.name = "portable"
        self.in_flight = threads
        self._layout = ExtentLayout(block_size)
        self._crc = crc_function()[1]
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="offload-io",
                                        initializer=no_wake_preempt)
        # All workers start now and each has switched its policy before the first request
        # (the pool would otherwise start them one per submit, each switching when it first runs).
        started = threading.Barrier(threads + 1)
        for _ in range(threads):
            self._pool.submit(started.wait, _START_TIMEOUT_S)
        try:
            started.wait(_START_TIMEOUT_S)
        except threading.BrokenBarrierError:
            self._pool.shutdown(wait=False)
            raise RuntimeError(f"the portable I/O backend's {threads} threads did not start within "
                               f"{_START_TIMEOUT_S:.0f} s") from None
        self._cond = threading.Condition()
        self._closing = False
        self._outstanding = [0, 0]
        self._busy_since = [0, 0]
        self._stats = {"bytes": [0, 0], "busy_ns": [0, 0], "requests": [0, 0]}

    def submit(self, req: IoReq) -> None:
        if self._closing:
            raise StoreClosedError("the I/O engine is closed: the store was closed or collected")
        req.nextents = self._layout.count(req.nbytes, req.tail_len)
        if req.nextents == 0 or req.op not in (IO_READ, IO_WRITE):
            raise ValueError("bad I/O request")
        req.remaining = req.nextents
        req.status, req.error_extent, req.short_got, req.short_want, req.done = 0, -1, 0, 0, 0
        with self._cond:
            req.submit_ns = time.monotonic_ns()
            if self._outstanding[req.op] == 0:
                self._busy_since[req.op] = req.submit_ns
            self._outstanding[req.op] += 1
            self._stats["requests"][req.op] += 1
        for x in self._layout.extents(req.nbytes, req.tail_len):
            self._pool.submit(self._run_extent, req, x)

    def _run_extent(self, req: IoReq, x) -> None:
        i, tail, length, off = x.index, x.tail, x.length, req.offset + x.offset
        addr = req.tail_page if tail else req.buf + x.offset
        status = got = 0
        try:
            if req.op == IO_WRITE:
                if tail:
                    ctypes.memmove(req.tail_page, req.tail_user, req.tail_len)
                    ctypes.memset(req.tail_page + req.tail_len, 0, IO_PAGE - req.tail_len)
                if req.crcs:
                    _crcs(req)[i] = self._crc(addr, length)
            view = memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
            move = os.preadv if req.op == IO_READ else os.pwritev
            while got < length:
                n = move(req.fd, [view[got:]], off + got)
                if n == 0:
                    status = -ENODATA_SHORT
                    break
                got += n
            if status == 0 and req.op == IO_READ:
                if req.crcs and self._crc(addr, length) != _crcs(req)[i]:
                    status = -74  # EBADMSG
                elif tail:
                    ctypes.memmove(req.tail_user, req.tail_page, req.tail_len)
        except Exception as exc:  # noqa: BLE001 - every failure must reach wait(), never hang it
            status = -(getattr(exc, "errno", None) or 5)
        self._finish(req, i, status, got, length)

    def _finish(self, req: IoReq, i: int, status: int, got: int, length: int) -> None:
        with self._cond:
            if status and (req.status == 0 or i < req.error_extent):
                req.status, req.error_extent = status, i
                req.short_got, req.short_want = (got, length) if status == -ENODATA_SHORT else (0, 0)
            self._stats["bytes"][req.op] += got
            req.remaining -= 1
            if req.remaining == 0:
                req.done_ns = time.monotonic_ns()
                self._outstanding[req.op] -= 1
                if self._outstanding[req.op] == 0:
                    self._stats["busy_ns"][req.op] += req.done_ns - self._busy_since[req.op]
                req.done = 1
                self._cond.notify_all()

    def wait(self, req: IoReq, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: req.done, timeout)

    def done(self, req: IoReq) -> bool:
        return bool(req.done)

    def stats(self) -> dict:
        with self._cond:
            s = self._stats
            busy = list(s["busy_ns"])
            now = time.monotonic_ns()
            for op in (IO_READ, IO_WRITE):
                if self._outstanding[op]:
                    busy[op] += now - self._busy_since[op]
            return {"bytes_read": s["bytes"][IO_READ], "bytes_written": s["bytes"][IO_WRITE],
                    "read_seconds": busy[IO_READ] / 1e9, "write_seconds": busy[IO_WRITE] / 1e9,
                    "reads": s["requests"][IO_READ], "writes": s["requests"][IO_WRITE]}

    @property
    def closed(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True
        self._pool.shutdown(wait=True)


def _crcs(req: IoReq):
    return ctypes.cast(req.crcs, ctypes.POINTER(ctypes.c_uint32))


def make_backend(kind: str, block_size: int, queue_depth: int, threads: int,
                 io_uring: bool | None = None) -> Backend:
    if kind not in BACKENDS:
        raise ValueError(f"backend={kind!r} is not one of {BACKENDS}")
    cls = NativeBackend if kind == "native" else PortableBackend
    return cls(block_size, queue_depth, threads, io_uring)


# ---- the store ---------------------------------------------------------------------------------

RUN_PREFIX = "offload-"
# defaults of the I/O engine: extent size and requests in flight (benchmarks/bench_io.py sizes them)
DEFAULT_BLOCK_SIZE = 4 << 20
DEFAULT_QUEUE_DEPTH = 64
OWNER_FILE = "owner.json"
# (backend, files, buffers) of stores closed with I/O stuck in flight: kept alive, never freed
# under a request the kernel or an I/O thread may still complete
_LEFT_IN_FLIGHT: list = []


def keep_alive(*objs) -> None:
    """Keep objects a stalled I/O request may still use alive until the interpreter exits."""
    _LEFT_IN_FLIGHT.append(objs)


class NvmeIOError(OSError, OffloadError):
    """A read or write of the swap files failed (errno, or a short transfer)."""


class StoreClosedError(RuntimeError, OffloadError):
    """An I/O was started on a store that is closed (by ``close()``, or by its finalizer when
    the store was collected)."""


class ChecksumError(NvmeIOError):
    """The bytes read back do not match the checksum recorded when they were written."""


class NvmeSpaceError(NvmeIOError, BudgetError):
    """Not enough free space under the swap path."""


class StaleSwapDirWarning(UserWarning):
    """A swap directory left by a crashed run was found (and not reused)."""


class DirectIOWarning(UserWarning):
    """The filesystem refuses O_DIRECT; the store falls back to buffered I/O."""


class _SwapFile:
    """One preallocated file: an O_DIRECT descriptor for aligned buffers and a buffered one
    for the rest (the same descriptor when the filesystem refuses O_DIRECT)."""

    def __init__(self, path: str, size: int, direct: bool):
        self.path, self.size = path, size
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self.fd_buffered = os.open(path, flags, 0o600)
        self.fd_direct = self.fd_buffered
        try:
            os.posix_fallocate(self.fd_buffered, 0, size)
            if direct:
                self.fd_direct = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
        except BaseException:
            self.close()
            os.unlink(path)
            raise

    def close(self) -> None:
        for fd in {self.fd_buffered, self.fd_direct}:
            if fd >= 0:
                os.close(fd)
        self.fd_buffered = self.fd_direct = -1


class _Key:
    """Where one key lives and what it holds. ``nbytes`` is the size of the valid data, or
    None (never written, a write in flight, or the last write failed)."""

    __slots__ = ("name", "file", "offset", "capacity", "crcs", "tail_page", "nbytes", "pending", "failed")

    def __init__(self, name, file, offset, capacity, crcs, tail_page):
        self.name, self.file, self.offset, self.capacity = name, file, offset, capacity
        self.crcs = crcs            # address of max_extents uint32 (a ctypes array the store owns)
        self.tail_page = tail_page  # address of a 4096-aligned page (an mmap the store owns)
        self.nbytes: int | None = None
        self.pending: IOHandle | None = None
        self.failed: Exception | None = None  # the error of the last write, when it failed


class IOHandle:
    """One read or write in flight. ``wait()`` raises its error; ``done()`` polls."""

    __slots__ = ("key", "op", "nbytes", "_store", "_k", "_req", "_tensor", "_error", "_finished")

    def __init__(self, store: "NvmeStore", k: _Key, op: int, req: IoReq, tensor: torch.Tensor):
        self.key, self.op, self.nbytes = k.name, op, tensor.nbytes
        self._store, self._k, self._req = store, k, req
        self._tensor = tensor  # kept alive until the I/O completes
        self._error: Exception | None = None
        self._finished = False

    def done(self) -> bool:
        """True once the transfer has finished (successfully or not)."""
        if not self._finished and self._store._backend.done(self._req):
            self._finish()
        return self._finished

    def wait(self, timeout: float | None = None) -> None:
        """Block until done. Raises NvmeIOError (errno, short transfer), ChecksumError, or
        TimeoutError when ``timeout`` seconds pass first (the I/O stays in flight)."""
        if not self._finished:
            with record_function("offload::nvme_wait"):
                if not self._store._backend.wait(self._req, timeout):
                    raise TimeoutError(f"{self._verb} of key {self.key!r} not done after {timeout} s")
            self._finish()
        if self._error is not None:
            raise self._error

    @property
    def _verb(self) -> str:
        return "read" if self.op == IO_READ else "write"

    def _finish(self) -> None:
        with self._store._lock:
            if self._finished:
                return
            self._error = self._store._error_of(self)
            k = self._k
            if self.op == IO_WRITE:
                k.nbytes = self.nbytes if self._error is None else None
                k.failed = self._error
            if k.pending is self:
                k.pending = None
            self._tensor = None
            self._finished = True

    def __repr__(self) -> str:
        return f"IOHandle({self._verb} {self.key!r}, {self.nbytes} bytes, done={self.done()})"


def _pid_alive(pid: int, create_time: float | None) -> bool:
    try:
        proc = psutil.Process(pid)
        return create_time is None or abs(proc.create_time() - create_time) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def find_stale_run_dirs(path: str) -> list[str]:
    """Run directories under ``path`` whose owning process on this host is gone."""
    stale = []
    try:
        entries = sorted(os.listdir(path))
    except OSError:
        return stale
    for entry in entries:
        d = os.path.join(path, entry)
        if not entry.startswith(RUN_PREFIX) or not os.path.isdir(d):
            continue
        try:
            with open(os.path.join(d, OWNER_FILE)) as f:
                owner = json.load(f)
            if owner.get("host") != socket.gethostname():
                continue  # another machine's run on a shared filesystem: not ours to judge
            if _pid_alive(int(owner["pid"]), owner.get("create_time")):
                continue
        except FileNotFoundError:
            # Created a moment ago by a live process that has not written its owner file yet?
            if time.time() - os.stat(d).st_mtime < 5:
                continue
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable owner file: stale
        stale.append(d)
    return stale


def _probe_direct(run_dir: str) -> str | None:
    """None when O_DIRECT works in run_dir, else why not."""
    probe = os.path.join(run_dir, ".direct-probe")
    page = mmap.mmap(-1, IO_PAGE)  # page-aligned
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            os.pwritev(fd, [page], 0)
            os.preadv(fd, [page], 0)
        finally:
            os.close(fd)
        return None
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return exc.strerror or str(exc)
        raise
    finally:
        page.close()
        try:
            os.unlink(probe)
        except OSError:
            pass


def _fs_type(path: str) -> str:
    best, fstype = "", "unknown"
    real = os.path.realpath(path)
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best):
            best, fstype = mp, part.fstype
    return fstype


def _cleanup(backend, files: list, run_dir: str, buffers: list) -> None:
    """Finish in-flight I/O, close the files, remove the run directory. ``buffers`` (bounce
    pages and checksum arrays the engine writes into) are held until the engine is gone."""
    try:
        backend.close()
    finally:
        for f in files:
            f.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        buffers.clear()


class NvmeStore:
    """Swap files under ``path``: flat tensors written and read by key, asynchronously."""

    def __init__(self, path: str, *, backend: str = "native", block_size: int = DEFAULT_BLOCK_SIZE,
                 queue_depth: int = DEFAULT_QUEUE_DEPTH, threads: int = 4, checksum: bool = True,
                 name: str = "swap",
                 io_uring: bool | None = None):
        """Create a private run directory under ``path`` and start the I/O backend.

        ``backend``: "native" (C engine: io_uring, else a pthread pool) or "portable"
        (Python threads). ``io_uring``: None (OFFLOAD_IO_URING, default auto), True, False.
        ``block_size`` is the I/O and checksum unit; ``queue_depth`` the extents in flight
        (native io_uring); ``threads`` the workers. A run directory left under ``path`` by a
        crashed process is reported with a StaleSwapDirWarning and left alone."""
        if not isinstance(block_size, int) or block_size <= 0 or block_size % IO_PAGE:
            raise ValueError(f"block_size={block_size!r} must be a positive multiple of {IO_PAGE}")
        if queue_depth < 1 or threads < 1:
            raise ValueError(f"queue_depth={queue_depth} and threads={threads} must be >= 1")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"name={name!r}: use 1-64 letters, digits, '_', '.' or '-'")
        self.path = os.path.abspath(os.fspath(path))
        self.name, self.block_size, self.checksum = name, block_size, bool(checksum)
        self.layout = ExtentLayout(block_size)
        if not os.path.exists(self.path):
            raise FileNotFoundError(errno.ENOENT, f"nvme_path {self.path} does not exist: create it, or point "
                                    "nvme_path at a directory on a fast local disk", self.path)
        if not os.path.isdir(self.path):
            raise NotADirectoryError(errno.ENOTDIR, f"nvme_path {self.path} is not a directory", self.path)
        for stale in find_stale_run_dirs(self.path):
            warnings.warn(f"stale offload swap directory {stale} ({fmt_exact(_dir_bytes(stale))} on disk): its run "
                          f"is gone (crashed or killed). It is not reused; remove it with: rm -rf {stale}",
                          StaleSwapDirWarning, stacklevel=2)
        run_dir = os.path.join(self.path, f"{RUN_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(run_dir, 0o700)
            with open(os.path.join(run_dir, OWNER_FILE), "w") as f:
                json.dump({"pid": os.getpid(), "create_time": psutil.Process().create_time(),
                           "host": socket.gethostname(), "started": time.time()}, f)
        except OSError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise PermissionError(exc.errno, f"nvme_path {self.path} is not writable ({exc.strerror}): "
                                  "point nvme_path at a writable directory", self.path) from exc
        self.run_dir = run_dir
        why = _probe_direct(run_dir)
        self.direct = why is None
        if not self.direct:
            warnings.warn(f"{self.path} ({_fs_type(self.path)}) refuses O_DIRECT ({why}): swap files use buffered "
                          "I/O through the page cache (slower, and it costs RAM); use a disk-backed filesystem",
                          DirectIOWarning, stacklevel=2)
        self.checksum_name = crc_function()[0] if self.checksum else "off"
        try:
            self._backend = make_backend(backend, block_size, queue_depth, threads, io_uring)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        self.backend = self._backend.name
        self._lock = threading.RLock()
        self._keys: dict[str, _Key] = {}
        self._files: list[_SwapFile] = []
        self._buffers: list = []  # crc arrays and tail pages: written by I/O workers
        self._warned_unaligned = False
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup, self._backend, self._files, run_dir, self._buffers)

    # -- allocation ----------------------------------------------------------------------------

    def reserve(self, sizes: Mapping[str, int]) -> None:
        """Give each key a preallocated, aligned region of at least ``sizes[key]`` bytes.

        Checks free space for the total first. Keys already reserved at the same or a larger
        size are left as they are; may be called more than once."""
        self._check_open()
        new = {}
        for key, n in sizes.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"keys must be non-empty strings, got {key!r}")
            if not isinstance(n, int) or n <= 0:
                raise ValueError(f"size of key {key!r} must be a positive int, got {n!r}")
            old = self._keys.get(key)
            if old is not None:
                if n > old.capacity:
                    raise ValueError(f"key {key!r} is reserved with {old.capacity} bytes, cannot grow to {n}")
                continue
            new[key] = n
        if not new:
            return
        offsets, total = {}, 0
        for key, n in new.items():
            offsets[key] = total
            total += self.layout.reserved(n)
        usage = psutil.disk_usage(self.run_dir)
        free = usage.free
        if usage.total and total > free:  # total 0: the filesystem does not say (ramfs)
            raise NvmeSpaceError(errno.ENOSPC, f"not enough free space under nvme_path {self.path} for the swap "
                                 f"files: need {fmt_exact(total)}, {fmt_exact(free)} free; free some space, lower what is "
                                 "offloaded to NVMe, or point nvme_path at a larger disk")
        with self._lock:
            fpath = os.path.join(self.run_dir, f"{self.name}-{len(self._files):03d}.swap")
            try:
                swap = _SwapFile(fpath, total, self.direct)
            except OSError as exc:
                raise NvmeSpaceError(exc.errno, f"cannot preallocate {fmt_exact(total)} for swap file {fpath} under "
                                     f"nvme_path {self.path}: {exc.strerror}") from exc
            self._files.append(swap)
            max_extents = {k: self.layout.max_extents(n) for k, n in new.items()}
            crcs = (ctypes.c_uint32 * sum(max_extents.values()))()
            pages = mmap.mmap(-1, IO_PAGE * len(new))  # page-aligned bounce pages, one per key
            pages_addr = ctypes.addressof(ctypes.c_char.from_buffer(pages))
            self._buffers += [crcs, pages]
            crc_at = ctypes.addressof(crcs)
            for i, (key, n) in enumerate(new.items()):
                self._keys[key] = _Key(key, swap, offsets[key], self.layout.reserved(n), crc_at,
                                       pages_addr + i * IO_PAGE)
                crc_at += 4 * max_extents[key]

    # -- I/O -----------------------------------------------------------------------------------

    def write(self, key: str, src: torch.Tensor) -> IOHandle:
        """Start writing ``src`` (contiguous, CPU) to ``key``. ``src`` must not be modified
        until the handle is done."""
        with record_function("offload::nvme_write"):
            k = self._key(key)
            self._check_tensor(src, "src")
            if src.nbytes > k.capacity:
                raise ValueError(f"write of {src.nbytes} bytes to key {key!r}, which has {k.capacity} reserved")
            return self._submit(k, IO_WRITE, src)

    def read(self, key: str, dst: torch.Tensor) -> IOHandle:
        """Start reading ``key`` into ``dst`` (contiguous, CPU, exactly the size written).
        ``dst`` holds the data once the handle is done; checksums are verified before."""
        with record_function("offload::nvme_read"):
            k = self._key(key)
            self._check_tensor(dst, "dst")
            with self._lock:
                self._settle(k)
                if k.pending is None and k.nbytes is None and k.failed is not None:
                    code = getattr(k.failed, "errno", None) or errno.EIO
                    raise NvmeIOError(code, f"key {key!r} holds no data: its last write failed ({k.failed})",
                                      k.file.path)
                if k.pending is None and k.nbytes is None:
                    raise NvmeIOError(errno.ENODATA, f"key {key!r} holds no data: it was never written, or its "
                                      "last write failed")
                if k.pending is None and dst.nbytes != k.nbytes:
                    raise ValueError(f"read of key {key!r} into {dst.nbytes} bytes, but {k.nbytes} were written")
            return self._submit(k, IO_READ, dst)

    def _submit(self, k: _Key, op: int, t: torch.Tensor) -> IOHandle:
        ptr = t.data_ptr()
        body, tail = self.layout.split(t.nbytes)
        aligned = ptr % IO_PAGE == 0
        if self.direct and not aligned and not self._warned_unaligned:
            self._warned_unaligned = True
            warnings.warn(f"a buffer at {ptr:#x} is not 4096-aligned, so it goes through the page cache instead "
                          "of O_DIRECT; allocate I/O buffers from a HostPool", stacklevel=3)
        req = IoReq(buf=ptr if body else None, nbytes=body, offset=k.offset,
                    tail_user=ptr + body if tail else None, tail_page=k.tail_page if tail else None,
                    crcs=k.crcs if self.checksum else None,
                    fd=k.file.fd_direct if aligned else k.file.fd_buffered, op=op, tail_len=tail)
        with self._lock:
            self._check_open()
            self._settle(k)
            if k.pending is not None:
                raise RuntimeError(f"key {k.name!r} already has a {k.pending._verb} in flight: wait on its handle "
                                   "before starting another I/O on the same key")
            handle = IOHandle(self, k, op, req, t)
            if op == IO_WRITE:
                k.nbytes = None  # invalid until this write succeeds
            k.pending = handle
            self._backend.submit(req)
        return handle

    def _settle(self, k: _Key) -> None:  # lock held
        if k.pending is not None:
            k.pending.done()

    def _error_of(self, h: IOHandle) -> Exception | None:
        req = h._req
        if req.status == 0:
            return None
        k, i = h._k, req.error_extent
        start = k.offset + self.layout.extent(req.nbytes, req.tail_len, i).offset
        where = f"extent {i} (file {k.file.path}, offset {start})"
        code = -req.status
        path = k.file.path
        if code == errno.EBADMSG and self.checksum:
            return ChecksumError(errno.EBADMSG, f"checksum mismatch reading key {h.key!r}: {where} does not "
                                 "match the crc32c recorded when it was written; the swap file is corrupt", path)
        if code == ENODATA_SHORT:
            return NvmeIOError(errno.EIO, f"short {h._verb} of key {h.key!r}: {where} moved {req.short_got} of "
                               f"{req.short_want} bytes", path)
        return NvmeIOError(code, f"{h._verb} of key {h.key!r} failed at {where}: {os.strerror(code)}", path)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _key(self, key: str) -> _Key:
        self._check_open()
        k = self._keys.get(key)
        if k is None:
            raise KeyError(f"key {key!r} is not reserved in NvmeStore {self.name!r}; call reserve() first")
        return k

    @staticmethod
    def _check_tensor(t: torch.Tensor, what: str) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{what} must be a contiguous CPU tensor")
        if t.nbytes == 0:
            raise ValueError(f"{what} is empty: nothing to move")

    def _check_open(self) -> None:
        if self._closed or self._backend.closed:     # closed, or its finalizer ran
            raise StoreClosedError(f"NvmeStore {self.name!r} at {self.path} is closed")

    def keys(self) -> list[str]:
        return list(self._keys)

    def stats(self) -> dict:
        """Bytes read/written, busy seconds per direction, files and reserved bytes."""
        out = self._backend.stats()
        out.update(files=len(self._files), reserved_bytes=sum(f.size for f in self._files), keys=len(self._keys),
                   backend=self.backend, direct=self.direct, checksum=self.checksum_name, run_dir=self.run_dir)
        return out

    def close(self, timeout: float = 60.0) -> bool:
        """Wait for in-flight I/O (at most ``timeout`` seconds in all), then remove the swap
        files and the run directory. I/O still in flight after that (a stalled disk) keeps its
        descriptors, buffers and I/O threads, which are left to finish (never freed under it);
        the run directory is removed anyway and a ResourceWarning says so: close never hangs.
        Returns False in that case (the callers' buffers must then stay allocated too)."""
        if self._closed:
            return True
        with self._lock:
            self._closed = True
            pending = [k.pending for k in self._keys.values() if k.pending is not None]
        deadline = time.monotonic() + timeout
        stuck = 0
        for h in pending:
            try:
                h.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                stuck += 1
            except Exception:  # noqa: BLE001 - closing: the caller did not ask for this result
                pass
        if stuck:
            self._finalizer.detach()
            keep_alive(self._backend, self._files, self._buffers)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            warnings.warn(f"NvmeStore {self.name!r}: {stuck} I/O request(s) still in flight after {timeout} s (a "
                          f"stalled disk under {self.path}); the run directory is removed, the requests' threads "
                          "and buffers are left to finish", ResourceWarning, stacklevel=2)
            return False
        self._finalizer()
        return True

    def __enter__(self) -> "NvmeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NvmeStore({self.run_dir!r}, backend={self.backend}, direct={self.direct})"
