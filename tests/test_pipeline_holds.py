"""The optimizer pipeline's hold on the native pool: one per phase of jobs in flight, not one
per block (each ctypes call inside step() hands the GIL over to the worker running the
first blocks' updates)."""
import time

import pytest
import torch

import offload
from offload import _native


@pytest.mark.skipif(offload.native_info()["backend"] != "native", reason="the native library's pool")
def test_one_pool_hold_per_commit_released_when_the_last_job_ends(monkeypatch):
    calls = {"hold": 0, "release": 0}
    hold, release = _native.pool_hold, _native.pool_release

    def counted_hold(L, **kw):
        calls["hold"] += 1
        hold(L, **kw)

    def counted_release(L):
        calls["release"] += 1
        release(L)
    monkeypatch.setattr(_native, "pool_hold", counted_hold)
    monkeypatch.setattr(_native, "pool_release", counted_release)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])   # 6 blocks
    eng = offload.initialize(model, {"optimizer": {"lr": 1e-3}, "offload_optimizer": {"device": "cpu"}})
    try:
        x = torch.randn(4, 256)
        for _ in range(3):
            before = dict(calls)
            eng.backward(eng(x).square().mean())
            assert eng.step() is True
            eng.synchronize()
            # the last job's release runs in its future's callback, just after synchronize() wakes
            deadline = time.monotonic() + 10
            while calls["release"] - before["release"] < 2 and time.monotonic() < deadline:
                time.sleep(0.001)
            # the commit's loop (submitting) and the jobs in flight: two holds, not 1 + 6
            assert calls["hold"] - before["hold"] == 2, calls
            assert calls["release"] - before["release"] == 2, calls
    finally:
        eng.close()
    assert calls["hold"] == calls["release"]
