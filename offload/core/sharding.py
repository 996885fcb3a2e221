"""Pure shard / pad / offset arithmetic for ``world_size`` ranks.

A block's flat buffer is padded to a multiple of ``world_size * ALIGN_ELEMS`` elements, so
that it splits into ``world_size`` equal shards whose starts stay 4 KiB-aligned in fp32
(the unit of O_DIRECT I/O). Rank r owns elements ``[r * shard, (r + 1) * shard)``.
One rank is the case world_size=1, not a separate path.
"""
from __future__ import annotations

ALIGN_ELEMS = 1024  # 4 KiB of fp32


def padded_numel(numel: int, world_size: int = 1) -> int:
    unit = world_size * ALIGN_ELEMS
    return max(unit, -(-numel // unit) * unit)


def shard_numel(numel: int, world_size: int = 1) -> int:
    return padded_numel(numel, world_size) // world_size


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's shard within the padded flat buffer."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    n = shard_numel(numel, world_size)
    return rank * n, (rank + 1) * n


def clip_range(start: int, end: int, lo: int, hi: int) -> tuple[int, int] | None:
    """The intersection of [start, end) and [lo, hi), or None when empty."""
    s, e = max(start, lo), min(end, hi)
    return (s, e) if s < e else None
