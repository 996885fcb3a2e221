"""Trace-based prefetch of NVMe-resident parameters against its bounds, in the same run.

L layers, each one flat parameter block on NVMe (``offload_param.device = nvme``), each
with a simulated compute per layer (a GIL-free wait) in its forward. One forward pass
through the engine is one "step" (parameters are fetched exactly once per pass; inference
keeps the measurement about the fetch schedule). Measured, interleaved, medians over rounds:

* raw: the best of a single large O_DIRECT read and dd with 8 MiB blocks over the swap
  file that holds the parameters (the same bytes on the same disk);
* IO-only: the engine's pass with zero compute and prefetch on (its GB/s is the prefetch
  throughput, ``read_vs_raw`` against raw);
* compute-only: the same layers with their parameters resident, no engine;
* the pass with compute ~= IO per layer, prefetch off and lookahead of 1, 2, 4 blocks.

Compute per layer is set to the IO-only time per layer measured in the same round.
Claims: ``step_vs_bound`` = best prefetched pass / max(compute-only, IO-only),
``speedup_vs_no_prefetch`` = pass without prefetch / best prefetched pass,
``read_vs_raw`` = IO-only GB/s / raw GB/s; both ratios are paired within each round (the raw
reads bracket the IO-only pass) and the median over rounds is quoted.

    python benchmarks/bench_prefetch.py              # 12 layers x 32 MiB, ~40 s
    python benchmarks/bench_prefetch.py --large      # 16 layers x 128 MiB
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import offload  # noqa: E402
from bench_io import raw_dd, raw_single  # noqa: E402
from offload.storage import HostPool  # noqa: E402


class Layer(nn.Module):
    def __init__(self, numel: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(numel) * 0.02)
        self.compute_s = 0.0

    def forward(self, x):
        if self.compute_s:
            time.sleep(self.compute_s)   # the accelerator's work, GIL released
        return x + self.w[:1]


class Stack(nn.Module):
    def __init__(self, layers: int, numel: int):
        super().__init__()
        self.layers = nn.ModuleList(Layer(numel) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def set_compute(model, seconds):
    for layer in model.layers:
        layer.compute_s = seconds


def timed_pass(eng, x) -> float:
    t0 = time.perf_counter()
    with torch.no_grad():
        eng(x)
    return time.perf_counter() - t0


def set_lookahead(eng, blocks: int, block_bytes: int) -> None:
    pf = eng.param_offload.prefetcher
    pf.enabled = blocks > 0
    pf.device_lookahead = pf.host_lookahead = blocks * block_bytes
    eng.param_offload.budget = pf.budget = (blocks + 1) * block_bytes


def raw_read(path: str, buf, nbytes: int) -> float:
    """GB/s of the best raw sequential O_DIRECT reader over the file's first ``nbytes``:
    one large read into an aligned buffer, or dd with 8 MiB blocks."""
    return max(nbytes / raw_single(path, buf, nbytes, write=False),
               nbytes / raw_dd(path, nbytes, 8 << 20, write=False)) / 1e9


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--mib", type=int, default=32, help="parameter MiB per layer")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--path", default=None, help="directory on the disk to measure (default: a temp dir)")
    p.add_argument("--large", action="store_true", help="16 layers x 128 MiB")
    p.add_argument("--png", default="bench_prefetch.png")
    args = p.parse_args(argv)
    if args.large:
        args.layers, args.mib = 16, 128
    numel = args.mib * (1 << 20) // 4
    with tempfile.TemporaryDirectory(prefix="bench-prefetch-", dir=args.path) as d:
        torch.manual_seed(0)
        model = Stack(args.layers, numel)
        resident = Stack(args.layers, numel)
        block = numel * 4
        total = block * args.layers
        cfg = {"offload_param": {"device": "nvme", "nvme_path": d, "device_budget_bytes": 5 * block},
               "prefetch": {"device_lookahead_bytes": 4 * block, "host_lookahead_bytes": 4 * block},
               "offload_optimizer": {"device": "nvme", "nvme_path": d, "buffer_count": 2}}
        eng = offload.initialize(model, cfg).eval()
        # The raw baseline reads the very swap file holding the parameters (same bytes,
        # same file, same disk), interleaved with the engine's passes.
        swap = max(glob.glob(os.path.join(eng.swap_dirs()["params"], "*.swap")), key=os.path.getsize)
        raw_pool = HostPool([total], name="bench-raw")
        raw_buf = raw_pool.acquire(total)
        raw_np = raw_buf.view(torch.uint8, total).numpy()
        raws = []
        x = torch.zeros(4)
        set_lookahead(eng, 4, block)
        timed_pass(eng, x)                          # records the trace
        configs = [0, 1, 2, 4]
        times = {c: [] for c in configs}
        io_times, compute_times = [], []
        for r in range(args.rounds):
            set_compute(model, 0.0)
            set_lookahead(eng, 4, block)
            before = raw_read(swap, raw_np, total)       # raw readings bracket the IO-only pass:
            io_times.append(timed_pass(eng, x))          # the disk's speed drifts within seconds
            raws.append((before + raw_read(swap, raw_np, total)) / 2)
            # compute ~= IO per layer, recalibrated each round: the disk's rate drifts
            per_layer = io_times[-1] / args.layers
            set_compute(resident, per_layer)
            t0 = time.perf_counter()
            with torch.no_grad():
                resident(x)
            compute_times.append(time.perf_counter() - t0)
            set_compute(model, per_layer)
            for c in (configs if r % 2 == 0 else configs[::-1]):
                set_lookahead(eng, c, block)
                timed_pass(eng, x)                  # settle the trace position for this window
                times[c].append(timed_pass(eng, x))
        stats = eng.stats()
        raw_buf.release()
        raw_pool.close()
        eng.close()
    raw = statistics.median(raws) * 1e9
    io_s, compute_s = statistics.median(io_times), statistics.median(compute_times)
    med = {c: statistics.median(v) for c, v in times.items()}
    best_c = min((c for c in configs if c), key=lambda c: med[c])
    bound = max(io_s, compute_s)
    io_gbps = total / io_s / 1e9
    print(f"{args.layers} layers x {args.mib} MiB on NVMe ({total / 2**30:.2f} GiB per pass), "
          f"raw read {raw / 1e9:.2f} GB/s, prefetch (IO-only) {io_gbps:.2f} GB/s")
    print(f"compute-only {compute_s * 1e3:.0f} ms, IO-only {io_s * 1e3:.0f} ms")
    for c in configs:
        label = "prefetch off" if c == 0 else f"lookahead {c} block{'s' if c > 1 else ''}"
        print(f"  {label:<20}{med[c] * 1e3:8.0f} ms  ({med[c] / bound:.2f}x bound)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(configs, [med[c] * 1e3 for c in configs], marker="o", label="step")
        ax.axhline(bound * 1e3, color="gray", linestyle="--", label="max(compute, IO)")
        ax.set_xlabel("lookahead (blocks)")
        ax.set_ylabel("ms per pass")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png)
        print(f"wrote {args.png}")
    except ImportError:
        pass
    # ratios paired within each round, then the median over rounds
    read_ratio = statistics.median(total / t / 1e9 / r for t, r in zip(io_times, raws))
    speedup = statistics.median(off / best for off, best in zip(times[0], times[best_c]))
    vs_bound = statistics.median(best / max(io, comp)
                                 for best, io, comp in zip(times[best_c], io_times, compute_times))
    claims = {"step_vs_bound": vs_bound, "speedup_vs_no_prefetch": speedup, "read_vs_raw": read_ratio}
    print(json.dumps({"benchmark": "prefetch", "layers": args.layers, "block_bytes": block,
                      "raw_read_gbps": raw / 1e9, "prefetch_gbps": io_gbps, "compute_only_s": compute_s,
                      "io_only_s": io_s, "pass_s": {str(c): v for c, v in med.items()},
                      "prefetch_counters": stats["prefetch"], "claims": claims}))


if __name__ == "__main__":
    sys.exit(main())
