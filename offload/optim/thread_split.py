"""The cores of a CPU compute device, split between torch and the optimizer while the
updates overlap the next forward.

On a CPU compute device the next forward's torch ops and the optimizer's kernels run on the
same cores. Left alone, both take every core: torch's intra-op team (OpenMP; an op is cut
into one equal part per thread) and the kernel's threads. An op ends when its slowest part
ends, and a part whose core is shared with a kernel thread runs at about half speed, so the
whole team waits for it. On this project's 2-core machine the forward beside the updates
took 50-67 ms against 30-44 ms alone, for 13-18 ms of updates (bench_step's 12 layers).

So while updates are in flight, ``ThreadSplit`` gives the optimizer ``k`` of torch's ``n``
threads and torch the rest: the native kernels run on at most ``k`` threads
(``offload.optim.set_num_threads``' count) and the main thread's torch team on ``n - k``
(``torch.set_num_threads``). ``k = max(1, n // 4)``: the update streams memory, and a
quarter of the cores is assumed to keep up with it (measured on 2 cores only, where
``k = 1``: bench_step's model trained in one process with and without the split, rounds
interleaved, whole step 1.05-1.14x torch's with it, 1.12-1.19x without, in five runs).

Lifecycle (one per commit): ``begin()`` when the first job leaves the submitting thread
(the block updated inline on that thread ran on all threads, see StepPipeline.submitting),
or, where torch's team is left the main thread alone, once that inline update's kernels are
done and before its write-back is submitted (``StepPipeline._split_after_inline_kernels``),
which also ends the idle spin of torch's team (``_native.pool_pause_team``): after the
inline block's region its workers spin for 2-4 ms, those left out of the smaller team on
the very cores the kernels get. Measured on 2 cores (bench_step's model, 8 fresh engines
x 10 steps): without it the optimizer worker, woken beside the spin, started 3-4 ms late
and ran its first kernel 5x slower, and the next forward waited for it 4-5 ms in 20-30% of
steps; with it, in 2 steps of 80 (0.3 and 1.1 ms), for ~0.1 ms of ``step()`` (the pause),
and the next step's first ops re-create the worker, which allocates its own buffers again
(0.4-1.8 MB for 256-1024-wide layers, freed when it is paused). While split, a kernel
call on one thread can be joined (``_native.pool_set_helpable``): a forward that must wait
for a block's update joins that block's kernel calls (``BlockShard.wait_update``) instead
of idling its core. bench_prefetch (6 x 16 MiB on NVMe, simulated compute), without and
with it in turn, twice: the default lookahead's step 90 and 95 ms against 80 and 80 ms;
``end_kernels()`` when the last job in flight ends (any thread); ``end_torch()`` on the
submitting thread, the one the forward runs on (torch's thread count is that thread's), at
the first forward pre-hook that finds no job in flight, or at backward(), synchronize(),
close(). A count changed by the user in between (it no longer reads what the split set) is
left as the user set it. Used only where torch's parallel backend is OpenMP (elsewhere
torch refuses to change its thread count once work has started) and the native kernels
are loaded.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from offload import _native


def openmp_backend() -> bool:
    """Whether torch's intra-op parallel backend is OpenMP (its thread count can change at
    any time, per calling thread)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


class ThreadSplit:
    def __init__(self):
        self._lock = threading.Lock()
        self._torch: Optional[tuple] = None      # (the user's count, the split's) while split
        self._kernels: Optional[tuple] = None    # (library, the user's count, the split's)
        self._helpable = None                    # the library, while its calls can be joined

    @property
    def split(self) -> bool:
        """Whether torch's team is currently the split's (the forward's hooks ask per block)."""
        return self._torch is not None

    @staticmethod
    def kernel_share(n: int) -> int:
        """``k``: the threads the kernels get of torch's ``n`` while split."""
        return max(1, n // 4)

    @staticmethod
    def leaves_torch_alone() -> bool:
        """Whether the split, begun now, would leave torch's team the calling thread alone
        (``n - k == 1``: 2 threads), which then opens no parallel region."""
        n = torch.get_num_threads()
        return n >= 2 and n - ThreadSplit.kernel_share(n) == 1

    def begin(self) -> None:
        """The first job of a commit leaves the submitting thread, or the inline update's
        kernels are done: split the threads."""
        n = torch.get_num_threads()
        L = _native.lib()
        if n < 2 or L is None:
            return
        k = self.kernel_share(n)
        with self._lock:
            if self._kernels is None:
                user = L.offload_kernel_get_num_threads()
                ours = min(k, user)
                if ours != user:
                    _native.kernel_set_num_threads(L, ours)
                    self._kernels = (L, user, ours)
            if not self._helpable:
                _native.pool_set_helpable(L, True)   # a forward that waits helps (BlockShard.wait_update)
                self._helpable = L
        if self._torch is None:
            torch.set_num_threads(n - k)
            self._torch = (n, n - k)
            # torch's workers left out of the smaller team would spin out the last region's
            # long idle spin on the cores just given to the kernels: ended now (the next
            # region with more threads starts them again)
            _native.pool_pause_team(L)

    def end_kernels(self) -> None:
        """The last job in flight has ended: the kernels' count back to the user's."""
        with self._lock:
            if self._helpable:
                _native.pool_set_helpable(self._helpable, False)
                self._helpable = None
            saved, self._kernels = self._kernels, None
            if saved is None:
                return
            L, user, ours = saved
            if L.offload_kernel_get_num_threads() == ours:
                _native.kernel_set_num_threads(L, user)

    def end_torch(self) -> None:
        """On the submitting thread: torch's team back to the user's count."""
        saved, self._torch = self._torch, None
        if saved is not None and torch.get_num_threads() == saved[1]:
            torch.set_num_threads(saved[0])
