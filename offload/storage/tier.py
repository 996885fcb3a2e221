"""Tiers: where a block's bytes live between uses, behind one interface, and the one
loaned-buffer state machine every owner of offloaded bytes uses (optimizer state,
parameter homes, parked gradients, saved activations).

The host pools: a fixed budget of host memory, allocated once, lent out slot by slot
(``HostPool``: fixed slots, for buffers of known sizes) or range by range (``HostArena``:
one budget of bytes, for buffers whose sizes are only known at run time).

Every slot is allocated at construction in its exact size rounded up only to the 4096-byte
page (never to a power of two), page-aligned so the NVMe store can move it with O_DIRECT,
and page-locked when CUDA is present so host<->device copies are asynchronous. After
construction nothing is allocated: ``acquire`` hands out a free slot, ``release`` takes it
back.

Pinning registers the pages of an anonymous mapping with ``cudaHostRegister`` rather than
using ``torch.empty(..., pin_memory=True)``, whose caching host allocator rounds every
request up to a power of two (up to 2x the memory for an unlucky size).

A tier holds keyed byte ranges:

* ``DeviceTier``: a tensor on the compute device, always resident;
* ``HostTier``: a persistent host-pool buffer, always resident;
* ``NvmeTier``: a swap-file extent; the bytes visit a buffer lent by a host pool only
  around their use.

``tier.reserve({key: nbytes, ...})`` makes room for keys (NVMe: one preallocated file for
the lot), ``tier.loan(key, nbytes, what)`` returns a key's ``Loan``, whose verbs move it::

    ON_TIER --fetch()--> READING --acquire()--> READY --commit()--> WRITING --release()--> ON_TIER
        \\--fill()------------------------------> READY --release()--------------------> ON_TIER
    READY --commit(keep=True)--> WRITING_KEPT --finish_write() / poll()--> READY
                                 WRITING_KEPT --unkeep()--> WRITING (the bytes are no longer needed)
    ``try_fill()`` is ``fill()`` without waiting for a pool buffer; ``lend(buf, read)`` is
    ``fetch()`` / ``fill()`` with a buffer the caller supplies (one from another source when
    the tier's pool cannot be waited for).
    ``keep()`` is ``commit(keep=True)`` decided after the write started: WRITING --> WRITING_KEPT.
    RESIDENT (device and host tiers): every verb is a no-op, acquire() returns the bytes.

``release()`` from READY returns the buffer without writing it (the bytes were only read);
from READING it waits for the read and discards it; from WRITING (or WRITING_KEPT) it waits
for the write. ``poll()`` settles a finished read (-> READY) or write (WRITING -> ON_TIER,
WRITING_KEPT -> READY) without waiting; ``finish_write()`` waits for a write (bounded).

WRITING_KEPT (an asynchronous write-through, e.g. a parameter home the next forward reads):
the write is in flight and the bytes stay in memory after it; ``acquire()`` returns them
at once, without waiting for the write (the write and the readers only read them). Nobody
modifies them until the write is settled: ``fill()`` and ``commit()`` refuse that state.

Lifetimes: the lent buffer belongs to the loan from ``fetch()``/``fill()`` until it is back
ON_TIER; another key may use it only after that. ``CallerBuffer`` lends memory the caller
owns (a tensor written from or read into in place) like a pool buffer. The loan is agnostic
of what the bytes mean (rows, dtypes, sizes): owners view ``acquire()``'s 1-D uint8 tensor as
they need.

Keys and retirement (owners whose keys come and go, e.g. saved activations): a loan made
with ``key=None`` and a free list ``keys`` is bound to ``keys.take(nbytes)`` at its first
``commit()`` (reading it before is an error). ``retire()`` (the owner is gone, possibly in a
finalizer) never waits nor takes a lock; the tier's ``settle_retired()``, on the owner's
thread, gives a retired loan's buffer back, and its key to ``keys.give(key, nbytes)``, once
no I/O of it is in flight.

Failures and waits: every wait is bounded (``timeout``, default the tier's
``wait_timeout_s``) and raises ``TierTimeout`` naming the key's owner and the stage. A failed
read or write gives its buffer back (the loan returns to ON_TIER) before the error is raised,
as ``TierIOError`` naming the operation, the owner (``what``: the block), the file and the
errno. A failed write leaves the key without data; the next read says why (the store keeps
the write's error).
"""
from __future__ import annotations

import bisect
import collections
import enum
import errno as errno_mod
import mmap
import threading
import time
from typing import Optional, Sequence

import torch
from torch.profiler import record_function

DEFAULT_WAIT_S = 600.0


PAGE = 4096


class PoolBudgetError(ValueError):
    """The pool cannot hold what was asked of it."""


def _round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def _fmt(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**30:.3f} GiB)"


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
                raise RuntimeError(f"cudaHostRegister of {_fmt(nbytes)} failed with CUDA error {int(err)}; "
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
        caps = [_round_up(s) for s in sizes]
        total = sum(caps)
        if budget_bytes is not None and total > budget_bytes:
            raise PoolBudgetError(
                f"HostPool {name!r}: {len(caps)} slots need {_fmt(total)} (each rounded up to 4096 bytes) but "
                f"budget_bytes is {_fmt(budget_bytes)}; raise the host memory budget to at least {total} bytes, "
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
        self._in_use = 0
        self._peak = 0
        self._closed = False

    @property
    def capacity_bytes(self) -> int:
        return sum(self._caps)

    def try_acquire(self, nbytes: int) -> HostBuffer | None:
        """The smallest free slot of at least ``nbytes``, or None when none is free now."""
        self._check_size(nbytes)
        with self._cond:
            return self._take(nbytes)

    def acquire(self, nbytes: int, timeout: float | None = None) -> HostBuffer:
        """The smallest free slot of at least ``nbytes``; blocks until one is released.

        Raises PoolBudgetError when no slot could ever hold ``nbytes``, TimeoutError when
        ``timeout`` seconds pass first."""
        return _acquire(self, nbytes, timeout, lambda: (
            f"HostPool {self.name!r}: no free slot of >= {nbytes} bytes after {timeout} s "
            f"({len(self._free)} of {len(self._caps)} slots free, {self._in_use} bytes in use); "
            "a buffer is probably held too long, or the pool is too small for the lookahead"))

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

    def _take(self, nbytes: int) -> HostBuffer | None:  # lock held
        if self._closed:
            raise RuntimeError(f"HostPool {self.name!r} is closed")
        k = bisect.bisect_left(self._free, (nbytes, -1))
        if k == len(self._free):
            return None
        cap, index = self._free.pop(k)
        self._in_use += cap
        self._peak = max(self._peak, self._in_use)
        return HostBuffer(self, index, self._memory[index].data)

    def _give_back(self, index: int, data: torch.Tensor) -> None:
        with self._cond:
            if self._closed:
                return
            bisect.insort(self._free, (self._caps[index], index))
            self._in_use -= self._caps[index]
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (f"HostPool({self.name!r}, {len(self._caps)} slots, {_fmt(self.capacity_bytes)}, "
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

    def try_acquire(self, nbytes: int) -> HostBuffer | None:
        """A range of at least ``nbytes`` (page-rounded), or None when none is free now."""
        self._check_size(nbytes)
        with self._cond:
            return self._take(nbytes)

    def acquire(self, nbytes: int, timeout: float | None = None) -> HostBuffer:
        """A range of at least ``nbytes``; blocks until ranges given back make room.
        Raises PoolBudgetError when ``nbytes`` exceeds the capacity, TimeoutError when
        ``timeout`` seconds pass first."""
        return _acquire(self, nbytes, timeout, lambda: (
            f"HostArena {self.name!r}: no free range of >= {nbytes} bytes after {timeout} s "
            f"({self._in_use} of {self._cap} bytes in use, largest free range "
            f"{max((n for _, n in self._free), default=0)})"))

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
        if _round_up(max(nbytes, 1)) > self._cap:
            raise PoolBudgetError(f"HostArena {self.name!r}: {nbytes} bytes do not fit in its "
                                  f"{_fmt(self._cap)}")

    def _take(self, nbytes: int) -> HostBuffer | None:  # lock held
        if self._closed:
            raise RuntimeError(f"HostArena {self.name!r} is closed")
        size = _round_up(max(nbytes, 1))
        for k, (off, n) in enumerate(self._free):
            if n >= size:
                if n == size:
                    del self._free[k]
                else:
                    self._free[k] = (off + size, n - size)
                self._in_use += size
                self._loans += 1
                self._peak = max(self._peak, self._in_use)
                return HostBuffer(self, off, self._memory.data[off:off + size])
        return None

    def _give_back(self, offset: int, data: torch.Tensor) -> None:
        size = data.numel()
        with self._cond:
            if self._closed:
                return
            k = bisect.bisect_left(self._free, (offset, 0))
            assert k == len(self._free) or self._free[k][0] >= offset + size, "range given back twice"
            assert k == 0 or sum(self._free[k - 1]) <= offset, "range given back twice"
            start, end = offset, offset + size
            if k < len(self._free) and self._free[k][0] == end:        # merge with the next
                end = sum(self._free.pop(k))
            if k > 0 and sum(self._free[k - 1]) == start:               # merge with the previous
                k -= 1
                start = self._free.pop(k)[0]
            self._free.insert(k, (start, end - start))
            self._in_use -= size
            self._loans -= 1
            self._cond.notify_all()

    def __repr__(self) -> str:
        return f"HostArena({self.name!r}, {_fmt(self._cap)}, pinned={self.pinned})"


def _acquire(pool, nbytes: int, timeout: float | None, timed_out) -> HostBuffer:
    """``pool._take(nbytes)`` under ``pool._cond``, waiting (bounded by ``timeout``) for
    buffers given back; ``timed_out()`` is the TimeoutError's message. Shared by HostPool
    (fixed slots) and HostArena (ranges)."""
    pool._check_size(nbytes)
    deadline = None if timeout is None else time.monotonic() + timeout
    with pool._cond:
        buf = pool._take(nbytes)
        if buf is not None:
            return buf
        with record_function("offload::pool_wait"):
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(timed_out())
                pool._cond.wait(remaining)
                buf = pool._take(nbytes)
                if buf is not None:
                    return buf


class TierKind(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"


class LoanState(enum.Enum):
    RESIDENT = "resident"   # device / host tier: always in memory
    ON_TIER = "on_tier"     # only on the tier, no buffer held
    READING = "reading"     # read into the lent buffer in flight
    READY = "ready"         # in the lent buffer
    WRITING = "writing"     # write from the lent buffer in flight; the buffer goes back after it
    WRITING_KEPT = "writing_kept"   # write in flight; the bytes stay in memory (READY) after it


class TierTimeout(TimeoutError):
    """A wait on a tier (a buffer, a read, a write) did not finish in time."""


class TierIOError(OSError):
    """A read or write of a tier failed; names the operation, the owner, the file, the errno."""


def io_error(op: str, what: str, exc: BaseException) -> BaseException:
    """``exc`` (from an I/O of ``what``) as a TierIOError naming the operation, the owner,
    the path and the errno; a non-OSError is returned as it is."""
    if isinstance(exc, TierIOError) or not isinstance(exc, OSError):
        return exc
    code = exc.errno or errno_mod.EIO
    err = TierIOError(code, f"{op} of {what} failed: {exc.strerror or exc}", exc.filename)
    err.__cause__ = exc
    return err


class NvmeTier:
    """Keys in an ``NvmeStore``; buffers lent by ``pool`` (a HostPool) around their use.
    ``store`` None: loans only hold lent buffers (READY until released or retired), never
    written: an owner whose bytes stay on the host uses the same verbs."""

    kind = TierKind.NVME

    def __init__(self, store, pool, *, wait_timeout_s: float = DEFAULT_WAIT_S):
        self.store, self.pool, self.wait_timeout_s = store, pool, wait_timeout_s
        self._retired = collections.deque()   # loans retire()d: appends are atomic (finalizers)
        self._draining: list = []             # ... settled once their I/O is done

    def reserve(self, sizes) -> None:
        self.store.reserve(dict(sizes))

    def loan(self, key: Optional[str], nbytes: int, what: str = "", keys=None) -> "Loan":
        """``key`` None: bound at the first commit from the free list ``keys`` (module doc)."""
        return Loan(self, key, nbytes, what or key, keys)

    def settle_retired(self) -> None:
        """On the owner's thread, never waits: every retired loan with no I/O in flight gives
        its buffer back (and its key to its free list); the others wait for a later call."""
        while self._retired:
            self._draining.append(self._retired.popleft())
        self._draining = [loan for loan in self._draining if not loan._settle_retired()]

    def put(self, key: str, src: torch.Tensor, what: str = "", write_pool=None,
            timeout: Optional[float] = None) -> None:
        """Write the whole key from ``src`` (1-D, host) and wait until it is durable. A source
        that is not 4 KiB-aligned goes through a buffer of ``write_pool`` (O_DIRECT stays)."""
        what = what or key
        timeout = self.wait_timeout_s if timeout is None else timeout
        nbytes = src.numel() * src.element_size()
        if src.data_ptr() % 4096 and write_pool is not None:
            with write_pool.acquire(nbytes, timeout=timeout) as loan:
                buf = loan.view(src.dtype, src.numel())
                buf.copy_(src)
                _wait(self.store.write(key, buf), "write", what, timeout)
            return
        _wait(self.store.write(key, src), "write", what, timeout)


class HostTier:
    """Keys in persistent buffers of a HostPool: always resident."""

    kind = TierKind.HOST

    def __init__(self, pool, *, wait_timeout_s: float = DEFAULT_WAIT_S):
        self.pool, self.wait_timeout_s = pool, wait_timeout_s

    def reserve(self, sizes) -> None:
        """The pool was sized for its keys when it was built: nothing to do."""

    def loan(self, key: str, nbytes: int, what: str = "") -> "Loan":
        buf = self.pool.acquire(nbytes).view(torch.uint8, nbytes)
        return Loan.resident(buf, key, what or key, self)


class DeviceTier:
    """Keys in tensors on the compute device: always resident."""

    kind = TierKind.DEVICE

    def __init__(self, device: torch.device, *, wait_timeout_s: float = DEFAULT_WAIT_S):
        self.device, self.wait_timeout_s = device, wait_timeout_s

    def reserve(self, sizes) -> None:
        """Device memory is allocated per loan."""

    def loan(self, key: str, nbytes: int, what: str = "") -> "Loan":
        return Loan.resident(torch.zeros(nbytes, dtype=torch.uint8, device=self.device), key, what or key, self)


def _wait(io, op: str, what: str, timeout: Optional[float]) -> None:
    try:
        io.wait(timeout)
    except TimeoutError:
        raise TierTimeout(f"{op} of {what} not done after {timeout} s: the disk is stalled or far too slow "
                          f"(raise wait_timeout_s if it is only slow)") from None
    except OSError as exc:
        raise io_error(op, what, exc) from exc


class CallerBuffer:
    """Memory the caller owns (a contiguous CPU tensor) lent to a loan in place of a pool
    buffer, with a HostBuffer's ``view`` / ``release``: ``release`` only drops the loan's
    reference (the caller's tensor lives on); the I/O reads or writes the tensor in place."""

    __slots__ = ("nbytes", "_data")

    def __init__(self, data: torch.Tensor):
        self._data = data.view(-1).view(torch.uint8)
        self.nbytes = self._data.numel()

    def view(self, dtype: torch.dtype, numel: int, offset_bytes: int = 0) -> torch.Tensor:
        assert self._data is not None, "this caller buffer was already released"
        end = offset_bytes + numel * dtype.itemsize
        assert 0 <= offset_bytes and end <= self.nbytes, f"a view of {end - offset_bytes} bytes in {self.nbytes}"
        return self._data[offset_bytes:end].view(dtype)

    def release(self) -> None:
        self._data = None


class Loan:
    """One key's bytes, lent into memory around their use. Thread-safe; see the module doc."""

    def __init__(self, tier: NvmeTier, key: Optional[str], nbytes: int, what: str, keys=None):
        self.tier, self.key, self.nbytes, self.what, self.keys = tier, key, nbytes, what, keys
        self.state = LoanState.ON_TIER
        self._lock = threading.RLock()
        self._buf = None       # buffer on loan while not ON_TIER (a pool's, OwnedBuffer, CallerBuffer)
        self._bytes: Optional[torch.Tensor] = None   # 1-D uint8 view of the bytes
        self._io = None        # IOHandle of the read or write in flight

    @classmethod
    def resident(cls, data: torch.Tensor, key: str, what: str, tier=None) -> "Loan":
        """A loan whose bytes always stay in memory (device or host tier)."""
        loan = cls(tier, key, data.numel() * data.element_size(), what)
        loan._bytes = data.view(-1).view(torch.uint8)
        loan.state = LoanState.RESIDENT
        return loan

    def replace_resident(self, data: torch.Tensor) -> torch.Tensor:
        """A RESIDENT loan's bytes become ``data`` (as many bytes); returns the old bytes."""
        new = data.view(-1).view(torch.uint8)
        with self._lock:
            assert self.state is LoanState.RESIDENT, f"{self.what}: only a resident loan trades its bytes"
            assert new.numel() == self.nbytes, f"{self.what}: {new.numel()} bytes for {self.nbytes}"
            old, self._bytes = self._bytes, new
        return old

    @property
    def in_memory(self) -> bool:
        return self.state is not LoanState.ON_TIER

    @property
    def buffer(self):
        """The buffer on loan (a pool's, an OwnedBuffer, a CallerBuffer), None when ON_TIER or RESIDENT."""
        return self._buf

    def _timeout(self, timeout: Optional[float]) -> float:
        if timeout is not None:
            return timeout
        return self.tier.wait_timeout_s if self.tier is not None else DEFAULT_WAIT_S

    # ---- verbs -----------------------------------------------------------------------------
    def fetch(self) -> bool:
        """ON_TIER -> READING if the pool has a buffer free now. True when the bytes are in
        memory or on their way; False (nothing started) when no buffer is free."""
        with self._lock:
            if self.state is not LoanState.ON_TIER:
                return True
            buf = self.tier.pool.try_acquire(self.nbytes)
            if buf is None:
                return False
            self._start_read(buf)
            return True

    def acquire(self, timeout: Optional[float] = None) -> torch.Tensor:
        """The bytes in memory (1-D uint8): waits for a read in flight; from ON_TIER first
        waits for a pool buffer and reads. -> READY (or RESIDENT)."""
        with self._lock:
            t = self._timeout(timeout)
            if self.state is LoanState.ON_TIER:
                self._start_read(self._lend(t, "read"))
            if self.state is LoanState.READING:
                self._wait_io("read", t)
                self.state = LoanState.READY
            assert self.state in (LoanState.READY, LoanState.RESIDENT, LoanState.WRITING_KEPT), \
                f"{self.what}: acquire from {self.state}"
            return self._bytes

    def _wait_io(self, op: str, t: float) -> None:
        """Wait (bounded, under the lock) for the I/O in flight; a failure settles it (the
        buffer goes back) and raises."""
        io, self._io = self._io, None
        try:
            _wait(io, op, self.what, t)
        except BaseException:
            self._settle_failed(io, t)
            raise

    def fill(self, timeout: Optional[float] = None) -> torch.Tensor:
        """A buffer for bytes that will be overwritten whole: ON_TIER -> READY without a read."""
        with self._lock:
            assert self.state is not LoanState.WRITING_KEPT, f"{self.what}: fill while its write is in flight"
            if self.state is LoanState.ON_TIER:
                self._take(self._lend(self._timeout(timeout), "buffer for"))
                self.state = LoanState.READY
            return self.acquire(timeout)

    def try_fill(self) -> Optional[torch.Tensor]:
        """``fill()`` if the pool has a buffer free now, else None (nothing changed)."""
        with self._lock:
            assert self.state is not LoanState.WRITING_KEPT, f"{self.what}: fill while its write is in flight"
            if self.state is LoanState.ON_TIER:
                buf = self.tier.pool.try_acquire(self.nbytes)
                if buf is None:
                    return None
                self._take(buf)
                self.state = LoanState.READY
            return self.acquire()

    def lend(self, buf, read: bool) -> None:
        """ON_TIER -> READING (``read``: the key's bytes come into ``buf``) or READY (``buf``
        will be overwritten) with ``buf`` (a HostBuffer of any pool, or an OwnedBuffer) in
        place of one of the tier's pool; it is released like the pool's own."""
        with self._lock:
            assert self.state is LoanState.ON_TIER, f"{self.what}: lend from {self.state}"
            if read:
                self._start_read(buf)
            else:
                self._take(buf)
                self.state = LoanState.READY

    def commit(self, keep: bool = False) -> None:
        """The bytes were modified: start writing them back (READY -> WRITING; with ``keep``,
        READY -> WRITING_KEPT: they stay in memory and readable, READY once written). Never
        waits; a write that cannot be submitted gives the buffer back and raises."""
        with self._lock:
            if self.state is LoanState.RESIDENT:
                return
            assert self.state is LoanState.READY, f"{self.what}: commit from {self.state}"
            assert self.key is not None or self.keys is not None, f"{self.what}: commit with no key nor free list"
            try:
                if self.key is None:
                    self.key = self.keys.take(self.nbytes)
                self._io = self.tier.store.write(self.key, self._bytes)
            except BaseException as exc:
                self._give_back()
                raise io_error("write", self.what, exc) from exc
            self.state = LoanState.WRITING_KEPT if keep else LoanState.WRITING

    def keep(self) -> None:
        """The bytes are needed after all while their write is in flight: WRITING ->
        WRITING_KEPT (READY once written); no-op when READY or WRITING_KEPT. Never waits."""
        with self._lock:
            if self.state is LoanState.WRITING:
                self.state = LoanState.WRITING_KEPT
            assert self.state in (LoanState.READY, LoanState.WRITING_KEPT), f"{self.what}: keep from {self.state}"

    def retire(self) -> None:
        """The owner let the loan go for good (it may be a finalizer on any thread): never
        waits, takes no lock; ``tier.settle_retired()`` gives back its buffer and key later."""
        self.tier._retired.append(self)

    def unkeep(self) -> None:
        """The kept bytes are no longer needed: WRITING_KEPT -> WRITING (the buffer goes back
        once the write completes), READY -> ON_TIER; no-op otherwise. Never waits."""
        with self._lock:
            if self.state is LoanState.WRITING_KEPT:
                self.state = LoanState.WRITING
            elif self.state is LoanState.READY:
                self._give_back()

    def finish_write(self, timeout: Optional[float] = None) -> None:
        """Wait (bounded) for the write in flight: WRITING -> ON_TIER (buffer back),
        WRITING_KEPT -> READY (bytes kept); no-op in any other state. A failed write gives
        the buffer back (ON_TIER) and raises."""
        with self._lock:
            if self.state is LoanState.WRITING:
                self.release(timeout)
            elif self.state is LoanState.WRITING_KEPT:
                t = self._timeout(timeout)
                self._wait_io("write", t)
                self.state = LoanState.READY

    def poll(self) -> bool:
        """Settle a finished read (-> READY) or write (WRITING -> ON_TIER, buffer back;
        WRITING_KEPT -> READY) without waiting; True when nothing is in flight afterwards. A failed I/O raises (its buffer
        is back first)."""
        with self._lock:
            if self.state not in (LoanState.READING, LoanState.WRITING, LoanState.WRITING_KEPT):
                return True
            if not self._io.done():
                return False
            if self.state is LoanState.READING:
                self.acquire()
            else:
                self.finish_write()
            return True

    def release(self, timeout: Optional[float] = None) -> None:
        """Back to ON_TIER: waits for a write in flight (raising its error after the buffer
        is back), discards a read in flight or the READY bytes. No-op when RESIDENT."""
        with self._lock:
            if self.state in (LoanState.RESIDENT, LoanState.ON_TIER):
                return
            t = self._timeout(timeout)
            io, self._io = self._io, None
            op = "write" if self.state in (LoanState.WRITING, LoanState.WRITING_KEPT) else "read"
            try:
                if io is not None:
                    _wait(io, op, self.what, t)
            except TierTimeout:
                self._settle_failed(io, t)
                raise
            except BaseException:
                self._give_back()
                if op == "write":
                    raise          # the read was going to be discarded anyway
            else:
                self._give_back()

    # ---- internals ---------------------------------------------------------------------------
    def _lend(self, timeout: float, op: str):
        try:
            return self.tier.pool.acquire(self.nbytes, timeout=timeout)
        except TimeoutError:
            raise TierTimeout(f"{op} {self.what}: no host buffer free after {timeout} s (every buffer is "
                              "held by another block)") from None

    def _take(self, buf) -> None:
        self._buf = buf
        self._bytes = buf.view(torch.uint8, self.nbytes)

    def _start_read(self, buf) -> None:
        self._take(buf)
        try:
            assert self.key is not None, f"{self.what}: read before its first write bound a key"
            self._io = self.tier.store.read(self.key, self._bytes)
        except BaseException as exc:
            self._give_back()
            raise io_error("read", self.what, exc) from exc
        self.state = LoanState.READING

    def _settle_failed(self, io, timeout: float) -> None:
        """After a failed or timed-out wait: the buffer goes back only once the I/O no longer
        uses it (a timed-out I/O keeps its buffer, which is then leaked, never reused live)."""
        if io is not None and not io.done():
            self._buf = None          # still in the backend's hands: never lent again
            self._bytes = None
            self.state = LoanState.ON_TIER
            return
        self._give_back()

    def _settle_retired(self) -> bool:
        """Retired: buffer and key back unless an I/O is still in flight (False)."""
        with self._lock:
            if self._io is not None and not self._io.done():
                return False
            self._io = None
            self._give_back()
            if self.keys is not None and self.key is not None:
                self.keys.give(self.key, self.nbytes)
                self.key = None
            return True

    def _give_back(self) -> None:
        self._bytes = None
        buf, self._buf = self._buf, None
        if buf is not None:
            buf.release()
        self.state = LoanState.ON_TIER

    def __repr__(self) -> str:
        return f"Loan({self.what!r}, {self.nbytes} bytes, {self.state.value})"
