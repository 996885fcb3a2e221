"""The NVMe keys saved tensors are written to: reused by size, reserved in batches.

The free list of the saved tensors' loans (storage/loan.py: a loan bound to a key at its
write): a key holds one saved tensor's copy (or a direct write's head page) from its write
until the loan retires; then it goes back to the free list of its size (a multiple of 4096
bytes). A size with no free key reserves as many new keys again as it has so far:
the sizes of one step's saved tensors repeat layer after layer, so a few reservations (one
swap file each) serve every later step.
"""
from __future__ import annotations

import collections
import threading
from typing import Dict, List

from offload.units import PAGE


class SwapKeys:
    def __init__(self, tier):
        self.tier = tier                    # the NvmeTier the keys are reserved in
        self._lock = threading.Lock()
        self._free: Dict[int, List[str]] = collections.defaultdict(list)
        self._reserved = collections.Counter()   # key size -> keys reserved

    @staticmethod
    def size_of(nbytes: int) -> int:
        """The size of the key that holds ``nbytes``."""
        return -(-max(nbytes, 1) // PAGE) * PAGE

    def take(self, nbytes: int) -> str:
        """A free key for ``nbytes``; none free: reserve as many again as this size has."""
        size = self.size_of(nbytes)
        with self._lock:
            free = self._free[size]
            if free:
                return free.pop()
            n = max(1, self._reserved[size])
            base = sum(self._reserved.values())
            names = [f"a{base + j}" for j in range(n)]
            self._reserved[size] += n
        self.tier.reserve({k: size for k in names})
        with self._lock:
            self._free[size].extend(names[1:])
        return names[0]

    def give(self, key: str, nbytes: int) -> None:
        """``key`` (taken for ``nbytes``) is free again: no transfer uses it."""
        with self._lock:
            self._free[self.size_of(nbytes)].append(key)
