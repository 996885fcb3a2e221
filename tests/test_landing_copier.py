"""The CPU device's landing copies (engine/landing_copier.py, native/copier.c): off the
backward's thread and inline with streaming stores; the bytes, the hand-over rule, and
training with every landing through each against plain PyTorch."""
import threading
import time

import pytest
import torch

import offload
from offload import _native
from offload.engine import landing_copier as lc
from offload.core.block_shard import BlockShard

from test_step import batches, cfg, check, make_model, train

native = pytest.mark.skipif(offload.native_info()["backend"] != "native", reason="the native copy engine")


@native
def test_copies_are_exact():
    handle, idle = _native.copier_create()
    try:
        for nbytes in (1, 4096, (256 << 10) + 8, (3 << 20) + 4):   # pieces of 256 KiB, and a partial one
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            dst = torch.zeros(nbytes, dtype=torch.uint8)
            job = _native.CopyJob(dst=dst.data_ptr(), src=src.data_ptr(), nbytes=nbytes)
            _native.copier_submit(handle, job)
            _native.copy_wait(handle, job)
            assert torch.equal(dst, src)
            assert job.finished == job.npieces == -(-nbytes // (256 << 10))
    finally:
        _native.copier_destroy(handle)


@pytest.fixture
def two_threads():
    """torch's team and the kernels' pool both 2 threads (the streaming copy runs on the team)."""
    from offload.optim import get_num_threads, set_num_threads
    before = torch.get_num_threads(), get_num_threads()
    torch.set_num_threads(2)
    set_num_threads(2)
    yield
    torch.set_num_threads(before[0])
    set_num_threads(before[1])


def on_team() -> bool:
    return offload.native_info()["pool"] != "pthread"


@native
@pytest.mark.parametrize("thread", ["main", "worker"])
def test_streamed_copies_are_exact_at_any_alignment_and_only_on_torchs_team(thread, two_threads):
    """On the main thread the copy runs on torch's team; on any other thread a copy of more
    than one piece copies nothing and says so (the caller copies: no registration with
    OpenMP per landing); one piece runs on the calling thread."""
    L = _native.lib()
    cases = [(nbytes, d_off, s_off) for nbytes in (1, 63, 4096, (256 << 10) + 8, (3 << 20) + 5)
             for d_off, s_off in ((0, 0), (1, 0), (4, 12), (15, 3))]
    got = []
    made = _native.pool_registrations(L)

    def run():
        for nbytes, d_off, s_off in cases:
            src = torch.randint(0, 256, (nbytes + s_off,), dtype=torch.uint8)
            dst = torch.zeros(nbytes + d_off + 64, dtype=torch.uint8)
            done = _native.copy_now(L, dst.data_ptr() + d_off, src.data_ptr() + s_off, nbytes)
            want = src[s_off:] if done else torch.zeros(nbytes, dtype=torch.uint8)
            got.append((done, torch.equal(dst[d_off:d_off + nbytes], want)
                        and not dst[:d_off].any() and not dst[d_off + nbytes:].any()))   # nothing outside
    if thread == "main":
        run()
    else:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    # one piece (256 KiB or less) runs on the calling thread; more go to the team, on the main thread
    expect = [(n <= (256 << 10) or (thread == "main" and on_team()), True) for n, _, _ in cases]
    assert got == expect
    assert _native.pool_registrations(L) == made
    with pytest.raises(OSError):
        _native.copy_now(L, 0, 0, 16)


@native
def test_landings_leave_the_thread_only_after_a_backward_that_left_the_cores_idle():
    copier = lc.LandingCopier()
    try:
        src, dst = torch.randn(1 << 20), torch.empty(1 << 20)
        assert copier.copy(dst, src) is None                 # nothing measured yet: inline
        copier.backward_begins()
        t = time.thread_time()
        while time.thread_time() - t < 0.05:                 # a backward on the CPU throughout
            pass
        copier.measure()
        assert not copier.use and copier.copy(dst, src) is None
        copier.backward_begins()
        time.sleep(0.05)                                     # one waiting for its device
        copier.measure()
        assert copier.use
        ev = copier.copy(dst, src)
        assert ev is not None, "the copier's worker did not start under SCHED_IDLE"
        assert copier.copy(dst[:10], src[:10]) is None                      # below MIN_BYTES: inline
        ev.synchronize()
        assert torch.equal(dst, src)
    finally:
        copier.close()


@native
def test_inline_landings_the_worker_could_take_are_left_out_of_the_backward_share():
    """A backward whose thread was busy only with landings made inline (the copier not in
    use yet) left the cores idle: the next backward's landings go to the worker. Copies the
    worker would not take (below MIN_BYTES) still count as the backward's own work."""
    copier = lc.LandingCopier()
    try:
        src, dst = torch.randn(1 << 20), torch.empty(1 << 20)
        for small, handed_over in ((True, False), (False, True)):
            copier.use = False
            copier.backward_begins()
            t = time.thread_time()
            while time.thread_time() - t < 0.06:
                assert (copier.land(dst[:10], src[:10]) if small else copier.land(dst, src)) is None
            time.sleep(0.04)                                 # then a wait for its device
            copier.measure()
            assert copier.use is handed_over, f"small={small}"
        ev = copier.land(dst, src)
        assert ev is not None, "the copier's worker did not start under SCHED_IDLE"
        ev.synchronize()
        assert torch.equal(dst, src)
    finally:
        copier.close()


@native
@pytest.mark.parametrize("opt,prm,backwards", [("cpu", "none", 1), ("cpu", "nvme", 2), ("none", "cpu", 1)])
def test_training_with_every_landing_off_the_thread_matches_torch(opt, prm, backwards, tmp_path, monkeypatch):
    """Every first landing of a window through the copier (forced for gradients of any size;
    with two backwards a step, the second adds to it): the update never reads a buffer
    with a copy in flight, and the weights follow torch's."""
    monkeypatch.setattr(lc, "MIN_BYTES", 0)
    monkeypatch.setattr(lc.LandingCopier, "measure", lambda self: setattr(self, "use", True))
    grad_shard, reads = BlockShard.grad_shard, []

    def checked(block):                   # the update reads no buffer with a copy in flight
        reads.append(all(ev._job is None for ev in block.grad.events if isinstance(ev, lc.LandingEvent)))
        return grad_shard(block)
    monkeypatch.setattr(BlockShard, "grad_shard", checked)
    eng = offload.initialize(make_model(), cfg(opt, prm, 0.0, tmp_path))
    eng._landing.use = True
    losses = train(eng, batches(6), backwards=backwards)
    assert eng._landing.copies >= 3 * len(eng.blocks)
    assert reads and all(reads)
    check(torch.stack(losses), eng.full_state_dict(), 0.0, 6 // backwards, backwards=backwards)
    eng.close()


@native
def test_training_with_every_inline_landing_streamed_matches_torch(tmp_path, monkeypatch, two_threads):
    """Landings done inline (the copier not in use) go through the native streaming copy
    (forced for gradients of any size here), and the weights follow torch's."""
    monkeypatch.setattr(lc, "MIN_BYTES", 0)
    monkeypatch.setattr(lc.LandingCopier, "measure", lambda self: setattr(self, "use", False))
    streamed, copy_now = [], _native.copy_now

    def counted(L, dst, src, nbytes):
        done = copy_now(L, dst, src, nbytes)
        streamed.append(done)
        return done
    monkeypatch.setattr(_native, "copy_now", counted)
    eng = offload.initialize(make_model(), cfg("cpu", "none", 0.0, tmp_path))
    losses = train(eng, batches(6), backwards=2)
    assert eng._landing.copies == 0
    assert len(streamed) >= 3 * len(eng.blocks)
    assert all(streamed), streamed       # this model's gradients: one piece each, any thread
    check(torch.stack(losses), eng.full_state_dict(), 0.0, 3, backwards=2)
    eng.close()
