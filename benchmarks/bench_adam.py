"""CPU Adam throughput: offload's native kernel beside torch's CPU AdamW and a bandwidth probe.

All in one process, on the same buffers, interleaved round by round (with a pause before
each timed call, see main), medians reported.
  ours_fp32      offload adam_step, fp32 grads and state                     28 B/param
  ours_mixed     offload adam_step, bf16 grads in, bf16 param copy out       28 B/param
  torch_fused    torch.optim.AdamW(fused=True), fp32                         28 B/param
  torch_foreach  torch.optim.AdamW(foreach=True), fp32                 28 B/param (+ temps)
  two_pass       torch fused AdamW on fp32 grads, then param_bf16.copy_(param)  34 B/param
  probe          native in-place stream a+=d, b+=d, c+=d (read 4, write 3 fp32)  28 B/param
Bytes per param count each array read or written once (what a perfect kernel moves).
Claims are speed ratios paired within each round (median over rounds).

Sharing the cores with torch (one block-sized step, --block, right after torch work), in the
two places a step runs:
  main       adam_step called on the main thread (CPUAdam.step, a user's call): its chunks run
             on the main thread's own OpenMP team, torch's intra-op workers
  worker     as the engine's optimizer pipeline runs it: a worker thread runs the step
Per placement, interleaved round by round:
  adam_isolated     the step after an idle pause (torch's OpenMP workers asleep)
  adam_after_torch  the step right after torch work (its OpenMP workers just went idle)
  torch_isolated    torch work (512x512 matmuls and 64K-element elementwise ops) after a pause
  torch_after_adam  the same torch work right after the step
The step's time is the kernel's own (adam_step's call, on the thread that runs it).
Claims ``adam_after_torch_vs_isolated`` and ``torch_after_adam_vs_isolated`` (>= 0.95): the
lower of the two placements (each the median of per-round ratios).
  small ops         torch's small elementwise op (64K floats, back to back) in this process once
                    the pool has started, run and gone idle, and in a process of its own where
                    the pool never starts (plain torch, same thread count), the two measuring in
                    turn (never at once), each after the same torch work and pause
Claim ``torch_small_op_with_pool_vs_without`` (<= 1.10): time per op with the pool over
without, the median of per-round ratios. "Without" is another process because in this one it
exists only before the pool first starts; taken there, once, before the rest, the two figures
differed by up to +-25% on a VM whose speed drifts, with no pool at all (the op takes 10-30 us).
The pool registers with torch's OpenMP runtime while it has work on its own threads (and
OFFLOAD_POOL_LINGER_MS after), so that runtime cuts its idle spins next to the kernels; then the
registration ends and torch spins as before (native/threadpool.c; native_info()["pool"] names
the runtime, "pthread" with OFFLOAD_POOL=pthread: never registered, never on torch's team).

Usage: python benchmarks/bench_adam.py [--size 64M] [--block 4M] [--threads N] [--rounds 12]
The last line printed is one JSON object with a `claims` map.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from offload import _native
from offload.optim import adam_step, set_num_threads
from worker_process import WorkerProcess, serve

BYTES = {"ours_fp32": 28, "ours_mixed": 28, "torch_fused": 28, "torch_foreach": 28, "two_pass": 34, "probe": 28}
KW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
PAUSE_S = 0.05


def parse_size(text: str) -> int:
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * mult[text[-1].upper()]) if text[-1].upper() in mult else int(text)


def build(n: int):
    """Every method's buffers, allocated and first-touched here (not in the timed loop)."""
    p = torch.randn(n)
    g = torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    g_bf16 = g.to(torch.bfloat16)
    copy_bf16 = torch.empty(n, dtype=torch.bfloat16)
    param = torch.nn.Parameter(p)  # shares p's storage: every method updates the same params
    param.grad = g
    fused = torch.optim.AdamW([param], fused=True, **KW)
    foreach = torch.optim.AdamW([param], foreach=True, **KW)
    fused.step()  # allocates their state now
    foreach.step()
    L = _native.lib()
    step = [10]

    def ours_fp32():
        adam_step(p, g, m, v, step=step[0], **KW)

    def ours_mixed():
        adam_step(p, g_bf16, m, v, step=step[0], param_copy=copy_bf16, **KW)

    def two_pass():
        fused.step()
        copy_bf16.copy_(p)

    def probe():
        _native.adam_bandwidth_probe(L, p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), n)

    return {"ours_fp32": ours_fp32, "ours_mixed": ours_mixed, "torch_fused": fused.step,
            "torch_foreach": foreach.step, "two_pass": two_pass, "probe": probe}


SMALL_ROUNDS = 9            # interleaved rounds of the small-op claim
SMALL_PAUSE_S = 0.02        # after torch work, before the small ops: as after the pool has idled


def small_ops_us(small: torch.Tensor) -> float:
    """Median microseconds per small elementwise op (64K floats), 200 back to back."""
    per = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(100):
            small.mul(1.0001).add_(1.0)
        per.append((time.perf_counter() - t0) / 200 * 1e6)
    return statistics.median(per)


def torch_work(a: torch.Tensor, b: torch.Tensor, small: torch.Tensor) -> None:
    """torch's work between two optimizer steps: 512x512 matmuls and small elementwise ops."""
    for _ in range(4):
        a @ b
        for _ in range(10):
            small.mul(1.0001).add_(1.0)


def small_op_worker() -> None:
    """The "without" side of the small-op claim: plain torch in a process where the native
    pool never starts; answers each request with one measurement."""
    a, b, small = torch.randn(512, 512), torch.randn(512, 512), torch.randn(1 << 16)

    def measure(_request: dict) -> dict:
        torch_work(a, b, small)
        time.sleep(SMALL_PAUSE_S)
        return {"us": small_ops_us(small)}
    serve(measure)


PLACEMENTS = ("main", "worker")
SCENARIOS = ("adam_isolated", "adam_after_torch", "torch_isolated", "torch_after_adam")


def sharing(block: int, rounds: int, threads: int) -> dict:
    """Times of the sharing scenarios (see the docstring) per placement, interleaved per round,
    then the small-op rounds against a plain torch process."""
    n = block
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    small = torch.randn(1 << 16)
    worker = ThreadPoolExecutor(1, thread_name_prefix="bench-step")   # the engine's optimizer thread
    L = _native.lib()
    kernel_s = [0.0]

    def kernel():
        t0 = time.perf_counter()
        adam_step(p, g, m, v, step=10, **KW)
        kernel_s[0] = time.perf_counter() - t0

    def adam(placement: str) -> float:
        """One step in `placement`; returns the kernel's own seconds."""
        if placement == "main":
            kernel()
        else:
            worker.submit(kernel).result()
        return kernel_s[0]

    def torch_work_here():
        torch_work(a, b, small)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for placement in PLACEMENTS:                         # warm-up: threads exist, pages touched
        adam(placement), torch_work_here()
    times = {pl: {k: [] for k in SCENARIOS} for pl in PLACEMENTS}
    for r in range(rounds):
        for placement in PLACEMENTS:
            t = times[placement]
            time.sleep(PAUSE_S)
            t["adam_isolated"].append(adam(placement))
            torch_work_here()
            t["adam_after_torch"].append(adam(placement))
            time.sleep(PAUSE_S)
            t["torch_isolated"].append(timed(torch_work_here))
            adam(placement)
            t["torch_after_adam"].append(timed(torch_work_here))
    worker.shutdown()

    def with_pool() -> float:   # once the pool's registration with torch's runtime has ended
        deadline = time.monotonic() + 10
        while _native.pool_registered(L) and time.monotonic() < deadline:
            time.sleep(0.005)
        torch_work_here()
        time.sleep(SMALL_PAUSE_S)
        return small_ops_us(small)

    plain = WorkerProcess([sys.executable, os.path.abspath(__file__), "--small-op-worker", "--threads",
                           str(threads)], "the plain-torch small-op worker", timeout_s=120.0)
    try:
        pairs = []
        for r in range(SMALL_ROUNDS):
            if r % 2 == 0:
                ours = with_pool()
                pairs.append((ours, plain.call()["us"]))
            else:
                base = plain.call()["us"]
                pairs.append((with_pool(), base))
    finally:
        plain.close()
    times["small_op_us"] = {"with_pool": round(statistics.median(p for p, _ in pairs), 2),
                            "without_pool": round(statistics.median(q for _, q in pairs), 2),
                            "ratio": round(statistics.median(p / q for p, q in pairs), 3)}
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64M", help="parameters per step (e.g. 64M, 256M, 1G)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for our pool and for torch (default: all CPUs)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", default="4M", help="parameters of the block-sized step shared with torch")
    ap.add_argument("--sharing-rounds", type=int, default=40)
    ap.add_argument("--small-op-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.small_op_worker:               # plain torch: the native pool never starts here
        torch.set_num_threads(args.threads)
        return small_op_worker()
    if _native.lib() is None:
        sys.exit(f"the native library is not in use: {_native.load_error() or 'OFFLOAD_NATIVE=off'}")
    n = parse_size(args.size)
    set_num_threads(args.threads)
    torch.set_num_threads(args.threads)

    share = sharing(parse_size(args.block), args.sharing_rounds, args.threads)
    small_op_us = share.pop("small_op_us")
    print(f"torch small op (64K floats): {small_op_us['with_pool']:.1f} us with the pool started and idle "
          f"(pool: {_native.native_info().get('pool')}), {small_op_us['without_pool']:.1f} us in a plain torch "
          f"process (medians of {SMALL_ROUNDS} rounds in turn; median ratio {small_op_us['ratio']:.3f})")

    def ratio(placement: str, base: str, after: str) -> float:
        ts = share[placement]
        return round(statistics.median(i / x for i, x in zip(ts[base], ts[after])), 3)
    sharing_ratios = {pl: {"adam_after_torch_vs_isolated": ratio(pl, "adam_isolated", "adam_after_torch"),
                           "torch_after_adam_vs_isolated": ratio(pl, "torch_isolated", "torch_after_adam")}
                      for pl in PLACEMENTS}
    for pl, ts in share.items():
        for name, t in ts.items():
            print(f"{pl:14s} {name:18s} median {statistics.median(t) * 1e3:8.2f} ms  min {min(t) * 1e3:8.2f} ms")
        print(f"{pl:14s} {sharing_ratios[pl]}")
    methods = build(n)
    for fn in methods.values():  # warm-up round
        fn()
    times = {name: [] for name in methods}
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        for name, fn in methods.items():
            # torch's OpenMP workers spin for a while after each parallel region; whatever ran
            # next would share the cores with them. A pause lets every method start on idle cores.
            time.sleep(PAUSE_S)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    wall = time.perf_counter() - t0

    results = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        results[name] = {"median_ms": round(med * 1e3, 2), "mparam_s": round(n / med / 1e6, 1),
                         "gb_s": round(n * BYTES[name] / med / 1e9, 1), "bytes_per_param": BYTES[name],
                         "min_ms": round(min(ts) * 1e3, 2)}
        r = results[name]
        print(f"{name:14s} {r['mparam_s']:8.0f} Mparam/s {r['gb_s']:6.1f} GB/s  median {r['median_ms']:8.2f} ms  "
              f"min {r['min_ms']:8.2f} ms")

    def paired(ours: str, baseline: str) -> float:
        """Median over rounds of the speed ratio within a round: robust to load that drifts
        between rounds (this machine may be shared), unlike a ratio of medians."""
        return round(statistics.median(b / a for a, b in zip(times[ours], times[baseline])), 3)

    claims = {
        "fp32_vs_torch_fused": paired("ours_fp32", "torch_fused"),
        "mixed_vs_two_pass": paired("ours_mixed", "two_pass"),
        "fp32_vs_inplace_roofline": paired("ours_fp32", "probe"),
        "adam_after_torch_vs_isolated": min(sharing_ratios[pl]["adam_after_torch_vs_isolated"]
                                            for pl in PLACEMENTS),
        "torch_after_adam_vs_isolated": min(sharing_ratios[pl]["torch_after_adam_vs_isolated"]
                                            for pl in PLACEMENTS),
        "torch_small_op_with_pool_vs_without": small_op_us["ratio"],
    }
    targets = {"fp32_vs_torch_fused": 1.0, "mixed_vs_two_pass": 1.3, "fp32_vs_inplace_roofline": 0.9,
               "adam_after_torch_vs_isolated": 0.95, "torch_after_adam_vs_isolated": 0.95,
               "torch_small_op_with_pool_vs_without": 1.10}
    at_most = {"torch_small_op_with_pool_vs_without"}  # lower is better
    print(json.dumps({"bench": "adam", "size": n, "threads": args.threads, "rounds": args.rounds,
                      "native": _native.native_info(), "torch": torch.__version__,
                      "loadavg_1m": round(os.getloadavg()[0], 2), "wall_s": round(wall, 1),
                      "results": results, "block": parse_size(args.block),
                      "sharing_ms": {pl: {k: round(statistics.median(v) * 1e3, 3) for k, v in ts.items()}
                                     for pl, ts in share.items()},
                      "sharing_ratios": sharing_ratios,
                      "small_op_us": small_op_us,
                      "claims": claims, "targets": targets,
                      "missed": [k for k, t in targets.items()
                                 if not (claims[k] <= t if k in at_most else claims[k] >= t)]}))


if __name__ == "__main__":
    main()
