"""The CPU device's landing copies off the backward's thread (engine/landing_copier.py,
native/copier.c): the bytes, the hand-over rule, and training with every landing through
it against plain PyTorch."""
import time

import pytest
import torch

import offload
from offload import _native
from offload.engine import landing_copier as lc
from offload.engine.block_shard import BlockShard

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
