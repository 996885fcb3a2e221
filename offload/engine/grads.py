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
"""
from __future__ import annotations

from typing import List, Optional

import torch

from offload import device as dev


class GradBuffer:
    def __init__(self, tensor: Optional[torch.Tensor], num_segments: int, *, numel: int = 0,
                 dtype: torch.dtype = torch.float32, device=None):
        self.tensor = tensor                          # 1-D, padded numel (None while transient and empty)
        # transient (no tensor, no pool): allocated on ``device`` at the first landing and
        # freed by reset_window (ZeRO-2/3 landing buffers, live only until reduce-scattered)
        self._device = device
        self.num_segments = num_segments
        self._numel, self._dtype = (tensor.numel(), tensor.dtype) if tensor is not None else (numel, dtype)
        self._seen = [False] * num_segments           # landed in the current window
        self.arrived = 0                              # landings in the current backward
        self.events: List = []                        # CUDA copies still in flight
        self._staging: Optional[torch.Tensor] = None  # pinned, for accumulating CUDA landings

    # ---- one backward ------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.arrived = 0

    @property
    def complete(self) -> bool:
        return self.arrived == self.num_segments

    def land(self, index: int, offset: int, grad: torch.Tensor, stream) -> None:
        """Add parameter ``index``'s gradient (any device, any float dtype) at ``offset``."""
        flat = grad.detach().reshape(-1)
        if self.tensor is None:
            self._allocate()
        dst = self.tensor[offset:offset + flat.numel()]
        if not self._seen[index]:
            if dst.device == flat.device:
                dst.copy_(flat)
            else:
                ev = dev.copy_to_host_async(dst, flat, stream)
                if ev is not None:
                    self.events.append(ev)
            self._seen[index] = True
        elif dst.device == flat.device:
            dst.add_(flat)
        else:
            # Accumulating a device gradient into host memory: bring it over, then add.
            if self._staging is None or self._staging.numel() < flat.numel():
                self._staging = dev.empty_host(self.tensor.numel(), flat.dtype, pin=True)
            tmp = self._staging[:flat.numel()]
            dev.sync_event(dev.copy_to_host_async(tmp, flat, stream))
            self.wait_landed()
            dst.add_(tmp)
        self.arrived += 1

    def _allocate(self) -> None:
        self.tensor = torch.zeros(self._numel, dtype=self._dtype, device=self._device)

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
        if self.tensor is None:     # every landing was whole-shard (land_whole) and none came
            return False
        for i, s in enumerate(segments):
            if not self._seen[i]:
                self.tensor[s.offset:s.offset + s.numel].zero_()
        return any_seen

    @property
    def any_landed(self) -> bool:
        return any(self._seen)

    def fill_missing(self, segments) -> None:
        """Make the buffer exist and zero every range that got no gradient (a rank must take
        part in a collective even when none of its parameters got a gradient)."""
        if self.tensor is None:
            self._allocate()
            self.tensor.zero_()
            self._seen = [True] * self.num_segments
        self.close_window(segments)
        self._seen = [True] * self.num_segments

    def land_whole(self, src: torch.Tensor) -> None:
        """Add a whole-buffer gradient (a reduce-scattered shard): the window's first
        landing overwrites, later ones add."""
        if self.tensor is None:
            self._allocate()
        if not any(self._seen):
            self.tensor.copy_(src)
        else:
            self.tensor.add_(src)
        self._seen = [True] * self.num_segments

    def reset_window(self) -> None:
        """After the optimizer consumed the buffer (or the window was discarded): the next
        landing overwrites; a transient buffer is freed."""
        self._seen = [False] * self.num_segments
        if self._device is not None:
            self.wait_landed()
            self.tensor = None                        # transient: freed
