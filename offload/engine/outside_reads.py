"""Forward reads of parameters outside the modules whose hooks wait for their update.

After a commit the next forward trails the optimizer: a forward pre-hook on each module that
owns (or shares) a block's parameters waits for that block's update. A parameter can also be
read where no such hook runs first: ``F.linear(x, self.embed.weight)`` in a parent's
forward, a child's bias added before the child runs. ``UpdateWaits`` covers those reads: it
joins the hook owner (core/hooks.py), whose torch-function mode, entered for a forward
that starts with updates in flight (``wants_reads``), reports every parameter that reaches a
torch function (``param_read``), and waits for its block's update first. Forwards that start
with no update in flight run without the mode. (With parameter offload the parameter side
does this: every use materializes the block, which waits for its update.)
"""
from __future__ import annotations

from typing import Dict, Sequence

from torch import nn


class UpdateWaits:
    """A participant of the hook owner (core/hooks.py); ``blocks`` are the trained ``Block``s (core/block.py)."""

    def __init__(self, blocks: Sequence, telemetry):
        self.blocks = list(blocks)
        self.telemetry = telemetry
        self._owner: Dict[int, object] = {id(s.param): b for b in self.blocks for s in b.layout.segments}

    def wants_reads(self) -> bool:
        """Watch this forward's parameter reads only while an update is in flight."""
        return any(b.update.future is not None or b.update.event is not None for b in self.blocks)

    def param_read(self, p: nn.Parameter) -> None:
        b = self._owner.get(id(p))
        if b is not None:
            b.wait_update_before_use(self.telemetry)
