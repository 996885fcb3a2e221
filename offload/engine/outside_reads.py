"""Forward reads of parameters outside the modules whose hooks wait for their update.

After a commit the next forward trails the optimizer: a forward pre-hook on each module that
owns (or shares) a block's parameters waits for that block's update. A parameter can also be
read where no such hook runs first: ``F.linear(x, self.embed.weight)`` in a parent's
forward, a child's bias added before the child runs. ``UpdateWaits`` covers those reads:
while a forward runs with updates in flight, a torch-function mode sees every parameter that
reaches a torch function and waits for its block's update first. Forwards that start with no
update in flight run without the mode. (With parameter offload the parameter side's own
mode does this: every use materializes the block, which waits for its update.)
"""
from __future__ import annotations

from typing import Dict, Sequence

from torch import nn
from torch.overrides import TorchFunctionMode


class _WaitOnRead(TorchFunctionMode):
    def __init__(self, waits: "UpdateWaits"):
        super().__init__()
        self.waits = waits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = self.waits
        for a in args:
            if isinstance(a, nn.Parameter):
                w.before_read(a)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, nn.Parameter):
                        w.before_read(x)
        for a in kwargs.values():
            if isinstance(a, nn.Parameter):
                w.before_read(a)
        return func(*args, **kwargs)


class UpdateWaits:
    """Install on the root module with ``root_hooks()``; ``blocks`` are the BlockShards."""

    def __init__(self, blocks: Sequence, telemetry):
        self.blocks = list(blocks)
        self.telemetry = telemetry
        self._owner: Dict[int, object] = {id(s.param): b for b in self.blocks for s in b.layout.segments}
        self._mode = None

    def root_hooks(self, model: nn.Module) -> list:
        return [model.register_forward_pre_hook(self._enter),
                model.register_forward_hook(self._exit, always_call=True)]

    def _enter(self, module, args) -> None:
        if self._mode is not None:
            return                            # re-entrant call of the root module
        if not any(b.pending is not None or b.update_event is not None for b in self.blocks):
            return
        self._mode = _WaitOnRead(self)
        self._mode.__enter__()

    def _exit(self, module, args, output) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

    def before_read(self, p: nn.Parameter) -> None:
        b = self._owner.get(id(p))
        if b is not None and (b.pending is not None or b.update_event is not None):
            with self.telemetry.span("offload::wait_update"):
                b.wait_update()
