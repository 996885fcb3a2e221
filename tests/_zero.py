"""Runs of several ranks for the multi-rank tests (tests/distributed/test_zero.py, test_zero_rules.py,
test_cuda.py): ``spawn`` starts one child per rank (tests/_zero_worker.py, forked by
tests/_forked.py) and collects what each wrote, and the hyper-parameters the ranks and the
one-process references share."""
import json
import os
import socket
import time

import pytest
import torch

import _forked
import _zero_worker

STEPS = 3
EPS = 1e-6
TOL = 1e-5
LR, WD, CLIP = 1e-3, 0.01, 0.5


def _port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return str(p)


def spawn(jobs, world, out, timeout=150, **spec_kw):
    """Run ``jobs`` on ``world`` ranks; returns (exit codes, errors by rank, results by rank).
    ``spec_kw``: backend="nccl", fake_nccl=True (see tests/_zero_worker.py)."""
    os.makedirs(out, exist_ok=True)
    spec = os.path.join(out, "spec.json")
    with open(spec, "w") as f:
        json.dump({"jobs": jobs, **spec_kw}, f)
    port = _port()
    procs = [_forked.start(_zero_worker.main, [str(r), str(world), port, out, spec]) for r in range(world)]
    deadline = time.time() + timeout
    rcs = []
    for p in procs:
        p.join(max(1, deadline - time.time()))
        if p.is_alive():
            for q in procs:
                q.kill()
            pytest.fail(f"ranks hung for {timeout} s (jobs {[j['name'] for j in jobs]})")
        rcs.append(p.exitcode)
    errs = {}
    for r in range(world):
        f = os.path.join(out, f"rank{r}.err")
        if os.path.exists(f):
            errs[r] = open(f).read()
    res = []
    for r in range(world):
        f = os.path.join(out, f"rank{r}.pt")
        res.append(torch.load(f, weights_only=False) if os.path.exists(f) else {})
    return rcs, errs, res
