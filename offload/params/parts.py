"""The parameter parts of one block that visit the device together.

A block's parameters may be several flat buffers: the trainable part (compute dtype, updated
by the optimizer, ``BlockShard.params``) and one frozen part per storage dtype (a bf16 base
beside fp32 adapters). Each part is a ``BlockParams`` with its own home (host buffer or NVMe
extent) and its own device copy; ``BlockParts`` drives them through the same transitions at
once, so parameter offload and prefetch handle a block as one unit of device bytes.

The state of the whole is the least advanced state of its parts
(WRITING, HOME < STAGING < STAGED, STAGED_WRITING < FETCHING < ON_DEVICE); parts share one
home tier, so they move in lockstep except that NVMe reads finish at different times, and
only the trainable part is written back (asynchronously: WRITING and STAGED_WRITING are
its). A block whose trainable part
was rewritten by the optimizer is stale as a whole and is refetched whole (frozen parts
never change, but one release keeps one state per block).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from offload.params.residency import BlockParams, ParamState

_ORDER = {ParamState.WRITING: 0, ParamState.HOME: 0, ParamState.STAGING: 1, ParamState.STAGED: 2,
          ParamState.STAGED_WRITING: 2, ParamState.FETCHING: 3, ParamState.ON_DEVICE: 4}


class BlockParts:
    def __init__(self, index: int, name: str, module, trainable: Optional[BlockParams],
                 frozen: List[BlockParams]):
        self.index = index                 # the block index (frozen-only blocks come after the trained ones)
        self.name = name or "<root>"
        self.module = module
        self.trainable = trainable         # also BlockShard.params: the optimizer writes its home
        self.frozen = list(frozen)
        self.parts: List[BlockParams] = ([trainable] if trainable is not None else []) + self.frozen
        assert self.parts, "a block has at least one part"
        self.nbytes = sum(p.nbytes for p in self.parts)          # device bytes when fetched
        self.users = 0                     # modules of this block running now (forward)

    # ---- the whole's view of its parts ----------------------------------------------------
    @property
    def state(self) -> ParamState:
        return min((p.state for p in self.parts), key=_ORDER.__getitem__)

    @property
    def on_nvme(self) -> bool:
        return self.parts[0].on_nvme

    @property
    def device_bytes(self) -> int:
        return sum(p.device_bytes for p in self.parts)

    @property
    def stale(self) -> bool:
        return any(p.stale for p in self.parts)

    @property
    def segments(self):
        """Every parameter of the block: (part, segment) pairs."""
        return [(p, s) for p in self.parts for s in p.layout.segments]

    def device_bufs(self) -> List[torch.Tensor]:
        return [p.device_buf for p in self.parts if p.device_buf is not None]

    def slot_free(self) -> bool:
        """Whether host staging buffers for every part are free now (NVMe home)."""
        loans = []
        try:
            for p in self.parts:
                loan = p.try_slot() if p.state is ParamState.HOME else None
                if p.state is ParamState.HOME and loan is None:
                    return False
                if loan is not None:
                    loans.append(loan)
            return True
        finally:
            for loan in loans:
                loan.release()

    # ---- transitions (all parts together) ----------------------------------------------------
    def stage(self) -> bool:
        """NVMe -> host staging buffers for every part still at home (the trainable part may
        be staged already, written through by its update); False (nothing staged) when a
        buffer is missing for any of them."""
        home = [p for p in self.parts if p.state is ParamState.HOME]
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
        (none on a CPU device: ``BlockParams.to_device``)."""
        return sum(p.to_device(h2d_stream) for p in self.parts
                   if p.state in (ParamState.HOME, ParamState.STAGING, ParamState.STAGED, ParamState.STAGED_WRITING))

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
