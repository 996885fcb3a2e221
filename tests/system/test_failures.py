"""Failure injection per stage of a block's work: the user's next engine call raises an error
naming the block and the stage within 10 s, the failed job gives back what it held, and
close() returns. Each run is a process of its own under a timeout, so a hang fails instead of
hanging: a child forked from a server that has imported torch and the engine once
(tests/_forked.py)."""
import pytest

import _failure_worker
import _forked


def run_worker(stage, opt, prm, clip, nvme_dir, *extra):
    return _forked.call(_failure_worker.run, [stage, opt, prm, str(clip), str(nvme_dir), *extra], timeout_s=180,
                        what=f"the engine after a failure injected into {stage}")


# (stage, optimizer tier, parameter tier, clipping, errno the user sees or None)
CASES = [
    ("state read", "nvme", "none", 0.0, 9),           # EBADF from the I/O backend, asynchronously
    ("state write", "nvme", "none", 0.0, 9),          # fails after its job returned
    ("state write", "nvme", "nvme", 1.0, 9),
    ("gradient park", "nvme", "none", 1.0, 9),       # the window's gradient sum parked on NVMe
    ("adam", "cpu", "none", 0.0, None),
    ("adam", "nvme", "nvme", 1.0, None),              # clipping: submitted by step()
    # the parameter home's NVMe write (asynchronous): test_failed_asynchronous_parameter_write_back
    ("parameter write-back", "nvme", "cpu", 0.0, 28),
    ("parameter read", "cpu", "nvme", 0.0, 9),        # the forward's fetch of the block (prefetched or not)
    ("gradient collective", "cpu", "none", 0.0, None),
    ("gradient collective", "nvme", "cpu", 1.0, None),
]


@pytest.mark.parametrize("stage, opt, prm, clip, code", CASES,
                         ids=[f"{c[0].replace(' ', '_')}-opt_{c[1]}-param_{c[2]}-clip_{c[3]}" for c in CASES])
def test_failure_names_block_and_stage(stage, opt, prm, clip, code, tmp_path):
    r = run_worker(stage, opt, prm, clip, tmp_path)
    assert r["fired"], r
    assert r["raised_by"] in ("forward", "backward", "step", "synchronize"), r
    assert r["stage"] == stage and r["block"] == "2 (layers.0)", r
    assert f"{stage} of block 2 (layers.0) failed" in r["text"], r
    assert r["latency"] < 10.0, r
    if code is not None:    # an OSError with the errno and the file
        assert r["is_oserror"] and r["errno"] == code, r
        assert ".swap" in r["text"] or "/injected/" in r["text"], r
    if stage != "parameter read":                 # a read loses nothing: the engine may go on
        assert r["after"] == r["text"], r         # every later call raises it again
    assert all(v == 0 for v in r["in_use"].values()), r
    if stage == "parameter read":   # close() restores the parameters: the still-broken read raises again
        assert r["close"] == "returned" or "parameter read of block 2" in r["close"], r
    else:
        assert r["close"] == "returned", r
    assert r["close_s"] < 10.0, r
    assert r["dirs_left"] == [], r


@pytest.mark.parametrize("path", ["kept_staged", "write_buffer"])
def test_failed_asynchronous_parameter_write_back(path, tmp_path):
    """NVMe parameter homes: the update job submits the parameter write and returns; the write
    fails afterwards (EBADF from the backend). Kept staged for the next forward (prefetch on)
    or written through a write buffer (prefetch off), the failure is raised from the user's
    next call naming block 2 and "parameter write-back", with the errno and the file, and
    again by every later call; the write buffer is back and close() returns."""
    r = run_worker("parameter write-back", "cpu", "nvme", 0.0, tmp_path,
                   *(["noprefetch"] if path == "write_buffer" else []))
    assert r["fired"] and r["kept"] is (path == "kept_staged"), r
    assert r["raised_by"] in ("forward", "backward", "step", "synchronize"), r
    assert r["stage"] == "parameter write-back" and r["block"] == "2 (layers.0)", r
    assert "parameter write-back of block 2 (layers.0) failed" in r["text"] and ".swap" in r["text"], r
    assert r["is_oserror"] and r["errno"] == 9 and r["latency"] < 10.0, r
    assert r["after"] == r["text"], r
    assert all(v == 0 for v in r["in_use"].values()), r
    assert r["close"] == "returned" and r["close_s"] < 10.0 and r["dirs_left"] == [], r


@pytest.mark.parametrize("prm", ["none", "nvme"])
def test_failed_update_ahead_names_block_and_stage(prm, tmp_path):
    """offload_optimizer.update_ahead: the kernel fails in block 2's update computed during
    backward. The user's next call raises it naming the block and "adam (update ahead)",
    every later call again; nothing stays on loan and close() returns."""
    r = run_worker("adam", "cpu", prm, 0.0, tmp_path, "ahead")
    assert r["fired"], r
    assert r["raised_by"] in ("forward", "backward", "step", "synchronize"), r
    assert r["stage"] == "adam (update ahead)" and r["block"] == "2 (layers.0)", r
    assert "adam (update ahead) of block 2 (layers.0) failed" in r["text"] and r["latency"] < 10.0, r
    assert r["after"] == r["text"], r
    assert all(v == 0 for v in r["in_use"].values()), r
    assert r["close"] == "returned" and r["close_s"] < 10.0 and r["dirs_left"] == [], r


def test_stalled_read_times_out_naming_block(tmp_path):
    """A read that never completes: the wait is bounded (wait_timeout_s = 5 s here; short
    enough for a test, long enough that the other blocks' real I/O never trips it on a loaded
    machine)."""
    r = run_worker("stall", "nvme", "none", 0.0, tmp_path)
    assert r["stage"] == "state read" and r["block"] == "2 (layers.0)", r
    assert "not done after 5.0 s" in r["text"] and r["errno"] == 110, r   # ETIMEDOUT
    assert r["latency"] < 5.0 + 10.0 and r["close"] == "returned" and r["close_s"] < 5.0 + 10.0, r
    assert r["dirs_left"] == [], r


@pytest.mark.parametrize("stage", ["state read", "state write", "stall"])
def test_failed_chunk_names_block_chunk_and_stage(stage, tmp_path):
    """Optimizer state in chunks: a failed read or write of block 2's second chunk (or a read
    that never completes) names the block, the chunk and its elements, and the stage; the job
    gives its buffers back and close() returns."""
    r = run_worker(stage, "nvme", "nvme", 1.0, tmp_path, "chunked")
    assert r["fired"], r
    want = "state read" if stage == "stall" else stage
    assert r["block"] == "2 (layers.0)" and r["stage"].startswith(f"{want} (chunk 2 of "), r
    assert "elements [" in r["stage"] and f"{r['stage']} of block 2 (layers.0) failed" in r["text"], r
    if stage == "stall":
        assert "not done after 5.0 s" in r["text"] and r["errno"] == 110, r
    else:
        assert r["is_oserror"] and r["errno"] == 9 and ".swap" in r["text"], r
        assert r["latency"] < 10.0, r
    assert r["after"] == r["text"], r
    if stage != "stall":                # a stalled read keeps its buffer (never reused live)
        assert all(v == 0 for v in r["in_use"].values()), r
    assert r["close"] == "returned" and r["close_s"] < 15.0, r
    assert r["dirs_left"] == [], r
