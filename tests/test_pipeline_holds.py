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
@pytest.mark.parametrize("torch_threads", [2, 4])
def test_one_pool_hold_per_commit_released_when_the_last_job_ends(monkeypatch, torch_threads):
    """One hold per commit. It is a handoff (quieting torch's team once, before the first job
    leaves the main thread) unless the cores are split and torch's team is left the main
    thread alone (2 threads): a plain hold then, nothing quieted."""
    calls = {"hold": 0, "release": 0, "quiet": 0}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
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
    quiets = 0 if eng.pipeline._split is not None and torch_threads == 2 else 1
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
            # the last job released the hold before its future was done: synchronize() returns
            # after it, with the registration over (native/threadpool.c: offload_pool_release)
            # one hold for the commit's loop and the jobs in flight together, not 1 + 6
            assert calls["hold"] - before["hold"] == 1, calls
            assert calls["release"] - before["release"] == 1, calls
            assert calls["quiet"] - before["quiet"] == quiets, calls  # before the first job leaves
    finally:
        eng.close()
        torch.set_num_threads(threads_before)
    assert calls["hold"] == calls["release"]


def two_thread_model():
    """torch's team set to 2 threads (the split then leaves it the main thread alone), a
    4-block model that has run once on it, and whether torch's OpenMP runtime can pause that
    team (omp_pause_resource_all): (model, x, native library, can_pause)."""
    torch.set_num_threads(2)
    L = _native.lib()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(4, 64)
    model(x)                              # torch's team has run: pausing it is possible now
    return model, x, L, _native.pool_pause_team(L)


@pytest.mark.skipif(offload.native_info()["backend"] != "native", reason="the native kernels' thread count")
@pytest.mark.parametrize("overlap", [True, False])
def test_cores_are_split_between_torch_and_the_updates_only_while_updates_run(monkeypatch, overlap):
    """While the updates of step() overlap the next forward on a CPU device, torch's team
    and the native kernels share the cores (optim/thread_split.py); before backward, and
    once every update has ended, both counts are the user's again, and a count the user
    changed in between stays the user's."""
    from offload.optim import get_num_threads as kernel_threads
    from offload.optim import pipeline as pl
    torch_before, kernels_before = torch.get_num_threads(), kernel_threads()
    model, x, L, can_pause = two_thread_model()
    gate = threading.Event()
    update = pl.StepPipeline._update

    def gated(self, block, args, at):
        if block.index > 0:              # block 0 runs inline, inside step(): never gated
            assert gate.wait(30), "the forward never opened the gate"
        return update(self, block, args, at)
    monkeypatch.setattr(pl.StepPipeline, "_update", gated)
    eng = offload.initialize(model, {"optimizer": {"lr": 1e-3}, "offload_optimizer": {"device": "cpu"},
                                     "overlap_step": overlap})
    seen = []
    armed = [False]                       # only the forward after step() opens the gate

    def in_block0(module, args):          # after the engine's own pre-hook (registered first)
        if armed[0]:
            seen.append((torch.get_num_threads(), kernel_threads()))
            gate.set()
    model[0].register_forward_pre_hook(in_block0)
    try:
        gate.set()                        # the first step's updates are not gated
        eng.backward(eng(x).square().mean())
        eng.step()
        eng.synchronize()
        for user_changes in (False, True):
            gate.clear()
            seen.clear()
            if not overlap:
                gate.set()                # step() waits for every update: nothing to gate
            eng.backward(eng(x).square().mean())
            paused = _native.pool_teams_paused(L)
            assert eng.step() is True
            armed[0] = True
            if overlap:                   # blocks 1-3 wait behind the gate: the split holds
                assert (torch.get_num_threads(), kernel_threads()) == (1, 1)
            # the split ends the idle spin of torch's team once per commit (thread_split.py)
            assert _native.pool_teams_paused(L) - paused == (1 if overlap and can_pause else 0)
            if user_changes:
                torch.set_num_threads(3)
            loss = eng(x).square().mean()
            want = (3 if user_changes else (1 if overlap else 2), 1 if overlap else kernels_before)
            assert seen[-1] == want, (seen, want)
            armed[0] = False
            eng.backward(loss)            # every core for backward, whatever is still in flight
            assert torch.get_num_threads() == (3 if user_changes else 2)
            eng.synchronize()
            deadline = time.monotonic() + 10   # the last job ends in its future's callback
            while kernel_threads() != kernels_before and time.monotonic() < deadline:
                time.sleep(0.001)
            assert kernel_threads() == kernels_before
            eng.step()
            eng.synchronize()
            torch.set_num_threads(2)
    finally:
        gate.set()
        eng.close()
        torch.set_num_threads(torch_before)
    assert kernel_threads() == kernels_before


@pytest.mark.skipif(offload.native_info()["backend"] != "native", reason="the native kernels' thread count")
def test_the_split_begins_inside_the_inline_update_before_its_write_back(monkeypatch):
    """With torch's team left the main thread alone (2 threads), the split begins inside
    step()'s inline update of the first block, once its kernels are done and before its
    write-back is submitted: pausing torch's team waits for its idle workers to exit, at once
    while they still spin after the kernels' region, for a core once a write-back to NVMe has
    woken the I/O threads (optim/pipeline.py: _split_after_inline_kernels)."""
    from offload.params.writeback import ParamWriteBack
    torch_before = torch.get_num_threads()
    model, x, L, can_pause = two_thread_model()
    commit, at_commit = ParamWriteBack.commit, []

    def recorded(self, block, *a, **kw):
        at_commit.append((block.index, threading.get_ident(), torch.get_num_threads(), _native.pool_teams_paused(L)))
        return commit(self, block, *a, **kw)
    monkeypatch.setattr(ParamWriteBack, "commit", recorded)
    eng = offload.initialize(model, {"optimizer": {"lr": 1e-3}, "offload_optimizer": {"device": "cpu"},
                                     "overlap_step": True})
    try:
        for _ in range(3):
            eng.backward(eng(x).square().mean())
            paused = _native.pool_teams_paused(L)
            at_commit.clear()
            assert eng.step() is True
            eng.synchronize()
            block, thread, torch_threads, paused_then = at_commit[0]
            assert (block, thread) == (0, threading.get_ident()), at_commit   # the inline update
            assert torch_threads == 1, at_commit                              # the split had begun
            assert paused_then - paused == (1 if can_pause else 0), at_commit  # and paused torch's team
            assert _native.pool_teams_paused(L) - paused == (1 if can_pause else 0)   # once a commit
    finally:
        eng.close()
        torch.set_num_threads(torch_before)
