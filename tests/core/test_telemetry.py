"""Telemetry spans: timed always, a torch profiler range only while a profiler records (on
any thread, ``profile_all_threads`` included)."""
import threading

import torch
from torch.profiler import ProfilerActivity, profile

from offload.core.telemetry import Telemetry


def test_span_times_without_a_profiler_and_enters_no_range(ranges_entered):
    entered = ranges_entered
    tel = Telemetry()
    with tel.span("offload::state_read", "adam", 128):
        pass
    try:
        with tel.span("offload::cpu_adam"):
            raise KeyError("inside")
    except KeyError:
        pass                                   # a failing stage is timed and re-raised
    snap = tel.snapshot()
    assert set(snap["seconds"]) == {"state_read", "cpu_adam"} and snap["bytes"] == {"adam": 128}
    assert [e[0] for e in tel._events] == ["offload::state_read", "offload::cpu_adam"]
    assert entered == []                       # no profiler: no range entered (~7 us each)


def test_a_link_counts_only_bytes_moved_over_it():
    tel = Telemetry()
    with tel.span("offload::param_fetch", "h2d"):       # a CPU device's fetch: nothing copied
        pass
    with tel.span("offload::prefetch_h2d", "h2d", 64) as span:
        span.moved(32)                                  # learned while the stage ran
    with tel.span("offload::grad_d2h", "h2h", 16):
        pass
    snap = tel.snapshot()
    assert snap["bytes"] == {"h2d": 96, "h2h": 16}
    assert set(snap["gbps"]) == {"h2d", "h2h"}
    assert set(snap["seconds"]) == {"param_fetch", "prefetch_h2d", "grad_d2h"}


def test_span_is_a_profiler_range_on_every_thread_while_one_records():
    tel = Telemetry()

    def worker():
        with tel.span("offload::cpu_adam"):
            torch.ones(4).sum()
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        with tel.span("offload::backward"):
            torch.ones(4).sum()
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    names = {e.name for e in prof.events()}
    assert {"offload::backward", "offload::cpu_adam"} <= names, names
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with tel.span("offload::forward"):
            torch.ones(4).sum()
    assert "offload::forward" in {e.name for e in prof.events()}
    assert tel.snapshot()["seconds"]["cpu_adam"] > 0
