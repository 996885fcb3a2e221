"""The whole training step with the CPU optimizer offloaded, against plain PyTorch, and how
much of the optimizer stays exposed.

Main figure, real compute: L layers ``x = x + tanh(x @ W)`` (W: d x d, fp32) trained on a
(batch, d) input, forward and backward by torch's matmuls on the compute device (on a
CPU-only machine: the same cores the optimizer threads use). Modes, each a fresh model,
interleaved round by round, medians over steps and rounds:
  * torch: plain PyTorch, ``torch.optim.AdamW(fused=True)`` (the step without offload);
  * serial: the engine with ``overlap_step`` off and ``synchronize()`` after ``step()``:
    the optimizer's time after backward when nothing overlaps it;
  * overlapped: the engine as configured by default (no clipping);
  * clipped: the engine with ``gradient_clipping`` (the step needs the global norm).
Step time = forward (with its waits for the previous step's updates), backward and step(). Exposed time = the ``step()`` call plus the forward's waits for updates
(``stats()["seconds"]["wait_update"]``). Claims, paired within rounds:
  ``exposed_step_fraction`` = exposed (overlapped) / optimizer time after backward (serial),
  ``step_vs_no_offload`` = step time (overlapped) / step time (torch).

``exposed_step_fraction`` is a claim only where the compute device is CUDA (benchmarks/
gpu_check.sh checks it). On a CPU compute device the first block's update, the last to be
queued, runs on the cores the next forward needs, so the forward waits for it; there the
fraction is printed as a measurement and the JSON names the claim under ``not_applicable``
(the whole step is the CPU's claim: ``step_vs_no_offload``).

Secondary figure, named as simulated: the same schedule with the compute replaced by a
GIL-free ``time.sleep`` per layer (``exposed_step_fraction_simulated_compute``): on a CPU-only
machine the optimizer threads then get the cores for free, so it shows the schedule only.

    python benchmarks/bench_step.py            # 12 layers x 1M params, ~1 min
    python benchmarks/bench_step.py --large    # 24 layers x 4M params
The last line printed is one JSON object with a `claims` map.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

import offload

TARGETS = {"exposed_step_fraction": 0.15, "step_vs_no_offload": 1.10}   # <=
CPU_NOT_APPLICABLE = {"exposed_step_fraction": "the compute device is the CPU: the first block's update runs on the "
                                               "cores the next forward needs, which waits for it; the whole step is "
                                               "the claim here (step_vs_no_offload); checked on a GPU by "
                                               "benchmarks/gpu_check.sh"}


class Layer(nn.Module):
    """Real compute: forward one (batch, d) x (d, d) matmul, backward two."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        return x + torch.tanh(x @ self.w)


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


class SimulatedLayer(nn.Module):
    def __init__(self, d: int, fwd_s: float, bwd_s: float):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.register_buffer("grad_w", torch.randn(d, d) * 1e-3, persistent=False)
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        return SimulatedCompute.apply(x, self.w, self.grad_w, self.fwd_s, self.bwd_s)


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def make_model(args, simulated: bool) -> Stack:
    torch.manual_seed(0)
    if simulated:
        return Stack(SimulatedLayer(args.d, args.sim_fwd_ms / 1e3, 2 * args.sim_fwd_ms / 1e3)
                     for _ in range(args.layers))
    return Stack(Layer(args.d) for _ in range(args.layers))


def run(mode: str, args, nvme_dir: str, device: torch.device, simulated: bool = False) -> dict:
    """Train ``args.steps`` timed steps (after two untimed ones) in ``mode``; medians."""
    model = make_model(args, simulated)
    x = torch.randn(args.batch, args.d, device=device)
    if mode == "torch":
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step = opt.step
        fwd = model
    else:
        cfg = {"optimizer": {"lr": 1e-4},
               "offload_optimizer": {"device": args.tier, "nvme_path": nvme_dir if args.tier == "nvme" else None},
               "gradient_clipping": 1.0 if mode == "clipped" else 0.0,
               "overlap_step": mode != "serial"}
        eng = offload.initialize(model, cfg)
        fwd = eng
    steps, exposed, after_backward = [], [], []
    for it in range(args.steps + 2):
        w0 = eng.stats()["seconds"].get("wait_update", 0.0) if mode != "torch" else 0.0   # outside the timing
        t0 = time.perf_counter()
        loss = fwd(x)
        if mode == "torch":
            loss.backward()
        else:
            eng.backward(loss)
        t1 = time.perf_counter()
        if mode == "torch":
            step()
            opt.zero_grad(set_to_none=True)
        else:
            eng.step()
            if mode == "serial":
                eng.synchronize()          # the whole optimizer runs here, after backward
        if device.type == "cuda":
            torch.cuda.synchronize()       # a step ends when its work on the device ends
        t2 = time.perf_counter()
        wait = eng.stats()["seconds"].get("wait_update", 0.0) - w0 if mode != "torch" else 0.0
        if it >= 2:                        # warm-up: first steps record orders, touch memory
            steps.append(t2 - t0)          # the forward includes its waits for the last updates
            after_backward.append(t2 - t1)
            exposed.append(wait + (t2 - t1))
    if mode != "torch":
        eng.synchronize()
        eng.close()
    return {"step_s": statistics.median(steps), "exposed_s": statistics.median(exposed),
            "opt_after_backward_s": statistics.median(after_backward)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=1024, help="layer width: d*d parameters per layer")
    p.add_argument("--batch", type=int, default=None,
                   help="rows per step, sets the compute per layer (default: 96 on a CPU, 16384 on CUDA, "
                        "so that forward and backward take longer than the optimizer)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tier", choices=["cpu", "nvme"], default="cpu")
    p.add_argument("--sim-fwd-ms", type=float, default=3.0,
                   help="simulated compute: forward wait per layer (backward: twice that)")
    p.add_argument("--large", action="store_true", help="24 layers x 4M params")
    args = p.parse_args(argv)
    if args.large:
        args.layers, args.d = 24, 2048
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if args.batch is None:
        args.batch = 16384 if device.type == "cuda" else 96
    import tempfile
    modes = ("torch", "serial", "overlapped", "clipped")
    res = {m: [] for m in modes}
    sim = {m: [] for m in ("serial", "overlapped")}
    # Every mode runs under the same OpenMP spin policy: the native pool's workers, once
    # started, make torch's idle workers stop spinning (native/threadpool.c), so start them
    # before the first mode, torch's included.
    from offload.optim import adam_step
    adam_step(*(torch.zeros(1 << 16) for _ in range(4)), step=1, lr=0.0, betas=(0.9, 0.999), eps=1e-8,
              weight_decay=0.0)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-step-") as d:
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                res[mode].append(run(mode, args, d, device))
            for mode in sim:
                sim[mode].append(run(mode, args, d, device, simulated=True))
    wall = time.perf_counter() - t_start
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in res.items()}
    serial_opt = med["serial"]["opt_after_backward_s"]

    def paired(num_mode, num_key, den_mode, den_key, table=res):
        return statistics.median(a[num_key] / b[den_key] for a, b in zip(table[num_mode], table[den_mode]))

    print(f"real compute: {args.layers} layers x {args.d}x{args.d} ({args.layers * args.d ** 2 / 1e6:.1f}M params), "
          f"batch {args.batch}, on {device.type}; optimizer tier {args.tier}, backend "
          f"{offload.native_info()['backend']}, pool {offload.native_info().get('pool')}")
    print(f"{'mode':<12}{'step ms':>10}{'exposed ms':>12}")
    for m, v in med.items():
        print(f"{m:<12}{v['step_s'] * 1e3:>10.1f}{v['exposed_s'] * 1e3:>12.1f}")
    compute = med["torch"]["step_s"] - med["torch"]["opt_after_backward_s"]
    print(f"optimizer time after backward (serial) {serial_opt * 1e3:.1f} ms; torch's forward + backward "
          f"{compute * 1e3:.1f} ms, its step (fused AdamW) {med['torch']['opt_after_backward_s'] * 1e3:.1f} ms")
    sim_frac = paired("overlapped", "exposed_s", "serial", "opt_after_backward_s", sim)
    print(f"simulated compute (sleep {args.sim_fwd_ms:g}/{2 * args.sim_fwd_ms:g} ms per layer): exposed "
          f"{statistics.median(x['exposed_s'] for x in sim['overlapped']) * 1e3:.1f} ms of "
          f"{statistics.median(x['opt_after_backward_s'] for x in sim['serial']) * 1e3:.1f} ms")
    claims = {"exposed_step_fraction": paired("overlapped", "exposed_s", "serial", "opt_after_backward_s"),
              "step_vs_no_offload": paired("overlapped", "step_s", "torch", "step_s"),
              "exposed_step_fraction_clipped": paired("clipped", "exposed_s", "serial", "opt_after_backward_s"),
              "step_vs_no_offload_clipped": paired("clipped", "step_s", "torch", "step_s"),
              "exposed_step_fraction_simulated_compute": sim_frac}
    targets, not_applicable, measured = dict(TARGETS), {}, claims["exposed_step_fraction"]
    if device.type != "cuda":
        not_applicable = dict(CPU_NOT_APPLICABLE)
        targets = {k: t for k, t in targets.items() if k not in not_applicable}
        measured = claims.pop("exposed_step_fraction")
        print(f"exposed_step_fraction {measured:.3f} (measured, not a claim here: "
              f"{not_applicable['exposed_step_fraction']})")
    missed = [k for k, t in targets.items() if not claims[k] <= t]
    print(json.dumps({"benchmark": "step", "device": device.type, "layers": args.layers, "d": args.d,
                      "batch": args.batch, "serial_optimizer_s": serial_opt, "compute_s": compute,
                      "compute_ge_optimizer": compute >= serial_opt, "modes": med,
                      "simulated_compute": {m: {k: statistics.median(x[k] for x in v) for k in v[0]}
                                            for m, v in sim.items()},
                      "loadavg_1m": round(os.getloadavg()[0], 2), "wall_s": round(wall, 1),
                      "exposed_step_fraction_measured": measured, "not_applicable": not_applicable,
                      "claims": claims, "targets_max": targets, "missed": missed}))


if __name__ == "__main__":
    sys.exit(main())
