"""Host pools and the buffers they lend: a fixed budget of host memory, allocated once, lent
out slot by slot (``HostPool``: fixed slots, for buffers of known sizes) or range by range
(``HostArena``: one budget of bytes, for buffers whose sizes are only known at run time), and
the two buffers lent like a pool's from outside every pool (``OwnedBuffer``, ``CallerBuffer``).

Every slot is allocated at construction in its exact size rounded up only to the 4096-byte
page (never to a power of two), page-aligned so the NVMe store can move it with O_DIRECT,
and page-locked when CUDA is present so host<->device copies are asynchronous. After
construction nothing is allocated: ``acquire`` hands out a free slot, ``release`` takes it
back.

Pinning registers the pages of an anonymous mapping with ``cudaHostRegister`` rather than
using ``torch.empty(..., pin_memory=True)``, whose caching host allocator rounds every
request up to a power of two (up to 2x the memory for an unlucky size).

Waiting for a buffer: ``acquire`` is the one bounded wait of the package for a pool's
buffer. Every release signals the pool's condition variable; a waiter that can itself make a
buffer come back (settle a write in flight, move a copy on) passes ``make_room``, which says
what it did (``Room``); one that knows nobody will give a buffer back gets None and uses a
buffer from elsewhere. The pool records who holds each buffer (``holder``, the owner's name),
so a wait that runs out names them.
"""
from __future__ import annotations

import bisect
import collections
import enum
import mmap
import threading
import time
from typing import Callable, Optional, Sequence

import torch
from torch.profiler import record_function

from offload.core.errors import BudgetError, InvariantError
from offload.units import PAGE, fmt_exact, round_up

class PoolBudgetError(ValueError, BudgetError):
    """The pool cannot hold what was asked of it."""



class Room(enum.Enum):
    """What a waiter's ``make_room()`` did while the pool had no buffer free for it."""
    MADE = "made"      # it gave a buffer back, or settled work that did: try again at once
    WAIT = "wait"      # the buffers are with work in flight that gives them back: wait for a release
    NEVER = "never"    # nothing in flight will give one back: stop waiting (acquire returns None)


class _HostMemory:
    """One page-aligned anonymous mapping of exactly ``nbytes`` (a multiple of 4096),
    optionally registered with CUDA as page-locked. ``data`` is a 1-D uint8 tensor over it;
    the mapping lives as long as any tensor derived from ``data``."""

    def __init__(self, nbytes: int, pin: bool, huge_pages: bool = False):
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages and not pin and hasattr(mmap, "MADV_HUGEPAGE"):
            try:              # 2 MiB pages where the kernel allows them: 512x fewer first-touch faults
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:   # a kernel without transparent huge pages: 4 KiB pages, as before
                pass
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)  # 1D uint8, page-aligned
        self.pinned = False
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {fmt_exact(nbytes)} failed with CUDA error {int(err)}; "
                                   "the pinned-memory limit (ulimit -l) may be too low, or pass pin=False")
            self.pinned = True

    def free(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned = False
        # The mapping itself goes when the last tensor over it is collected.
        self.data = None
        self._map = None


def _check_request(kind: str, name: str, closed: bool, nbytes) -> None:
    """A request to a host pool or arena: the pool open, ``nbytes`` an int >= 0."""
    if closed:
        raise RuntimeError(f"{kind} {name!r} is closed")
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")


class HostBuffer:
    """A slot on loan from a HostPool. ``nbytes`` is its capacity.

    Views alias the slot: they must not be used after ``release()``, when the slot may be
    handed to someone else. Any I/O or copy into or out of the slot must have completed
    before it is released."""

    __slots__ = ("nbytes", "_pool", "_index", "_data")

    def __init__(self, pool: "HostPool", index: int, data: torch.Tensor):
        self.nbytes = data.numel()
        self._pool = pool
        self._index = index
        self._data = data

    @property
    def data_ptr(self) -> int:
        self._check()
        return self._data.data_ptr()

    def view(self, dtype: torch.dtype, numel: int, offset_bytes: int = 0) -> torch.Tensor:
        """A 1-D CPU tensor of ``numel`` ``dtype`` elements at ``offset_bytes`` in the slot."""
        self._check()
        itemsize = dtype.itemsize
        if numel < 0 or offset_bytes < 0 or offset_bytes % itemsize:
            raise ValueError(f"offset_bytes={offset_bytes} must be >= 0 and a multiple of {itemsize} "
                             f"(the size of {dtype}); numel={numel} must be >= 0")
        end = offset_bytes + numel * itemsize
        if end > self.nbytes:
            raise ValueError(f"a view of {numel} x {dtype} at offset {offset_bytes} needs {end} bytes, "
                             f"the slot holds {self.nbytes}")
        return self._data[offset_bytes:end].view(dtype)

    def release(self) -> None:
        """Give the slot back to the pool."""
        self._check()
        data, self._data = self._data, None
        self._pool._give_back(self._index, data)

    def _check(self) -> None:
        if self._data is None:
            raise RuntimeError(f"this buffer of pool {self._pool.name!r} was already released")

    def __enter__(self) -> "HostBuffer":
        return self

    def __exit__(self, *exc) -> None:
        if self._data is not None:
            self.release()

    def __repr__(self) -> str:
        state = "released" if self._data is None else "on loan"
        return f"HostBuffer(pool={self._pool.name!r}, slot={self._index}, nbytes={self.nbytes}, {state})"


class OwnedBuffer:
    """A page-aligned host buffer of ``nbytes`` outside every pool, with a HostBuffer's
    ``view`` / ``release``: for a loan that must not wait for its pool because nothing in
    flight would give a buffer back (engine/grad_landing.py ``GradBuffer``). ``release`` drops it."""

    __slots__ = ("nbytes", "_data")

    def __init__(self, nbytes: int):
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % PAGE
        self.nbytes = nbytes
        self._data = raw[skip:skip + nbytes]

    def view(self, dtype: torch.dtype, numel: int, offset_bytes: int = 0) -> torch.Tensor:
        if self._data is None:
            raise RuntimeError("this buffer was already released")
        itemsize = dtype.itemsize
        end = offset_bytes + numel * itemsize
        if numel < 0 or offset_bytes < 0 or offset_bytes % itemsize or end > self.nbytes:
            raise ValueError(f"a view of {numel} x {dtype} at offset {offset_bytes} does not fit {self.nbytes} bytes")
        return self._data[offset_bytes:end].view(dtype)

    def release(self) -> None:
        self._data = None


class HostPool:
    """Fixed host buffers, one per entry of ``slot_bytes``, allocated up front."""

    def __init__(self, slot_bytes: Sequence[int], *, budget_bytes: int | None = None,
                 pin: bool | None = None, name: str = "host", huge_pages: bool = False):
        """Allocate one buffer per entry of ``slot_bytes``, each rounded up only to 4096.

        ``pin=None`` pins iff CUDA is available. ``huge_pages``: unpinned slots ask for
        transparent huge pages (``MADV_HUGEPAGE``; a pinned slot is never advised), for
        buffers streamed through every step (optimizer state, gradients): the kernel and the
        gradient copies then miss the TLB once per 2 MiB instead of once per 4 KiB. Raises
        PoolBudgetError naming the budget, the bytes asked and the fix when the slots do not
        fit in ``budget_bytes``."""
        self.name = name
        sizes = [int(s) for s in slot_bytes]
        if not sizes or any(s <= 0 for s in sizes):
            raise ValueError(f"HostPool {name!r}: slot_bytes must be a non-empty list of positive sizes, got {sizes}")
        caps = [round_up(s) for s in sizes]
        total = sum(caps)
        if budget_bytes is not None and total > budget_bytes:
            raise PoolBudgetError(
                f"HostPool {name!r}: {len(caps)} slots need {fmt_exact(total)} (each rounded up to 4096 bytes) but "
                f"budget_bytes is {fmt_exact(budget_bytes)}; raise the host memory budget to at least {total} bytes, "
                f"or ask for fewer or smaller slots (e.g. keep fewer blocks in flight)")
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise ValueError(f"HostPool {name!r}: pin=True needs CUDA, which is not available; pass pin=None or False")
        self.pinned = bool(pin)
        self._memory: list[_HostMemory] = []
        try:
            for cap in caps:
                self._memory.append(_HostMemory(cap, self.pinned, huge_pages))
        except BaseException:
            self.close()
            raise
        self._caps = caps
        self._cond = threading.Condition()
        # Free slots as (capacity, index), sorted: the smallest that fits is one bisect away.
        self._free = sorted((cap, i) for i, cap in enumerate(caps))
        self._holders: dict = {}          # slot index -> who holds it (``holder`` of acquire)
        self._in_use = 0
        self._peak = 0
        self._closed = False

    @property
    def capacity_bytes(self) -> int:
        return sum(self._caps)

    def try_acquire(self, nbytes: int, holder: str = "") -> HostBuffer | None:
        """The smallest free slot of at least ``nbytes``, or None when none is free now.
        ``holder`` names who takes it (a timed-out wait names the holders)."""
        self._check_size(nbytes)
        with self._cond:
            return self._take(nbytes, holder)

    def acquire(self, nbytes: int, timeout: float | None = None, *, holder: str = "",
                make_room: Optional[Callable[[], Room]] = None, poll_s: float | None = None) -> HostBuffer | None:
        """The smallest free slot of at least ``nbytes``, waiting (bounded) until one is
        released: the pool's one wait (see the module doc; ``make_room``, ``poll_s``: ``wait``).

        Raises PoolBudgetError when no slot could ever hold ``nbytes``, TimeoutError naming
        the slots' holders when ``timeout`` seconds pass first."""
        return _wait(self, nbytes, timeout, holder, make_room, poll_s, lambda: (
            f"HostPool {self.name!r}: no free slot of >= {nbytes} bytes after {timeout} s "
            f"({len(self._free)} of {len(self._caps)} slots free, {self._in_use} bytes in use; "
            f"{self._held_by()}); a buffer is probably held too long, or the pool is too small for "
            "the lookahead"))

    def stats(self) -> dict:
        with self._cond:
            return {"capacity_bytes": self.capacity_bytes, "in_use_bytes": self._in_use,
                    "peak_bytes": self._peak, "slots": len(self._caps), "free_slots": len(self._free),
                    "pinned": self.pinned}

    def close(self) -> None:
        """Free the memory. Buffers still on loan must not be used afterwards."""
        self._closed = True
        for m in getattr(self, "_memory", []):
            m.free()
        self._memory = []
        self._free = []

    # -- internals ---------------------------------------------------------------------------

    def _check_size(self, nbytes: int) -> None:
        _check_request("HostPool", self.name, self._closed, nbytes)
        if nbytes > max(self._caps):
            raise PoolBudgetError(f"HostPool {self.name!r}: no slot can hold {nbytes} bytes (the largest "
                                  f"holds {max(self._caps)}); size the pool's slots for the largest block")

    def _take(self, nbytes: int, holder: str = "") -> HostBuffer | None:  # lock held
        if self._closed:
            raise RuntimeError(f"HostPool {self.name!r} is closed")
        k = bisect.bisect_left(self._free, (nbytes, -1))
        if k == len(self._free):
            return None
        cap, index = self._free.pop(k)
        self._holders[index] = holder
        self._in_use += cap
        self._peak = max(self._peak, self._in_use)
        return HostBuffer(self, index, self._memory[index].data)

    def _give_back(self, index: int, data: torch.Tensor) -> None:
        with self._cond:
            if self._closed:
                return
            bisect.insort(self._free, (self._caps[index], index))
            self._holders.pop(index, None)
            self._in_use -= self._caps[index]
            self._cond.notify_all()

    def _held_by(self) -> str:  # lock held
        return _held_by(self._holders.values())

    def __repr__(self) -> str:
        return (f"HostPool({self.name!r}, {len(self._caps)} slots, {fmt_exact(self.capacity_bytes)}, "
                f"pinned={self.pinned})")


class HostArena:
    """One budget of ``capacity_bytes`` host memory (one mapping, allocated up front, pinned
    like a HostPool's slots), lent as page-aligned ranges of any size: first fit, and a range
    given back merges with its free neighbours. For buffers whose sizes are known only at run
    time (saved activations); ``acquire`` / ``try_acquire`` / ``release`` as for HostPool, so
    the bytes on loan never exceed ``capacity_bytes`` (a multiple of 4096, at most the
    budget asked: rounded down). ``huge_pages``: an unpinned arena whose pages are given back
    (``trim``) and faulted in again every step asks for transparent huge pages
    (``MADV_HUGEPAGE``), one fault per 2 MiB instead of per 4 KiB."""

    def __init__(self, budget_bytes: int, *, pin: bool | None = None, name: str = "arena",
                 huge_pages: bool = False):
        self.name = name
        cap = int(budget_bytes) // PAGE * PAGE
        if cap <= 0:
            raise PoolBudgetError(f"HostArena {name!r}: a budget of {budget_bytes} bytes holds no 4096-byte page")
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise ValueError(f"HostArena {name!r}: pin=True needs CUDA, which is not available; pass pin=None or False")
        self.pinned = bool(pin)
        self._memory = _HostMemory(cap, self.pinned, huge_pages)
        self._cap = cap
        self._cond = threading.Condition()
        self._free = [(0, cap)]          # (offset, size) of free ranges, sorted by offset, never adjacent
        self._holders: dict = {}         # offset of a range on loan -> who holds it
        self._in_use = 0
        self._peak = 0
        self._loans = 0
        self._closed = False

    @property
    def capacity_bytes(self) -> int:
        return self._cap

    @property
    def in_use_bytes(self) -> int:
        return self._in_use

    def largest_free(self) -> int:
        with self._cond:
            return max((n for _, n in self._free), default=0)

    def try_acquire(self, nbytes: int, holder: str = "") -> HostBuffer | None:
        """A range of at least ``nbytes`` (page-rounded), or None when none is free now."""
        self._check_size(nbytes)
        with self._cond:
            return self._take(nbytes, holder)

    def acquire(self, nbytes: int, timeout: float | None = None, *, holder: str = "",
                make_room: Optional[Callable[[], Room]] = None, poll_s: float | None = None) -> HostBuffer | None:
        """A range of at least ``nbytes``, waiting (bounded) until ranges given back make
        room: the pool's one wait, as ``HostPool.acquire``. Raises PoolBudgetError when
        ``nbytes`` exceeds the capacity, TimeoutError naming the ranges' holders when
        ``timeout`` seconds pass first."""
        return _wait(self, nbytes, timeout, holder, make_room, poll_s, lambda: (
            f"HostArena {self.name!r}: no free range of >= {nbytes} bytes after {timeout} s "
            f"({self._in_use} of {self._cap} bytes in use, largest free range "
            f"{max((n for _, n in self._free), default=0)}; {_held_by(self._holders.values())})"))

    def trim(self) -> int:
        """Give the pages of every free range back to the OS (``MADV_DONTNEED``; they read as
        zeros and fault in again on the next use), so the arena's resident memory is what is
        on loan. A pinned arena keeps its pages (they must stay locked): returns 0. Returns
        the bytes given back."""
        if self.pinned or self._closed:
            return 0
        with self._cond:
            ranges = list(self._free)
            for off, n in ranges:
                self._memory._map.madvise(mmap.MADV_DONTNEED, off, n)
        return sum(n for _, n in ranges)

    def stats(self) -> dict:
        with self._cond:
            return {"capacity_bytes": self._cap, "in_use_bytes": self._in_use, "peak_bytes": self._peak,
                    "loans": self._loans, "largest_free_bytes": max((n for _, n in self._free), default=0),
                    "pinned": self.pinned}

    def close(self) -> None:
        """Free the memory. Ranges still on loan must not be used afterwards."""
        self._closed = True
        if self._memory is not None:
            self._memory.free()
        self._memory = None
        self._free = []

    # -- internals ---------------------------------------------------------------------------
    def _check_size(self, nbytes: int) -> None:
        _check_request("HostArena", self.name, self._closed, nbytes)
        if round_up(max(nbytes, 1)) > self._cap:
            raise PoolBudgetError(f"HostArena {self.name!r}: {nbytes} bytes do not fit in its "
                                  f"{fmt_exact(self._cap)}")

    def _take(self, nbytes: int, holder: str = "") -> HostBuffer | None:  # lock held
        if self._closed:
            raise RuntimeError(f"HostArena {self.name!r} is closed")
        size = round_up(max(nbytes, 1))
        for k, (off, n) in enumerate(self._free):
            if n >= size:
                if n == size:
                    del self._free[k]
                else:
                    self._free[k] = (off + size, n - size)
                self._in_use += size
                self._loans += 1
                self._holders[off] = holder
                self._peak = max(self._peak, self._in_use)
                return HostBuffer(self, off, self._memory.data[off:off + size])
        return None

    def _give_back(self, offset: int, data: torch.Tensor) -> None:
        size = data.numel()
        with self._cond:
            if self._closed:
                return
            k = bisect.bisect_left(self._free, (offset, 0))
            if not (k == len(self._free) or self._free[k][0] >= offset + size):
                raise InvariantError("range given back twice")
            if not (k == 0 or sum(self._free[k - 1]) <= offset):
                raise InvariantError("range given back twice")
            start, end = offset, offset + size
            if k < len(self._free) and self._free[k][0] == end:        # merge with the next
                end = sum(self._free.pop(k))
            if k > 0 and sum(self._free[k - 1]) == start:               # merge with the previous
                k -= 1
                start = self._free.pop(k)[0]
            self._free.insert(k, (start, end - start))
            self._in_use -= size
            self._loans -= 1
            self._holders.pop(offset, None)
            self._cond.notify_all()

    def __repr__(self) -> str:
        return f"HostArena({self.name!r}, {fmt_exact(self._cap)}, pinned={self.pinned})"


def _wait(pool, nbytes: int, timeout: float | None, holder: str, make_room, poll_s: float | None,
          timed_out) -> HostBuffer | None:
    """The one bounded wait for a buffer of ``pool`` (HostPool slots or HostArena ranges):
    ``pool._take(nbytes, holder)`` under ``pool._cond``, which every release signals.

    While none is free, ``make_room()`` (called without the pool's lock, so it may release
    buffers itself) says what it did: ``Room.MADE``, try again at once; ``Room.WAIT``, wait
    for a release, at most ``poll_s`` before asking again (None: until a release); and
    ``Room.NEVER``, nothing will give one back: returns None. Without ``make_room`` the wait
    lasts until a release. ``timeout`` (None: unbounded) bounds it all; past it, TimeoutError
    with ``timed_out()``'s message, which names the buffers' holders."""
    pool._check_size(nbytes)
    deadline = None if timeout is None else time.monotonic() + timeout
    with pool._cond:
        buf = pool._take(nbytes, holder)
    if buf is not None:
        return buf
    with record_function("offload::pool_wait"):
        while True:
            room = make_room() if make_room is not None else Room.WAIT
            if room is Room.NEVER:
                return None
            with pool._cond:
                buf = pool._take(nbytes, holder)
                if buf is not None:
                    return buf
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(timed_out())
                if room is Room.MADE:
                    continue
                if make_room is not None and poll_s is not None:
                    remaining = poll_s if remaining is None else min(remaining, poll_s)
                pool._cond.wait(remaining)
                buf = pool._take(nbytes, holder)
                if buf is not None:
                    return buf


def _held_by(holders) -> str:
    """'held by a (2), b' for the holders' names, the most frequent first (at most 4 named)."""
    counts = collections.Counter(h or "an unnamed owner" for h in holders)
    if not counts:
        return "nothing on loan"
    named = [f"{h} ({n})" if n > 1 else h for h, n in counts.most_common(4)]
    more = len(counts) - len(named)
    return "held by " + ", ".join(named) + (f" and {more} more" if more else "")


class CallerBuffer:
    """Memory the caller owns (a contiguous CPU tensor) lent to a loan in place of a pool
    buffer, with a HostBuffer's ``view`` / ``release``: ``release`` only drops the loan's
    reference (the caller's tensor lives on); the I/O reads or writes the tensor in place."""

    __slots__ = ("nbytes", "_data")

    def __init__(self, data: torch.Tensor):
        self._data = data.view(-1).view(torch.uint8)
        self.nbytes = self._data.numel()

    def view(self, dtype: torch.dtype, numel: int, offset_bytes: int = 0) -> torch.Tensor:
        if not (self._data is not None):
            raise InvariantError("this caller buffer was already released")
        end = offset_bytes + numel * dtype.itemsize
        if not (0 <= offset_bytes and end <= self.nbytes):
            raise InvariantError(f"a view of {end - offset_bytes} bytes in {self.nbytes}")
        return self._data[offset_bytes:end].view(dtype)

    def release(self) -> None:
        self._data = None

