"""Which blocks' new parameters stay staged in host memory after their write-back.

Made once per engine and shared: parameter offload decides it before a commit queues the
updates (params/offload.py ``plan_write_through``: the blocks the next forward uses first,
within the device budget and the host lookahead), and the parameter write-back reads it on
the optimizer workers (params/write_back.py ``ParamWriteBack``), so neither holds the other.
"""
from __future__ import annotations


class WriteThrough:
    """``keep``: indices of the blocks whose write-back keeps the new home copy staged this
    commit; set by the main thread before the updates are queued, read by the workers."""

    def __init__(self) -> None:
        self.keep: frozenset = frozenset()

    def keeps_staged(self, index: int) -> bool:
        """Whether block ``index``'s write-back keeps the new home copy staged."""
        return index in self.keep
