"""I/O backends of the NVMe store, behind one interface.

Both take the same request, ``offload._native.IoReq``: a body of whole pages moved straight
between a caller's buffer and a file, an optional tail page moved through a bounce page, and
an optional array of per-extent crc32c checksums (written by a write, checked by a read).
The extents are those of ``offload.storage.layout.ExtentLayout`` (one description of the
on-disk layout; native/aio.c implements the same geometry from the same block size).

  * ``NativeBackend``: the C engine (native/aio.c): io_uring rings where the kernel allows
    them, else a pthread pool of pread/pwrite. ``OFFLOAD_IO_URING=auto|on|off`` (or the
    ``io_uring`` argument) chooses; ``name`` reports what runs.
  * ``PortableBackend``: a Python thread pool of os.preadv/os.pwritev (which release the GIL);
    one extent in flight per thread. Checksums use the native crc32c when the library loads,
    else zlib's crc32 (the store never mixes the two).

Scheduling: the I/O threads of both run under SCHED_BATCH where the OS has it (Linux) and the
process runs under the default policy: same CPU share, but a thread woken by a submit does
not preempt the submitter or its neighbour (the checksum of a 16 MiB write-back would
otherwise hold a core for ~2 ms in the middle of the optimizer's chain); see native/aio.c.
Both start all their threads when created and return once each has switched, so no request is
moved under the caller's policy.

Lifetimes: after ``submit(req)`` the request struct and every buffer it points to belong to
the backend until ``done(req)`` is true; ``close()`` finishes every queued request first.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

from offload import _native
from offload._native import IO_PAGE, IO_READ, IO_WRITE, IoReq
from offload.storage.layout import ExtentLayout

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

    def submit(self, req: IoReq) -> None: ...
    def wait(self, req: IoReq, timeout: float | None) -> bool: ...   # True when done
    def done(self, req: IoReq) -> bool: ...
    def stats(self) -> dict: ...
    def close(self) -> None: ...


class NativeBackend(Backend):
    def __init__(self, block_size: int, queue_depth: int, threads: int, io_uring: bool | None = None):
        if _native.lib() is None:
            raise RuntimeError(f"the native I/O backend needs the native library: {_native.load_error()}; "
                               "use backend='portable' or build it with `make native`")
        self._engine, cfg = _native.aio_create(block_size, queue_depth, threads, _uring_setting(io_uring))
        self.io_uring = bool(cfg.uring_active)
        self.uring_error = os.strerror(cfg.uring_error) if cfg.uring_error else None
        self.in_flight = cfg.ring_depth * threads
        self.name = "native-io_uring" if self.io_uring else "native-threads"

    def submit(self, req: IoReq) -> None:
        _native.aio_submit(self._engine, req)

    def wait(self, req: IoReq, timeout: float | None) -> bool:
        # Wait in slices so that Ctrl-C reaches Python between them.
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = 0.25 if deadline is None else min(0.25, max(0.0, deadline - time.monotonic()))
            if _native.aio_wait(self._engine, req, int(step * 1e9)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def done(self, req: IoReq) -> bool:
        return _native.aio_done(req)

    def stats(self) -> dict:
        s = _native.aio_stats(self._engine)
        return {"bytes_read": s.bytes[IO_READ], "bytes_written": s.bytes[IO_WRITE],
                "read_seconds": s.busy_ns[IO_READ] / 1e9, "write_seconds": s.busy_ns[IO_WRITE] / 1e9,
                "reads": s.requests[IO_READ], "writes": s.requests[IO_WRITE]}

    def close(self) -> None:
        if self._engine:
            _native.aio_destroy(self._engine)
            self._engine = None


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
        self._outstanding = [0, 0]
        self._busy_since = [0, 0]
        self._stats = {"bytes": [0, 0], "busy_ns": [0, 0], "requests": [0, 0]}

    def submit(self, req: IoReq) -> None:
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

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _crcs(req: IoReq):
    return ctypes.cast(req.crcs, ctypes.POINTER(ctypes.c_uint32))


def make_backend(kind: str, block_size: int, queue_depth: int, threads: int,
                 io_uring: bool | None = None) -> Backend:
    if kind not in BACKENDS:
        raise ValueError(f"backend={kind!r} is not one of {BACKENDS}")
    cls = NativeBackend if kind == "native" else PortableBackend
    return cls(block_size, queue_depth, threads, io_uring)
