"""Update rules on the CPU: each rule's step rate beside its torch counterpart and beside the
in-place bandwidth probe at the bytes the rule moves; int8 against fp32 state with the
state on NVMe.

Part 1, kernels (all in one process, same buffers, interleaved round by round, medians):
  ours        rule.cpu_step on flat fp32 params, fp32 grads, fp32 state (offload/optim)
  torch       torch.optim.<X>(fused=True) where torch has a fused CPU kernel (AdamW, Adam, SGD,
              Adagrad); Adafactor: foreach=True (torch has no fused one); Lion: the plain-torch
              reference with foreach ops (torch has no Lion)
  probe       offload_bandwidth_probe over the rule's own arrays: rw[k] += 0 * grad for the param and
              each state row (read 1 + k, write k fp32 arrays: the rule's grad, param and rows,
              the same buffers, values unchanged)
  vs_probe    ours' bytes/s over the probe's bytes/s, bytes = what the rule reads and writes
              once per parameter over all its passes (single-pass rules: the probe's traffic)
  int8        the same rule with int8 state (bytes: param 8, grad 4, rows 2 x 1.016 each)
Adafactor is not single-pass: besides the factored update it reads the parameter for its
norm and the update for its norm; its bytes (ADAFACTOR_BYTES) count param 8 + grad 4 (row
and column sums) + grad 4 + update 8 (built, then its norm) + update 4 (applied) = 28.

Part 2, `int8_vs_fp32_nvme_step`: the optimizer step of a model whose state lives on NVMe,
block by block as the engine's pipeline runs it with its defaults (offload/storage NvmeStore,
O_DIRECT when the filesystem allows; `buffer_count` = 4 host buffers and one optimizer worker,
so up to 3 blocks' reads are in flight while one block steps, and a buffer whose write has
landed takes the next read, as optim/pipeline.py's read-ahead and reclaim do), with AdamW;
fp32 state (master + 2 rows, 12 B/param) against int8 state (master + 2 int8 rows + scales,
6.03 B/param). Rounds alternate fp32 / int8 (the disk's rate drifts) and the claim is the
median of the paired ratios. This drives the storage and the rule directly: it is not (yet)
the engine's own step.

Part 3, `--gpt-steps N` (300 for the issue's figure; 0, the default, skips it): the accuracy
cost of int8 state. `offload train`'s GPT (4 layers, d=256, 8 x 128 tokens, its default corpus,
seed 0, AdamW lr 2e-3 betas (0.9, 0.95) wd 0, 10 % warm-up then cosine to 10 %, as its
defaults) trained twice in plain torch on the CPU with offload's AdamW rule as a standalone
optimizer (CPUAdamW), fp32 state against int8 state, same data order. Reports both loss
curves (every step, in --curve-csv), the final training loss (mean of the last 10 steps, as
`offload train` reports it) and the validation loss; claim `int8_gpt_final_loss_rel_diff`.
This is not the engine's `offload train` (the engine does not take state_dtype yet).

How part 1 times (each ratio: `--pairs` pairs, the median of the per-pair ratios). The two
methods of a ratio (ours and the probe; ours and torch; int8 and ours) run back to back in
turn, a b a b ..., after one untimed b, and each pair is one a and the b right after it. So
every timed call of either method starts microseconds after a call of the other: both find
the threads awake (torch's OpenMP team, which a call from the main thread runs on, spins for
a few ms after each call), and ours and the probe find the cache as the other left it (they
move the same arrays). A pause before each call instead left every call to wake the sleeping
team, whose threads start 0.3-4 ms late here (native/threadpool.c): 2-30 % of a 10-16 ms
call, drawn anew per call, so single calls varied by up to 1.5x and the median ratio to the
probe moved 0.84-0.96 between quiet runs. A pause (PAUSE_S) now comes only before each
sequence, to let other tenants' bursts settle.

Usage: python benchmarks/bench_optim.py [--size 16M] [--rounds 7] [--pairs 21] [--nvme-size 64M]
       [--nvme-path DIR] [--block 4M] [--threads N] [--isa NAME] [--gpt-steps 300 --curve-csv FILE]
The last line printed is one JSON object with a `claims` map, its `targets` (single-pass rules
>= 0.9 of the probe, int8 state <= 6.2 B/param, int8 NVMe step >= 1.6x) and the `missed` ones.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from offload import _native
from offload.optim import get_rule, quant, set_num_threads

PAUSE_S = 0.05
ADAFACTOR_BYTES = 28
HP = {"AdamW": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
      "Adam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
      "Lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01),
      "SGD": dict(lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False),
      "SGD_nesterov": dict(lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True),
      "Adagrad": dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10),
      "Adafactor": dict(lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0)}
TORCH_FUSED = {"AdamW": "fused", "Adam": "fused", "SGD": "fused", "SGD_nesterov": "fused", "Adagrad": "fused",
               "Adafactor": "foreach"}
RULE_OF = {"SGD_nesterov": "SGD"}  # benchmark entries that are a rule with other hyper-parameters


def parse_size(text: str) -> int:
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * mult[text[-1].upper()]) if text[-1].upper() in mult else int(text)


def alternate(a, b, pairs: int) -> tuple:
    """Seconds of `pairs` calls of a and of b made in turn, a b a b ..., after a pause and
    one untimed call of b: every timed call follows a call of the other (see the docstring)."""
    time.sleep(PAUSE_S)  # let other tenants' bursts settle before the sequence
    b()
    ta, tb = [], []
    for _ in range(pairs):
        for fn, out in ((a, ta), (b, tb)):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return ta, tb


def kernel_methods(name: str, n: int, L) -> dict:
    """name -> (callable, bytes per param) for ours, torch, probe and int8."""
    rule = get_rule(RULE_OF.get(name, name))
    group = dict(rule.defaults, **HP[name])
    shape = (4096, n // 4096) if name == "Adafactor" else (n,)
    p = torch.randn(shape)
    g = torch.randn(shape)
    st = rule.init_state(p, group, "fp32")
    rows = rule.rows(group, shape)
    nbytes = ADAFACTOR_BYTES if name == "Adafactor" else 4 * (2 * (1 + len(rows)) + 1)
    step = [2]  # not the first: SGD's momentum buffer runs its steady-state branch

    def ours():
        rule.cpu_step(p.view(-1), g.view(-1), st, group, step[0], shape=shape)
    out = {"ours": (ours, nbytes)}

    param = torch.nn.Parameter(p)  # shares p's storage
    param.grad = g
    if name in TORCH_FUSED:
        cls = getattr(torch.optim, RULE_OF.get(name, name))
        kw = {k: v for k, v in HP[name].items()}
        topt = cls([param], **{TORCH_FUSED[name]: True}, **kw)
        topt.step()
        out["torch"] = (topt.step, nbytes)
    else:  # Lion: the plain-torch reference with foreach ops
        lst = {"exp_avg": torch.zeros(shape)}
        out["torch"] = (lambda: rule.device_step([p], [g], [lst], group, [step[0]]), nbytes)

    if L is not None and name != "Adafactor":
        # the probe streams over the rule's own memory (it reads the gradient, scaled by 0,
        # and adds it to the parameter and state rows: no value changes), so the ratio
        # compares the kernels, not where two sets of buffers happened to land in memory
        # (a zero array in the gradient's place moved the probe's rate by 2-4 % per process)
        arrays = [p.view(-1)] + [st[r.name] for r in rows]
        assert all(a.dtype == torch.float32 and a.numel() == n for a in arrays)
        out["probe"] = (lambda: _native.bandwidth_probe(L, [a.data_ptr() for a in arrays], g.data_ptr(), n, scale=0.0),
                        nbytes)
    elif L is not None:
        arrays, d = [torch.zeros(n) for _ in range(3)], torch.zeros(n)
        out["probe"] = (lambda: _native.bandwidth_probe(L, [a.data_ptr() for a in arrays], d.data_ptr(), n), 28)

    if name != "Adafactor" and rows:
        p8 = p.clone().view(-1)
        st8 = rule.init_state(p8, group, "int8")

        def int8():
            rule.cpu_step(p8, g.view(-1), st8, group, step[0])
        out["int8"] = (int8, 12 + len(rows) * 2 * (1 + 4 / quant.BLOCK))
    return out


def bench_kernels(names, n, pairs, L) -> dict:
    results = {}
    for name in names:
        methods = kernel_methods(name, n, L)
        for _ in range(3):   # warm up, interleaved: first touch, the threads, torch's state
            for fn, _ in methods.values():
                fn()
        # (a, b): the ratios of a over b; ours is timed in each of its sequences
        comparisons = [("ours", "probe"), ("ours", "torch"), ("int8", "ours")]
        times = collections.defaultdict(list)
        pairs_of = {}
        for a, b in comparisons:
            if a in methods and b in methods:
                ta, tb = alternate(methods[a][0], methods[b][0], pairs)
                times[a] += ta
                times[b] += tb
                pairs_of[(a, b)] = list(zip(ta, tb))
        med = {k: statistics.median(v) for k, v in times.items()}
        r = {f"{k}_mparam_s": round(n / med[k] / 1e6, 1) for k in methods}

        def paired(a: str, b: str, bytes_a: float = 1.0, bytes_b: float = 1.0) -> float:
            """Median over the pairs of a's rate over b's (rates in bytes/s when bytes are given)."""
            return round(statistics.median((bytes_a / ta) / (bytes_b / tb) for ta, tb in pairs_of[(a, b)]), 2)
        r["ours_vs_torch"] = paired("ours", "torch")
        if "probe" in methods:
            r["bytes_per_param"] = methods["ours"][1]
            r["probe_gb_s"] = round(methods["probe"][1] * n / med["probe"] / 1e9, 2)
            r["ours_gb_s"] = round(methods["ours"][1] * n / med["ours"] / 1e9, 2)
            r["ours_vs_probe"] = paired("ours", "probe", methods["ours"][1], methods["probe"][1])
            per_pair = [(methods["ours"][1] / ta) / (methods["probe"][1] / tb) for ta, tb in pairs_of[("ours", "probe")]]
            r["ours_vs_probe_quartiles"] = [round(q, 3) for q in statistics.quantiles(per_pair, n=4)]
            if "int8" in methods:
                r["int8_bytes_per_param"] = round(methods["int8"][1], 2)
                r["int8_vs_fp32_kernel"] = paired("int8", "ours")
        results[name] = r
        print(name, json.dumps(r), flush=True)
    return results


# ---- part 2: state on NVMe -------------------------------------------------------------------
class NvmeStateRun:
    """The AdamW step of `nblocks` blocks of `block` params whose state lives in an NvmeStore,
    each block's state one buffer in offload/optim/state.py's StateLayout."""

    def __init__(self, store, pool, nblocks: int, block: int, state_dtype: str):
        from offload.optim.state import StateLayout
        self.rule, self.group = get_rule("AdamW"), dict(get_rule("AdamW").defaults, **HP["AdamW"])
        self.store, self.pool, self.n, self.block, self.dtype = store, pool, nblocks, block, state_dtype
        self.layout = StateLayout.for_rule(self.rule, self.group, block, state_dtype)
        self.nbytes = self.layout.nbytes
        self.keys = [f"{state_dtype}.{i}" for i in range(nblocks)]
        store.reserve({k: self.nbytes for k in self.keys})
        self.grad = torch.randn(block)
        self.step = 1
        init = torch.randn(block)
        for k in self.keys:  # every block's state written once (fresh: master + zero rows)
            buf = pool.acquire(self.nbytes)
            master, state = self._views(buf)
            master.copy_(init)
            for t in state.values():
                t.zero_()
            store.write(k, buf.view(torch.uint8, self.nbytes)).wait()
            buf.release()

    def _views(self, buf):
        return self.layout.views(buf.view(torch.uint8, self.nbytes))

    def run(self, compute: bool = True, slots: int = 4) -> float:
        """One optimizer step over every block; returns seconds. compute=False moves the same
        bytes without stepping (the I/O alone, reported beside the step). ``slots`` host
        buffers: the step's own, the rest read ahead (the engine's buffer_count)."""
        t0 = time.perf_counter()
        bufs = [self.pool.acquire(self.nbytes) for _ in range(slots)]
        free = list(range(slots))
        reading = collections.deque()   # (block, slot, handle), in block order
        writing = collections.deque()   # (slot, handle), oldest first
        ahead = 0                       # the next block to read

        def view(slot):
            return bufs[slot].view(torch.uint8, self.nbytes)

        for i in range(self.n):
            while writing and writing[0][1].done():     # reclaim landed writes
                free.append(writing.popleft()[0])
            if not reading and not free:                # block i needs a buffer: the oldest write
                slot, w = writing.popleft()
                w.wait()
                free.append(slot)
            while free and ahead < self.n:              # read ahead into every free buffer
                slot = free.pop()
                reading.append((ahead, slot, self.store.read(self.keys[ahead], view(slot))))
                ahead += 1
            block, slot, r = reading.popleft()
            assert block == i
            r.wait()
            if compute:
                master, state = self._views(bufs[slot])
                self.rule.cpu_step(master, self.grad, state, self.group, self.step + 1)
            writing.append((slot, self.store.write(self.keys[i], view(slot))))
        for _, w in writing:
            w.wait()
        for b in bufs:
            b.release()
        self.step += 1
        return time.perf_counter() - t0


def bench_nvme(path: str, total: int, block: int, rounds: int) -> dict:
    from offload.storage.nvme import NvmeStore
    from offload.storage.pool import HostPool
    nblocks = max(1, total // block)
    need = nblocks * block * (12 + 6.1) * 1.1
    free = shutil.disk_usage(path).free
    if free < need + (1 << 30):
        raise SystemExit(f"--nvme-path {path} has {free / 2**30:.1f} GiB free; this run writes "
                         f"{need / 2**30:.1f} GiB: use a smaller --nvme-size or another path")
    store = NvmeStore(path, name="bench_optim")
    from offload.optim.state import StateLayout
    adam, group = get_rule("AdamW"), dict(get_rule("AdamW").defaults)
    pool = HostPool([StateLayout.for_rule(adam, group, block, d).nbytes for d in ("fp32", "int8") for _ in range(4)],
                    name="bench_optim")
    try:
        runs = {d: NvmeStateRun(store, pool, nblocks, block, d) for d in ("fp32", "int8")}
        for r in runs.values():
            r.run()  # warm
        t = {"fp32": [], "int8": []}
        ratios = []
        for i in range(rounds):
            order = ("fp32", "int8") if i % 2 == 0 else ("int8", "fp32")
            pair = {d: runs[d].run() for d in order}
            for d in pair:
                t[d].append(pair[d])
            ratios.append(pair["fp32"] / pair["int8"])
        io = {"fp32": [], "int8": []}
        io_ratios = []
        for i in range(rounds):
            order = ("fp32", "int8") if i % 2 == 0 else ("int8", "fp32")
            pair = {d: runs[d].run(compute=False) for d in order}
            for d in pair:
                io[d].append(pair[d])
            io_ratios.append(pair["fp32"] / pair["int8"])
        return {"io_only_fp32_s": round(statistics.median(io["fp32"]), 3),
                "io_only_int8_s": round(statistics.median(io["int8"]), 3),
                "io_only_int8_vs_fp32": round(statistics.median(io_ratios), 2),"params": nblocks * block, "block": block, "direct_io": store.direct,
                "fp32_step_s": round(statistics.median(t["fp32"]), 3),
                "int8_step_s": round(statistics.median(t["int8"]), 3),
                "fp32_state_bytes": runs["fp32"].nbytes * nblocks, "int8_state_bytes": runs["int8"].nbytes * nblocks,
                "int8_vs_fp32_nvme_step": round(statistics.median(ratios), 2),
                "ratios": [round(r, 2) for r in ratios]}
    finally:
        store.close()
        pool.close()


def bench_gpt(steps: int, curve_csv: str | None) -> dict:
    import math
    from offload.cli.corpus import Corpus
    from offload.models.gpt import GPT, GPTConfig
    from offload.optim import CPUAdamW
    gcfg = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256)
    corpus = Corpus.load(None)
    warmup = min(30, max(1, steps // 10))

    def lr_at(step):  # offload train's schedule
        if step < warmup:
            return (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac))

    # Both runs in lockstep (same batch each step), so a run cut short compares equal steps.
    runs = {}
    for state_dtype in ("fp32", "int8"):
        torch.manual_seed(0)
        model = GPT(gcfg)
        opt = CPUAdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0, state_dtype=state_dtype)
        runs[state_dtype] = (model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at))
    gen = torch.Generator().manual_seed(0)
    eval_gen = torch.Generator().manual_seed(1)
    evals = [corpus.batch(8, 128, eval_gen, "val") for _ in range(4)]
    curves = {d: [] for d in runs}
    t0 = time.perf_counter()

    def write_curves():
        if curve_csv:
            with open(curve_csv, "w") as f:
                f.write("step,loss_fp32_state,loss_int8_state\n")
                for i, (a, b) in enumerate(zip(curves["fp32"], curves["int8"]), 1):
                    f.write(f"{i},{a:.5f},{b:.5f}\n")
    for step in range(1, steps + 1):
        x, y = corpus.batch(8, 128, gen, "train")
        for d, (model, opt, sched) in runs.items():
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            curves[d].append(float(loss.detach()))
        if step % 25 == 0:
            print(f"gpt step {step}: loss fp32 state {curves['fp32'][-1]:.4f}, int8 state {curves['int8'][-1]:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            write_curves()
    write_curves()
    result = {}
    k = max(1, min(10, steps // 5))
    for d, (model, _, _) in runs.items():
        with torch.no_grad():
            val = sum(float(model(x, y)) for x, y in evals) / len(evals)
        losses = curves[d]
        result[d] = {"loss_first": round(sum(losses[:k]) / k, 4), "loss_last": round(sum(losses[-k:]) / k, 4),
                     "val_loss": round(val, 4)}
        print("gpt", d, json.dumps(result[d]), flush=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    a, b = result["fp32"]["loss_last"], result["int8"]["loss_last"]
    result["steps"] = steps
    result["int8_gpt_final_loss_rel_diff"] = round(abs(b - a) / a, 4)
    result["int8_gpt_val_loss_rel_diff"] = round(abs(result["int8"]["val_loss"] - result["fp32"]["val_loss"])
                                                 / result["fp32"]["val_loss"], 4)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="16M", help="params per kernel benchmark (default 16M)")
    ap.add_argument("--rounds", type=int, default=7, help="NVMe step rounds (part 2)")
    ap.add_argument("--pairs", type=int, default=21, help="timed pairs per kernel ratio (part 1)")
    ap.add_argument("--isa", default=None, help="force the native kernels' and the probe's ISA "
                    "(scalar, avx2, avx512, avx512_bf16; default: the best this CPU has)")
    ap.add_argument("--rules", default="AdamW,Adam,Lion,SGD,SGD_nesterov,Adagrad,Adafactor")
    ap.add_argument("--nvme-size", default="64M", help="params of the NVMe-state model (default 64M)")
    ap.add_argument("--block", default="4M", help="params per block (default 4M)")
    ap.add_argument("--nvme-path", default=None, help="swap directory (default: a temporary directory under /tmp)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gpt-steps", type=int, default=0, help="part 3: GPT steps per state dtype (300 for the claim)")
    ap.add_argument("--curve-csv", default=None, help="part 3: write both loss curves here")
    ap.add_argument("--skip-kernels", action="store_true", help="run only parts 2 and 3")
    ap.add_argument("--skip-nvme", action="store_true", help="skip part 2")
    args = ap.parse_args()
    if args.threads:
        set_num_threads(args.threads)
    torch.set_num_threads(args.threads or os.cpu_count())
    L = _native.lib()
    if args.isa:
        _native.kernel_set_isa(L, args.isa)
    n = parse_size(args.size)
    load = os.getloadavg()
    kernels = {} if args.skip_kernels else bench_kernels(args.rules.split(","), n, args.pairs, L)
    adam = get_rule("AdamW")
    claims = {"int8_state_bytes_per_param_rule": round(adam.bytes_per_param("nvme", "int8"), 3)}
    nvme = None
    if not args.skip_nvme:
        tmp = None
        path = args.nvme_path
        if path is None:
            tmp = path = tempfile.mkdtemp(prefix="bench_optim.", dir="/tmp")
        try:
            nvme = bench_nvme(path, parse_size(args.nvme_size), parse_size(args.block), args.rounds)
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        print("nvme", json.dumps(nvme), flush=True)
        claims["int8_state_bytes_per_param"] = round(nvme["int8_state_bytes"] / nvme["params"], 3)
        claims["int8_vs_fp32_nvme_step"] = nvme["int8_vs_fp32_nvme_step"]
    gpt = None
    if args.gpt_steps > 0:
        gpt = bench_gpt(args.gpt_steps, args.curve_csv)
        claims["int8_gpt_final_loss_rel_diff"] = gpt["int8_gpt_final_loss_rel_diff"]
    for name, r in kernels.items():
        claims[f"{name.lower()}_vs_torch"] = r["ours_vs_torch"]
        if "ours_vs_probe" in r:
            claims[f"{name.lower()}_vs_probe"] = r["ours_vs_probe"]
    targets = {k: 0.9 for k in claims if k.endswith("_vs_probe") and not k.startswith("adafactor")}
    targets.update({k: v for k, v in (("int8_state_bytes_per_param", 6.2), ("int8_vs_fp32_nvme_step", 1.6))
                    if k in claims})
    at_most = {"int8_state_bytes_per_param"}  # lower is better
    missed = [k for k, t in targets.items() if not (claims[k] <= t if k in at_most else claims[k] >= t)]
    print(json.dumps({"benchmark": "bench_optim", "size": n, "native": _native.native_info(),
                      "targets": targets, "missed": missed,
                      "load_before": [round(x, 2) for x in load], "load_after": [round(x, 2) for x in os.getloadavg()],
                      "kernels": kernels, "nvme": nvme, "gpt": gpt, "claims": claims}))


if __name__ == "__main__":
    sys.exit(main())
