"""One parameter part of a block (``ParamPart``: one flat buffer, materialized as one
unit) and its residency (``ParamState``): where it lives between uses (parameter offload) and
its moves. A block's ``parts`` (core/block.py) move together; the updated parameters come
home through params/write_back.py.

The block's canonical parameter copy (compute dtype, 1-D, padded numel) lives on its home
tier: a persistent host buffer (``HOST``) or a swap-file extent (``NVME``). It is
materialized on the device only around its use; in between, each parameter's ``.data`` is
an empty placeholder, so a use that bypasses the engine fails loudly instead of reading
stale values, or, once the engine handed the model back its weights (``hand_back``), a view
of a host copy of the home copy, current until the block next visits the device or its home
changes (both put the placeholder, or the device copy, back first).

Transitions (an illegal one raises ``ParamStateError``)::

    NVME home:  HOME --stage()--> STAGING --(read done)--> STAGED --to_device()--> FETCHING
    HOST home:  HOME --to_device()--> FETCHING
    FETCHING --ensure()--> ON_DEVICE --release()--> HOME (or WRITING, see below)

    write-back of an update (NVMe home, ``write_home``; asynchronous, the job moves on):
      kept staged (``begin_write_through``):  STAGED_WRITING --(write done)--> STAGED
      through a write buffer:                 WRITING --(write done)--> HOME (buffer back)
      adopted (``adopt_home``, an update computed ahead): either of the two, in the update's
      own buffer, which goes back to the update's slot instead of a pool
    STAGED_WRITING is readable: ``to_device()`` serves the held bytes while the write goes
    on; ``release()`` turns it into WRITING (the buffer goes back once written). A WRITING
    block is read only after its write: ``ensure()`` waits for it (bounded).

The host side of an NVMe home (HOME / STAGING / STAGED / STAGED_WRITING / WRITING) is the
key's ``offload.storage.loan.Loan`` (ON_TIER / READING / READY / WRITING_KEPT / WRITING), the
same loaned-buffer state machine the optimizer state uses; this object adds only the device
side (FETCHING, ON_DEVICE), and ``state`` is derived from the two, so there is one source of
truth. Every wait on the host side is bounded; a failed read or write gives its buffer back
before it raises.

Write-backs in flight are settled by whoever meets them first: ``poll_write()`` (the
prefetcher, parameter offload at every use, a worker that needs a write buffer), or
``finish_write()`` (a read of a WRITING block, the next write of the same home, synchronize,
close). One write of a home is in flight at a time, so NVMe sees them in order. A failed
write gives its buffer back, is recorded through ``on_failure`` (the engine raises it from
the user's next call) and raised as a ``BlockError`` naming the block and the stage
"parameter write-back".

``ensure()`` walks the whole chain on demand. Lifetimes: the host staging buffer of an NVMe
block is returned to the pool once the H2D copy has completed (CUDA), or, on a CPU device,
serves as the device copy itself until ``release()``. A copy is valid only for the home
version it was read from: the optimizer bumps ``home_version`` when it writes the home
copy, and ``ensure()`` refetches a stale copy, so a stale block is never served.
"""
from __future__ import annotations

import enum
import threading
from typing import Optional

import torch

from offload import device as dev
from offload.core.blocks import BlockLayout
from offload.core.errors import BlockError, block_error
from offload.storage.loan import LoanState
from offload.storage.tier import NvmeTier


class ParamState(enum.Enum):
    HOME = "home"
    STAGING = "staging"
    STAGED = "staged"
    STAGED_WRITING = "staged_writing"   # staged and current; its write-back to NVMe in flight
    WRITING = "writing"                 # write-back in flight from a buffer that goes back after it
    FETCHING = "fetching"
    ON_DEVICE = "on_device"

    @property
    def order(self) -> int:
        """How far along the way to the device (a block's residency is its parts' least)."""
        return _ORDER[self]


_ORDER = {ParamState.WRITING: 0, ParamState.HOME: 0, ParamState.STAGING: 1, ParamState.STAGED: 2,
          ParamState.STAGED_WRITING: 2, ParamState.FETCHING: 3, ParamState.ON_DEVICE: 4}


class ParamStateError(BlockError):
    """A parameter part was asked for a move its residency does not allow (a bug in the
    engine: the message names the part and its state)."""


_HOST_SIDE = {LoanState.ON_TIER: ParamState.HOME, LoanState.READING: ParamState.STAGING,
              LoanState.READY: ParamState.STAGED, LoanState.WRITING_KEPT: ParamState.STAGED_WRITING,
              LoanState.WRITING: ParamState.WRITING}
_READABLE = (ParamState.HOME, ParamState.STAGING, ParamState.STAGED, ParamState.STAGED_WRITING)
WRITE_BACK = "parameter write-back"     # the stage named in the errors of a home's write


class ParamPart:
    def __init__(self, layout: BlockLayout, dtype: torch.dtype, device: torch.device, *, home_buf=None,
                 store=None, pool=None, write_pool=None, key: str = "", home_numel: int = 0, gather=None,
                 wait_timeout_s: Optional[float] = None, on_failure=None, codec=None, flats=None):
        self.layout = layout
        # a frozen part stored quantized (params/quantized.py): the home holds its codec's
        # blob, the device copy is the flat of ``dtype`` values it dequantizes to (on a CPU
        # device taken from and given back to ``flats``, a quantized.DequantFlats)
        self.codec = codec
        self.flats = flats if device.type == "cpu" else None
        self.dtype = dtype
        self.device = device
        self.numel = layout.padded_numel  # the device copy: the full flat
        self.nbytes = self.numel * dtype.itemsize
        # The home copy: the full flat, or (ZeRO-3) only this rank's shard; then ``gather(full,
        # shard)`` (an async all-gather returning a work handle) assembles the device copy.
        self.home_numel = home_numel or self.numel
        self.home_nbytes = codec.nbytes if codec is not None else self.home_numel * dtype.itemsize
        self._gather = gather
        self._work = None                 # all-gather in flight (FETCHING)
        self.home_buf = home_buf          # 1-D host tensor (HOST home), else None
        self.key = key
        self.what = f"parameters of block {layout.index} ({layout.name or '<root>'})"
        self._write_pool = write_pool     # host buffers for writing an unaligned source
        self._tier = self._loan = None
        if store is not None:             # NVMe home: staged through buffers lent by ``pool``
            kw = {} if wait_timeout_s is None else {"wait_timeout_s": wait_timeout_s}
            self._tier = NvmeTier(store, pool, **kw)
            self._loan = self._tier.loan(key, self.home_nbytes, self.what)
        self._device_state: Optional[ParamState] = None   # FETCHING / ON_DEVICE, else None
        self.device_buf: Optional[torch.Tensor] = None   # 1-D on the device while FETCHING/ON_DEVICE
        self.users = 0                    # modules of this block running now (forward)
        self.home_version = 0
        self._copy_version = -1
        self._event = None                # H2D copy in flight
        self._through = False             # the staged buffer is being filled by a write-through
        self._lock = threading.RLock()
        self._on_failure = on_failure     # a failed write-back's BlockError goes here (the engine's record)
        self.placeholder = torch.empty(0, dtype=dtype, device=device)
        self.handed_back: Optional[torch.Tensor] = None   # the copy the parameters view (hand_back)
        self.origin = torch.device("cpu")   # where the parameters were at initialize (hand_back, close)

    @property
    def on_nvme(self) -> bool:
        return self._loan is not None

    @property
    def at_home(self) -> bool:
        """HOME: no copy anywhere but the home."""
        return self.state is ParamState.HOME

    @property
    def readable(self) -> bool:
        """Whether ``to_device()`` can start from here (HOME, STAGING, STAGED, STAGED_WRITING)."""
        return self.state in _READABLE

    @property
    def state(self) -> ParamState:
        """The device side when the block is there or on its way, else the host side (the
        NVMe loan), else HOME."""
        if self._device_state is not None:
            return self._device_state
        if self._loan is None:
            return ParamState.HOME
        if self._loan.state not in _HOST_SIDE:
            raise ParamStateError(f"{self.what}: its home's loan is {self._loan.state.value}, no parameter state")
        return _HOST_SIDE[self._loan.state]

    def _staged(self) -> torch.Tensor:
        """The staged home copy (1-D, compute dtype; a quantized part's blob bytes) in the loan's buffer."""
        try:
            buf = self._loan.acquire()
            return buf[:self.home_nbytes] if self.codec is not None else buf.view(self.dtype)[:self.home_numel]
        except Exception as exc:      # the loan gave its buffer back: HOME again
            raise self._error("parameter read", exc) from exc

    def _error(self, stage: str, exc: BaseException) -> BaseException:
        return block_error(f"{self.layout.index} ({self.layout.name or '<root>'})", stage, exc)

    def _write_error(self, exc: BaseException) -> BaseException:
        """A failed write-back as a BlockError naming the block, recorded (``on_failure``)."""
        err = self._error(WRITE_BACK, exc)
        if self._on_failure is not None and err is not exc:
            self._on_failure(self.layout.index, err)
        return err

    @property
    def device_bytes(self) -> int:
        """Bytes this block holds on the device now (in flight or resident)."""
        return self.nbytes if self.state in (ParamState.FETCHING, ParamState.ON_DEVICE) else 0

    @property
    def stale(self) -> bool:
        return self.state is not ParamState.HOME and self._copy_version != self.home_version

    def slot_free(self) -> bool:
        """Whether a host staging buffer for this block is free now (NVMe home)."""
        buf = self._tier.pool.try_acquire(self.home_nbytes)
        if buf is None:
            return False
        buf.release()
        return True

    def try_slot(self):
        """A host staging buffer for this block's home copy, or None when none is free (the
        caller releases it)."""
        return self._tier.pool.try_acquire(self.home_nbytes)

    # ---- transitions ------------------------------------------------------------------
    def stage(self) -> bool:
        """NVMe -> host pool buffer, asynchronously (HOME -> STAGING). False: no buffer free."""
        with self._lock:
            if not (self.on_nvme and self.state is ParamState.HOME):
                raise ParamStateError(f"{self.what}: stage() in state {self.state.value} (needs an NVMe home, HOME)")
            try:
                if not self._loan.fetch():
                    return False
            except Exception as exc:
                raise self._error("parameter read", exc) from exc
            self._copy_version = self.home_version
            return True

    def poll(self) -> None:
        """STAGING -> STAGED if the read has completed, and a completed write-back settled
        (``poll_write``); never waits. A failed read or write raises."""
        with self._lock:
            if self.state is ParamState.STAGING:
                try:
                    self._loan.poll()
                except Exception as exc:
                    raise self._error("parameter read", exc) from exc
            self.poll_write()

    @property
    def writing(self) -> bool:
        """Whether a write-back of the home copy is in flight (whatever the device side)."""
        return self._loan is not None and self._loan.state in (LoanState.WRITING, LoanState.WRITING_KEPT)

    def poll_write(self) -> bool:
        """Settle a completed write-back without waiting (STAGED_WRITING -> STAGED, WRITING ->
        HOME with its buffer back); True when none is in flight afterwards. A failed write
        raises its BlockError (recorded, its buffer back)."""
        with self._lock:
            if not self.writing:
                return True
            try:
                return self._loan.poll()
            except Exception as exc:
                raise self._write_error(exc) from exc

    def finish_write(self, timeout: Optional[float] = None) -> None:
        """Wait (bounded) for the write-back in flight: STAGED_WRITING -> STAGED, WRITING ->
        HOME. A failed or timed-out write raises its BlockError (recorded)."""
        with self._lock:
            if not self.writing:
                return
            try:
                self._loan.finish_write(timeout)
            except Exception as exc:
                raise self._write_error(exc) from exc

    def to_device(self, h2d_stream) -> int:
        """Start the host -> device copy (-> FETCHING). Returns the bytes it copies from host
        to device memory: none on a CPU device, where the device copy is the host buffer
        itself (the home, or the staging buffer the NVMe read landed in)."""
        with self._lock:
            if self.state is ParamState.HOME:
                self._copy_version = self.home_version
            if self.state not in _READABLE:
                raise ParamStateError(f"{self.what}: to_device() in state {self.state.value}")
            # NVMe: waits (bounded) for a staging buffer and for the read; STAGED_WRITING: the
            # held bytes at once, their write goes on (both only read them)
            src = self._staged() if self.on_nvme else self.home_buf
            copied = 0 if self.device.type == "cpu" else self.home_nbytes
            if self.codec is not None:         # stored quantized: dequantized into a new device flat
                out = self.flats.take(self.numel, self.dtype) if self.flats is not None else None
                self.device_buf, self._event = self.codec.materialize(src, self.device, h2d_stream, out=out)
            elif self._gather is not None:     # ZeRO-3: every rank's shard into the device copy
                self.device_buf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
                shard = src
                if self.device.type != "cpu":
                    # this rank's shard copied in on the H2D stream (not a blocking copy on the
                    # compute stream); the gather, queued on the compute stream, is ordered after it
                    shard = dev.empty_on(h2d_stream, src.numel(), src.dtype, self.device)
                    dev.wait_event(dev.current_stream(self.device), dev.copy_(shard, src, h2d_stream))
                    dev.mark_used(shard, dev.current_stream(self.device))
                self._work = self._gather(self.device_buf, shard)
            elif self.device.type == "cpu":
                self.device_buf = src          # host memory is device memory: no copy
            else:
                self.device_buf = dev.empty_on(h2d_stream, self.numel, self.dtype, self.device)
                self._event = dev.copy_(self.device_buf, src, h2d_stream)
            self._device_state = ParamState.FETCHING
            return copied

    def ensure(self, h2d_stream) -> int:
        """The parameters on the device, current, with every parameter bound to its view.
        Returns the bytes copied from host to device memory to get them there (``to_device``;
        0 when they were on their way already)."""
        copied = 0
        with self._lock:
            if self.stale:
                self.release()                 # stale: the optimizer wrote the home copy since
            if self.state is ParamState.WRITING:
                self.finish_write()            # read back only once written: -> HOME
            if self.state in _READABLE:
                copied = self.to_device(h2d_stream)
            if self.state is ParamState.FETCHING:
                self._wait_gather()
                ev, self._event = self._event, None
                if ev is not None:
                    compute = dev.current_stream(self.device)
                    dev.wait_event(compute, ev)
                    dev.mark_used(self.device_buf, compute)
                    if self.on_nvme:           # the host buffer may go back once the copy is done
                        dev.sync_event(ev)
                        self._drop_host()
                for s in self.layout.segments:
                    s.param.data = self.device_buf[s.offset:s.offset + s.numel].view(s.shape)
                self.handed_back = None
                self._device_state = ParamState.ON_DEVICE
            return copied

    def release(self) -> None:
        """Drop the device copy (any state -> HOME, or WRITING while a write-back is in
        flight: its buffer goes back once written); parameters become empty placeholders.
        Never waits for a write."""
        with self._lock:
            if self.state is ParamState.HOME:
                return
            self.handed_back = None
            if self._event is not None:
                dev.sync_event(self._event)
                self._event = None
            self._wait_gather()                # a collective in flight completes on every rank
            for s in self.layout.segments:
                s.param.data = self.placeholder
            if self.flats is not None and self.device_buf is not None:
                self.flats.give(self.device_buf)     # a dequantized flat: for the next block
            self.device_buf = None
            self._device_state = None
            self._drop_host()                  # a read in flight is waited for and discarded

    def _wait_gather(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            work.wait()
            if self.on_nvme:                   # the staged shard may go back to the pool
                self._drop_host()

    def _drop_host(self) -> None:
        """The host side lets its bytes go: a read in flight is waited for and discarded; a
        write in flight keeps its buffer until it completes (STAGED_WRITING -> WRITING)."""
        if self._loan is None:
            return
        if self.writing:
            self._loan.unkeep()
        else:
            self._loan.release()

    def release_initial(self) -> None:
        """After construction: the parameters' original memory goes, placeholders come."""
        with self._lock:
            self._to_placeholders()

    def _to_placeholders(self) -> None:
        for s in self.layout.segments:
            s.param.data = self.placeholder
        self.handed_back = None

    def hand_back(self, flat: torch.Tensor) -> None:
        """The parameters view ``flat`` (1-D, this block's full flat in the compute dtype, a copy
        of its current home copy that the caller made, wherever it lives) while the block is
        at home: the model's own tensors hold the weights between the engine's uses. The copy
        is the model's, not the engine's home: writing into it changes nothing the engine
        trains. It goes (placeholders, or the device copy, come back) when the block next
        visits the device or its home copy is replaced (``write_home``)."""
        with self._lock:
            if self._device_state is not None:
                raise ParamStateError(f"{self.what}: handed back while on the device")
            if flat.numel() < self.layout.numel:
                raise ValueError(f"{self.what}: a copy of {flat.numel()} elements cannot hold {self.layout.numel}")
            for s in self.layout.segments:
                s.param.data = flat[s.offset:s.offset + s.numel].view(s.shape)
            self.handed_back = flat

    # ---- the home copy ----------------------------------------------------------------
    def begin_write_through(self) -> Optional[torch.Tensor]:
        """NVMe home, next use near: a staging buffer the new home copy is assembled in
        (1-D, compute dtype, ``home_numel``), so that once written (``write_home``) it stays
        staged and the next use reads no byte from NVMe. A staged copy of the old version
        (STAGING / STAGED) is dropped first. None when the block is on the device (its copy
        is dropped as stale on its next use instead) or no staging buffer is free (then the
        caller writes through its own write buffer).

        Lifetime: from here to ``write_home`` (or ``abort_write_through``) the buffer holds
        bytes being written by the optimizer: the block's update is in flight, so neither
        the prefetcher nor eviction touches it (``ParamOffload`` skips blocks whose update
        is in flight)."""
        with self._lock:
            if not self.on_nvme or self._gather is not None or self._device_state is not None:
                return None
            self.finish_write()            # the last write-back (raises its own failure)
            self._loan.release()           # an old staged copy (a read in flight is waited for)
            try:
                data = self._loan.fill(timeout=0.0)    # never waits for a buffer
            except TimeoutError:
                return None
            self._through = True
            return data.view(self.dtype)[:self.home_numel]

    def abort_write_through(self) -> None:
        """After a failed update: the half-written staging buffer goes back."""
        with self._lock:
            if self._through:
                self._through = False
                self._loan.release()

    def write_home(self, src: torch.Tensor, buffer=None) -> None:
        """Replace the home copy with ``src`` (1-D, compute dtype, host); device copies made
        before this are stale from now on.

        NVMe, asynchronously (the update's write-back; returns once the write is submitted):
        ``src`` is the staging buffer of ``begin_write_through`` (-> STAGED_WRITING, readable
        at once), or lies in ``buffer`` (a HostBuffer of the write pool) and the block is not
        on the device (-> WRITING; the buffer goes back to its pool once written).
        Otherwise the write is waited for (durable on return), a source that is not 4 KiB-
        aligned going through a write buffer, so I/O stays O_DIRECT. ``buffer`` is this
        object's from the call on, whatever happens (released here when not lent to the
        home). Any earlier write-back of this home completes first: writes reach NVMe in order."""
        with self._lock:
            if self.handed_back is not None:
                self._to_placeholders()  # the model's copy is stale from now on
            if self._through:            # src is the staged buffer (begin_write_through): it stays
                if buffer is not None:
                    raise ParamStateError(f"{self.what}: a buffer lent while a write-through holds the staged one")
                self._through = False
                self._commit_home(keep=True)
                return
            lent = False
            try:
                if self.on_nvme:
                    self.finish_write()
                    if buffer is not None and self._device_state is None:
                        self._loan.release()   # an old staged copy (a read in flight is waited for)
                        self._loan.lend(buffer, read=False)
                        lent = True
                        self._commit_home(keep=False)
                        return
                    # the block is on the device (its staged buffer is in use): written and waited
                    # for; a failure is the caller's stage (the optimizer's write-back). (Frozen
                    # parts have no write pool: written rarely, through a staging buffer.)
                    self._tier.put(self.key, src, self.what, write_pool=self._write_pool or self._tier.pool)
                elif src.data_ptr() != self.home_buf.data_ptr():
                    self.home_buf.copy_(src)
                self.home_version += 1
            finally:
                if buffer is not None and not lent:
                    buffer.release()

    def adopt_home(self, lend, keep: bool) -> bool:
        """NVMe home: the new home copy was assembled in a buffer of another owner (an update
        computed ahead, optim/ahead.py); ``lend()`` hands that buffer over (a HostBuffer-like
        object whose ``release`` gives it back to its owner) and it becomes the home's: written
        from where it is, no copy, and kept staged (``keep``: STAGED_WRITING, readable at once,
        as after ``begin_write_through``) or given back once written (WRITING). Any earlier
        write-back of this home completes first, and an old staged copy goes. False, nothing
        done and ``lend`` not called, where the home cannot take it: not on NVMe, gathered
        (ZeRO-3), or on the device now (its staged buffer in use); the caller writes it as
        ``write_home`` does."""
        with self._lock:
            if not self.on_nvme or self._gather is not None or self._device_state is not None:
                return False
            if self._through:
                raise ParamStateError(f"{self.what}: adopted while a write-through is in flight")
            if self.handed_back is not None:
                self._to_placeholders()
            self.finish_write()            # the last write-back (raises its own failure)
            self._loan.release()           # an old staged copy (a read in flight is waited for)
            self._loan.lend(lend(), read=False)
            self._commit_home(keep)
            return True

    def _commit_home(self, keep: bool) -> None:
        """The loan's buffer holds the new home copy: its write is submitted (``keep``: it
        stays staged, the new home copy, readable at once) and device copies made before are
        stale. A write that cannot be submitted gives the buffer back (HOME) and raises."""
        try:
            self._loan.commit(keep=keep)
        except Exception as exc:
            raise self._write_error(exc) from exc
        finally:
            self.home_version += 1
        if keep:
            self._copy_version = self.home_version    # the staged copy is the new home copy

    def read_home(self, raw: bool = False) -> torch.Tensor:
        """A new host tensor holding the home copy (1-D, ``home_numel``; ``raw``: the bytes
        as stored, a quantized part's blob, uint8 ``home_nbytes``): for checkpoints and state
        dicts, not the training path. A staged copy is used as it is; otherwise the home is
        read through a staging buffer, which goes back at once."""
        with self._lock:
            if raw:
                def copy(buf):
                    return buf.view(torch.uint8)[:self.home_nbytes].clone()
            else:           # quantized: its values
                copy = self.codec.values if self.codec is not None else torch.clone
            if not self.on_nvme:
                return copy(self.home_buf)
            self.finish_write()            # WRITING: read back once written
            if self._loan.in_memory:
                return copy(self._staged())
            try:
                return copy(self._staged())
            finally:
                self._loan.release()

    def home_view_for_write(self):
        """Where the optimizer may write the new home copy directly (HOST home), else None."""
        return None if self.on_nvme else self.home_buf


