"""The default budgets of parameter offload, in one place (the engine's memory plan and the
planner's predictions use these functions; an explicit config value always wins).

* device budget: bytes of offloaded parameters on the device at once, prefetches in flight
  included; by default two of the largest blocks (one in use, the next arriving), or the
  largest set one module's forward needs at once when that is more.
* host lookahead: bytes of blocks staged from NVMe ahead of use; by default twice the budget.
* device lookahead: bytes of blocks copied to the device ahead of use; by default what the
  budget leaves beside the largest block.
"""
from __future__ import annotations

from typing import Optional


def device_budget(configured: Optional[int], largest_block_bytes: int, working_set_bytes: int = 0) -> int:
    if configured:
        return configured
    return max(2 * largest_block_bytes, working_set_bytes)


def host_lookahead(configured: Optional[int], budget: int) -> int:
    return configured if configured is not None else 2 * budget


def device_lookahead(configured: Optional[int], budget: int, largest_block_bytes: int) -> int:
    return configured if configured is not None else budget - largest_block_bytes
