"""The optimizer pipeline's hold on the native pool: one per commit (its submission loop and
every job in flight), not one per block (each ctypes call inside step() hands the GIL over
to the worker running the first blocks' updates); on a CPU device with one rank the first
block's update runs inside step(), on the main thread."""
import threading
import time

import pytest
import torch

import offload
from offload import _native


@pytest.mark.skipif(offload.native_info()["backend"] != "native", reason="the native library's pool")
def test_one_pool_hold_per_commit_released_when_the_last_job_ends(monkeypatch):
    calls = {"hold": 0, "release": 0, "quiet": 0}
    hold, begin, quiet, release = (_native.pool_hold, _native.pool_hold_begin_handoff, _native.pool_handoff_quiet,
                                   _native.pool_release)

    def counted(name, fn):
        def call(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return call
    monkeypatch.setattr(_native, "pool_hold", counted("hold", hold))
    monkeypatch.setattr(_native, "pool_hold_begin_handoff", counted("hold", begin))
    monkeypatch.setattr(_native, "pool_handoff_quiet", counted("quiet", quiet))
    monkeypatch.setattr(_native, "pool_release", counted("release", release))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])   # 6 blocks
    eng = offload.initialize(model, {"optimizer": {"lr": 1e-3}, "offload_optimizer": {"device": "cpu"}})
    main = threading.get_ident()
    try:
        x = torch.randn(4, 256)
        for _ in range(3):
            before = dict(calls)
            eng.backward(eng(x).square().mean())
            t0 = time.perf_counter()
            assert eng.step() is True
            first = eng.blocks[0].pending
            if eng.device.type == "cpu":     # the first block's update ran inside step()
                assert first is not None and first.done() and first.exception() is None
                ran = [(tid, a) for name, a, b, tid, _ in eng.telemetry._events if name == "offload::cpu_adam" and a >= t0]
                assert ran and min(ran, key=lambda e: e[1])[0] == main, ran
            eng.synchronize()
            # the last job's release runs in its future's callback, just after synchronize() wakes
            deadline = time.monotonic() + 10
            while calls["release"] - before["release"] < 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            # one hold for the commit's loop and the jobs in flight together, not 1 + 6
            assert calls["hold"] - before["hold"] == 1, calls
            assert calls["release"] - before["release"] == 1, calls
            assert calls["quiet"] - before["quiet"] == 1, calls      # before the first job leaves
    finally:
        eng.close()
    assert calls["hold"] == calls["release"]
