"""The progress bar of ``offload train`` and ``offload finetune``: a ``tqdm`` bar whose
postfix shows the loss, tokens/s and bytes per tier.

On a terminal tqdm redraws one line in place; when the stream is not a TTY (a log file, CI)
each refresh becomes one complete line, at most every ``interval`` seconds and at the end, so
logs stay readable.

    bar = Progress(total=300)
    for step in range(300):
        bar.update(step + 1, loss=2.31, tok_s=6500.0, tiers={"device": 1 << 20, "nvme": 40 << 20})
    bar.close()
"""
from __future__ import annotations

import sys
import time
from typing import Mapping, Optional, TextIO

from tqdm import tqdm

from offload.units import fmt_bytes


def postfix(loss: Optional[float] = None, tok_s: Optional[float] = None,
            tiers: Optional[Mapping[str, int]] = None) -> str:
    """'loss 2.310 | 6,500 tok/s | device 1MiB nvme 40MiB' (tiers holding nothing left out)."""
    parts = []
    if loss is not None:
        parts.append(f"loss {loss:.3f}")
    if tok_s is not None:
        parts.append(f"{tok_s:,.0f} tok/s")
    if tiers:
        held = " ".join(f"{k} {fmt_bytes(v)}" for k, v in tiers.items() if v)
        if held:
            parts.append(held)
    return " | ".join(parts)


class _Lines:
    """A non-TTY stream for tqdm: each redraw (``\\r`` + text) becomes one line."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, s: str) -> None:
        text = s.replace("\r", "").rstrip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


class Progress:
    def __init__(self, total: int, stream: Optional[TextIO] = None, interval: float = 10.0,
                 refresh: float = 4.0, tty: Optional[bool] = None, desc: Optional[str] = None):
        stream = stream if stream is not None else sys.stdout
        self.tty = stream.isatty() if tty is None else tty
        self.min_wait = 1.0 / refresh if self.tty else interval
        self._last = float("-inf")
        self._bar = tqdm(total=max(int(total), 1), file=stream if self.tty else _Lines(stream), desc=desc,
                         mininterval=0, miniters=1, dynamic_ncols=self.tty, ncols=None if self.tty else 120,
                         ascii=not self.tty, unit="step", leave=True)
        self._done = False

    def due(self, n: int) -> bool:
        """Whether ``update(n)`` would draw now (to skip computing its fields otherwise)."""
        return n >= self._bar.total or time.perf_counter() - self._last >= self.min_wait

    def update(self, n: int, force: bool = False, **fields) -> None:
        """Move the bar to step ``n`` and show ``fields`` (loss, tok_s, tiers) when due."""
        if not (force or self.due(n)):
            return
        self._last = time.perf_counter()
        self._bar.set_postfix_str(postfix(**fields), refresh=False)
        self._bar.update(n - self._bar.n)

    def write(self, message: str) -> None:
        """Print a message line without garbling the bar."""
        self._bar.write(message)

    def close(self) -> None:
        if not self._done:
            self._bar.close()
        self._done = True
