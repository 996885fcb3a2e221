"""The accumulation window and its commit: when gradients are summed, when the update
happens (gradients land in engine/grad_landing.py's ``GradBuffer``, from the engine's hook
participant, engine/update_and_grads.py).

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

import enum
import math
import warnings
from typing import Callable, List, Optional, Sequence

import torch

from offload import device as dev
from offload.core import sharding
from offload.dist.comm import Comm
from offload.dist.grad_sync import GradSync
from offload.core.block import Block, BlockPhase
from offload.core.telemetry import Telemetry
from offload.engine.loss_scale import LossScaler
from offload.engine.sigint import sigint_deferred
from offload.optim.pipeline import Stage, StepArgs
from offload.optim.torch_face import hyperparams
from offload.params.part import ParamState


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
                # the window's sum waits for step() or the next micro-step on NVMe (engine/grad_landing.py),
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
                        raise self.pipeline.record_failure(b, Stage.GRAD_COLLECTIVE, exc) from exc
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
            with sigint_deferred():
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
            raise self.pipeline.record_failure(block, Stage.GRAD_COLLECTIVE, exc) from exc
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


