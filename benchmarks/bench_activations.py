"""Activation offload to NVMe on a long sequence: peak host RSS, step time, bytes moved.

A Llama-shaped model (RMSNorm, rotary attention through SDPA, SwiGLU MLP, tied LM head) at
8192 tokens and a width at which the tensors saved for backward are most of the process's
memory, trained through the engine (optimizer state on the host) without and with
``offload_activations: nvme``, each without and with activation checkpointing (one
``torch.utils.checkpoint`` per layer). Training steps are real: forward, backward, update,
write-back.

* peak RSS: each configuration runs in a fresh subprocess (``ru_maxrss``), so the figures
  are not mixed with another configuration's allocations;
* step time: without and with offload, each configuration in a process of its own that
  steps on command, the two stepping in turn (never at once), warmed up alike: the claim is
  the median of the per-round ratios of paired steps (the disk's rate and the machine's load
  drift), with their quartiles beside it. Not one process: on a CPU device activation
  offload keeps allocations over 4 MiB mmapped process-wide (device.py), which slowed a
  baseline sharing its process by 5-8% (measured: 4.62-4.79 s against 4.39-4.45 s a step),
  while a user without offload has malloc untouched; likewise only the offload process asks
  for huge pages (device.prefer_huge_pages, as the offload command does for activation
  offload), which slowed plain torch training here (device.py). The claim holds "when the disk keeps
  up": a step's activation writes, at the disk's rate, fit in the forward's time without
  offload, and its reads in the backward's (the disk's rate: a probe in the offload
  process, before and after the rounds, writing and reading 512 MiB through an NVMe store
  configured as the engine's, O_DIRECT and checksummed; it has the disk to itself, the
  engine shares it with nothing but shares the CPU with compute). The output says which it
  was, with the figures;
* bytes moved: the engine's d2h / h2d bytes against the sizes of the tensors plain torch
  saves in the same forward (an outermost saved-tensor hook counting unique tensors of at
  least ``min_bytes`` that are not parameters).

    python benchmarks/bench_activations.py                   # the wide shape (SHAPES below)
    python benchmarks/bench_activations.py --shape narrow    # the shape the disk here cannot keep up with
    python benchmarks/bench_activations.py [--seq 8192] [--layers 3] [--hidden 384] [--mlp 2048] [--heads 3] ...

The output also gives each phase's time, the seconds the engine waited on NVMe per step
(writes: a pack with more than lookahead_bytes in flight; reads: an unpack before its read
landed) and the disk's busy-time rates.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import offload  # noqa: E402
from worker_process import WorkerProcess, serve  # noqa: E402


# Default shapes. "wide": the tensors saved for backward (1.4 GB a step) are about 80% of the
# process's peak RSS without offload, and the forward is long enough for the disk here to
# write them (a step's writes need about 0.7 of the forward: 0.93 s at the probed 1.5 GB/s,
# against a forward of ~1.35 s scaled from its CPU time to the narrow shape's quiet 0.64 s),
# so step_overhead is a figure of the engine; a step takes ~4 s on a quiet machine.
# "narrow" (the default until this version): about twice the saved bytes per FLOP, so a
# step's writes take longer than its forward here (0.74 s of 0.64 s) and the benchmark says
# the disk does not keep up.
SHAPES = {"wide": {"hidden": 384, "mlp": 2048, "heads": 3, "layers": 3, "lookahead_bytes": 128 << 20},
          "narrow": {"hidden": 128, "mlp": 4096, "heads": 2, "layers": 2, "lookahead_bytes": 64 << 20}}


# ---- the model ---------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Layer(nn.Module):
    def __init__(self, d, heads, mlp):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, mlp, bias=False), nn.Linear(d, mlp, bias=False)
        self.down = nn.Linear(mlp, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(B, T, self.heads, C // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(rotary(q, cos, sin), rotary(k, cos, sin), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab, d, layers, heads, mlp, seq, ckpt):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, mlp) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.ckpt = ckpt
        hd = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat((ang, ang), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((ang, ang), -1).sin(), persistent=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        cos, sin = self.cos[:idx.shape[1]], self.sin[:idx.shape[1]]
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False) if self.ckpt else layer(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def build(a, ckpt):
    torch.manual_seed(0)
    return Llama(a.vocab, a.hidden, a.layers, a.heads, a.mlp, a.seq, ckpt)


def engine(a, model, act):
    return offload.initialize(model, {
        "optimizer": {"lr": 1e-4}, "offload_optimizer": {"device": "cpu"},
        "offload_activations": {"device": act, "nvme_path": a.nvme_path, "min_bytes": a.min_bytes,
                                "lookahead_bytes": a.lookahead_bytes}})


def batch(a, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, a.vocab, (1, a.seq + 1), generator=g).to(offload.device.compute_device())
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def train_step(eng, a, step, peaks=None, phases=None):
    """One step, synchronized; with ``peaks`` (CUDA), appends the step's device peak above
    what was allocated when it started (activations and the step's working memory); with
    ``phases``, appends (forward seconds, backward and update seconds)."""
    x, y = batch(a, step)
    cuda = torch.cuda.is_available()
    if cuda and peaks is not None:
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    loss = eng(x, y)
    if phases is not None:
        eng.synchronize()
    t1 = time.perf_counter()
    eng.backward(loss)
    eng.step()
    eng.synchronize()
    t2 = time.perf_counter()
    if cuda and peaks is not None:
        peaks.append(torch.cuda.max_memory_allocated() - start)
    if phases is not None:
        phases.append((t1 - t0, t2 - t1))
    return t2 - t0


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- workers (fresh subprocesses) ---------------------------------------------------------------
def worker_rss(a):
    """One configuration, alone in this process: peak RSS over a few steps."""
    eng = engine(a, build(a, a.ckpt), a.act)
    times = [train_step(eng, a, s) for s in range(a.steps)]
    st = eng.stats().get("activations")
    eng.close()
    return {"maxrss_mb": maxrss_mb(), "step_s": times, "activations": st}


def plain_saved_bytes(a, model):
    """Unique saved tensors >= min_bytes that are not parameters, as plain torch saves them."""
    storages = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        n = t.numel() * t.element_size()
        if n >= a.min_bytes and t.untyped_storage().data_ptr() not in storages and id(t) not in seen:
            seen.add(id(t))
            total += n
        return t
    x, y = batch(a, 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def disk_rate(a, nbytes=512 << 20, piece=128 << 20) -> dict:
    """The disk's write and read rate (GB/s) under ``a.nvme_path`` as the engine's store
    moves data: an NvmeStore with the engine's aio settings (O_DIRECT, checksums), ``nbytes``
    in ``piece``-sized keys, all in flight at once, from and into page-aligned buffers."""
    from offload.storage.nvme import NvmeStore
    from offload.storage.pool import HostArena
    aio = offload.Config.from_any({}).aio
    n = nbytes // piece
    store = NvmeStore(a.nvme_path, backend=aio.backend, block_size=aio.block_size, queue_depth=aio.queue_depth,
                      threads=aio.thread_count, checksum=aio.checksum, name="bench-probe")
    arena = HostArena(nbytes, pin=False, name="bench-probe")
    try:
        store.reserve({f"p{i}": piece for i in range(n)})
        bufs = [arena.try_acquire(piece).view(torch.uint8, piece) for _ in range(n)]
        for b in bufs:
            b.random_(0, 256)
        out = {}
        for what in ("write", "read"):
            t0 = time.perf_counter()
            ios = [getattr(store, what)(f"p{i}", b) for i, b in enumerate(bufs)]
            for io in ios:
                io.wait(600)
            out[what] = nbytes / (time.perf_counter() - t0) / 1e9
        return out
    finally:
        store.close()
        arena.close()


def worker_stepper(a):
    """One configuration (``a.act``) in this process, stepping on command
    (benchmarks/worker_process.py). Requests: ``saved`` (plain torch's saved bytes, before the
    engine exists), ``step`` (one synchronized training step), ``probe`` (the disk's rate),
    ``stats`` (the engine's activation stats). The engine is closed once stdin closes."""
    eng = None

    def handle(req: dict) -> dict:
        nonlocal eng
        op = req["op"]
        if op == "saved":
            return {"bytes": plain_saved_bytes(a, build(a, a.ckpt))}
        if op == "step":
            if eng is None:
                eng = engine(a, build(a, a.ckpt), a.act)
            peaks, phases = [], []
            t = train_step(eng, a, req["step"], peaks, phases)
            return {"s": t, "forward_s": phases[0][0], "backward_s": phases[0][1], "peak": peaks[0] if peaks else 0}
        if op == "probe":
            return disk_rate(a)
        if op == "stats":
            return eng.stats().get("activations") or {}
        raise ValueError(f"stepper: unknown request {op!r}")
    serve(handle)
    if eng is not None:
        eng.close()


class Stepper(WorkerProcess):
    """A ``worker_stepper`` subprocess for one configuration (``act``)."""

    def __init__(self, a, act: str):
        super().__init__(worker_args(a, "stepper", act=act), f"bench_activations' {act} stepper", timeout_s=900.0)
        self.act = act


def quartiles(xs) -> list:
    """[first quartile, third quartile] of ``xs`` (inclusive method; both the value for one)."""
    if len(xs) < 2:
        return [xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


def time_paired(a, ckpt: bool, tier: str, rounds: int) -> dict:
    """Without and with offload (``tier``), each in its own stepper process, stepping in turn:
    one warm-up step each, then ``rounds`` rounds of one step each, the order alternating
    (base first in even rounds); the claim is the median of the per-round ratios."""
    a = argparse.Namespace(**{**vars(a), "ckpt": ckpt, "tier": tier})
    base, off = Stepper(a, "none"), Stepper(a, tier)
    try:
        saved = base.call(op="saved")["bytes"]
        base.call(op="step", step=0)
        off.call(op="step", step=0)                      # the first step reserves swap files
        probes = [off.call(op="probe")] if tier == "nvme" else []
        s0 = off.call(op="stats")
        ratios, steps = [], {"none": [], tier: []}
        for r in range(rounds):
            order = (base, off) if r % 2 == 0 else (off, base)
            got = {st.act: st.call(op="step", step=r + 1) for st in order}
            for k, v in got.items():
                steps[k].append(v)
            ratios.append(got[tier]["s"] / got["none"]["s"])
        s1 = off.call(op="stats")
        if tier == "nvme":
            probes.append(off.call(op="probe"))
    finally:
        base.close()
        off.close()
    tb, to = steps["none"], steps[tier]
    waits = {d: (s1["wait_s"][d] - s0["wait_s"][d]) / rounds for d in ("write", "read")}
    late = (s1["prefetch"]["late"] - s0["prefetch"]["late"]) / rounds
    per_step = {k: (s1["bytes_moved"][k] - s0["bytes_moved"].get(k, 0)) / rounds for k in s1["bytes_moved"]}
    med = lambda xs, k: statistics.median(x[k] for x in xs)   # noqa: E731
    return {"step_overhead": statistics.median(ratios), "step_overhead_quartiles": quartiles(ratios),
            "pair_ratios": ratios, "base_step_s": med(tb, "s"), "offload_step_s": med(to, "s"),
            "plain_saved_bytes": saved, "moved_per_step": per_step, "activations": s1, "wait_s_per_step": waits,
            "late_reads_per_step": late, "base_forward_s": med(tb, "forward_s"),
            "base_backward_s": med(tb, "backward_s"), "offload_forward_s": med(to, "forward_s"),
            "offload_backward_s": med(to, "backward_s"),
            "disk_gbps": {d: statistics.mean(p[d] for p in probes) for d in ("write", "read")} if probes else {},
            "device_step_peak": {"none": max(x["peak"] for x in tb), tier: max(x["peak"] for x in to)}}


def worker_args(a, mode, **kw) -> list:
    args = [sys.executable, os.path.abspath(__file__), "--worker", mode]
    for k, v in {**vars(a), **kw}.items():
        if k in ("worker",) or v is None:
            continue
        if isinstance(v, bool):
            if v:
                args.append(f"--{k.replace('_', '-')}")
        else:
            args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def run_worker(a, mode, **kw) -> dict:
    out = subprocess.run(worker_args(a, mode, **kw), check=True, capture_output=True, text=True,
                         env={**os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def disk_budget(t: dict) -> dict:
    """Seconds the disk needs for one step's activation writes and reads at its probed rate,
    against the time the step gives them without offload: the forward for the writes (a
    tensor is written while the forward goes on), the backward and update for the reads."""
    mv, g = t["moved_per_step"], t["disk_gbps"]
    return {"write_s": mv.get("nvme_write", 0) / (g["write"] * 1e9), "forward_s": t["base_forward_s"],
            "read_s": mv.get("nvme_read", 0) / (g["read"] * 1e9), "backward_s": t["base_backward_s"]}


def disk_keeps_up(t: dict) -> bool:
    """A step's writes fit in the forward's time and its reads in the backward's, at the
    disk's probed rate."""
    b = disk_budget(t)
    return b["write_s"] <= b["forward_s"] and b["read_s"] <= b["backward_s"]


def device_check(a, load):
    """On CUDA: activations to pinned host memory on side streams, against keeping them."""
    if not torch.cuda.is_available():
        sys.exit("bench_activations --device-check needs CUDA")
    out = {}
    for ckpt in (False, True):
        t = time_paired(a, ckpt, "cpu", a.rounds if not ckpt else a.rounds_checkpointed)
        per_layer = t["plain_saved_bytes"] / a.layers
        bound = a.lookahead_bytes + per_layer
        held = t["activations"]["device_bytes_peak"]
        peak = t["device_step_peak"]
        out["checkpointed" if ckpt else "plain"] = {
            "step_overhead": t["step_overhead"], "step_overhead_quartiles": t["step_overhead_quartiles"],
            "base_step_s": t["base_step_s"],
            "offload_step_s": t["offload_step_s"], "saved_bytes_per_step": t["plain_saved_bytes"],
            "offloaded_held_on_device_peak": held, "bound_lookahead_plus_one_layer": bound,
            "device_step_peak_none": peak["none"], "device_step_peak_offload": peak["cpu"],
            "gbps": t["activations"]["gbps"], "prefetch": t["activations"]["prefetch"]}
        print(f"checkpointing={ckpt}: step {t['base_step_s']:.3f} s -> {t['offload_step_s']:.3f} s "
              f"({t['step_overhead']:.3f}x, quartiles {t['step_overhead_quartiles'][0]:.3f}-"
              f"{t['step_overhead_quartiles'][1]:.3f} of {len(t['pair_ratios'])} pairs); device step peak {peak['none'] / 2**20:.0f} -> {peak['cpu'] / 2**20:.0f} MiB; "
              f"offloaded tensors held on the device at most {held / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB)")
    claims = {"gpu_step_overhead": out["plain"]["step_overhead"],
              "gpu_step_overhead_checkpointed": out["checkpointed"]["step_overhead"],
              "gpu_saved_device_peak_vs_bound": out["plain"]["offloaded_held_on_device_peak"]
              / out["plain"]["bound_lookahead_plus_one_layer"],
              "gpu_device_step_peak_with_vs_without": out["plain"]["device_step_peak_offload"]
              / max(1, out["plain"]["device_step_peak_none"])}
    targets_max = {"gpu_step_overhead": 1.05, "gpu_saved_device_peak_vs_bound": 1.0}
    missed = [k for k, t in targets_max.items() if not claims[k] <= t]
    print(json.dumps({"bench": "activations_gpu", "load": list(load), "results": out, "claims": claims,
                      "targets_max": targets_max, "missed": missed}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="wide",
                   help="defaults of the flags below: " + "; ".join(f"{k}: {v}" for k, v in sorted(SHAPES.items())))
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--mlp", type=int, default=None)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--min-bytes", type=int, default=1 << 20)
    p.add_argument("--lookahead-bytes", type=int, default=None)
    p.add_argument("--steps", type=int, default=2, help="steps per RSS run")
    p.add_argument("--rounds", type=int, default=9,
                   help="timing rounds without checkpointing (one step each without and with offload)")
    p.add_argument("--rounds-checkpointed", type=int, default=3,
                   help="timing rounds with checkpointing (its step time is reported, not a claim)")
    p.add_argument("--nvme-path", default=None, help="swap directory (default: a temporary one)")
    p.add_argument("--device-check", action="store_true",
                   help="GPU figures only (for gpu_check.sh): offload_activations cpu (pinned host, side "
                        "streams) against none: step time and device peak of saved activations")
    p.add_argument("--tier", default="nvme", help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--act", default="none", help=argparse.SUPPRESS)
    a = p.parse_args()
    for k, v in SHAPES[a.shape].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.worker:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        if a.act != "none":
            offload.device.prefer_huge_pages()     # as the offload command does (device.py)
        if a.worker == "stepper":
            return worker_stepper(a)
        out = worker_rss(a)
        print(json.dumps(out))
        return
    tmp = None
    if a.nvme_path is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-act-", dir=os.environ.get("OFFLOAD_BENCH_DIR", "/tmp"))
        a.nvme_path = tmp.name
    need = 4 * a.seq * (a.mlp * 6 + a.hidden * 12) * a.layers + 4 * a.seq * a.vocab * 3
    free = __import__("shutil").disk_usage(a.nvme_path).free
    if free < 3 * need:
        sys.exit(f"bench_activations: {free / 2**30:.1f} GiB free under {a.nvme_path}, need about "
                 f"{3 * need / 2**30:.1f} GiB: pass --nvme-path on a larger disk or lower --seq")
    load = os.getloadavg()
    if a.device_check:
        return device_check(a, load)
    print(f"Llama-shaped: {a.layers} layers, d={a.hidden}, mlp={a.mlp}, heads={a.heads}, vocab={a.vocab}, "
          f"{a.seq} tokens; min_bytes={a.min_bytes}, lookahead={a.lookahead_bytes >> 20} MiB; "
          f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"{'checkpointing':>13} {'RSS none MiB':>12} {'RSS nvme MiB':>12} {'ratio':>6} {'step none s':>11} "
          f"{'step nvme s':>11} {'overhead':>8} {'quartiles':>11} {'pairs':>5} {'disk ok':>7} {'moved/saved':>11}")
    results = {}
    for ckpt in (False, True):
        r_none = run_worker(a, "rss", ckpt=ckpt, act="none")
        r_nvme = run_worker(a, "rss", ckpt=ckpt, act="nvme")
        t = time_paired(a, ckpt, a.tier, a.rounds_checkpointed if ckpt else a.rounds)
        mv = t["moved_per_step"]
        moved_vs_saved = mv["d2h"] / t["plain_saved_bytes"] if t["plain_saved_bytes"] else math.nan
        back_vs_saved = mv["h2d"] / t["plain_saved_bytes"] if t["plain_saved_bytes"] else math.nan
        res = {"rss_none_mib": r_none["maxrss_mb"], "rss_nvme_mib": r_nvme["maxrss_mb"],
               "rss_with_vs_without": r_nvme["maxrss_mb"] / r_none["maxrss_mb"],
               "step_overhead": t["step_overhead"], "step_overhead_quartiles": t["step_overhead_quartiles"],
               "pair_ratios": t["pair_ratios"], "base_step_s": t["base_step_s"],
               "offload_step_s": t["offload_step_s"], "disk_keeps_up": disk_keeps_up(t),
               "disk_gbps": t["disk_gbps"], "disk_budget_s": disk_budget(t),
               "phases_s": {k: t[k] for k in ("base_forward_s", "base_backward_s", "offload_forward_s",
                                               "offload_backward_s")},
               "saved_bytes_per_step": t["plain_saved_bytes"], "moved_per_step": mv,
               "moved_vs_saved": moved_vs_saved, "back_vs_saved": back_vs_saved,
               "gbps": t["activations"]["gbps"], "prefetch": t["activations"]["prefetch"],
               "wait_s_per_step": t["wait_s_per_step"], "late_reads_per_step": t["late_reads_per_step"],
               "read_window": t["activations"].get("read_window")}
        results["checkpointed" if ckpt else "plain"] = res
        q = res["step_overhead_quartiles"]
        print(f"{str(ckpt):>13} {res['rss_none_mib']:12.0f} {res['rss_nvme_mib']:12.0f} "
              f"{res['rss_with_vs_without']:6.2f} {res['base_step_s']:11.2f} {res['offload_step_s']:11.2f} "
              f"{res['step_overhead']:8.3f} {q[0]:5.3f}-{q[1]:5.3f} {len(res['pair_ratios']):5d} "
              f"{str(res['disk_keeps_up']):>7} {moved_vs_saved:11.4f}")
    plain = results["plain"]
    b = plain["disk_budget_s"]
    print(f"disk (probed): write {plain['disk_gbps']['write']:.2f} GB/s, read {plain['disk_gbps']['read']:.2f} GB/s; "
          f"a step's writes need {b['write_s']:.2f} s of a {b['forward_s']:.2f} s forward, its reads "
          f"{b['read_s']:.2f} s of a {b['backward_s']:.2f} s backward")
    for name, r in results.items():
        ph, w = r["phases_s"], r["wait_s_per_step"]
        print(f"{name}: forward {ph['base_forward_s']:.2f} -> {ph['offload_forward_s']:.2f} s, backward and update "
              f"{ph['base_backward_s']:.2f} -> {ph['offload_backward_s']:.2f} s; the engine waited {w['write']:.2f} s "
              f"per step for writes, {w['read']:.2f} s for reads ({r['late_reads_per_step']:.0f} landed late); "
              f"nvme GB/s (busy time) write {r['gbps'].get('nvme_write', 0):.2f}, read {r['gbps'].get('nvme_read', 0):.2f}")
    if not plain["disk_keeps_up"]:
        print("the disk does not keep up: a step's activation writes or reads take longer at the disk's rate than "
              "the forward or backward they overlap, so step_overhead measures the disk, not the engine")
    claims = {"rss_with_vs_without": plain["rss_with_vs_without"],
              "rss_with_vs_without_checkpointed": results["checkpointed"]["rss_with_vs_without"],
              "step_overhead": plain["step_overhead"],
              "step_overhead_quartiles": plain["step_overhead_quartiles"],
              "step_overhead_checkpointed": results["checkpointed"]["step_overhead"],
              "step_overhead_checkpointed_quartiles": results["checkpointed"]["step_overhead_quartiles"],
              "disk_keeps_up": plain["disk_keeps_up"],
              "bytes_moved_vs_saved": plain["moved_vs_saved"],
              "bytes_moved_vs_saved_checkpointed": results["checkpointed"]["moved_vs_saved"]}
    if tmp is not None:
        tmp.cleanup()
    print(json.dumps({"bench": "activations", "load": list(load), "config": {k: v for k, v in vars(a).items()
                      if k not in ("worker", "ckpt", "act")}, "results": results, "claims": claims}))


if __name__ == "__main__":
    main()
