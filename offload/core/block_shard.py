"""The runtime owner of one block shard: its device parameter buffer, its optimizer state,
its gradient buffer, and the update in flight.

``pending`` is the future of the optimizer update in flight for this block (None when the
parameters are current); ``update_event`` marks the end of the H2D copy of the updated
parameters. A forward that uses the block first calls ``wait_update()``.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Optional

import torch

from offload import device as dev
from offload.core.blocks import BlockLayout
from offload.core.errors import BlockError


class BlockShard:
    def __init__(self, layout: BlockLayout, param_flat: Optional[torch.Tensor], state,
                 grad, shard: tuple, params=None, landing=None,
                 ahead=None):
        self.layout = layout
        self.param_flat = param_flat      # 1-D, compute dtype, on the device; params are views
        self.params = params              # BlockParams when the parameters are offloaded (then
                                          # param_flat is None: they visit the device per use)
        self.state = state                # [master | exp_avg | exp_avg_sq] of this rank's shard
        self.grad = grad                  # accumulated gradients: the full flat (stages 0, 1) or the shard
        self.landing = landing            # stages 2, 3: full-size, transient, reduce-scattered into grad
        self.shard = shard                # [start, end) of this rank's shard in the padded flat
        self.pending: Optional[Future] = None
        self.update_event = None          # H2D copy of the new parameters (CUDA)
        self.stepped = 0                  # optimizer steps applied (bias correction)
        self.ahead = ahead                # AheadSlot (update_ahead): the update computed during backward

    @property
    def index(self) -> int:
        return self.layout.index

    @property
    def name(self) -> str:
        return self.layout.name or "<root>"

    def wait_update(self) -> None:
        """Make the parameters current before use: the host waits for the optimizer job
        (re-raising its error), the compute stream waits for the H2D copy it queued."""
        fut = self.pending
        if fut is not None:
            try:
                fut.result()              # the job's own waits are bounded, so this is too
            except BlockError as err:     # stays pending: the engine cannot go on after it
                err.reported = True
                raise
            self.pending = None
        ev, self.update_event = self.update_event, None
        if ev is not None:
            dev.wait_event(dev.current_stream(self.param_flat.device), ev)

    def must_wait(self) -> bool:
        """Whether ``wait_update()`` would wait: an update still running, or a device copy to
        order after. A finished update only needs ``wait_update()`` to collect it (and raise
        its error)."""
        fut = self.pending
        return (fut is not None and not fut.done()) or self.update_event is not None

    def wait_update_before_use(self, telemetry) -> None:
        """Before a forward reads the block's parameters: ``wait_update()``, timed as an
        ``offload::wait_update`` span only when it waits (a finished update is collected
        without a span, which would cost the main thread more than the collection)."""
        if self.must_wait():
            with telemetry.span("offload::wait_update"):
                self.wait_update()
        elif self.pending is not None:
            self.wait_update()

    def grad_shard(self) -> torch.Tensor:
        """The gradients of this rank's shard (a view into the gradient buffer)."""
        t = self.grad.resident()          # a gradient parked on NVMe comes back first
        s0, s1 = self.shard
        return t if t.numel() == s1 - s0 else t[s0:s1]

    def home_shard(self, full_or_shard: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a parameter home buffer, which holds either the full flat
        (parameter offload without ZeRO-3) or only the shard (ZeRO-3)."""
        s0, s1 = self.shard
        return full_or_shard if full_or_shard.numel() == s1 - s0 else full_or_shard[s0:s1]
