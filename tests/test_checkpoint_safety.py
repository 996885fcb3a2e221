"""Checkpoint saves: a full disk names the operation, path, block and errno; two saves to one
directory never delete each other's files, and the second fails naming the first's process."""
import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import offload
from offload.io.checkpoint import CheckpointError, CheckpointIOError
from _models import batches, make_model

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]))


def trained(tmp_path):
    eng = offload.initialize(make_model(layers=2), {"offload_optimizer": {"device": "cpu"}})
    for x, y in batches(2):
        eng.backward(eng(x, y))
        eng.step()
    return eng


def test_full_disk_names_operation_path_block_errno(tmp_path):
    """RLIMIT_FSIZE makes the first large block file fail with EFBIG (as a full disk fails with
    ENOSPC): the error is an OSError naming the block file, the block and the errno, and the
    previous checkpoint stays loadable."""
    code = f"""
        import json, resource, signal, sys
        sys.path.insert(0, {HERE!r})
        from test_checkpoint_safety import trained
        from offload.io.checkpoint import CheckpointIOError
        eng = trained(None)
        eng.save_checkpoint({str(tmp_path / 'ck')!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
        out = {{}}
        try:
            eng.save_checkpoint({str(tmp_path / 'ck')!r})
        except OSError as e:
            out = {{"type": type(e).__name__, "errno": e.errno, "file": e.filename, "text": str(e)}}
        eng.close()
        print(json.dumps(out))
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180,
                       env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["type"] == "CheckpointIOError" and out["errno"] == errno.EFBIG, out
    assert "writing the state of block 2 (layers.0)" in out["text"] and "File too large" in out["text"], out
    assert out["file"].startswith(str(tmp_path / "ck.tmp-")) and out["file"].endswith(".bin"), out
    assert not list(tmp_path.glob("ck.tmp-*"))                 # the half-written copy is gone
    assert offload.export_fp32(str(tmp_path / "ck"))           # the previous checkpoint loads


def test_concurrent_save_refused_naming_the_other_process(tmp_path):
    ck = tmp_path / "ck"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from offload.io.checkpoint import _SaveLock
        lock = _SaveLock({str(ck)!r})
        lock.acquire()
        tmp = {str(ck)!r} + f".tmp-{{os.getpid()}}"
        os.makedirs(tmp)
        open(os.path.join(tmp, "block_00000.rank0.bin"), "wb").write(b"in progress")
        print("saving", flush=True)
        sys.stdin.read()          # holds the lock until the test closes stdin
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "saving"
        eng = trained(tmp_path)
        t0 = time.monotonic()
        with pytest.raises(CheckpointError) as exc:
            eng.save_checkpoint(str(ck))
        assert time.monotonic() - t0 < 10
        msg = str(exc.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in msg and "being saved by another process" in msg
        live = tmp_path / f"ck.tmp-{holder.pid}"
        assert (live / "block_00000.rank0.bin").read_bytes() == b"in progress"   # not deleted
        assert not ck.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
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
    code = f"""
        import json, os, sys, time
        sys.path.insert(0, {HERE!r})
        from test_checkpoint_safety import trained
        from offload.io.checkpoint import CheckpointError
        eng = trained(None)
        ok = refused = 0
        start = float(sys.argv[1])
        while time.time() < start:
            time.sleep(0.001)
        for _ in range(4):
            try:
                eng.save_checkpoint({str(tmp_path / 'ck')!r})
                ok += 1
            except CheckpointError as e:
                assert "being saved by another process" in str(e), e
                refused += 1
        eng.close()
        print(json.dumps({{"ok": ok, "refused": refused}}))
    """
    start = str(time.time() + 8)
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), start], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV) for _ in range(2)]
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=240)
        assert p.returncode == 0, e[-3000:]
        outs.append(json.loads(o.strip().splitlines()[-1]))
    assert sum(o["ok"] for o in outs) >= 1 and all(o["ok"] + o["refused"] == 4 for o in outs), outs
    assert not list(tmp_path.glob("ck.tmp-*"))
    assert offload.export_fp32(str(tmp_path / "ck"))


def test_unreadable_block_file_names_block_path_errno(tmp_path):
    eng = trained(tmp_path)
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
    eng = trained(None)
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
