"""The read window: reused memory that saved activations read back from NVMe land in, on the
CPU device, lent as tensors whose death gives their range back.

On the CPU device a saved tensor read back from NVMe lands straight in the memory autograd
gets (activations/). Fresh memory for every read costs a page fault per 4 KiB page (the
kernel zeroes each page while the read pins it) and an unmap when autograd frees it: kernel
time for every GiB read, taken from the cores the backward computes on. The
window is one anonymous mapping (an unpinned ``HostArena``, on transparent huge pages where
the kernel allows them) whose ranges are reused within a backward, so its pages fault in once
per backward at most, one fault per 2 MiB (bench_activations' figures, with and without it:
benchmarks/RESULTS.md, "The activation read window" and "Huge pages").

Lifetimes. ``lend`` hands out a range as a tensor with a storage of its own
(``torch.from_numpy`` over the range): autograd frees it like any tensor, and the storage's
death (the numpy array it holds goes) runs a finalizer on whichever thread freed it, which
only queues the range (a deque append: atomic, never a lock). ``settle`` gives queued ranges
back to the arena, on the engine's thread. A lent tensor keeps the mapping alive (through the
arena's own view it holds), so closing the window never frees memory under a tensor autograd
still has.

Resident memory. The pages resident are the most of the window in use at once, as fresh
allocations' would be; ``trim`` gives the free ranges' pages back (``MADV_DONTNEED``), which
the engine does before each forward, so a forward's RSS does not carry the window.
``lend`` never waits: a window without room returns None, and the caller allocates fresh
memory (what it did without a window).
"""
from __future__ import annotations

import collections
import weakref
from typing import Optional

import torch

from offload.storage.pool import HostArena, PoolBudgetError


class ReadWindow:
    """Reused, page-aligned memory for reads back from NVMe on the CPU device."""

    def __init__(self, name: str = "activation-reads"):
        self.name = name
        self._arena: Optional[HostArena] = None
        self._back = collections.deque()    # HostBuffers whose tensors died: finalizers append
        self.loans = 0                      # ranges lent
        self.misses = 0                     # reads the window had no room for (fresh memory)

    @property
    def capacity_bytes(self) -> int:
        return self._arena.capacity_bytes if self._arena is not None else 0

    def ensure(self, capacity: int) -> None:
        """Room for ``capacity`` bytes on loan at once. Address space only: pages become
        resident when a read lands in them. A window with ranges on loan keeps its size (a
        graph still alive uses it); a larger one is made at the next call that finds it idle."""
        self.settle()
        arena = self._arena
        if capacity <= 0:          # a forward that saved nothing this size: nothing to read back
            return
        if arena is not None and (arena.capacity_bytes >= capacity or arena.in_use_bytes):
            return
        if arena is not None:
            arena.close()
        self._arena = HostArena(capacity, pin=False, name=self.name, huge_pages=True)   # trimmed every step

    def lend(self, nbytes: int) -> Optional[torch.Tensor]:
        """A 1-D uint8 tensor of ``nbytes`` starting on a 4 KiB page (an O_DIRECT read can land
        in it), its range given back when its storage dies; None when the window has no room."""
        self.settle()
        if self._arena is None:
            self.misses += 1
            return None
        try:
            buf = self._arena.try_acquire(nbytes)
        except PoolBudgetError:
            buf = None
        if buf is None:
            self.misses += 1
            return None
        arr = buf.view(torch.uint8, nbytes).numpy()      # holds the arena's view: the mapping lives
        weakref.finalize(arr, self._back.append, buf)    # runs when the storage below lets arr go
        self.loans += 1
        return torch.from_numpy(arr)                     # a storage of its own, holding arr

    def settle(self) -> None:
        """Ranges whose tensors died go back to the arena (the engine's thread)."""
        while self._back:
            self._back.popleft().release()

    def trim(self) -> int:
        """Give the free ranges' pages back to the OS; returns the bytes given back."""
        self.settle()
        return self._arena.trim() if self._arena is not None else 0

    def stats(self) -> dict:
        st = self._arena.stats() if self._arena is not None else {}
        return {"capacity_bytes": self.capacity_bytes, "peak_bytes": st.get("peak_bytes", 0),
                "in_use_bytes": st.get("in_use_bytes", 0), "loans": self.loans, "misses": self.misses}

    def close(self) -> None:
        """Drop the mapping; tensors still lent keep their memory until they go."""
        self.settle()
        if self._arena is not None:
            self._arena.close()
        self._arena = None
