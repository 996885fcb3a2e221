"""Bytes communicated per step and step time for ZeRO stages 0-3, 2 ranks on gloo (CPU).

Accounting (the engine's ``stats()['comm_bytes']``): per rank, ring-equivalent. For a buffer
of N bytes over W ranks an all-reduce counts 2 (W-1)/W N, a reduce-scatter and an all-gather
(W-1)/W N each (what one rank sends, and receives, in a ring algorithm), N being the full
padded buffer. The theory, with Psi = the model's parameter bytes (fp32, unpadded) and the
same (W-1)/W factor: stage 0 all-reduces the gradients (2 Psi); stages 1 and 2 reduce-scatter
the gradients and all-gather the updated parameters (2 Psi); stage 3 all-gathers parameters
in forward and again in backward and reduce-scatters the gradients (3 Psi). The ratio
measured / theory exceeds 1 by the padding (a block pads to a multiple of W * 1024
elements) and falls below it when ZeRO-3 keeps a block on the device from forward into
backward (the last block, within the prefetch lookahead). Collectives of checks (the global
norm, the block-order check) are a few bytes and not counted as model traffic, except the
norm's 8-byte all-reduce.

Step time: median wall time of forward + backward + step + synchronize over the measured
steps on rank 0 (gloo over loopback on a shared CPU: the relative cost of the stages, not a
network figure).

    python benchmarks/bench_zero.py                 # 8 layers of 512x512, ~1 min
    python benchmarks/bench_zero.py --layers 16 --width 1024
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn


def model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def rank_main(args) -> None:
    import torch.distributed as dist
    import offload
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port)
    dist.init_process_group("gloo", rank=args.rank, world_size=2)
    g = torch.Generator().manual_seed(100 + args.rank)
    data = [torch.randn(args.batch, args.width, generator=g) for _ in range(args.warmup + args.steps)]
    out = {}
    for stage in (0, 1, 2, 3):
        m = model(args.layers, args.width)
        psi = sum(p.numel() * 4 for p in m.parameters())
        eng = offload.initialize(m, {"offload_optimizer": {"device": "cpu"},
                                     "zero_optimization": {"stage": stage, "timeout_s": 60}})
        times = []
        before = None
        for i, x in enumerate(data):
            if i == args.warmup:
                eng.synchronize()
                before = dict(eng.stats()["comm_bytes"])
            t0 = time.perf_counter()
            eng.backward(eng(x).pow(2).mean())
            eng.step()
            eng.synchronize()
            times.append(time.perf_counter() - t0)
        after = eng.stats()["comm_bytes"]
        per_step = {k: (after[k] - before[k]) / args.steps for k in after}
        eng.close()
        theory = {0: 2, 1: 2, 2: 2, 3: 3}[stage] * psi * (2 - 1) / 2
        total = sum(per_step.values())
        out[stage] = {"stage": stage, "psi_bytes": psi, "comm_bytes_per_step": per_step,
                      "comm_total_per_step": total, "theory_bytes": theory, "vs_theory": total / theory,
                      "step_s": statistics.median(times[args.warmup:])}
        dist.barrier()
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--port", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.rank is not None:
        return rank_main(args)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = str(s.getsockname()[1])
    s.close()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        base = [sys.executable, os.path.abspath(__file__), "--layers", str(args.layers), "--width", str(args.width),
                "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--port", port, "--out", out]
        procs = [subprocess.Popen(base + ["--rank", str(r)]) for r in range(2)]
        rcs = [p.wait(timeout=1800) for p in procs]
        if any(rcs):
            sys.exit(f"a rank failed: exit codes {rcs}")
        with open(out) as f:
            res = {int(k): v for k, v in json.load(f).items()}
    for st in res.values():
        print(json.dumps(st))
    claims = {f"stage{s}_comm_vs_theory": round(res[s]["vs_theory"], 4) for s in (0, 1, 2, 3)}
    claims.update({f"stage{s}_step_s": round(res[s]["step_s"], 4) for s in (0, 1, 2, 3)})
    print(json.dumps({"bench": "zero", "world_size": 2, "layers": args.layers, "width": args.width,
                      "psi_bytes": res[0]["psi_bytes"], "claims": claims}))


if __name__ == "__main__":
    main()
