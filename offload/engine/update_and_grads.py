"""The engine's hook participant for updates and gradients (``UpdateAndGrads``)."""
from __future__ import annotations

import torch

from offload import device as dev
from offload.core.block import Block
from offload.core.telemetry import Telemetry


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
