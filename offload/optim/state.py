"""The owner of one block shard's optimizer state, and its residency transitions.

The state is one flat uint8 buffer laid out by the update rule's ``StateLayout``
(optim/state_layout.py): ``[master fp32 | the rule's rows at state_dtype | int8 scales]``,
every region 4 KiB-aligned (O_DIRECT), e.g. AdamW fp32 ``[master | exp_avg | exp_avg_sq]``,
AdamW int8 ``[master | exp_avg codes | exp_avg_sq codes | their absmax scales]``, SGD with
momentum ``[master | momentum_buffer]``. The same bytes on every tier. Its home tier is fixed
at construction:

* ``DEVICE``: a tensor on the compute device (``offload_optimizer.device = none``);
* ``HOST``: a persistent host-pool buffer (``cpu``);
* ``NVME``: a swap-file extent; the bytes visit a host-pool buffer only around the step.

Residency is the key's ``offload.storage.tier.Loan`` (the one loaned-buffer state machine,
shared with the parameter homes)::

    ON_TIER --fetch()--> READING --acquire()--> READY --commit()--> WRITING --reclaim()--> ON_TIER
                                                  \\--drop()-----------------------------> ON_TIER

``drop()`` returns an unmodified buffer without writing it. A pool buffer on loan may be
reused by another block only after ``reclaim()`` (the write has completed) or ``drop()``.
HOST and DEVICE states are always RESIDENT and every transition is a no-op. Every wait is
bounded; a failed read or write gives its buffer back before its error (naming the block,
the operation, the file and the errno) is raised.
"""
from __future__ import annotations

from typing import Optional

import torch

from offload.optim.state_layout import StateLayout
from offload.storage.tier import Loan, LoanState, NvmeTier, TierKind

Tier = TierKind             # where the state lives
Residency = LoanState       # where it is now


class OptimState:
    """The fp32 master and the rule's state rows of one block shard (``layout``)."""

    def __init__(self, key: str, layout: StateLayout, tier: Tier, *, tensor: Optional[torch.Tensor] = None,
                 pool=None, store=None, what: str = "", wait_timeout_s: Optional[float] = None):
        self.key = key
        self.layout = layout
        self.numel = layout.numel
        self.nbytes = layout.nbytes
        self.tier = tier
        self.what = f"optimizer state of {what or key}"
        if tier is Tier.NVME:
            assert tensor is None and pool is not None and store is not None
            kw = {} if wait_timeout_s is None else {"wait_timeout_s": wait_timeout_s}
            self._loan = NvmeTier(store, pool, **kw).loan(key, self.nbytes, self.what)
        else:
            assert tensor is not None and tensor.dtype == torch.uint8 and tensor.numel() == self.nbytes
            self._loan = Loan.resident(tensor, key, self.what)

    def _bytes(self, data: torch.Tensor) -> torch.Tensor:
        return data.view(torch.uint8).view(-1)[:self.nbytes]

    def views(self, buf: torch.Tensor) -> tuple:
        """(master fp32 [numel], {row name: tensor}) as views of an acquired buffer."""
        return self.layout.views(buf)

    @property
    def residency(self) -> Residency:
        return self._loan.state

    @property
    def in_memory(self) -> bool:
        return self._loan.in_memory

    # ---- transitions ------------------------------------------------------------------------
    def fetch(self) -> bool:
        """Start reading from NVMe (ON_TIER -> READING) into a free pool buffer.
        Returns False, with nothing started, when no pool buffer is free."""
        return self._loan.fetch()

    def acquire(self, timeout: Optional[float] = None) -> torch.Tensor:
        """The state's bytes (flat uint8, ``nbytes``; ``views()`` splits them), resident in
        memory (waits for a read in flight; from ON_TIER, first waits for a pool buffer)."""
        return self._bytes(self._loan.acquire(timeout))

    def overwrite(self, fill) -> None:
        """Replace the whole state: ``fill(buf)`` writes every byte (no read from NVMe
        first); the NVME tier then writes it back (-> WRITING)."""
        buf = self._bytes(self._loan.fill())
        try:
            fill(buf)
        except BaseException:
            self._loan.release()
            raise
        self._loan.commit()

    def commit(self) -> None:
        """The state was modified: start writing it back (READY -> WRITING)."""
        self._loan.commit()

    def reclaim(self, block: bool = True, timeout: Optional[float] = None) -> bool:
        """WRITING -> ON_TIER once the write has completed; the pool buffer goes back (a
        failed write raises after that). With ``block=False`` returns False while the write
        is still in flight."""
        if self._loan.state is not Residency.WRITING:
            return True
        if not block:
            return self._loan.poll()
        self._loan.release(timeout)
        return True

    def drop(self, timeout: Optional[float] = None) -> None:
        """READY (or READING) -> ON_TIER without writing (the state was only read)."""
        if self._loan.state in (Residency.READING, Residency.READY):
            self._loan.release(timeout)

    def discard(self) -> None:
        """After a failure: back to ON_TIER whatever the state (a write in flight is waited
        for, its error swallowed: the caller is already raising one)."""
        try:
            self._loan.release()
        except BaseException:   # noqa: BLE001 - the first error is the one reported
            pass
