"""Tiers: where a block's bytes live between uses, behind one interface. Each tier lends a
key's bytes as a ``Loan`` (storage/loan.py, the one loaned-buffer state machine); the host
pools the NVMe tier lends buffers from are in storage/pool.py.

A tier holds keyed byte ranges:

* ``DeviceTier``: a tensor on the compute device, always resident;
* ``HostTier``: a persistent host-pool buffer, always resident;
* ``NvmeTier``: a swap-file extent; the bytes visit a buffer lent by a host pool only
  around their use.

``tier.reserve({key: nbytes, ...})`` makes room for keys (NVMe: one preallocated file for
the lot), ``tier.loan(key, nbytes, what)`` returns a key's ``Loan``, whose verbs and diagram
are in storage/loan.py.
"""
from __future__ import annotations

import collections
from typing import Optional

import torch

from offload.placement import Placement
from offload.storage.loan import DEFAULT_WAIT_S, Loan, _wait


class NvmeTier:
    """Keys in an ``NvmeStore``; buffers lent by ``pool`` (a HostPool) around their use.
    ``store`` None: loans only hold lent buffers (READY until released or retired), never
    written: an owner whose bytes stay on the host uses the same verbs."""

    kind = Placement.NVME

    def __init__(self, store, pool, *, wait_timeout_s: float = DEFAULT_WAIT_S):
        self.store, self.pool, self.wait_timeout_s = store, pool, wait_timeout_s
        self._retired = collections.deque()   # loans retire()d: appends are atomic (finalizers)
        self._draining: list = []             # ... settled once their I/O is done

    def reserve(self, sizes) -> None:
        self.store.reserve(dict(sizes))

    def loan(self, key: Optional[str], nbytes: int, what: str = "", keys=None) -> "Loan":
        """``key`` None: bound at the first commit from the free list ``keys`` (module doc)."""
        return Loan(self, key, nbytes, what or key, keys)

    def settle_retired(self) -> None:
        """On the owner's thread, never waits: every retired loan with no I/O in flight gives
        its buffer back (and its key to its free list); the others wait for a later call."""
        while self._retired:
            self._draining.append(self._retired.popleft())
        self._draining = [loan for loan in self._draining if not loan._settle_retired()]

    def put(self, key: str, src: torch.Tensor, what: str = "", write_pool=None,
            timeout: Optional[float] = None) -> None:
        """Write the whole key from ``src`` (1-D, host) and wait until it is durable. A source
        that is not 4 KiB-aligned goes through a buffer of ``write_pool`` (O_DIRECT stays)."""
        what = what or key
        timeout = self.wait_timeout_s if timeout is None else timeout
        nbytes = src.numel() * src.element_size()
        if src.data_ptr() % 4096 and write_pool is not None:
            with write_pool.acquire(nbytes, timeout=timeout) as loan:
                buf = loan.view(src.dtype, src.numel())
                buf.copy_(src)
                _wait(self.store.write(key, buf), "write", what, timeout)
            return
        _wait(self.store.write(key, src), "write", what, timeout)


class HostTier:
    """Keys in persistent buffers of a HostPool: always resident."""

    kind = Placement.HOST

    def __init__(self, pool, *, wait_timeout_s: float = DEFAULT_WAIT_S):
        self.pool, self.wait_timeout_s = pool, wait_timeout_s

    def reserve(self, sizes) -> None:
        """The pool was sized for its keys when it was built: nothing to do."""

    def loan(self, key: str, nbytes: int, what: str = "") -> "Loan":
        buf = self.pool.acquire(nbytes).view(torch.uint8, nbytes)
        return Loan.resident(buf, key, what or key, self)


class DeviceTier:
    """Keys in tensors on the compute device: always resident."""

    kind = Placement.DEVICE

    def __init__(self, device: torch.device, *, wait_timeout_s: float = DEFAULT_WAIT_S):
        self.device, self.wait_timeout_s = device, wait_timeout_s

    def reserve(self, sizes) -> None:
        """Device memory is allocated per loan."""

    def loan(self, key: str, nbytes: int, what: str = "") -> "Loan":
        return Loan.resident(torch.zeros(nbytes, dtype=torch.uint8, device=self.device), key, what or key, self)
