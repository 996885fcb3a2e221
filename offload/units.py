"""Units every layer shares, defined once: the I/O page and how a byte count is written.

``PAGE`` is the unit of O_DIRECT I/O and of every host buffer's alignment (pools, NVMe extents,
state regions, the native library's ``IO_PAGE``). It sits at the bottom of the package,
importing nothing from it, so that the native boundary, storage and the planner can all use it.
"""
from __future__ import annotations

from typing import Optional

PAGE = 4096


def round_up(n: int, to: int = PAGE) -> int:
    """``n`` rounded up to a multiple of ``to`` (by default the page)."""
    return -(-n // to) * to


def fmt_bytes(n: Optional[float]) -> str:
    """1536 -> '1.5KiB' (binary units, 3 significant figures); None -> '?'."""
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.3g}{unit}"
        n /= 1024
    return f"{n:.3g}TiB"


def fmt_exact(nbytes: int) -> str:
    """1536 -> '1536 bytes (1.5KiB)': the exact count for a config value, and its size."""
    return f"{nbytes} bytes ({fmt_bytes(nbytes)})"
