"""Peak host RSS with parameters and optimizer state on NVMe, for two model sizes.

Each model (about 1 GiB and 4 GiB of total fp32 state: parameters, master weights, Adam
moments) is built on the meta device, handed to the engine (which materializes it one
block at a time straight to NVMe) and trained for a few steps, in a fresh process that
reports its own peak RSS. Host memory is bounded by the engine's pools, not by the model:
the two peaks should be about equal (goal: both < 1.5 GiB).

The claimed peak is training's: initialize, the steps, and synchronize, read before
``close()``. ``close()`` then gives the model back with its trained values when it fits in
host memory (engine.close), which by design materializes the whole model on the host; that
peak is printed beside (``peak_rss_with_close_bytes``), not claimed.

    python benchmarks/bench_rss.py                 # 1 GiB and 4 GiB of state, ~1 minute
    python benchmarks/bench_rss.py --sizes 1 8     # GiB of state per model
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, resource, sys, time, torch
from torch import nn
import offload
layers, width, path, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
with torch.device("meta"):
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])
cfg = {"offload_param": {"device": "nvme", "nvme_path": path},
       "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 2},
       "optimizer": {"lr": 1e-4}}
t0 = time.perf_counter()
eng = offload.initialize(model, cfg)
t_init = time.perf_counter() - t0
x = torch.randn(8, width)
losses = []
t0 = time.perf_counter()
for _ in range(steps):
    loss = eng(x).pow(2).mean()
    eng.backward(loss)
    eng.step()
    losses.append(loss.item())
eng.synchronize()
t_steps = (time.perf_counter() - t0) / steps
params = sum(b.layout.numel for b in eng.blocks if b.trains)
stats = eng.stats()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # training's peak
eng.close()
print(json.dumps({"params": params, "state_bytes": params * 16, "init_s": t_init, "step_s": t_steps,
                  "peak_rss_bytes": peak,
                  "peak_rss_with_close_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "losses": losses, "host_pool_bytes": stats["tier_bytes"]["host"],
                  "nvme_bytes": stats["tier_bytes"]["nvme"]}))
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[1.0, 4.0], help="GiB of total state per model")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--path", default=None, help="directory on the NVMe disk (default: a temp dir)")
    args = p.parse_args(argv)
    per_layer = (args.width * args.width + args.width) * 16      # bytes of state per layer
    results = []
    for gib in args.sizes:
        layers = max(1, round(gib * 2**30 / per_layer))
        with tempfile.TemporaryDirectory(prefix="bench-rss-", dir=args.path) as d:
            out = subprocess.run([sys.executable, "-c", CHILD, str(layers), str(args.width), d, str(args.steps)],
                                 check=True, capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..")))
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["layers"] = layers
        results.append(r)
        print(f"{r['state_bytes'] / 2**30:5.2f} GiB of state ({layers} layers): peak RSS "
              f"{r['peak_rss_bytes'] / 2**30:.2f} GiB (with close(): {r['peak_rss_with_close_bytes'] / 2**30:.2f}), host pools {r['host_pool_bytes'] / 2**30:.2f} GiB, "
              f"init {r['init_s']:.1f} s, {r['step_s']:.1f} s/step, loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    peaks = [r["peak_rss_bytes"] for r in results]
    claims = {"max_peak_rss_gib": max(peaks) / 2**30,
              "rss_growth_ratio": peaks[-1] / peaks[0],
              "state_growth_ratio": results[-1]["state_bytes"] / results[0]["state_bytes"]}
    print(json.dumps({"benchmark": "rss", "models": results, "claims": claims}))


if __name__ == "__main__":
    sys.exit(main())
