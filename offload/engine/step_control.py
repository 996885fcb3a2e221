"""The accumulation window and its commit: where gradients land and are summed (``GradBuffer``,
landed by ``UpdateAndGrads``, the engine's hook participant), when the update happens.

The contract (the same with and without clipping, fp32 / bf16 / fp16, on every tier)::

    backward()  lands gradients in the window's buffers; never changes the weights, the
                optimizer state or the counters a checkpoint records
    step()      closes one micro-step (``micro_step += 1``); the step() that closes a window
                of ``gradient_accumulation_steps`` micro-steps commits the update:
                norm -> clip / unscale -> (fp16 overflow: skip) -> every block queued
    zero_grad() discards the window's gradients (all its micro-steps so far)

Several backward() calls between two step() calls sum into one micro-step, as torch sums
``.grad``. A window abandoned before its step() (an exception, Ctrl-C, a checkpoint) leaves
weights, state and counters at the previous commit; its gradients stay until zero_grad().

The window, as an explicit state::

    EMPTY --backward()--> BACKWARD --(returns or raises)--> ACCUMULATED --backward()--> ...
    ACCUMULATED --step() inside the window--> ACCUMULATED
    ACCUMULATED --step() at the boundary--> COMMITTING --> EMPTY   (updates queued / skipped)
    ACCUMULATED --zero_grad()--> EMPTY                             (gradients discarded)
    EMPTY --step() at the boundary--> EMPTY                        (nothing to commit: False)

Overlap: the commit queues every block's update in forward order and returns at once; the
next forward of block k waits for block k's update alone (the engine's wait hooks), so the
optimizer runs under the next forward. Work that changes nothing is moved earlier, into
the backward that is expected to close the window: reading optimizer state back from NVMe
(read-ahead in forward order) and each block's gradient norm (clipping, fp16) on the
optimizer workers as its gradients land. A further backward() in the same micro-step
discards those norms (they are recomputed at the commit).

With ``offload_optimizer.update_ahead`` the update itself moves earlier too, without
changing anything the contract protects: in the backward expected to close the window each
block's update starts as the block completes, computed into a second state buffer and a
staged parameter copy (optim/ahead.py); the commit then queues, per block, the swap and the
parameter write-back instead of the update. A further backward() in the window, zero_grad()
and a checkpoint load drop what was computed ahead (``_drop_ahead``), as does a
hyper-parameter changed before step() (``StepControl._submit``); the commit then computes
those blocks' updates itself.

Synchronization: the commit's jobs read the gradient buffers until they finish; the next
backward() waits for every job in flight before it lands anything (``Block.wait_update``),
and for the updates computed ahead before it adds to their gradients (``_drop_ahead``).
"""
from __future__ import annotations

import _signal
import enum
import math
import signal
import threading
import time
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from offload import device as dev
from offload.core import sharding
from offload.dist.comm import Comm
from offload.dist.grad_sync import GradSync
from offload.core.block import Block, BlockPhase
from offload.core.telemetry import Telemetry
from offload.optim.pipeline import StepArgs, hyperparams
from offload.params.residency import ParamState
from offload.config import LossScalerConfig
from offload.storage.tier import LoanState, OwnedBuffer, TierTimeout


_POLL_S = 0.05        # a borrow waiting for a pool buffer re-checks whether any will come back this often


class Spill(enum.Enum):
    NONE = "none"            # no sum of this window anywhere but the buffer (if borrowed)
    PARKED = "parked"        # this window's running sum is on NVMe; no buffer held


class GradBuffer:
    """The accumulated gradients of one block, and how a parameter's gradient lands in them.

    Layout: 1-D, ``dtype`` (fp32, or the compute dtype when there is no accumulation), the
    block's padded numel, in the optimizer state's memory (host for the cpu/nvme tiers, the
    device for tier none). A parameter's gradient lands once per backward, from its
    post-accumulate-grad hook: the first landing of an accumulation window overwrites the
    parameter's range, later ones add to it, so no zeroing pass runs between windows. Ranges
    whose parameter received no gradient in a window are zeroed when the window closes.

    Synchronization: a CUDA landing is an asynchronous copy on the D2H stream; ``events``
    holds the completion events, which the optimizer waits for (``wait_landed``) before it
    reads the buffer. The device gradient is freed by the caller right after the landing is
    queued (its memory is protected by ``record_stream``).

    Landing copies, also on a CPU device, and the caller frees autograd's tensor right after
    (engine.py): the buffer is allocated once, and autograd's next gradient reuses the memory
    just freed, still in cache, where keeping autograd's tensors until the update would keep a
    fresh allocation per parameter alive through the step.

    Spilling (a ``tier``: an ``NvmeTier`` over the offload-grads pool): the buffer is the key
    ``b<i>.grad``'s ``Loan`` (storage/tier.py, the loaned-buffer state machine optimizer state
    and parameter homes use), so gradients that must outlive their buffer (the update waits for
    the global norm; the window spans several micro-steps) are parked on NVMe between uses::

        window    Spill    Loan
        empty     NONE     ON_TIER          (no buffer; the key holds nothing of this window)
        landing   NONE     READY            --land/_borrow: try_fill() (a fresh window) or fetch()
        parked    PARKED   ON_TIER          <--park(): commit() -> WRITING, release() (write waited)
        back      NONE     READY            <--resident()/land: fetch()/acquire() (the sum read back)
        any --reset_window()--> NONE, ON_TIER (release(): a READY buffer is discarded; the update
                                               consumed it)

    ``park`` runs on an optimizer worker; a later borrow waits for it (``_parking``). Zeroing the
    ranges of parameters without a gradient (``close_window``) on a parked buffer is applied when
    it comes back. A borrow waits for a pool buffer only while an update or a park in flight will
    give one back, at most ``tier.wait_timeout_s``; when none will (every buffer is held by a
    block still collecting gradients) the loan takes a buffer outside the pool (``OwnedBuffer``)
    rather than wait forever.

    With a ``tier`` the buffer is the key's loan, taken at the window's first landing and
    returned when the window is consumed (``reset_window``), so host memory for gradients is
    bounded by the tier's pool, not the model. ``has_jobs`` tells whether an update or park in
    flight will return a pool buffer; if none will, the loan takes one outside the pool."""

    def __init__(self, tensor: Optional[torch.Tensor], num_segments: int, *, numel: int = 0,
                 dtype: torch.dtype = torch.float32, tier=None, has_jobs=None, device=None,
                 key: str = "", what: str = "", gaps: Sequence[Tuple[int, int]] = ()):
        self.tensor = tensor                          # 1-D, padded numel (None while not borrowed)
        # transient (no tensor, no pool): allocated on ``device`` at the first landing and
        # freed by reset_window (ZeRO-2/3 landing buffers, live only until reduce-scattered)
        self._device = device
        self.num_segments = num_segments
        self._numel, self._dtype = (tensor.numel(), tensor.dtype) if tensor is not None else (numel, dtype)
        self._has_jobs = has_jobs
        self._nbytes = self._numel * self._dtype.itemsize
        # the key's Loan on the NVMe tier (parked sums), None without a tier
        self._loan = tier.loan(key, self._nbytes, what or key) if tier is not None else None
        self._seen = [False] * num_segments           # landed in the current window
        self.arrived = 0                              # landings in the current backward
        self.events: List = []                        # CUDA copies still in flight
        self._staging: Optional[torch.Tensor] = None  # pinned, for accumulating CUDA landings
        self.spill = Spill.NONE
        self._parking = None                          # Future of park() in flight
        self._park_thread = None                      # the worker running the park job
        self._zero_on_return = None                   # segments to zero when a parked sum returns
        # [a, b) ranges no parameter covers (alignment gaps, padding): zeroed in a borrowed
        # buffer, which holds another block's bytes (an int8 scale block may span a gap)
        self._gaps = tuple(gaps)

    @property
    def device(self) -> torch.device:
        """Where the buffer lives: the device (a transient landing buffer, or one allocated
        there), else host memory."""
        if self._device is not None:
            return self._device
        return self.tensor.device if self.tensor is not None else torch.device("cpu")

    # ---- one backward ------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.arrived = 0

    @property
    def complete(self) -> bool:
        return self.arrived == self.num_segments

    def land(self, index: int, offset: int, grad: torch.Tensor, stream) -> None:
        """Add parameter ``index``'s gradient (any device, any float dtype) at ``offset``."""
        flat = grad.detach().reshape(-1)
        if self._parking is not None:
            self._wait_parking()                      # the park of the last micro-step first
        if self.tensor is None:
            self._borrow()
        dst = self.tensor[offset:offset + flat.numel()]
        if not self._seen[index]:
            if dst.device == flat.device:
                dst.copy_(flat)
            else:
                ev = dev.copy_to_host_async(dst, flat, stream)
                if ev is not None:
                    self.events.append(ev)
            self._seen[index] = True
        else:
            self._add(dst, flat, stream)
        self.arrived += 1

    def _add(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """``dst`` (a range of the buffer) += ``src`` (1-D, any device). The one rule of where
        a landed gradient is summed: in the buffer's memory. A source on another device (a
        device gradient, a reduce-scattered device shard, into host memory) is copied next to
        the buffer first (the pinned staging buffer), then added there."""
        if dst.device == src.device:
            self.wait_landed()                        # a copy of this window may be in flight
            dst.add_(src)
            return
        if self._staging is None or self._staging.numel() < src.numel() or self._staging.dtype != src.dtype:
            self._staging = dev.empty_host(max(self.tensor.numel(), src.numel()), src.dtype, pin=True)
        tmp = self._staging[:src.numel()]
        dev.sync_event(dev.copy_to_host_async(tmp, src, stream))
        self.wait_landed()
        dst.add_(tmp)

    def _borrow(self) -> None:
        """The buffer in memory: a fresh one for a new window, or the parked sum read back."""
        self._wait_parking()
        if self._loan is None:
            self.tensor = torch.zeros(self._numel, dtype=self._dtype, device=self._device)
            return
        parked = self.spill is Spill.PARKED
        if not (self._loan.fetch() if parked else self._loan.try_fill() is not None):
            self._lend_when_free(parked)
        self.tensor = self._loan.acquire().view(self._dtype)     # a read in flight: waited (bounded)
        if not parked:
            for a, b in self._gaps:
                self.tensor[a:b].zero_()
        if parked:                                   # the window's sum so far is back
            self.spill = Spill.NONE
            segs, self._zero_on_return = self._zero_on_return, None
            if segs is not None:
                self._zero_unseen(segs)

    def _lend_when_free(self, read: bool) -> None:
        """Wait for a pool buffer while work in flight will give one back, within the tier's
        wait_timeout_s; when none will, lend the loan a buffer outside the pool."""
        pool, deadline = self._loan.tier.pool, time.monotonic() + self._loan.tier.wait_timeout_s
        while True:
            if not self._has_jobs():
                # every buffer is held by a block still collecting gradients: outside the pool
                self._loan.lend(OwnedBuffer(self._nbytes), read)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TierTimeout(f"buffer for {self._loan.what}: no gradient buffer came back after "
                                  f"{self._loan.tier.wait_timeout_s} s (an update or park in flight is stuck)")
            try:
                buf = pool.acquire(self._nbytes, timeout=min(left, _POLL_S))
            except TimeoutError:
                continue
            self._loan.lend(buf, read)
            return

    # ---- spilling ------------------------------------------------------------------------------
    @property
    def spills(self) -> bool:
        return self._loan is not None

    def park(self) -> None:
        """Write the window's sum so far to the NVMe tier and give the buffer back (READY ->
        WRITING -> ON_TIER: PARKED); a no-op without a buffer. Runs on a worker; see
        ``start_park``. A failed write gives the buffer back, then raises (naming the block)."""
        if self.tensor is None or self._loan is None or self._loan.state is not LoanState.READY:
            return
        self.wait_landed()
        self.tensor = None
        self._loan.commit()
        self._loan.release()                          # waits for the write (bounded)
        self.spill = Spill.PARKED

    def start_park(self, run, first=None, fail=None):
        """Park on a worker (``run(fn)`` returns a Future), after ``first()`` (a reader of the
        buffer, e.g. its norms) if given; the next borrow waits for it. Returns the Future,
        whose result is ``first()``'s. ``fail(stage, exc)`` turns a failure of ``first``
        ("gradient norm") or of the write ("gradient park") into the error the Future raises
        (the engine's: it names the block and is raised from the user's next call)."""
        self._wait_parking()

        def job():
            self._park_thread = threading.get_ident()   # first() reads the buffer before the park
            stage = "gradient norm"
            try:
                out = first() if first is not None else None
                stage = "gradient park"
                self.park()
            except BaseException as exc:
                err = fail(stage, exc) if fail is not None else exc
                if err is exc:
                    raise
                raise err from exc
            finally:
                self._park_thread = None
            return out
        self._parking = run(job)
        return self._parking

    @property
    def parking(self) -> bool:
        return self._parking is not None and not self._parking.done()

    def _wait_parking(self) -> None:
        fut, self._parking = self._parking, None
        if fut is not None:
            fut.result()

    def resident(self) -> torch.Tensor:
        """The buffer in memory (a parked sum is read back into a borrowed buffer)."""
        if self._park_thread != threading.get_ident():
            self._wait_parking()
        if self.tensor is None and self.spill is Spill.PARKED:
            self._borrow()
        return self.tensor

    def seen(self, index: int) -> bool:
        """Whether parameter ``index`` got a gradient in the current window."""
        return self._seen[index]

    def wait_landed(self) -> None:
        for ev in self.events:
            dev.sync_event(ev)
        self.events.clear()

    # ---- the accumulation window -------------------------------------------------------------
    def close_window(self, segments) -> bool:
        """Zero the ranges of parameters that got no gradient in this window.
        Returns whether any gradient landed at all."""
        any_seen = any(self._seen)
        if not any_seen:
            return False
        self._wait_parking()
        if self.tensor is None and self.spill is Spill.PARKED:
            self._zero_on_return = segments           # applied when the sum comes back
            return True
        if self.tensor is None:     # every landing was whole-shard (land_whole) and none came
            return False
        self._zero_unseen(segments)
        return any_seen

    def _zero_unseen(self, segments) -> None:
        for i, s in enumerate(segments):
            if not self._seen[i]:
                self.tensor[s.offset:s.offset + s.numel].zero_()

    @property
    def any_landed(self) -> bool:
        return any(self._seen)

    def fill_missing(self, segments) -> None:
        """Make the buffer exist and zero every range that got no gradient (a rank must take
        part in a collective even when none of its parameters got a gradient)."""
        if self.tensor is None:
            self._borrow()
            self.tensor.zero_()
            self._seen = [True] * self.num_segments
        self.close_window(segments)
        self._seen = [True] * self.num_segments

    def land_whole(self, src: torch.Tensor, stream=None) -> None:
        """Add a whole-buffer gradient (a reduce-scattered shard, on any device): the window's
        first landing overwrites, later ones add (``_add``: summed in the buffer's memory).
        ``stream``: where a device source's copy runs (None: the current stream)."""
        if self.tensor is None:
            self._borrow()
        self.wait_landed()
        if not any(self._seen):
            self.tensor.copy_(src)
        else:
            self._add(self.tensor, src.reshape(-1), stream)
        self._seen = [True] * self.num_segments

    def reset_window(self) -> None:
        """After the optimizer consumed the buffer: the next landing overwrites (a borrowed
        buffer goes back to the pool)."""
        self._wait_parking()
        self.wait_landed()                            # no copy writes into the next window
        self._seen = [False] * self.num_segments
        self.spill, self._zero_on_return = Spill.NONE, None
        if self._loan is None and self._device is not None:
            self.tensor = None                        # transient: freed
        elif self._loan is not None and self.tensor is not None:
            self.tensor = None
            self._loan.release()                      # READY: discarded, the buffer goes back


class UpdateAndGrads:
    """The engine's part of each block's lifecycle (a participant of core/hooks.py): a
    block's update lands before any module reads its parameters (its own module and modules
    sharing a tied parameter); each parameter's gradient leaves the device as it accumulates,
    and a block whose gradients are all in is complete (``control`` is told; it tells the hook
    owner's post_backward)."""

    def __init__(self, control: "StepControl", telemetry: Telemetry, device: torch.device):
        self.control = control
        self.telemetry = telemetry
        self.d2h = dev.new_stream(device)    # the gradients' copies off the device

    def pre_forward(self, block: Block) -> None:
        if block.trains:                     # a block of frozen parameters only has no update
            block.wait_update_before_use(self.telemetry)

    def grad_accumulated(self, block: Block, k: int, param: torch.Tensor) -> None:
        seg = block.layout.segments[k]
        grad = param.grad
        buf = block.landing or block.grads    # full-size either way: land at the flat offset
        # d2h from an accelerator; h2h on a CPU device, whose landing is a copy within host memory
        with self.telemetry.span("offload::grad_d2h", dev.link(grad.device, buf.device),
                                 grad.numel() * grad.element_size()):
            buf.land(k, seg.offset, grad, self.d2h)
        param.grad = None   # device gradient memory is freed (the D2H holds it: record_stream)
        if buf.complete:
            self.control.on_block_complete(block)


class LossScaler:
    """Dynamic loss scaling for fp16: an overflow skips the step and lowers the scale; after
    ``growth_interval`` clean steps the scale grows (the same rule as torch.amp.GradScaler).
    Owned by the window's commit; inert (scale 1) in fp32 and bf16."""

    def __init__(self, cfg: LossScalerConfig, enabled: bool):
        self.cfg = cfg
        self.enabled = enabled
        self.scale = float(cfg.initial_scale) if enabled else 1.0
        self.clean_steps = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_scale)
            self.clean_steps = 0
            self.skipped += 1
        else:
            self.clean_steps += 1
            if self.clean_steps % self.cfg.growth_interval == 0:
                self.scale *= self.cfg.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, d: dict) -> None:
        self.scale = float(d["scale"])
        self.clean_steps = int(d["clean_steps"])
        self.skipped = int(d["skipped"])


class Window(enum.Enum):
    EMPTY = "empty"                # no gradient since the last commit (its updates may still run)
    BACKWARD = "backward"          # a backward() is landing gradients
    ACCUMULATED = "accumulated"    # gradients held; weights, state and counters untouched
    COMMITTING = "committing"      # step() at the boundary: norm, scale, queueing the updates


class StepControl:
    """Owns the window state, the step counters, the clipping and the fp16 loss scale, and
    queues each block's update on ``pipeline`` (optim/pipeline.py) at the commit.

    ``blocks``: the trained blocks. ``on_block_complete(block)``, if given, is told when a
    block's gradients of a backward are all in (the hook owner's post_backward: parameter
    offload releases the block). ``grad_sync`` is None where no gradient crosses ranks or
    buffers (one rank, stages 0 and 1): a one-rank step then runs nothing in dist/.
    ``gatherer``: the ZeRO-1/2 parameter all-gather after each update (dist/param_gather.py),
    or None. ``update_ahead``: each block's update starts as its gradients of the window's
    last backward are in (optim/ahead.py); ``param_offload`` then releases the staged copy
    the update replaces."""

    def __init__(self, *, blocks: Sequence[Block], pipeline, grad_sync: Optional[GradSync], comm: Comm,
                 scaler: LossScaler, telemetry: Telemetry, device: torch.device, rule, optimizer,
                 gradient_accumulation_steps: int, gradient_clipping: float, param_order: dict, read_ahead: bool,
                 gatherer=None, param_offload=None, update_ahead: bool = False, wait_timeout_s: float = 60.0,
                 on_block_complete: Optional[Callable[[Block], None]] = None):
        self.blocks = list(blocks)
        self.pipeline = pipeline
        self.device = device
        self.rule = rule
        self.optimizer = optimizer
        self._gatherer = gatherer
        self._param_offload = param_offload
        self._wait_timeout_s = wait_timeout_s
        self._commit_inputs: tuple = ((), None)   # (hyper-parameters, compute-done event) of this commit
        self.grad_sync = grad_sync
        self.comm = comm
        self.distributed = comm.active        # fixed for the engine's life: read once
        self.scaler = scaler
        self.telemetry = telemetry
        self.gas = gradient_accumulation_steps
        self.clip = gradient_clipping
        self._param_order = param_order       # id(param) -> position in model.parameters()
        self._read_ahead = read_ahead         # optimizer state on NVMe: read it during backward
        self._on_complete = on_block_complete
        self._update_ahead = update_ahead     # start a block's update as it completes
        self.state = Window.EMPTY
        self.global_step = 0                  # commits (fp16 overflow skips excluded)
        self.micro_step = 0                   # step() calls
        self.last_grad_norm: Optional[float] = None
        self._boundary = False                # the current micro-step closes the window
        self._forced: Optional[bool] = None   # set_boundary(): the caller decides the window
        self._arrival: List[int] = []         # block completion order of the last backward
        self._backwards = 0                   # backward() calls in the current micro-step
        self._warned_multi = False
        self._norms: list = []                # futures: per-block norms of the last backward

    # ---- queries ------------------------------------------------------------------------
    def at_boundary(self) -> bool:
        """Whether the next step() closes the accumulation window."""
        if self._forced is not None:
            return self._forced
        return (self.micro_step + 1) % self.gas == 0

    def set_boundary(self, is_boundary: Optional[bool]) -> None:
        """The caller decides whether the next step() closes the window (None: count
        gradient_accumulation_steps again)."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"is_boundary must be True, False or None, not {is_boundary!r}")
        self._forced = is_boundary

    @property
    def needs_norm(self) -> bool:
        return self.clip > 0 or self.scaler.enabled

    # ---- backward -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Land ``loss``'s gradients in the window: ``loss / gradient_accumulation_steps``
        (DeepSpeed's convention; not divided with ``scale_wrt_gas=False``), times the fp16
        loss scale."""
        if self.state is Window.BACKWARD:
            raise RuntimeError("backward() called from inside backward(): one backward at a time")
        if self.state is Window.COMMITTING:
            raise RuntimeError("backward() called while step() commits the window")
        for b in self.blocks:
            if b.update.future is not None:         # the last commit's jobs still read the grad buffers
                b.wait_update()
        self._drop_ahead()                    # computed from gradients this backward adds to
        if self.state is Window.ACCUMULATED:  # another backward joins this micro-step
            self._drop_norms()
            if self.grad_sync is not None:
                self.grad_sync.reopen()
        self._backwards += 1
        if self._backwards == 2 and self.gas > 1 and not self._warned_multi:
            self._warned_multi = True
            warnings.warn(f"two backward() calls without step() between them sum into one micro-step; with "
                          f"gradient_accumulation_steps={self.gas} the update is committed by every "
                          f"{self.gas}th step(): call step() after every backward() (it is a no-op inside "
                          f"the window), as DeepSpeed does", stacklevel=3)
        self._boundary = self.at_boundary()
        self._arrival = []
        if self.grad_sync is not None:
            self.grad_sync.begin(self._boundary)
        for b in self.blocks:
            (b.landing or b.grads).begin_backward()
        if self._boundary and self._read_ahead:   # the commit will queue blocks in forward order
            self.pipeline.set_order(self.blocks)
        scaled = loss / self.gas if self.gas > 1 and scale_wrt_gas else loss
        if self.scaler.enabled:
            scaled = scaled * self.scaler.scale
        self.state = Window.BACKWARD
        try:
            with self.telemetry.span("offload::backward"):
                scaled.backward()
        finally:
            self.state = Window.ACCUMULATED   # a failed backward leaves partial gradients
        for b in self.blocks:                 # parameters that took no part in this backward
            buf = b.landing or b.grads
            if not buf.complete:
                buf.arrived = buf.num_segments
                self.on_block_complete(b)
        if not self._boundary and self.grad_sync is not None:
            self.grad_sync.wait_all()         # summed in place before the next backward lands

    def on_block_complete(self, block: Block) -> None:
        """All of ``block``'s gradients of this backward have landed (from its grad hook)."""
        self._arrival.append(block.index)
        if self._on_complete is not None:
            self._on_complete(block)
        # collectives issued in the fixed block order; without them each block as it completes
        ready = self.grad_sync.ready(block) if self.grad_sync is not None else (block,)
        for b in ready:
            norm = self._boundary and self.needs_norm and not self.distributed
            if b.grads.spills:
                # the window's sum waits for step() or the next micro-step on NVMe (GradBuffer),
                # parked on a worker right after its norm is taken
                fut = b.grads.start_park(self.pipeline.run, (lambda b=b: self._block_norms(b)) if norm else None,
                                        fail=lambda stage, exc, b=b: self.pipeline.record_failure(b, stage, exc))
                if norm:
                    self._norms.append(fut)
            elif norm:
                # the global norm needs every block: compute this block's share now, on a
                # worker, while backward goes on (read-only; dropped if another backward comes)
                self._norms.append(self.pipeline.run(self._block_norms, b))
            elif self._update_ahead and self._boundary:
                self._submit_ahead(b)         # its update, computed now, committed by step()

    # ---- step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Close one micro-step; at the window's boundary commit the update. Returns True when
        an update was committed (False inside the window and on an fp16 overflow skip)."""
        if self.state in (Window.BACKWARD, Window.COMMITTING):
            raise RuntimeError(f"step() called during {self.state.value}: call it after backward() returns")
        if self.at_boundary():
            # what every block's update of this commit shares (_submit): the hyper-parameters
            # as the groups hold them now, and the point of the compute stream after the
            # gradients are final (recorded by the first _submit)
            self._commit_inputs = (hyperparams(self.optimizer), None)
        committed = self._commit() if self.at_boundary() else False
        self.micro_step += 1
        self._backwards = 0
        return committed

    def _commit(self) -> bool:
        if self.state is Window.EMPTY:        # no gradient in this window: nothing to commit
            return False
        self.state = Window.COMMITTING
        try:
            self.comm.step = self.global_step + 1
            if self.distributed:              # the ranks took the same path through the model
                self.comm.check_same("block order of backward", self._arrival)
            if self.grad_sync is not None:
                for b in self.blocks:         # a failed collective names its block and stage
                    try:
                        self.grad_sync.wait(b)
                    except Exception as exc:
                        raise self.pipeline.record_failure(b, "gradient collective", exc) from exc
            coef, overflow = 1.0, False
            if self.needs_norm:
                with self.telemetry.span("offload::grad_norm"):
                    coef, overflow = self._unscale_clip_coef()
            if overflow:
                self.scaler.update(True)
                self._discard()
                self.telemetry.count("skipped_steps")
                return False
            self.scaler.update(False)
            if self._read_ahead:              # the next forward's order
                self.pipeline.set_order(self.blocks)
            # the updates run under the next forward. From the first submit on the step is
            # committed whole: a Ctrl-C waits for the last submit and global_step, then comes
            # from step() (a worker's job cannot be cut short either, and a half-submitted
            # step would mix two steps' weights).
            with _sigint_deferred():
                for b in self.blocks:
                    self._submit(b, coef)
                self.global_step += 1
            return True
        finally:
            self.state = Window.EMPTY

    def _submit(self, block: Block, grad_scale: float) -> None:
        """Queue ``block``'s update of this commit (IDLE -> COMMITTING -> UPDATING, or back to
        IDLE when the window gave it no gradient)."""
        block.close_window()
        try:
            self._queue(block, grad_scale)
        finally:
            if block.phase is BlockPhase.COMMITTING:
                block.skip_update()           # nothing queued (no gradient, or the submit raised)

    def _queue(self, block: Block, grad_scale: float) -> None:
        if not self.distributed and not block.grads.close_window(block.layout.segments):
            block.grads.reset_window()    # no gradient at all: torch skips such parameters
            return                        # (nor was an update computed ahead: _submit_ahead)
        groups, done = self._commit_inputs
        if done is None:
            # recorded at the commit's first submit, after the commit waited for every
            # gradient collective: their finishing kernels (the division by the world size, the
            # shard added into its buffer) run on the compute stream after backward, and the
            # update's stream waits on this event alone
            done = dev.record_event(dev.current_stream(self.device))
            self._commit_inputs = (groups, done)
        args = StepArgs(step=block.update.step + 1, groups=groups, rule=self.rule, grad_scale=grad_scale,
                        compute_done=done)
        ahead = block.update.ahead
        if ahead is not None and ahead.pending_for(args.step, args.groups) is None:
            # an update computed ahead that failed (since step() began: an earlier failure is
            # raised before the commit) is raised as it is, not met again by a second try
            self.pipeline.raise_failure()
            # computed ahead with other hyper-parameters (set between backward and step):
            # dropped, and the update runs now
            ahead.drop(self._wait_timeout_s, block.name)
        fut = self.pipeline.submit(block, args)
        if self._gatherer is not None:    # then every rank's updated shard to every rank
            block.update.future = self._gatherer.submit(block, fut)

    def _submit_ahead(self, block: Block) -> None:
        """``offload_optimizer.update_ahead``: ``block``'s gradients of the window's last
        backward are in; its update starts now, into its ahead slot (optim/ahead.py)."""
        ahead = block.update.ahead
        if ahead.out_lent and self._param_offload is not None:
            self._param_offload.release_before_update(block)
        if ahead.out_lent and block.trainable.state is not ParamState.WRITING:
            return                        # its home's staged copy is in use: step() updates it
        # (WRITING: the buffer comes back once the last write-back completes; the job waits)
        if not block.grads.close_window(block.layout.segments):
            return                        # no gradient: step() skips the block, as torch does
        self.pipeline.submit_ahead(block, StepArgs(step=block.update.step + 1, groups=hyperparams(self.optimizer),
                                                   rule=self.rule))

    # ---- discarding ---------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Discard the window's gradients; weights, state and counters are not touched."""
        if self.state in (Window.BACKWARD, Window.COMMITTING):
            raise RuntimeError(f"zero_grad() called during {self.state.value}")
        if self.state is Window.EMPTY:
            return
        self._discard()
        self._backwards = 0
        self.state = Window.EMPTY

    def _discard(self) -> None:
        self._drop_norms()
        self._drop_ahead()
        if self.grad_sync is not None:
            self.grad_sync.discard()
        for b in self.blocks:
            b.grads.reset_window()
            if b.landing is not None:
                b.landing.reset_window()

    def _drop_ahead(self) -> None:
        for b in self.blocks:                 # updates computed ahead (optim/ahead.py): discarded
            if b.update.ahead is not None:
                b.update.ahead.drop(self.pipeline.wait_timeout_s, f"block {b.index} ({b.name})")

    def _drop_norms(self) -> None:
        norms, self._norms = self._norms, []
        for fut in norms:                     # read-only jobs: let them finish, ignore the values
            fut.result()

    # ---- norm, clipping, loss scale --------------------------------------------------------------
    def _block_norms(self, block: Block):
        """(parameter order, norm) of each parameter of ``block`` that got a gradient in
        this window, as torch.nn.utils.clip_grad_norm_ computes them on fp32 master gradients
        (it skips grad None): in fp32 also where the window's gradients are bf16 (no
        accumulation), whose norms in bf16 would carry 3 significant digits into the clip."""
        try:
            if self.grad_sync is not None:
                self.grad_sync.wait(block)
        except BaseException as exc:      # named for its block, raised from step()
            raise self.pipeline.record_failure(block, "gradient collective", exc) from exc
        block.grads.wait_landed()
        g = block.grad_shard()
        items = [(self._param_order.get(id(s.param), 0), g[s.offset - block.shard[0]:][:s.numel])
                 for i, s in enumerate(block.layout.segments) if block.grads.seen(i)]
        if not items:
            return []
        norms = torch._foreach_norm([g for _, g in items], 2.0, dtype=torch.float32)
        return [(o, n) for (o, _), n in zip(items, norms)]

    def _unscale_clip_coef(self):
        """(grad_scale for the kernel, overflow) from the global gradient norm, computed as
        torch.nn.utils.clip_grad_norm_ does: per-parameter norms (parameters without a
        gradient skipped), stacked in model.parameters() order, then the norm of those."""
        if not self.distributed:
            if not self._norms:               # not computed during backward: now, on the workers
                self._norms = [self.pipeline.run(self._block_norms, b) for b in self.blocks]
            per_param = [item for fut in self._norms for item in fut.result()]
            self._norms = []
            per_param.sort(key=lambda t: t[0])
            norms = [n for _, n in per_param]
        else:
            per_param = []
            partitioned = self.grad_sync.stage >= 1   # each rank holds the grads of its shard
            for b in self.blocks:
                b.grads.wait_landed()
                s0, s1 = b.shard
                g = b.grad_shard()
                for s in b.layout.segments:
                    r = sharding.clip_range(s.offset, s.offset + s.numel, s0, s1) if partitioned \
                        else (s.offset, s.offset + s.numel)
                    if r is not None:
                        per_param.append((self._param_order.get(id(s.param), 0), g[r[0] - s0:r[1] - s0]))
            per_param.sort(key=lambda t: t[0])
            norms = torch._foreach_norm([g for _, g in per_param], 2.0, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if len(norms) \
            else torch.zeros(())
        if self.distributed and self.grad_sync.stage >= 1:   # sqrt of the sum over ranks of the local squares
            sq = (total.double() ** 2).reshape(1)
            self.comm.all_reduce(sq, "gradient norm")
            total = sq.sqrt()[0].float()
        inv_scale = 1.0 / self.scaler.scale
        if not math.isfinite(total.item()):
            self.last_grad_norm = math.inf
            return 1.0, True
        self.last_grad_norm = float(total) * inv_scale if self.scaler.enabled else float(total)
        coef = inv_scale
        if self.clip > 0:
            unscaled = total * inv_scale if self.scaler.enabled else total
            c = torch.clamp(self.clip / (unscaled + 1e-6), max=1.0)
            coef = c.item() * inv_scale if self.scaler.enabled else c.item()
        return coef, False


class _sigint_deferred:
    """Hold a Ctrl-C back until the body ends, then deliver it to the handler that was in
    place (Python's: KeyboardInterrupt). A signal mask cannot do this: SIGINT sent to the
    process lands on any thread that does not block it, and Python raises it on the main
    thread between any two bytecodes all the same. Only the main thread can swap handlers,
    and only a handler Python installed can be put back; elsewhere this does nothing.
    Swapped through ``_signal``, the C module under ``signal``: ``signal``'s wrappers turn
    each handler into an enum member by raising and catching a ValueError, twice per swap,
    and right after a backward (caches cold) a swap through them took 60-90 us of step()."""

    __slots__ = ("previous", "caught")

    def __enter__(self):
        self.previous, self.caught = None, False
        if threading.current_thread() is not threading.main_thread():
            return self
        previous = _signal.getsignal(signal.SIGINT)
        if previous is None:             # installed outside Python: cannot be restored
            return self
        _signal.signal(signal.SIGINT, self._catch)
        self.previous = previous
        return self

    def _catch(self, signum, frame) -> None:
        self.caught = True

    def __exit__(self, *exc) -> None:
        if self.previous is None:
            return
        _signal.signal(signal.SIGINT, self.previous)
        self.previous = None
        if self.caught:
            _signal.raise_signal(signal.SIGINT)   # now, to the handler in place again
