"""The other processes of tests/io/test_checkpoint_safety.py: each function runs in a child forked
by tests/_forked.py (a process of its own: its file-size limit, its pid in the save lock)."""
import os
import resource
import signal

import offload
from offload.io.checkpoint import CheckpointError, _SaveLock
from _models import batches, make_model


def trained():
    """A 2-layer engine (optimizer state on the host) after two steps."""
    eng = offload.initialize(make_model(layers=2), {"offload_optimizer": {"device": "cpu"}})
    for x, y in batches(2):
        eng.backward(eng(x, y))
        eng.step()
    return eng


def save_past_file_size_limit(ck: str) -> dict:
    """Save ``ck``, then save it again under a 64 KiB file-size limit (EFBIG at the first large
    block file, as a full disk fails with ENOSPC); returns what the second save raised."""
    eng = trained()
    eng.save_checkpoint(ck)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    out = {}
    try:
        eng.save_checkpoint(ck)
    except OSError as e:
        out = {"type": type(e).__name__, "errno": e.errno, "file": e.filename, "text": str(e)}
    eng.close()
    return out


def hold_save_lock(ck: str, saving, done) -> None:
    """Take ``ck``'s save lock and leave a file in this process's temporary directory, as a save
    in progress does; set ``saving``, hold until ``done`` is set (at most 120 s)."""
    lock = _SaveLock(ck)
    lock.acquire()
    tmp = ck + f".tmp-{os.getpid()}"
    os.makedirs(tmp)
    with open(os.path.join(tmp, "block_00000.rank0.bin"), "wb") as f:
        f.write(b"in progress")
    saving.set()
    done.wait(120)


def save_repeatedly(ck: str, go, times: int = 4) -> dict:
    """Train, wait at ``go`` (a barrier with the other saver), then save ``ck`` ``times``
    times; returns how many saves completed and how many were refused for the other's."""
    eng = trained()
    ok = refused = 0
    go.wait(120)
    for _ in range(times):
        try:
            eng.save_checkpoint(ck)
            ok += 1
        except CheckpointError as e:
            assert "being saved by another process" in str(e), e
            refused += 1
    eng.close()
    return {"ok": ok, "refused": refused}
