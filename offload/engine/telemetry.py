"""Telemetry: per-stage seconds, bytes per link, peaks, and a Chrome/Perfetto trace.

Every hot-path stage runs inside ``telemetry.span("offload::<stage>")``, which is both a
``torch.profiler.record_function`` range (visible in the PyTorch profiler) and a timed
interval recorded here. Spans from worker threads are recorded with their thread id, so the
trace shows the optimizer overlapping the forward/backward. Thread-safe.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time

import torch

_MAX_EVENTS = 200_000


class Telemetry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.seconds = collections.defaultdict(float)   # stage -> seconds, all threads summed
        self.bytes = collections.defaultdict(int)       # link -> bytes moved
        self.link_seconds = collections.defaultdict(float)
        self.peaks = collections.defaultdict(int)       # name -> peak bytes
        self.counters = collections.defaultdict(int)    # name -> count
        self._events = collections.deque(maxlen=_MAX_EVENTS)

    @contextlib.contextmanager
    def span(self, name: str, link: str | None = None, nbytes: int = 0):
        """Time a stage; with ``link``, also count ``nbytes`` moved over that link."""
        start = time.perf_counter()
        with torch.profiler.record_function(name):
            try:
                yield
            finally:
                end = time.perf_counter()
                stage = name.split("::", 1)[-1]
                with self._lock:
                    self.seconds[stage] += end - start
                    if link is not None:
                        self.bytes[link] += nbytes
                        self.link_seconds[link] += end - start
                    self._events.append((name, start, end, threading.get_ident(), nbytes))

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def peak(self, name: str, value: int) -> None:
        with self._lock:
            if value > self.peaks[name]:
                self.peaks[name] = value

    def snapshot(self) -> dict:
        with self._lock:
            rates = {k: (self.bytes[k] / s / 1e9 if s > 0 else 0.0) for k, s in self.link_seconds.items()}
            return {"seconds": dict(self.seconds), "bytes": dict(self.bytes), "gbps": rates,
                    "peaks": dict(self.peaks), "counters": dict(self.counters)}

    def chrome_trace(self, path: str) -> str:
        """Write the recorded spans as a Chrome trace (open in ui.perfetto.dev or chrome://tracing)."""
        with self._lock:
            events = list(self._events)
        tids = {}
        out = []
        for name, start, end, tid, nbytes in events:
            t = tids.setdefault(tid, len(tids))
            ev = {"name": name, "ph": "X", "pid": os.getpid(), "tid": t,
                  "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6}
            if nbytes:
                ev["args"] = {"bytes": nbytes}
            out.append(ev)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
        return path
