"""Checkpoint saves: a full disk names the operation, path, block and errno; two saves to one
directory never delete each other's files, and the second fails naming the first's process.
The other processes are children forked by tests/_forked.py (tests/_checkpoint_worker.py)."""
import errno
import socket
import time

import pytest
import torch

import _checkpoint_worker as worker
import _forked
import offload
from offload.io.checkpoint import CheckpointError, CheckpointIOError
from _models import batches

trained = worker.trained


def test_full_disk_names_operation_path_block_errno(tmp_path):
    """RLIMIT_FSIZE makes the first large block file fail with EFBIG (as a full disk fails with
    ENOSPC): the error is an OSError naming the block file, the block and the errno, and the
    previous checkpoint stays loadable."""
    out = _forked.call(worker.save_past_file_size_limit, str(tmp_path / "ck"), timeout_s=180,
                       what="a save past the file-size limit")
    assert out["type"] == "CheckpointIOError" and out["errno"] == errno.EFBIG, out
    assert "writing the state of block 2 (layers.0)" in out["text"] and "File too large" in out["text"], out
    assert out["file"].startswith(str(tmp_path / "ck.tmp-")) and out["file"].endswith(".bin"), out
    assert not list(tmp_path.glob("ck.tmp-*"))                 # the half-written copy is gone
    assert offload.export_fp32(str(tmp_path / "ck"))           # the previous checkpoint loads


def test_concurrent_save_refused_naming_the_other_process(tmp_path):
    ck = tmp_path / "ck"
    ctx = _forked.context()
    saving, done = ctx.Event(), ctx.Event()
    holder = _forked.Child(worker.hold_save_lock, str(ck), saving, done)
    try:
        assert saving.wait(120), "the other process never took the save lock"
        eng = trained()
        t0 = time.monotonic()
        with pytest.raises(CheckpointError) as exc:
            eng.save_checkpoint(str(ck))
        assert time.monotonic() - t0 < 10
        msg = str(exc.value)
        pid = holder.process.pid
        assert f"pid {pid} on host {socket.gethostname()}" in msg and "being saved by another process" in msg
        live = tmp_path / f"ck.tmp-{pid}"
        assert (live / "block_00000.rank0.bin").read_bytes() == b"in progress"   # not deleted
        assert not ck.exists()
    finally:
        done.set()
        holder.result(timeout_s=30, what="the process holding the save lock")
    # the other process is gone (its lock went with it): the save works, its leftovers are removed
    eng.save_checkpoint(str(ck))
    assert not list(tmp_path.glob("ck.tmp-*"))
    sd = eng.full_state_dict()
    got = offload.export_fp32(str(ck))
    assert all(torch.equal(sd[k], got[k]) for k in sd)
    eng.close()


def test_two_processes_saving_at_once_never_corrupt(tmp_path):
    """Two real engines in two processes save to one directory at the same moment, repeatedly:
    each save either completes or is refused naming the other, and the directory always holds
    a complete checkpoint."""
    go = _forked.context().Barrier(2)
    savers = [_forked.Child(worker.save_repeatedly, str(tmp_path / "ck"), go) for _ in range(2)]
    outs = [s.result(timeout_s=240, what="a saving process") for s in savers]
    assert sum(o["ok"] for o in outs) >= 1 and all(o["ok"] + o["refused"] == 4 for o in outs), outs
    assert not list(tmp_path.glob("ck.tmp-*"))
    assert offload.export_fp32(str(tmp_path / "ck"))


def test_unreadable_block_file_names_block_path_errno(tmp_path):
    eng = trained()
    eng.save_checkpoint(str(tmp_path / "ck"))
    victim = sorted((tmp_path / "ck").glob("block_00002.*.bin"))[0]
    victim.unlink()
    with pytest.raises(CheckpointIOError) as exc:
        eng.load_checkpoint(str(tmp_path / "ck"))
    e = exc.value
    assert e.errno == errno.ENOENT and e.filename == str(victim)
    assert "checkpoint load: reading the state of block 'layers.0'" in str(e)
    eng.close()


def test_checkpoint_paths_may_be_pathlib(tmp_path):
    """save_checkpoint / load_checkpoint / export_fp32 take a pathlib.Path as they take a str."""
    eng = trained()
    want = {k: v.clone() for k, v in eng.full_state_dict().items()}
    eng.save_checkpoint(tmp_path / "ck")
    x, y = next(iter(batches(1)))
    eng.backward(eng(x, y))
    eng.step()
    eng.load_checkpoint(tmp_path / "ck")
    got = eng.full_state_dict()
    eng.close()
    assert all(torch.equal(want[k], got[k]) for k in want)
    fp32 = offload.export_fp32(tmp_path / "ck")
    assert all(torch.equal(want[k].float(), fp32[k]) for k in want)
