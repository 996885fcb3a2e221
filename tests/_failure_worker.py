"""One failure-injection run, in its own process (tests/system/test_failures.py runs it under a timeout,
so a hang fails the test instead of hanging CI).

    python _failure_worker.py STAGE OPT_TIER PARAM_TIER CLIP NVME_DIR [chunked | noprefetch | ahead]

or run(argv) in a child forked by tests/_forked.py.

``chunked``: the optimizer state moves in chunks (offload_optimizer.state_chunk_bytes below
block TARGET's state); the failure hits its second chunk. ``noprefetch``: prefetch off (NVMe
parameter homes are then written back through write buffers, none kept staged).

Trains a small GPT with a failure injected into one stage of block TARGET's work, as a user
loop would (forward, backward, step; no synchronize between steps), and prints one JSON line:
the error the user got (type, text, errno), which call raised it, the seconds from the moment
the failure happened to the moment the user got it, and what close() did and how long it took.
"""
import errno
import json
import os
import sys
import time

import offload
from offload.dist.grad_sync import GradSync
from offload.params.part import ParamPart
from _models import batches, make_model

TARGET = 2          # block "layers.0"
fired = []          # time.monotonic() of the first injected failure


def fire():
    if not fired:
        fired.append(time.monotonic())


def break_io(store, key, op, stall=False, after=0):
    """Requests of ``op`` on ``key`` get a bad descriptor: the backend fails them with EBADF,
    asynchronously, as a failing disk would. ``stall``: they never complete instead.
    ``after``: the first ``after`` requests go through."""
    from offload._native import IO_READ, IO_WRITE
    want = {"read": IO_READ, "write": IO_WRITE}[op]
    k = store._keys[key]
    backend = store._backend
    real_submit, real_done, real_wait = backend.submit, backend.done, backend.wait
    stalled = set()
    seen = [0]

    def submit(req):
        if req.offset == k.offset and req.op == want:
            seen[0] += 1
        if req.offset == k.offset and req.op == want and seen[0] > after:
            fire()
            if stall:
                stalled.add(id(req))
            else:
                req.fd = -1
        return real_submit(req)

    def done(req):
        return False if id(req) in stalled else real_done(req)

    def wait(req, timeout):
        if id(req) in stalled:
            time.sleep(min(timeout if timeout is not None else 0.1, 0.5))
            return False
        return real_wait(req, timeout)
    backend.submit, backend.done, backend.wait = submit, done, wait


def run(argv):
    """One run; returns what the user saw (see the module docstring)."""
    stage, opt, prm, clip, nvme = argv[0:5]
    chunked = argv[5:6] == ["chunked"]
    noprefetch = argv[5:6] == ["noprefetch"]
    ahead = argv[5:6] == ["ahead"]
    cfg = {"offload_optimizer": {"device": opt, "nvme_path": nvme if opt == "nvme" else None, "buffer_count": 2,
                                 "state_chunk_bytes": 100_000 if chunked else None, "update_ahead": ahead},
           "offload_param": {"device": prm, "nvme_path": nvme if prm == "nvme" else None},
           "gradient_clipping": float(clip), "aio": {"backend": "native", "block_size": 1 << 16},
           "wait_timeout_s": 5.0 if stage == "stall" else 60.0, "prefetch": {"enabled": not noprefetch}}
    if stage == "gradient collective":   # one rank runs gradient collectives only where ZeRO partitions them
        cfg["zero_optimization"] = {"stage": 2}
    eng = offload.initialize(make_model(layers=2), cfg)
    dirs = list(eng.swap_dirs().values())
    key = f"b{TARGET}.state"
    if chunked:                        # its second chunk
        assert len(eng.blocks[TARGET].state.chunks) > 1
        key = eng.blocks[TARGET].state.chunks[1].key
    if stage in ("state read", "stall"):
        break_io(eng.resources.store("optimizer"), key, "read", stall=stage == "stall")
    elif stage == "state write":
        break_io(eng.resources.store("optimizer"), key, "write")
    elif stage == "gradient park":     # clipping: the window's sum waits on NVMe for step()
        break_io(eng.resources.store("optimizer"), f"b{TARGET}.grad", "write")
    elif stage == "parameter read":
        break_io(eng.resources.store("params"), f"b{TARGET}.param", "read")
    elif stage == "parameter write-back" and prm == "nvme":
        # with prefetch the third step's update keeps the block staged (the trace is known)
        break_io(eng.resources.store("params"), f"b{TARGET}.param", "write", after=0 if noprefetch else 2)
    elif stage == "parameter write-back":
        real = ParamPart.write_home

        def write_home(self, src, **kw):
            if self.layout.index == TARGET:
                fire()
                raise OSError(errno.ENOSPC, "No space left on device (injected)", "/injected/home")
            return real(self, src, **kw)
        ParamPart.write_home = write_home
    elif stage == "adam":              # the update rule's CPU step (the engine's rule object)
        real_step = eng.rule.cpu_step
        numel = eng.blocks[TARGET].state.numel

        def in_target(master):
            # the pipeline may step a block in several pieces (one per parameter group, per
            # parameter for factored rules, per state chunk: optim/pipeline.py): any piece of
            # the target block's master
            st = eng.blocks[TARGET].state
            if not st.in_memory:
                return False
            m = st.views(st.acquire(timeout=5))[0]
            return m.data_ptr() <= master.data_ptr() < m.data_ptr() + m.numel() * m.element_size()

        def cpu_step(master, *a, **k):
            if master.numel() == eng.blocks[TARGET].layout.numel or master.numel() == numel or in_target(master):
                fire()
                raise RuntimeError("injected failure in the CPU kernel")
            return real_step(master, *a, **k)
        eng.rule.cpu_step = cpu_step
    elif stage == "gradient collective":
        real_wait = GradSync.wait

        def wait(self, block):
            if block.index == TARGET:
                fire()
                raise RuntimeError("injected: allreduce timed out after 300 s")
            return real_wait(self, block)
        GradSync.wait = wait
    out = {"raised_by": None}
    call = None
    try:
        for x, y in batches(4):
            call = "forward"
            loss = eng(x, y)
            call = "backward"
            eng.backward(loss)
            call = "step"
            eng.step()
        call = "synchronize"
        eng.synchronize()
    except Exception as exc:   # noqa: BLE001 - what the user sees
        got = time.monotonic()
        out.update(raised_by=call, type=type(exc).__name__, text=str(exc), errno=getattr(exc, "errno", None),
                   is_oserror=isinstance(exc, OSError), latency=got - fired[0] if fired else None,
                   block=getattr(exc, "block", None), stage=getattr(exc, "stage", None))
    out["fired"] = bool(fired)
    # every later call raises the same failure
    try:
        eng(*batches(1)[0])
        out["after"] = None
    except Exception as exc:   # noqa: BLE001
        out["after"] = str(exc)
    # the failed job gave back what it held: after draining, no swap or gradient buffer is on loan
    try:
        eng.pipeline.wait_all()
    except Exception:   # noqa: BLE001 - the same failure again
        pass
    if eng.param_offload is not None:
        eng.param_offload.wait_writes()     # parameter write-backs in flight: their buffers come back
        out["kept"] = eng.param_offload.write_through.keeps_staged(TARGET)
    out["in_use"] = {p.name: p.stats()["in_use_bytes"]
                     for p in map(eng.resources.pool, ("offload-swap", "offload-param-write")) if p is not None}
    t0 = time.monotonic()
    try:
        eng.close()
        out["close"] = "returned"
    except Exception as exc:   # noqa: BLE001
        out["close"] = f"raised {type(exc).__name__}: {exc}"
    out["close_s"] = time.monotonic() - t0
    out["dirs_left"] = [d for d in dirs if os.path.exists(d)]
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1:])))
