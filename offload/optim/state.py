"""The owner of one block shard's optimizer state, and its residency transitions.

The state is one flat fp32 buffer of three rows, ``[master | exp_avg | exp_avg_sq]``, each
row ``numel`` long (a 4 KiB multiple, so every row starts aligned for O_DIRECT). Its home
tier is fixed at construction:

* ``DEVICE``: a tensor on the compute device (``offload_optimizer.device = none``);
* ``HOST``: a persistent host-pool buffer (``cpu``);
* ``NVME``: a swap-file extent; the bytes visit a host-pool buffer only around the step.

NVMe transitions (guarded by assertions)::

    ON_NVME --fetch()--> READING --acquire()--> READY --commit()--> WRITING --reclaim()--> ON_NVME
                                                  \\--drop()-----------------------------> ON_NVME

``drop()`` returns an unmodified buffer without writing it. A pool buffer on loan may be
reused by another block only after ``reclaim()`` (the write has completed) or ``drop()``.
HOST and DEVICE states are always RESIDENT and every transition is a no-op.
"""
from __future__ import annotations

import enum
import threading
from typing import Optional

import torch


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"


class Residency(enum.Enum):
    RESIDENT = "resident"
    ON_NVME = "on_nvme"
    READING = "reading"
    READY = "ready"
    WRITING = "writing"


class OptimState:
    """fp32 master, exp_avg and exp_avg_sq of one block shard."""

    ROWS = 3

    def __init__(self, key: str, numel: int, tier: Tier, *, tensor: Optional[torch.Tensor] = None,
                 pool=None, store=None):
        self.key = key
        self.numel = numel
        self.nbytes = self.ROWS * numel * 4
        self.tier = tier
        self._pool = pool            # HostPool lending READING/READY/WRITING buffers (NVME tier)
        self._store = store          # NvmeStore holding the extent (NVME tier)
        self._lock = threading.Lock()
        self._loan = None            # HostBuffer on loan while not ON_NVME
        self._io = None              # IOHandle of the read or write in flight
        if tier is Tier.NVME:
            assert tensor is None and pool is not None and store is not None
            self._tensor = None
            self.residency = Residency.ON_NVME
        else:
            assert tensor is not None and tensor.numel() == self.ROWS * numel and tensor.dtype == torch.float32
            self._tensor = tensor.view(self.ROWS, numel)
            self.residency = Residency.RESIDENT

    # ---- transitions ------------------------------------------------------------------------
    def fetch(self) -> bool:
        """Start reading from NVMe (ON_NVME -> READING) into a free pool buffer.
        Returns False, with nothing started, when no pool buffer is free."""
        with self._lock:
            if self.residency is not Residency.ON_NVME:
                return True
            loan = self._pool.try_acquire(self.nbytes)
            if loan is None:
                return False
            self._start_read(loan)
            return True

    def acquire(self, timeout: Optional[float] = None) -> torch.Tensor:
        """The ``[3, numel]`` fp32 state, resident in memory (waits for a read in flight;
        from ON_NVME, first waits for a pool buffer)."""
        with self._lock:
            if self.residency is Residency.ON_NVME:
                self._start_read(self._pool.acquire(self.nbytes, timeout=timeout))
            if self.residency is Residency.READING:
                io, self._io = self._io, None
                try:
                    io.wait()
                except BaseException:
                    self._give_back()
                    raise
                self.residency = Residency.READY
            assert self.residency in (Residency.READY, Residency.RESIDENT), self.residency
            return self._tensor

    def overwrite(self, fill) -> None:
        """Replace the whole state: ``fill(tensor)`` writes every row (no read from NVMe
        first); the NVME tier then writes it back (-> WRITING)."""
        with self._lock:
            if self.residency is Residency.ON_NVME:
                loan = self._pool.acquire(self.nbytes)
                self._loan = loan
                self._tensor = loan.view(torch.float32, self.ROWS * self.numel).view(self.ROWS, self.numel)
                self.residency = Residency.READY
        tensor = self.acquire()
        fill(tensor)
        self.commit()

    def _start_read(self, loan) -> None:
        self._loan = loan
        self._tensor = loan.view(torch.float32, self.ROWS * self.numel).view(self.ROWS, self.numel)
        self._io = self._store.read(self.key, self._tensor.view(-1))
        self.residency = Residency.READING

    def commit(self) -> None:
        """The state was modified: start writing it back (READY -> WRITING)."""
        with self._lock:
            if self.residency is Residency.RESIDENT:
                return
            assert self.residency is Residency.READY, self.residency
            self._io = self._store.write(self.key, self._tensor.view(-1))
            self.residency = Residency.WRITING

    def reclaim(self, block: bool = True) -> bool:
        """WRITING -> ON_NVME once the write has completed; the pool buffer goes back.
        With ``block=False`` returns False while the write is still in flight."""
        with self._lock:
            if self.residency is not Residency.WRITING:
                return True
            if not block and not self._io.done():
                return False
            io, self._io = self._io, None
            try:
                io.wait()
            finally:
                self._give_back()
            return True

    def drop(self) -> None:
        """READY -> ON_NVME without writing (the state was only read)."""
        with self._lock:
            if self.residency is Residency.READING:
                self._io.wait()
                self._io = None
                self.residency = Residency.READY
            if self.residency is Residency.READY:
                self._give_back()

    def _give_back(self) -> None:
        self._tensor = None
        loan, self._loan = self._loan, None
        loan.release()
        self.residency = Residency.ON_NVME

    @property
    def in_memory(self) -> bool:
        return self.residency is not Residency.ON_NVME
