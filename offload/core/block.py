"""One block: the unit of residency, I/O and optimizer work, as one object.

A ``Block`` holds everything the engine keeps of one block: its layout (core/blocks.py),
its parameter parts and where they live, its gradient buffer, its optimizer state, the update
in flight, and its ``phase`` in the step. The engine keeps one list of them, in forward
order, blocks holding only frozen parameters included (``trains`` says which); every
participant (hooks, gradient landing, parameter offload, the optimizer pipeline, step
control, gradient sync, checkpoints) is handed ``Block`` objects, never an index into
another list.

The phase (``BlockPhase``) moves only through the verbs below; an illegal move raises
``BlockPhaseError`` naming the block, its phase and the verb::

    IDLE --enter_forward--> FORWARD --exit_forward--> FORWARD_DONE --enter_backward--> BACKWARD
    FORWARD --enter_forward--> FORWARD             (a module re-used within one forward nests)
    FORWARD --exit_forward (in backward)--> BACKWARD   (a recomputation: activation checkpointing)
    BACKWARD --enter_forward--> FORWARD            (... its recomputation starts)
    FORWARD_DONE --enter_forward--> FORWARD        (a forward with no backward: eval, no_grad)
    IDLE --enter_backward--> BACKWARD              (a parameter read outside its block's modules)
    FORWARD --enter_backward--> BACKWARD           (a gradient while a module of it is recomputed;
                                                    its exit_forward then stays in BACKWARD)
    FORWARD_DONE / BACKWARD / IDLE --end_backward--> IDLE   (its gradients are in, or none came)
    IDLE / FORWARD_DONE / BACKWARD --close_window--> COMMITTING   (step() at the boundary;
                                                    BACKWARD: a backward that raised)
    COMMITTING --start_update--> UPDATING --wait_update--> IDLE   (the update collected)
    COMMITTING --skip_update--> IDLE               (no gradient in the window, or the submit failed)

A block's next forward waits for its update (the engine's hook participant collects it
before the block enters FORWARD), so UPDATING never meets FORWARD. An update computed ahead
(optim/ahead.py) is not in flight in this sense: its result waits in the block's slot until
the commit starts the update that takes it.

This module names the higher layers' types only in strings: core imports nothing above it.
"""
from __future__ import annotations

import enum
from concurrent.futures import Future
from typing import List, Optional, Tuple

import torch
from torch import nn

from offload import device as dev
from offload.core.blocks import BlockLayout
from offload.core.errors import BlockError


class BlockPhase(enum.Enum):
    IDLE = "idle"                    # nothing runs on it: not in use since its last backward (or never)
    FORWARD = "forward"              # a module reading its parameters runs now
    FORWARD_DONE = "forward_done"    # used by this forward; its gradients are awaited
    BACKWARD = "backward"            # its gradients are landing
    COMMITTING = "committing"        # step() closed the window: its update is being queued
    UPDATING = "updating"            # its update is in flight (or done and not collected yet)


_P = BlockPhase
_LEGAL = {
    "enter_forward": {_P.IDLE, _P.FORWARD, _P.FORWARD_DONE, _P.BACKWARD},
    "exit_forward": {_P.FORWARD, _P.BACKWARD},
    "enter_backward": {_P.IDLE, _P.FORWARD, _P.FORWARD_DONE},
    "end_backward": {_P.IDLE, _P.FORWARD_DONE, _P.BACKWARD},
    "close_window": {_P.IDLE, _P.FORWARD_DONE, _P.BACKWARD},
    "start_update": {_P.COMMITTING},
    "skip_update": {_P.COMMITTING},
    "collect_update": {_P.UPDATING},
}


class BlockPhaseError(BlockError):
    """A verb was called on a block in a phase it cannot leave that way (a bug in the engine,
    or a call order the engine does not support: the message names both)."""


class BlockUpdate:
    """The update of one block: the job in flight, its device event, the steps taken, and the
    update-ahead slot.

    ``future`` is the optimizer job in flight (None when the parameters are current);
    ``event`` marks the end of the device work that wrote the new parameters (the H2D
    write-back, or the device optimizer's kernels). The rule for a consumer of the block's new
    parameters: the host waits for ``future``, and the stream the consumer reads with waits
    for ``event`` (``Block.wait_update`` for the compute stream, ``Block.order_after_update``
    for another one)."""

    __slots__ = ("future", "event", "step", "ahead")

    def __init__(self, ahead=None):
        self.future: Optional[Future] = None
        self.event = None                 # CUDA event of the new parameters' device work
        self.step = 0                     # optimizer steps applied (bias correction)
        self.ahead: Optional["AheadSlot"] = ahead   # optim/ahead.py (update_ahead), else None


class Block:
    """One block (see the module docstring). Fields:

    ``layout``     the trainable parameters' flat layout (None: frozen parameters only)
    ``parts``      the parameter parts materialized as one unit each (params/part.py
                   ``ParamPart``): the trainable part first, then one frozen part per dtype;
                   empty when parameters are not offloaded. Today a block's parts move
                   together; a block whose parts move one at a time (a MoE layer's experts)
                   changes only this list's users.
    ``param_flat`` the device flat the parameters view when they are not offloaded
    ``grads``      the gradient buffer (engine/grad_landing.py ``GradBuffer``), None if frozen only
    ``landing``    ZeRO-2/3: the full-size transient buffer reduce-scattered into ``grads``
    ``state``      the optimizer state (optim/state.py ``OptimState``), None if frozen only
    ``shard``      [start, end) of this rank's shard in the padded flat
    ``update``     the update in flight (``BlockUpdate``)
    ``users``      modules (and outside reads) of this block running now (parameter offload)
    """

    index: int
    name: str
    module: nn.Module
    device: torch.device
    layout: Optional[BlockLayout]
    phase: BlockPhase
    parts: List["ParamPart"]
    param_flat: Optional[torch.Tensor]
    grads: Optional["GradBuffer"]
    landing: Optional["GradBuffer"]
    state: Optional["OptimState"]
    shard: Tuple[int, int]
    update: BlockUpdate
    users: int
    _depth: int

    def __init__(self, index: int, name: str, module: nn.Module, device: torch.device, *,
                 layout: Optional[BlockLayout] = None, parts=(), param_flat: Optional[torch.Tensor] = None,
                 grads=None, landing=None, state=None, shard: Tuple[int, int] = (0, 0), ahead=None):
        self.index = index
        self.name = name or "<root>"      # the module name ("<root>" for the root block)
        self.module = module
        self.device = device              # the compute device
        self.layout = layout
        self.phase = BlockPhase.IDLE
        self.parts = list(parts)
        self.param_flat = param_flat      # 1-D, compute dtype, on the device; params are views
        self.grads = grads
        self.landing = landing
        self.state = state
        self.shard = shard
        self.update = BlockUpdate(ahead)
        self.users = 0
        self._depth = 0                   # nesting of FORWARD (a module re-used within one forward)

    def __repr__(self) -> str:
        return f"Block({self.index}, {self.name!r}, {self.phase.value})"

    # ---- what it holds -------------------------------------------------------------------
    @property
    def trains(self) -> bool:
        """Whether the block has trainable parameters (gradients, optimizer state, updates)."""
        return self.layout is not None

    @property
    def trainable(self) -> Optional["ParamPart"]:
        """The trainable part (parameters offloaded), else None."""
        return self.parts[0] if self.parts and self.layout is not None else None

    @property
    def frozen(self) -> List["ParamPart"]:
        """The frozen parts (one per storage dtype; parameters offloaded)."""
        return self.parts[1:] if self.layout is not None else list(self.parts)

    @property
    def segments(self):
        """Every offloaded parameter of the block: (part, segment) pairs."""
        return [(p, s) for p in self.parts for s in p.layout.segments]

    @property
    def nbytes(self) -> int:
        """Device bytes of the offloaded parts when materialized."""
        return sum(p.nbytes for p in self.parts)

    # ---- residency of its parts (parameter offload; params/part.py) -----------------------
    # Every part moves through the same transitions at once, so parameter offload and prefetch
    # handle a block as one unit of device bytes. The block's residency is the least advanced
    # of its parts' (``ParamState.order``): parts share one home tier and move in lockstep
    # except that NVMe reads finish at different times, and only the trainable part is written
    # back (asynchronously: WRITING and STAGED_WRITING are its). A block whose trainable part
    # was rewritten by the optimizer is stale as a whole and is refetched whole (frozen parts
    # never change, but one release keeps one residency per block).
    @property
    def residency(self):
        """The least advanced ``ParamState`` of its parts."""
        return min((p.state for p in self.parts), key=lambda s: s.order)

    @property
    def on_nvme(self) -> bool:
        return self.parts[0].on_nvme

    @property
    def device_bytes(self) -> int:
        return sum(p.device_bytes for p in self.parts)

    @property
    def stale(self) -> bool:
        return any(p.stale for p in self.parts)

    def device_bufs(self) -> List[torch.Tensor]:
        return [p.device_buf for p in self.parts if p.device_buf is not None]

    def slot_free(self) -> bool:
        """Whether host staging buffers for every part at home are free now (NVMe home)."""
        loans = []
        try:
            for p in self.parts:
                if p.at_home:
                    loan = p.try_slot()
                    if loan is None:
                        return False
                    loans.append(loan)
            return True
        finally:
            for loan in loans:
                loan.release()

    def stage(self) -> bool:
        """NVMe -> host staging buffers for every part still at home (the trainable part may
        be staged already, written through by its update); False (nothing staged) when a
        buffer is missing for any of them."""
        home = [p for p in self.parts if p.at_home]
        if not home or not self.slot_free():
            return False
        for k, p in enumerate(home):
            if not p.stage():               # another thread took a buffer meanwhile
                for q in home[:k]:
                    q.release()
                return False
        return True

    def poll(self) -> None:
        for p in self.parts:
            p.poll()

    @property
    def writing(self) -> bool:
        """Whether a write-back of a part's home is in flight."""
        return any(p.writing for p in self.parts)

    def poll_write(self) -> None:
        for p in self.parts:
            p.poll_write()

    def finish_write(self, timeout=None) -> None:
        for p in self.parts:
            p.finish_write(timeout)

    def to_device(self, h2d_stream) -> int:
        """Start every part's way to the device; the bytes copied from host to device memory
        (none on a CPU device: ``ParamPart.to_device``)."""
        return sum(p.to_device(h2d_stream) for p in self.parts if p.readable)

    def ensure(self, h2d_stream) -> int:
        """Every part on the device, current, its parameters bound to their views; the bytes
        copied from host to device memory for it."""
        if self.stale:
            self.release()
        return sum(p.ensure(h2d_stream) for p in self.parts)

    def release(self) -> None:
        for p in self.parts:
            p.release()

    def release_initial(self) -> None:
        for p in self.parts:
            p.release_initial()

    # ---- phase verbs ----------------------------------------------------------------------
    def _move(self, verb: str, to: BlockPhase) -> None:
        if self.phase not in _LEGAL[verb]:
            raise BlockPhaseError(f"block {self.index} ({self.name}): {verb} in phase {self.phase.value} "
                                  f"(legal from {sorted(p.value for p in _LEGAL[verb])})")
        self.phase = to

    def enter_forward(self) -> None:
        """A module reading the block's parameters starts (nested uses count)."""
        self._move("enter_forward", BlockPhase.FORWARD)
        self._depth += 1

    def exit_forward(self, in_backward: bool) -> None:
        """That module ends (also when it raised): the outermost one leaves FORWARD_DONE, or
        BACKWARD when it was a recomputation inside backward."""
        if self._depth <= 0:
            raise BlockPhaseError(f"block {self.index} ({self.name}): exit_forward without enter_forward")
        self._depth -= 1
        if self._depth == 0:
            self._move("exit_forward", BlockPhase.BACKWARD if in_backward else BlockPhase.FORWARD_DONE)

    @property
    def in_forward(self) -> bool:
        """Whether a module reading the block runs now."""
        return self._depth > 0

    def enter_backward(self) -> bool:
        """The block's first gradient of this backward exists; False when it was in BACKWARD
        already."""
        if self.phase is BlockPhase.BACKWARD:
            return False
        self._move("enter_backward", BlockPhase.BACKWARD)
        return True

    def end_backward(self) -> None:
        """The block's gradients of this backward are in (or it took no part in it)."""
        self._move("end_backward", BlockPhase.IDLE)

    def close_window(self) -> None:
        """step() at the window's boundary reaches this block: its update is queued next."""
        self._move("close_window", BlockPhase.COMMITTING)

    def start_update(self, submit) -> Future:
        """Queue the update job of this commit (``submit()`` queues it and returns its
        future): the future is the block's until collected (``wait_update``)."""
        if self.update.future is not None:
            raise BlockPhaseError(f"block {self.index} ({self.name}) already has an update in flight")
        self._move("start_update", BlockPhase.UPDATING)
        try:
            self.update.future = submit()
        except BaseException:
            self.phase = BlockPhase.COMMITTING   # not queued: the caller skips the update
            raise
        return self.update.future

    def skip_update(self) -> None:
        """No update this commit (no gradient in the window, or queueing it failed)."""
        self._move("skip_update", BlockPhase.IDLE)

    # ---- the update in flight ------------------------------------------------------------
    def wait_update(self) -> None:
        """Make the parameters current before use: the host waits for the optimizer job
        (re-raising its error), the compute stream waits for the device work it queued."""
        u = self.update
        fut = u.future
        if fut is not None:
            try:
                fut.result()              # the job's own waits are bounded, so this is too
            except BlockError as err:     # stays in flight: the engine cannot go on after it
                err.reported = True
                raise
            u.future = None
            if self.phase is BlockPhase.UPDATING:
                self._move("collect_update", BlockPhase.IDLE)
        ev, u.event = u.event, None
        if ev is not None:
            dev.wait_event(dev.current_stream(self.device), ev)

    def order_after_update(self, stream) -> None:
        """Order ``stream`` after the device work of the update (its job has returned): for a
        consumer on another thread or stream (the ZeRO-1/2 parameter gather). The event is
        kept: the compute stream still waits on it in ``wait_update``."""
        dev.wait_event(stream, self.update.event)

    def must_wait(self) -> bool:
        """Whether ``wait_update()`` would wait: an update still running, or a device copy to
        order after. A finished update only needs ``wait_update()`` to collect it (and raise
        its error)."""
        fut = self.update.future
        return (fut is not None and not fut.done()) or self.update.event is not None

    def wait_update_before_use(self, telemetry) -> None:
        """Before a forward reads the block's parameters: ``wait_update()``, timed as an
        ``offload::wait_update`` span only when it waits (a finished update is collected
        without a span, which would cost the main thread more than the collection)."""
        if self.must_wait():
            with telemetry.span("offload::wait_update"):
                self.wait_update()
        elif self.update.future is not None:
            self.wait_update()

    # ---- views of its buffers --------------------------------------------------------------
    def grad_shard(self) -> torch.Tensor:
        """The gradients of this rank's shard (a view into the gradient buffer)."""
        t = self.grads.resident()         # a gradient parked on NVMe comes back first
        s0, s1 = self.shard
        return t if t.numel() == s1 - s0 else t[s0:s1]

    def home_shard(self, full_or_shard: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a parameter home buffer, which holds either the full flat
        (parameter offload without ZeRO-3) or only the shard (ZeRO-3)."""
        s0, s1 = self.shard
        return full_or_shard if full_or_shard.numel() == s1 - s0 else full_or_shard[s0:s1]
