"""Telemetry: per-stage seconds, bytes per link, peaks, and a Chrome/Perfetto trace.

Every hot-path stage runs inside ``telemetry.span("offload::<stage>")``, a timed interval
recorded here and, while a torch profiler records, a ``torch.profiler.record_function``
range of the same name (visible in the PyTorch profiler). Spans from worker threads are recorded with their thread id, so the
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

    def span(self, name: str, link: str | None = None, nbytes: int = 0) -> "_Span":
        """Time a stage; with ``link``, also count ``nbytes`` moved over that link (more with
        ``moved(n)`` on the span ``with`` returns, for a stage that learns what it copied as it
        runs). A link is counted only for bytes that were moved: a stage that copied nothing
        adds no bytes and no link time. The stage is a ``torch.profiler.record_function``
        range while a profiler records (entering one is not free, and a step opens many spans:
        not paid when nothing records)."""
        return _Span(self, name, link, nbytes)

    def _record(self, name: str, start: float, end: float, link: str | None, nbytes: int) -> None:
        stage = _STAGES.get(name)
        if stage is None:
            stage = _STAGES.setdefault(name, name.split("::", 1)[-1])
        with self._lock:
            self.seconds[stage] += end - start
            if link is not None and nbytes:
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


_STAGES: dict = {}      # span name -> stage ("offload::cpu_adam" -> "cpu_adam")


def profiling() -> bool:
    """Whether a torch profiler records now, on any thread: torch's own fast check (a
    module flag set while any profiler runs, ``profile_all_threads`` included, which
    ``torch.autograd._profiler_enabled()`` does not see); where a torch version lacks it,
    always (the ranges are then entered unconditionally, as before)."""
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True) or torch.autograd._profiler_enabled()


def profiler_range(name: str):
    """``torch.profiler.record_function(name)`` while a profiler records, else nothing (a
    range outside the spans, e.g. torch's own optimizer step range, on the same terms)."""
    return torch.profiler.record_function(name) if profiling() else contextlib.nullcontext()


class _Span:
    """One timed stage (``Telemetry.span``): a plain context manager, not a generator (this
    runs per block and per gradient on the hot path)."""
    __slots__ = ("_tel", "_name", "_link", "_nbytes", "_start", "_range")

    def __init__(self, tel: Telemetry, name: str, link: str | None, nbytes: int):
        self._tel, self._name, self._link, self._nbytes = tel, name, link, nbytes
        self._range = None

    def __enter__(self) -> "_Span":
        self._start = time.perf_counter()
        if profiling():
            self._range = torch.profiler.record_function(self._name)
            self._range.__enter__()
        return self

    def moved(self, nbytes: int) -> None:
        """``nbytes`` more were moved over the span's link."""
        self._nbytes += nbytes

    def __exit__(self, *exc) -> None:
        end = time.perf_counter()
        try:
            self._tel._record(self._name, self._start, end, self._link, self._nbytes)
        finally:
            if self._range is not None:
                self._range.__exit__(*exc)
