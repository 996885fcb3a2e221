"""A small progress bar with no dependencies.

On a terminal it redraws one line in place (``\\r``) at most ``refresh`` times a second; when the
stream is not a TTY (a log file, CI) it prints a complete line every ``interval`` seconds and at
the end, so logs stay readable.

    bar = Progress(total=300)
    for step in range(300):
        bar.update(step + 1, loss=2.31, tok_s=6500.0, tiers={"device": 1 << 20, "nvme": 40 << 20})
    bar.close()
"""
from __future__ import annotations

import sys
import time
from typing import Mapping, Optional, TextIO


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5KiB' (binary units, 3 significant figures)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.3g}{unit}"
        n /= 1024
    return f"{n:.3g}TiB"


def fmt_seconds(s: float) -> str:
    s = max(0.0, s)
    m, sec = divmod(int(round(s)), 60)
    return f"{m}:{sec:02d}"


class Progress:
    def __init__(self, total: int, stream: Optional[TextIO] = None, width: int = 24,
                 interval: float = 10.0, refresh: float = 4.0, tty: Optional[bool] = None):
        self.total = max(int(total), 1)
        self.stream = stream if stream is not None else sys.stdout
        self.width = width
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = interval             # non-TTY: seconds between printed lines
        self.min_redraw = 1.0 / refresh      # TTY: seconds between redraws
        self.start = time.perf_counter()
        self._last = float("-inf")
        self._line = ""
        self._done = False

    def line(self, n: int, loss: Optional[float] = None, tok_s: Optional[float] = None,
             tiers: Optional[Mapping[str, int]] = None) -> str:
        """The status text for step ``n``."""
        frac = min(n / self.total, 1.0)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        filled = int(round(frac * self.width))
        parts = [f"[{'#' * filled}{'.' * (self.width - filled)}] {n}/{self.total}",
                 f"{fmt_seconds(elapsed)}<{fmt_seconds(eta)}"]
        if loss is not None:
            parts.append(f"loss {loss:.3f}")
        if tok_s is not None:
            parts.append(f"{tok_s:,.0f} tok/s")
        if tiers:
            parts.append(" ".join(f"{k} {fmt_bytes(v)}" for k, v in tiers.items() if v))
        return " | ".join(parts)

    def due(self, n: int) -> bool:
        """Whether ``update(n)`` would draw now (to skip computing its fields otherwise)."""
        wait = self.min_redraw if self.tty else self.interval
        return n >= self.total or time.perf_counter() - self._last >= wait

    def update(self, n: int, force: bool = False, **fields) -> None:
        if not (force or self.due(n)):
            return
        self._last = time.perf_counter()
        text = self.line(n, **fields)
        if self.tty:
            pad = max(len(self._line) - len(text), 0)
            self.stream.write("\r" + text + " " * pad)
        else:
            self.stream.write(text + "\n")
        self._line = text
        self.stream.flush()

    def write(self, message: str) -> None:
        """Print a message line without garbling the bar."""
        if self.tty and self._line:
            self.stream.write("\r" + " " * len(self._line) + "\r")
        self.stream.write(message + "\n")
        if self.tty and self._line:
            self.stream.write(self._line)
        self.stream.flush()

    def close(self) -> None:
        if not self._done and self.tty and self._line:
            self.stream.write("\n")
            self.stream.flush()
        self._done = True
