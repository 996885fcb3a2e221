"""The engine's blocks as a checkpoint sees them (io/checkpoint.py ``Subject``).

``CheckpointView`` is made by the engine for one save, load or consolidation: the facts a
checkpoint records, and the only ways it changes the engine: a block's state overwritten
(``write_state``), its parameters written from the master (``write_params``, to their home
when offloaded, else the resident flat), every gradient window discarded (``reset_grads``)
and the step counters set (``set_counters``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Tuple

import torch

from offload.core.block import Block


class CheckpointView:
    def __init__(self, *, blocks: List[Block], control, comm, telemetry, module, optimizer, scaler, config,
                 rule: str, state_dtype: str, stage: int, weights, param_offload):
        self.blocks = blocks
        self._control = control               # StepControl: the counters
        self.comm, self.telemetry, self.module, self.optimizer = comm, telemetry, module, optimizer
        self.scaler, self.config, self.rule, self.state_dtype = scaler, config, rule, state_dtype
        self.stage, self.weights, self.param_offload = stage, weights, param_offload

    def counters(self) -> Tuple[int, int]:
        return self._control.global_step, self._control.micro_step

    def set_counters(self, global_step: int, micro_step: int) -> None:
        self._control.global_step, self._control.micro_step = global_step, micro_step

    def state_layout(self, i: int):
        return self.blocks[i].state.layout

    @contextlib.contextmanager
    def read_state(self, i: int):
        state = self.blocks[i].state
        buf = state.acquire()
        try:
            yield buf, state.views(buf)[0]
        finally:
            state.release()

    def write_state(self, i: int, fill: Callable[[torch.Tensor, torch.Tensor], None], stepped: int) -> None:
        b = self.blocks[i]
        b.state.overwrite(lambda buf: fill(buf, b.state.views(buf)[0]))
        b.state.finish_write()
        b.update.step = stepped

    def write_params(self, i: int, mine: torch.Tensor, full: Callable[[], torch.Tensor]) -> None:
        b = self.blocks[i]
        s0, s1 = b.shard
        n = b.layout.numel
        with torch.no_grad():
            if b.trainable is not None and b.trainable.home_numel == s1 - s0:   # the home holds the shard
                home = torch.zeros(b.trainable.home_numel, dtype=b.trainable.dtype)
                home[:mine.numel()].copy_(mine)
                b.trainable.write_home(home)
                return
            master = full()
            if b.trainable is not None:      # offloaded: the home copy, in the compute dtype
                home = torch.zeros(b.trainable.home_numel, dtype=b.trainable.dtype)
                home[:n].copy_(master)
                b.trainable.write_home(home)
            else:
                b.param_flat[:n].copy_(master)

    def reset_grads(self) -> None:
        for b in self.blocks:
            b.grads.reset_window()
