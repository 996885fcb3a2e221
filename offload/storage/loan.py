"""The one loaned-buffer state machine every owner of offloaded bytes uses (optimizer state,
parameter homes, parked gradients, saved activations): ``Loan``, one key's bytes of a tier
(storage/tier.py) lent into memory around their use, and its states (``LoanState``).

A tier's ``loan(key, nbytes, what)`` returns a key's ``Loan``, whose verbs move it::

    ON_TIER --fetch()--> READING --acquire()--> READY --commit()--> WRITING --release()--> ON_TIER
        \\--fill()------------------------------> READY --release()--------------------> ON_TIER
    READY --commit(keep=True)--> WRITING_KEPT --finish_write() / poll()--> READY
                                 WRITING_KEPT --unkeep()--> WRITING (the bytes are no longer needed)
    ``try_fill()`` is ``fill()`` without waiting for a pool buffer; ``lend(buf, read)`` is
    ``fetch()`` / ``fill()`` with a buffer the caller supplies (one from another source when
    the tier's pool cannot be waited for).
    ``keep()`` is ``commit(keep=True)`` decided after the write started: WRITING --> WRITING_KEPT.
    ``overwrite(write)`` is ``fill()``, ``write(bytes)``, ``commit()`` (``release()`` if ``write``
    raises); ``discard()`` is ``release()`` after a failure, its own errors swallowed.
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

import errno as errno_mod
import enum
import threading
from typing import Optional

import torch

from offload.core.errors import InvariantError, OffloadError

DEFAULT_WAIT_S = 600.0


class LoanState(enum.Enum):
    RESIDENT = "resident"   # device / host tier: always in memory
    ON_TIER = "on_tier"     # only on the tier, no buffer held
    READING = "reading"     # read into the lent buffer in flight
    READY = "ready"         # in the lent buffer
    WRITING = "writing"     # write from the lent buffer in flight; the buffer goes back after it
    WRITING_KEPT = "writing_kept"   # write in flight; the bytes stay in memory (READY) after it


class TierTimeout(TimeoutError, OffloadError):
    """A wait on a tier (a buffer, a read, a write) did not finish in time."""


class TierIOError(OSError, OffloadError):
    """A read or write of a tier failed; names the operation, the owner, the file, the errno."""


class LoanStateError(InvariantError):
    """A verb called on a loan in a state it cannot leave that way (a bug in the owner that
    called it: the message names the loan, the verb and the state)."""


def io_error(op: str, what: str, exc: BaseException) -> BaseException:
    """``exc`` (from an I/O of ``what``) as a TierIOError naming the operation, the owner,
    the path and the errno; a non-OSError is returned as it is."""
    if isinstance(exc, TierIOError) or not isinstance(exc, OSError):
        return exc
    code = exc.errno or errno_mod.EIO
    err = TierIOError(code, f"{op} of {what} failed: {exc.strerror or exc}", exc.filename)
    err.__cause__ = exc
    return err


def _wait(io, op: str, what: str, timeout: Optional[float]) -> None:
    try:
        io.wait(timeout)
    except TimeoutError:
        raise TierTimeout(f"{op} of {what} not done after {timeout} s: the disk is stalled or far too slow "
                          f"(raise wait_timeout_s if it is only slow)") from None
    except OSError as exc:
        raise io_error(op, what, exc) from exc


class Loan:
    """One key's bytes, lent into memory around their use. Thread-safe; see the module doc."""

    def __init__(self, tier, key: Optional[str], nbytes: int, what: str, keys=None):
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
            if not (self.state is LoanState.RESIDENT):
                raise LoanStateError(f"{self.what}: only a resident loan trades its bytes")
            if not (new.numel() == self.nbytes):
                raise LoanStateError(f"{self.what}: {new.numel()} bytes for {self.nbytes}")
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
    def fetch(self, timeout: Optional[float] = None, *, make_room=None, poll_s: Optional[float] = None) -> bool:
        """ON_TIER -> READING. True when the bytes are in memory or on their way; False
        (nothing started) when no buffer is free. Without ``timeout`` it never waits; with
        one it waits for a buffer (the pool's one bounded wait, storage/pool.py: ``make_room``
        and ``poll_s`` as there, called without the loan's lock) and raises TierTimeout
        naming the buffers' holders when none comes; False then only when ``make_room``
        says none will (``Room.NEVER``)."""
        with self._lock:
            if self.state is not LoanState.ON_TIER:
                return True
            buf = self.tier.pool.try_acquire(self.nbytes, self.what)
            if buf is not None:
                self._start_read(buf)
                return True
        if timeout is None:
            return False
        buf = self._lend(timeout, "read", make_room, poll_s)
        if buf is None:
            return False
        with self._lock:
            if self.state is not LoanState.ON_TIER:   # another thread fetched it meanwhile
                buf.release()
                return True
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
            if not (self.state in (LoanState.READY, LoanState.RESIDENT, LoanState.WRITING_KEPT)):
                raise LoanStateError(f"{self.what}: acquire from {self.state}")
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
            if not (self.state is not LoanState.WRITING_KEPT):
                raise LoanStateError(f"{self.what}: fill while its write is in flight")
            if self.state is LoanState.ON_TIER:
                self._take(self._lend(self._timeout(timeout), "buffer for"))
                self.state = LoanState.READY
            return self.acquire(timeout)

    def try_fill(self) -> Optional[torch.Tensor]:
        """``fill()`` if the pool has a buffer free now, else None (nothing changed)."""
        with self._lock:
            if not (self.state is not LoanState.WRITING_KEPT):
                raise LoanStateError(f"{self.what}: fill while its write is in flight")
            if self.state is LoanState.ON_TIER:
                buf = self.tier.pool.try_acquire(self.nbytes, self.what)
                if buf is None:
                    return None
                self._take(buf)
                self.state = LoanState.READY
            return self.acquire()

    def overwrite(self, write, timeout: Optional[float] = None) -> None:
        """Replace the whole key: ``write(bytes)`` writes every byte of ``fill()``'s buffer (no
        read first), then ``commit()`` (-> WRITING; RESIDENT stays). A ``write`` that raises
        gives the buffer back (-> ON_TIER) and its error goes on."""
        data = self.fill(timeout)
        try:
            write(data)
        except BaseException:
            self.release()
            raise
        self.commit()

    def lend(self, buf, read: bool) -> None:
        """ON_TIER -> READING (``read``: the key's bytes come into ``buf``) or READY (``buf``
        will be overwritten) with ``buf`` (a HostBuffer of any pool, or an OwnedBuffer) in
        place of one of the tier's pool; it is released like the pool's own."""
        with self._lock:
            if not (self.state is LoanState.ON_TIER):
                raise LoanStateError(f"{self.what}: lend from {self.state}")
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
            if not (self.state is LoanState.READY):
                raise LoanStateError(f"{self.what}: commit from {self.state}")
            if not (self.key is not None or self.keys is not None):
                raise LoanStateError(f"{self.what}: commit with no key nor free list")
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
            if not (self.state in (LoanState.READY, LoanState.WRITING_KEPT)):
                raise LoanStateError(f"{self.what}: keep from {self.state}")

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

    def discard(self) -> None:
        """After a failure: back to ON_TIER whatever the state (a write in flight is waited
        for, bounded), its own errors swallowed: the caller is already raising one."""
        try:
            self.release()
        except BaseException:   # noqa: BLE001 - the first error is the one reported
            pass

    # ---- internals ---------------------------------------------------------------------------
    def _lend(self, timeout: float, op: str, make_room=None, poll_s: Optional[float] = None):
        """A buffer of the tier's pool for this loan (its one bounded wait, storage/pool.py)."""
        try:
            return self.tier.pool.acquire(self.nbytes, timeout, holder=self.what, make_room=make_room,
                                          poll_s=poll_s)
        except TimeoutError as exc:
            raise TierTimeout(f"{op} {self.what}: no host buffer free after {timeout} s ({exc})") from None

    def _take(self, buf) -> None:
        self._buf = buf
        self._bytes = buf.view(torch.uint8, self.nbytes)

    def _start_read(self, buf) -> None:
        self._take(buf)
        try:
            if not (self.key is not None):
                raise LoanStateError(f"{self.what}: read before its first write bound a key")
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
