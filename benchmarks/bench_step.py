"""How much of the CPU optimizer step stays exposed after backward.

L layers, each holding real parameters (so the CPU Adam does its real work over real
buffers) whose accelerator compute is simulated by a GIL-free wait in forward and backward
(``time.sleep``): on a CPU-only machine this measures the schedule, not core contention.

Measured in the same run, interleaved, medians over rounds:
  * serial optimizer time: every block's update run after backward, nothing overlapping;
  * exposed time, overlapped mode (no clipping; step() commits the update, the next forward
    trails the optimizer block by block);
  * exposed time, clipped mode (the same, with the global norm computed during backward).
Exposed time = time the forward spends waiting for updates (``offload::wait_update``) plus
the ``step()`` call itself. ``exposed_step_fraction`` = exposed / serial optimizer time.

    python benchmarks/bench_step.py            # default: 16 layers x 1M params, ~30 s
    python benchmarks/bench_step.py --large    # 24 layers x 4M params
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

import offload


class SimulatedCompute(torch.autograd.Function):
    """y = x; the weight gets a fixed gradient. Forward and backward wait (GIL released)."""

    @staticmethod
    def forward(ctx, x, w, grad_w, fwd_s, bwd_s):
        time.sleep(fwd_s)
        ctx.grad_w, ctx.bwd_s = grad_w, bwd_s
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd_s)
        return g, ctx.grad_w.clone(), None, None, None


class Layer(nn.Module):
    def __init__(self, numel, fwd_s, bwd_s):
        super().__init__()
        self.w = nn.Parameter(torch.randn(numel) * 0.02)
        self.register_buffer("grad_w", torch.randn(numel) * 1e-3, persistent=False)
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        return SimulatedCompute.apply(x, self.w, self.grad_w, self.fwd_s, self.bwd_s)


class Stack(nn.Module):
    def __init__(self, layers, numel, fwd_s, bwd_s):
        super().__init__()
        self.layers = nn.ModuleList(Layer(numel, fwd_s, bwd_s) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def run(mode, args, nvme_dir):
    torch.manual_seed(0)
    model = Stack(args.layers, args.numel, args.fwd_ms / 1e3, args.bwd_ms / 1e3)
    cfg = {"optimizer": {"lr": 1e-4},
           "offload_optimizer": {"device": args.tier, "nvme_path": nvme_dir if args.tier == "nvme" else None},
           "gradient_clipping": 1.0 if mode == "clipped" else 0.0,
           "overlap_step": mode != "serial"}
    eng = offload.initialize(model, cfg)
    x = torch.ones(8, requires_grad=True)
    serial, exposed, steps = [], [], []
    for it in range(args.steps + 2):
        t0 = time.perf_counter()
        w0 = eng.telemetry.seconds.get("wait_update", 0.0)
        loss = eng(x)
        eng.backward(loss)
        t1 = time.perf_counter()
        eng.step()
        if mode == "serial":
            eng.synchronize()          # the whole optimizer runs here, after backward
        t2 = time.perf_counter()
        wait = eng.telemetry.seconds.get("wait_update", 0.0) - w0
        if it >= 2:                    # warm-up: first steps record orders, touch memory
            serial.append(t2 - t1)
            exposed.append(wait + (t2 - t1))
            steps.append(t2 - t0)
    eng.synchronize()
    eng.close()
    return {"opt_after_backward_s": statistics.median(serial), "exposed_s": statistics.median(exposed),
            "step_s": statistics.median(steps)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--numel", type=int, default=1 << 20, help="parameters per layer")
    p.add_argument("--fwd-ms", type=float, default=3.0, help="simulated forward compute per layer")
    p.add_argument("--bwd-ms", type=float, default=6.0, help="simulated backward compute per layer")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tier", choices=["cpu", "nvme"], default="cpu")
    p.add_argument("--large", action="store_true", help="24 layers x 4M params")
    args = p.parse_args(argv)
    if args.large:
        args.layers, args.numel = 24, 4 << 20
    results = {m: [] for m in ("serial", "overlapped", "clipped")}
    with tempfile.TemporaryDirectory(prefix="bench-step-") as d:
        for r in range(args.rounds):
            for mode in results:
                results[mode].append(run(mode, args, d))
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in results.items()}
    serial_opt = med["serial"]["opt_after_backward_s"]
    compute = args.layers * (args.fwd_ms + args.bwd_ms) / 1e3
    print(f"{'mode':<12}{'step ms':>10}{'exposed ms':>12}")
    for m, v in med.items():
        print(f"{m:<12}{v['step_s'] * 1e3:>10.1f}{v['exposed_s'] * 1e3:>12.1f}")
    print(f"serial optimizer time {serial_opt * 1e3:.1f} ms, simulated compute {compute * 1e3:.1f} ms per step "
          f"({args.layers} layers x {args.numel / 1e6:.1f}M params, tier {args.tier}, "
          f"backend {offload.native_info()['backend']})")
    claims = {"exposed_step_fraction": med["overlapped"]["exposed_s"] / serial_opt,
              "exposed_step_fraction_clipped": med["clipped"]["exposed_s"] / serial_opt}
    print(json.dumps({"benchmark": "step", "serial_optimizer_s": serial_opt, "compute_s": compute,
                      "compute_ge_optimizer": compute >= serial_opt, "modes": med, "claims": claims}))


if __name__ == "__main__":
    sys.exit(main())
