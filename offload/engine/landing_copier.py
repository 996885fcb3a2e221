"""The CPU compute device's gradient landings, off the thread that runs backward.

On CUDA a gradient lands in host memory through an asynchronous copy on the D2H stream
(engine/grads.py). On a CPU device the landing is a memcpy into the block's gradient buffer;
done inline it sat on the backward's path, 2-3 ms per 16 MiB on this project's 2-core
machine. ``LandingCopier`` hands it to the native copy engine (native/copier.c): a worker
under SCHED_IDLE copies while a core has nothing else to run (a backward waiting for an
accelerator, for I/O), and whoever needs the bytes first (the next landing, the update, the
end of backward) finishes the copy on its own thread. Never slower than inline by more than
one 256 KiB piece; never a core taken from torch's team or the optimizer (an idle-policy
thread gives way to any other at once: measured, a normal-priority copy thread beside
bench_step's real compute made the whole step 1.18x torch's against 1.03x inline).

One copy in flight: ``copy`` first completes the last one, so at most one of autograd's
gradients outlives its landing, and only until the next landing or the end of backward
(``drain``). A copy returns its event (``synchronize()``, as a CUDA event), which the
gradient buffer keeps with its others (``GradBuffer.wait_landed``).

Used only where it helps and is safe: the native library loads, the worker runs under
SCHED_IDLE, both tensors are contiguous and of one dtype, the copy is at least ``MIN_BYTES``
(a smaller one costs less inline than its hand-over), and the last backward left the cores
idle (``measure``: its thread spent less than ``IDLE_SHARE`` of it on the CPU, waiting for
an accelerator, for parameters coming from NVMe, for a simulated device). The landings made
inline that the worker would have taken are left out of that CPU time (``land``): they are
the very work that would leave the thread. Counted in, they held the share above the line
once it was crossed: bench_prefetch's backward (6 x 16 MiB, a simulated device) spent
0.35-0.39 of its time on the CPU with its landings inline and 0.22-0.24 with them on the
worker, so after one busy backward they stayed inline for good. A backward that
keeps torch's team working gains nothing from moving the copy, and loses by it even under
SCHED_IDLE: measured on bench_step's real compute, 1.12-1.23x torch's step with the copier
against 1.03-1.12x inline (the copier's memcpy runs in the team's short gaps, against its
caches and memory bandwidth). Nothing measured yet (the first backward): inline.

Inline (``land_now``), a landing of at least ``MIN_BYTES`` made on the main thread goes
through the native library's streaming copy on torch's own team (``_native.copy_now``; on
another thread, or with the kernels' thread count not torch's, torch's ``copy_``): it skips
reading the destination's lines before overwriting them, which ``copy_`` does at these
sizes. Measured on bench_step's model (12 landings of 4 MiB a backward), fresh engines
alternating in one process: backward 43.5 ms against 47.9 ms with ``copy_``, the whole step
1.04x torch's against 1.08x.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import torch

from offload import _native

MIN_BYTES = 1 << 20
IDLE_SHARE = 0.35    # a backward on the CPU for less than this share of its time left cores idle


class LandingEvent:
    """One landing copy; ``synchronize()`` returns once the bytes are in the buffer."""
    __slots__ = ("_copier", "_job", "_src", "_dst")

    def __init__(self, copier: "LandingCopier", job, src: torch.Tensor, dst: torch.Tensor):
        self._copier, self._job, self._src, self._dst = copier, job, src, dst

    def synchronize(self) -> None:
        job = self._job
        if job is None:
            return
        _native.copy_wait(self._copier.handle, job)
        self._job = self._src = self._dst = None    # autograd's gradient is freed here


class LandingCopier:
    """Created with the engine; the native worker starts at the first copy handed to it
    (``_start``), not at initialize: loading the library then changed the heap the user's
    own first allocations see (StepPipeline._pool_lib, tests/test_host_heap.py)."""

    def __init__(self):
        self.handle: Optional[int] = None
        self.use = False                 # the last backward left the cores idle (measure)
        self.copies = 0                  # copies handed to the worker
        self._started = False            # _start ran (the handle, or None: landings inline)
        self._last: Optional[LandingEvent] = None
        self._lock = threading.Lock()
        self._since: Optional[tuple] = None
        self._thread: Optional[int] = None   # the thread running backward (backward_begins)
        self._inline_cpu = 0.0           # its CPU seconds in landings the worker could have taken
        self._lib = False                # land_now's library: unresolved (False), None: torch's copy_

    def backward_begins(self) -> None:
        """On the thread that runs backward, as it starts (``measure`` ends the interval)."""
        self._since = (time.perf_counter(), time.thread_time())
        self._thread, self._inline_cpu = threading.get_ident(), 0.0

    def measure(self) -> None:
        """As backward ends: whether the next backward's landings go to the worker (``use``),
        from its thread's CPU time less the inline landings the worker could have taken."""
        since, self._since = self._since, None
        if since is not None:
            wall = time.perf_counter() - since[0]
            cpu = time.thread_time() - since[1] - self._inline_cpu
            self.use = wall > 0 and cpu < IDLE_SHARE * wall

    def _movable(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Whether the worker can take this copy (``use`` aside)."""
        return (src.numel() * src.element_size() >= MIN_BYTES and src.dtype == dst.dtype
                and src.numel() == dst.numel() and src.is_contiguous() and dst.is_contiguous())

    def land(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[LandingEvent]:
        """Land ``src`` in ``dst`` (host tensors, a buffer of the engine's own): handed to the
        worker (``copy``; its event returned), else copied here (``land_now``; None). An inline
        copy the worker could have taken is timed on backward's thread, for ``measure``."""
        ev = self.copy(dst, src)
        if ev is not None:
            return ev
        if threading.get_ident() != self._thread or not self._movable(dst, src):
            self.land_now(dst, src)
            return None
        t = time.thread_time()
        self.land_now(dst, src)
        self._inline_cpu += time.thread_time() - t
        return None

    def _start(self) -> bool:
        """Start the worker once; False where landings stay inline (no native library, no
        idle policy for the worker)."""
        if not self._started:
            self._started = True
            try:
                if _native.lib() is None:
                    return False
                handle, idle = _native.copier_create()
            except (ImportError, OSError):
                return False
            if not idle:
                _native.copier_destroy(handle)
                return False
            self.handle = handle
        return self.handle is not None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[LandingEvent]:
        """Start copying ``src`` into ``dst`` (host tensors); None when it is to be done inline."""
        if not self.use or not self._movable(dst, src):
            return None
        nbytes = src.numel() * src.element_size()
        with self._lock:
            if not self._start():
                return None
            self._finish_last()
            job = _native.CopyJob(dst=dst.data_ptr(), src=src.data_ptr(), nbytes=nbytes)
            ev = LandingEvent(self, job, src, dst)
            _native.copier_submit(self.handle, job)
            self._last = ev
            self.copies += 1
        return ev

    def land_now(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (host tensors) on the calling thread, done on return."""
        nbytes = src.numel() * src.element_size()
        if (nbytes < MIN_BYTES or src.dtype != dst.dtype or src.numel() != dst.numel()
                or not src.is_contiguous() or not dst.is_contiguous()):
            dst.copy_(src)
            return
        if self._lib is False:           # looked up at the first landing, never at initialize
            try:
                self._lib = _native.lib()
            except ImportError:
                self._lib = None
        if self._lib is None or not _native.copy_now(self._lib, dst.data_ptr(), src.data_ptr(), nbytes):
            dst.copy_(src)

    def _finish_last(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            last.synchronize()

    def drain(self) -> None:
        """Complete the copy in flight (the end of backward: no gradient outlives it)."""
        with self._lock:
            self._finish_last()

    def close(self) -> None:
        with self._lock:
            self._finish_last()
            handle, self.handle = self.handle, None
            self._started = True         # closed: no worker starts after this
        if handle is not None:
            _native.copier_destroy(handle)
