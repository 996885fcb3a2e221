"""The owner of one block shard's optimizer state, and its residency transitions.

The state is one flat fp32 buffer of three rows, ``[master | exp_avg | exp_avg_sq]``, each
row ``numel`` long (a 4 KiB multiple, so every row starts aligned for O_DIRECT). Its home
tier is fixed at construction:

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

from offload.storage.tier import Loan, LoanState, NvmeTier, TierKind

Tier = TierKind             # where the state lives
Residency = LoanState       # where it is now


class OptimState:
    """fp32 master, exp_avg and exp_avg_sq of one block shard."""

    ROWS = 3

    def __init__(self, key: str, numel: int, tier: Tier, *, tensor: Optional[torch.Tensor] = None,
                 pool=None, store=None, what: str = "", wait_timeout_s: Optional[float] = None):
        self.key = key
        self.numel = numel
        self.nbytes = self.ROWS * numel * 4
        self.tier = tier
        self.what = f"optimizer state of {what or key}"
        if tier is Tier.NVME:
            assert tensor is None and pool is not None and store is not None
            kw = {} if wait_timeout_s is None else {"wait_timeout_s": wait_timeout_s}
            self._loan = NvmeTier(store, pool, **kw).loan(key, self.nbytes, self.what)
        else:
            assert tensor is not None and tensor.numel() == self.ROWS * numel and tensor.dtype == torch.float32
            self._loan = Loan.resident(tensor, key, self.what)

    def _rows(self, data: torch.Tensor) -> torch.Tensor:
        return data.view(torch.float32).view(self.ROWS, self.numel)

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
        """The ``[3, numel]`` fp32 state, resident in memory (waits for a read in flight;
        from ON_TIER, first waits for a pool buffer)."""
        return self._rows(self._loan.acquire(timeout))

    def overwrite(self, fill) -> None:
        """Replace the whole state: ``fill(tensor)`` writes every row (no read from NVMe
        first); the NVME tier then writes it back (-> WRITING)."""
        tensor = self._rows(self._loan.fill())
        try:
            fill(tensor)
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
