"""Which blocks' new parameters stay staged in host memory after their write-back.

Made once per engine and shared: parameter offload plans it before a commit queues the
updates (params/participant.py ``plan_write_through`` calls ``plan``), and the parameter
write-back reads it on the optimizer workers (params/write_back.py ``ParamWriteBack``), so
neither holds the other.
"""
from __future__ import annotations

from typing import Optional, Sequence


class WriteThrough:
    """``keep``: indices of the blocks whose write-back keeps the new home copy staged this
    commit; set by the main thread before the updates are queued, read by the workers."""

    def __init__(self) -> None:
        self.keep: frozenset = frozenset()

    def keeps_staged(self, index: int) -> bool:
        """Whether block ``index``'s write-back keeps the new home copy staged."""
        return index in self.keep

    def plan(self, order: Optional[Sequence], limit: int) -> None:
        """The blocks whose new parameters stay staged in host memory after their write-back,
        so the next forward reads them without an NVMe read: those the next forward uses
        first (``order``, blocks: ``Prefetcher.next_order``, at the first commit the order
        this step recorded; None when prefetch is off, the order unknown or across ranks),
        within ``limit`` bytes (the device budget plus the host lookahead: what the staging
        pool holds beside its spare slot, the blocks the forward would have on the device and
        staged ahead), NVMe homes only. A block kept finds its staging buffer at its update or
        is written through a write buffer instead; a kept block not yet used is evicted like
        any staged block when another needs its buffer."""
        keep = set()
        seen = 0
        for b in order or ():
            if b.index in keep:
                continue
            seen += b.nbytes
            if seen > limit:
                break
            if b.on_nvme:
                keep.add(b.index)
        self.keep = frozenset(keep)
