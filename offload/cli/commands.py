"""The ``offload`` command.

    offload train     fine-tune the built-in small GPT on a local corpus through the engine
    offload estimate  bytes per tier for every placement, against this machine
    offload plan      measure this machine, rank the placements by predicted step time
    offload bench     run benchmarks/bench_<name>.py
    offload export    consolidated fp32 weights from a checkpoint (.pt or .safetensors)

Errors in what the user gave (config, flags, paths) print one line, ``offload: error: ...``,
and exit with status 2; no traceback.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import List, Optional

from offload import config as config_mod
from offload.config import ConfigError

EXIT_USAGE = 2
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CLIError(Exception):
    """A problem with what the user asked for; printed as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, but errors read ``offload: error: ...`` and name the nearest flag."""

    def error(self, message):
        raise CLIError(message)

    def parse_args(self, args=None, namespace=None):
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            sub = getattr(ns, "_parser", self)
            if getattr(ns, "command", None) == "bench":   # the rest goes to the benchmark
                ns.bench_args = list(ns.bench_args) + extra
                return ns
            raise CLIError(config_mod.unknown_flag_message(sub, extra[0]))
        return ns


# ---- formatting -----------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    from offload.cli.progress import fmt_bytes as f
    return f(n)


def format_summary(stats: dict) -> List[str]:
    """Time per stage, GB moved per link and GB/s, bytes per tier, from ``engine.stats()``."""
    lines = [f"summary after {stats.get('step', 0)} optimizer steps:"]
    secs = stats.get("seconds") or {}
    if secs:
        lines.append("  time per stage (s, all threads): " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(secs.items(), key=lambda kv: -kv[1])))
    moved = stats.get("bytes") or {}
    if moved:
        rates = stats.get("gbps") or {}
        lines.append("  moved per link: " + ", ".join(
            f"{k} {v / 1e9:.2f} GB at {rates.get(k, 0.0):.2f} GB/s" for k, v in sorted(moved.items())))
    tiers = stats.get("tier_bytes") or {}
    if tiers:
        lines.append("  bytes per tier: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in tiers.items()))
    peaks = dict(stats.get("peaks") or {})
    if stats.get("device_param_bytes_peak") is not None:
        peaks["device params"] = stats["device_param_bytes_peak"]
    if peaks:
        lines.append("  peaks: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in peaks.items()))
    if stats.get("loss_scale") is not None or stats.get("skipped_steps"):
        lines.append(f"  loss scale {stats.get('loss_scale')}, skipped steps {stats.get('skipped_steps', 0)}")
    return lines


# ---- train ----------------------------------------------------------------------------------------
TRAIN_DEFAULTS = {"optimizer": {"lr": 2e-3, "betas": (0.9, 0.95), "weight_decay": 0.0},
                  "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}


def _train_config(args) -> tuple:
    """(Config, temporary NVMe dir or None). Without --config the train defaults apply
    (parameters and optimizer state on NVMe, in a temporary directory unless --nvme-path)."""
    import copy
    import torch
    base = None if args.config else copy.deepcopy(TRAIN_DEFAULTS)
    d = config_mod.flags_to_dict(args, base=base)
    if "precision" not in d and not args.config:
        d["precision"] = "bf16" if torch.cuda.is_available() else "fp32"
    tmp = None
    for tier in ("offload_optimizer", "offload_param"):
        sec = d.get(tier) or {}
        if sec.get("device") == "nvme" and not sec.get("nvme_path"):
            if tmp is None:
                tmp = tempfile.mkdtemp(prefix="nvme-tier-")   # not "offload-*": that is the store's run-dir prefix
            sec["nvme_path"] = tmp
    try:
        cfg = config_mod.build_config(d)
        cfg.check_paths()      # before any model memory: the same messages initialize gives
        return cfg, tmp
    except BaseException:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _initialize(model_fn, cfg, say):
    """The engine for a fresh model; parameter offload falls back to none (one line) when the
    engine does not support it yet."""
    import offload
    try:
        return offload.initialize(model_fn(), cfg), cfg
    except NotImplementedError as exc:
        if cfg.offload_param.device == "none":
            raise
        say(f"offload: note: {exc}; continuing with offload_param none")
        cfg = cfg.replace(offload_param=config_mod.OffloadParamConfig())
        return offload.initialize(model_fn(), cfg), cfg


def _lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac))
    return f


def _eval_loss(model, batches) -> float:
    import torch
    was = model.training
    model.eval()
    with torch.no_grad():
        loss = sum(float(model(x, y)) for x, y in batches) / len(batches)
    model.train(was)
    return loss


def _sample(model, prompt: str, n: int, seed: int) -> str:
    import torch
    from offload.cli.corpus import decode, encode
    g = torch.Generator().manual_seed(seed)
    idx = encode(prompt).long()[None]
    model.eval()
    with torch.no_grad():
        for _ in range(n):
            logits = model(idx[:, -model.cfg.block_size:])[0, -1].float()
            probs = torch.softmax(logits / 0.8, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)[None]], dim=1)
    return decode(idx[0, len(prompt.encode()):].tolist())


def _plot(csv_rows, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r[0] for r in csv_rows]
    losses = [r[1] for r in csv_rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, lw=0.8, label="train loss")
    k = max(1, len(losses) // 20)
    smooth = [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1]) for i in range(len(losses))]
    ax.plot(steps, smooth, lw=1.6, label=f"mean of {k + 1}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def cmd_train(args) -> int:
    import torch
    from offload.cli.corpus import Corpus
    from offload.models.gpt import GPT, GPTConfig
    from offload.cli.progress import Progress

    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2:
        raise CLIError("--steps, --batch-size must be >= 1 and --seq-len >= 2")
    try:
        gcfg = GPTConfig(block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    except ValueError as exc:
        raise CLIError(f"model: {exc}") from None
    try:
        corpus = Corpus.load(args.corpus)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(f"--corpus: {exc}") from None
    cfg, tmp_nvme = _train_config(args)     # validated before any model memory is allocated
    out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    say = print
    engine = None
    try:
        torch.manual_seed(args.seed)
        gen = torch.Generator().manual_seed(args.seed)
        eval_gen = torch.Generator().manual_seed(args.seed + 1)
        eval_batches = [corpus.batch(args.batch_size, args.seq_len, eval_gen, "val") for _ in range(4)]

        def build():
            torch.manual_seed(args.seed)
            return GPT(gcfg)
        probe = build()
        val_start = _eval_loss(probe, eval_batches)
        n_params = sum(p.numel() for p in probe.parameters())
        del probe
        engine, cfg = _initialize(build, cfg, say)
        device = engine.device
        say(f"offload train: GPT {n_params / 1e6:.2f}M params ({gcfg.n_layer} layers, d={gcfg.n_embd}), "
            f"corpus {corpus.name} ({corpus.train.numel() / 1e3:.0f} KB), {args.steps} steps x "
            f"{args.batch_size}x{args.seq_len} tokens, precision {cfg.precision}, device {device}")
        say(f"  tiers: optimizer state -> {cfg.offload_optimizer.device}, parameters -> "
            f"{cfg.offload_param.device}" + (f", nvme path {tmp_nvme} (temporary)" if tmp_nvme else "")
            + f"; output {out}")
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({"engine": cfg.to_dict(), "model": gcfg.__dict__, "train": {
                k: getattr(args, k) for k in ("steps", "batch_size", "seq_len", "warmup", "seed", "corpus")}},
                f, indent=2, default=str)
        warmup = min(args.warmup, max(1, args.steps // 10))
        sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, _lr_lambda(warmup, args.steps))
        gas = cfg.gradient_accumulation_steps
        bar = Progress(args.steps, interval=args.log_every)
        rows, ema = [], None
        tokens = 0
        t_start = time.perf_counter()
        deadline = t_start + args.max_minutes * 60 if args.max_minutes > 0 else float("inf")
        stopped_early = False
        for step in range(1, args.steps + 1):
            total = 0.0
            for _ in range(gas):
                x, y = corpus.batch(args.batch_size, args.seq_len, gen, "train", device)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()               # a no-op until the accumulation boundary
                total += float(loss.detach())
                tokens += x.numel()
            sched.step()
            loss_v = total / gas
            if not math.isfinite(loss_v):
                raise CLIError(f"the loss became {loss_v} at step {step}: lower --lr")
            ema = loss_v if ema is None else 0.9 * ema + 0.1 * loss_v
            elapsed = time.perf_counter() - t_start
            rows.append((step, loss_v, sched.get_last_lr()[0], tokens, elapsed))
            if bar.due(step):
                bar.update(step, loss=ema, tok_s=tokens / elapsed, tiers=engine.stats().get("tier_bytes"))
            if time.perf_counter() > deadline and step < args.steps:
                bar.update(step, force=True, loss=ema, tok_s=tokens / elapsed,
                           tiers=engine.stats().get("tier_bytes"))
                stopped_early = True
                break
        bar.close()
        train_s = time.perf_counter() - t_start
        if stopped_early:
            say(f"offload: note: stopped at step {rows[-1][0]} of {args.steps}: --max-minutes {args.max_minutes} reached")

        with open(os.path.join(out, "loss.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "loss", "lr", "tokens", "seconds"])
            for r in rows:
                w.writerow([r[0], f"{r[1]:.5f}", f"{r[2]:.6g}", r[3], f"{r[4]:.3f}"])
        ckpt = None
        if not args.no_checkpoint:
            ckpt = engine.save_checkpoint(os.path.join(out, "checkpoint"))
        stats = engine.stats()
        if args.trace:
            engine.telemetry.chrome_trace(args.trace)
        trained = GPT(gcfg)
        trained.load_state_dict(engine.full_state_dict())
        val_end = _eval_loss(trained, eval_batches)
        k = max(1, min(10, len(rows) // 5))
        first = sum(r[1] for r in rows[:k]) / k
        last = sum(r[1] for r in rows[-k:]) / k
        summary = {"steps": rows[-1][0], "train_seconds": train_s, "tokens": tokens,
                   "tokens_per_s": tokens / train_s, "loss_first": first, "loss_last": last,
                   "val_loss_start": val_start, "val_loss_end": val_end, "checkpoint": ckpt,
                   "placement": {"optimizer": cfg.offload_optimizer.device, "param": cfg.offload_param.device},
                   "stats": stats}
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
        png = _plot([(r[0], r[1]) for r in rows], os.path.join(out, "loss.png"))
        say(f"loss {first:.3f} -> {last:.3f} (mean of first/last {k} steps); validation {val_start:.3f} -> "
            f"{val_end:.3f}; {train_s:.1f} s, {tokens / train_s:,.0f} tokens/s")
        for line in format_summary(stats):
            say(line)
        if args.sample > 0:
            say("sample: " + repr(_sample(trained, "The ", args.sample, args.seed)))
        say(f"wrote {out}/: loss.csv, " + ("loss.png, " if png else "") + ("checkpoint/, " if ckpt else "")
            + "summary.json, config.json" + (f"; trace {args.trace}" if args.trace else "")
            + ("" if png else " (pip install matplotlib for loss.png)"))
        return 0
    finally:
        try:
            if engine is not None:
                engine.close()
        finally:
            if tmp_nvme:
                shutil.rmtree(tmp_nvme, ignore_errors=True)


# ---- estimate -------------------------------------------------------------------------------------
def _model_spec(args, default_gpt: bool = False):
    from offload.planner import estimate as est
    given = [x for x in ("params", "hf_config", "model") if getattr(args, x) is not None]
    if len(given) > 1:
        raise CLIError("give the model once: --params, --hf-config or --model")
    if args.params is not None:
        return est.spec_from_counts(args.params, args.largest_layer)
    if args.largest_layer is not None:
        raise CLIError("--largest-layer needs --params")
    if args.hf_config is not None:
        return est.spec_from_hf_config(args.hf_config)
    if args.model is not None:
        return est.spec_from_callable(args.model)
    if default_gpt:
        return None
    raise CLIError("no model: give --params N [--largest-layer N], --hf-config PATH or --model pkg.mod:fn")


def _size(text, flag):
    return None if text is None else config_mod.parse_bytes(text, flag)


def cmd_estimate(args) -> int:
    from offload.planner import estimate as est
    spec = _model_spec(args)
    machine = est.this_machine(args.nvme_path, _size(args.device_memory, "--device-memory"))
    rows = est.estimate(spec, args.precision, args.world_size, args.buffer_count, args.gradient_clipping,
                        args.gradient_accumulation_steps, _size(args.grad_host_bytes, "--grad-host-bytes"))
    if args.json:
        print(json.dumps({"model": spec.__dict__, "machine": machine.__dict__, "placements": [
            {**r.__dict__, "fit": est.check_fit(r, machine)} for r in rows],
            "deepspeed_reference": est.deepspeed_reference(spec, args.world_size)}, indent=2))
        return 0
    print(spec.describe() + f"; precision {args.precision}, world size {args.world_size}"
          + ("" if spec.exact else "; largest layer assumed params/12 (give --largest-layer)"))
    print("bytes per tier for each placement (model states only: activations come on top, on the device;"
          "\n device per rank, host and nvme per node):")
    hdr = f"  {'optimizer':<10}{'param':<7}{'device':>11}{'pinned':>11}{'host':>11}{'host total':>12}{'nvme':>11}  fits"
    print(hdr)
    for r in rows:
        fit = est.check_fit(r, machine)
        verdict = "yes" if est.fits(r, machine) else "no (" + ", ".join(k for k, v in fit.items() if v is False) + ")"
        if fit["device"] is None and est.fits(r, machine):
            verdict = "yes, if the device has room"
        print(f"  {r.optimizer:<10}{r.param:<7}{fmt_bytes(r.device):>11}{fmt_bytes(r.pinned):>11}"
              f"{fmt_bytes(r.host):>11}{fmt_bytes(r.host_total):>12}{fmt_bytes(r.nvme):>11}  {verdict}")
    dev = ("unknown (no accelerator; give --device-memory)" if machine.device_bytes is None
           else f"{fmt_bytes(machine.device_bytes)} ({machine.device_name})")
    print(f"this machine: device {dev}; host {fmt_bytes(machine.host_available)} available; "
          f"nvme {fmt_bytes(machine.nvme_free)} free at {machine.nvme_path}")
    print(f"  (fits: under {est.DEVICE_MARGIN:.0%} of the device, {est.HOST_MARGIN:.0%} of available host "
          f"memory, {est.NVME_MARGIN:.0%} of free disk)")
    if args.deepspeed:
        print("DeepSpeed's estimators for comparison (buffer factor 1.5 on host):")
        for k, v in est.deepspeed_reference(spec, args.world_size).items():
            print(f"  {k:<34} device {fmt_bytes(v['device']):>10}  host {fmt_bytes(v['host']):>10}")
    return 0


# ---- plan -----------------------------------------------------------------------------------------
def _gpt_case(args):
    import torch
    from offload.planner import estimate as est
    from offload.models.gpt import GPT, GPTConfig
    from offload.planner.plan import CheckCase
    gcfg = GPTConfig(block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    gen = torch.Generator().manual_seed(0)

    def batch():
        x = torch.randint(0, gcfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)
        return x, torch.roll(x, -1, 1)

    def build():
        torch.manual_seed(0)
        return GPT(gcfg)
    with torch.device("meta"):
        spec = est.spec_from_module(GPT(gcfg), f"GPT {gcfg.n_layer}x{gcfg.n_embd}")
    return CheckCase(spec.name, build, batch, spec)


def _bench_step_case(layers=12, numel=1 << 20, fwd_ms=3.0, bwd_ms=6.0):
    """benchmarks/bench_step.py's model (compute simulated by GIL-free waits), when present."""
    import importlib.util
    import torch
    from offload.planner import estimate as est
    from offload.planner.plan import CheckCase, Compute
    path = os.path.join(REPO_ROOT, "benchmarks", "bench_step.py")
    if not os.path.isfile(path):
        return None
    spec_ = importlib.util.spec_from_file_location("_offload_bench_step", path)
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)

    def build():
        torch.manual_seed(0)
        return mod.Stack(layers, numel, fwd_ms / 1e3, bwd_ms / 1e3)
    x = torch.ones(8, requires_grad=True)
    spec = est.ModelSpec(layers * numel, numel, numel, f"bench_step {layers}x{numel / 1e6:.0f}M", layers)
    compute = Compute(layers * fwd_ms / 1e3, layers * bwd_ms / 1e3, False, False)
    return CheckCase(spec.name, build, lambda: (x,), spec, compute)


def cmd_plan(args) -> int:
    import torch
    from offload.planner import estimate as est
    from offload.planner import plan
    nvme_path = args.nvme_path or tempfile.gettempdir()
    if not os.path.isdir(nvme_path):
        raise CLIError(f"--nvme-path {nvme_path!r} does not exist: give an existing directory")
    if args.profile:
        try:
            profile = plan.Profile.load(args.profile)
        except (FileNotFoundError, ValueError) as exc:
            raise CLIError(str(exc)) from None
        print(f"profile {args.profile} (measured {profile.created} on {profile.device})")
    else:
        print("measuring this machine (CPU Adam, copies, NVMe, matmul; a few seconds) ...", flush=True)
        profile = plan.measure_profile(nvme_path)
        if args.save_profile:
            profile.save(args.save_profile)
            print(f"saved the profile to {args.save_profile}")
    print(f"  CPU Adam {profile.adam_params_per_s / 1e9:.2f} Gparam/s ({profile.adam_backend}); device Adam "
          f"{profile.device_adam_params_per_s / 1e9:.2f} Gparam/s; h2d {profile.h2d_gbps:.1f} GB/s, d2h "
          f"{profile.d2h_gbps:.1f} GB/s" + (" (host memcpy: no accelerator)" if not profile.cuda else "")
          + f"; nvme read {profile.nvme_read_gbps:.2f} GB/s, write {profile.nvme_write_gbps:.2f} GB/s "
          f"({profile.io_backend}, {profile.nvme_read_latency_s * 1e3:.2f}/{profile.nvme_write_latency_s * 1e3:.2f} ms per request, duplex {profile.nvme_duplex:.0%}); matmul {profile.matmul_tflops:.2f} TFLOP/s")

    if args.check:
        return _plan_check(args, profile, nvme_path)

    spec = _model_spec(args, default_gpt=True)
    tokens = args.batch_size * args.seq_len
    if spec is None:      # the built-in GPT (offload train's model): measure its compute
        case = _gpt_case(args)
        spec = case.spec
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        compute = plan.measure_compute(case.build(), case.make_batch, device)
    else:
        compute = plan.flops_compute(spec, tokens, profile)
    machine = est.this_machine(nvme_path, _size(args.device_memory, "--device-memory"))
    ranked = plan.rank(spec, profile, compute, machine, args.precision, args.gradient_accumulation_steps,
                       args.gradient_clipping > 0)
    print(spec.describe() + f"; {tokens} tokens per micro-step, precision {args.precision}")
    print(f"compute (forward+backward) {compute.total_s * 1e3:.1f} ms per micro-step, "
          + ("measured on the device without offload" if compute.measured
             else "from 6 x params x tokens at the measured matmul rate"))
    print(f"  {'rank':<5}{'optimizer':<10}{'param':<7}{'step':>10}{'tokens/s':>11}  {'bottleneck':<11}"
          f"{'device':>10}{'host':>10}{'nvme':>10}  fits")
    for i, r in enumerate(ranked, 1):
        p, m = r.prediction, r.memory
        fit = "yes" if r.fits and r.fit["device"] else ("yes, if the device has room" if r.fits else
              "no (" + ", ".join(k for k, v in r.fit.items() if v is False) + ")")
        tok_s = tokens * args.gradient_accumulation_steps / p.step_s
        print(f"  {i:<5}{m.optimizer:<10}{m.param:<7}{p.step_s * 1e3:>8.1f}ms{tok_s:>11,.0f}  {p.bottleneck:<11}"
              f"{fmt_bytes(m.device):>10}{fmt_bytes(m.host_total):>10}{fmt_bytes(m.nvme):>10}  {fit}")
    base = plan.fits_without_offload(ranked)
    if base is not None:
        slowest = max(ranked, key=lambda r: r.prediction.step_s)
        print(f"the model fits on the device without offload ({fmt_bytes(base.memory.device)} of "
              f"{fmt_bytes(machine.device_bytes)}): train with offload_optimizer none, offload_param none. "
              f"Offloading it only slows it down (up to {slowest.prediction.step_s / base.prediction.step_s:.1f}x "
              "slower per step here).")
    elif machine.device_bytes is None:
        print("no accelerator memory size known: give --device-memory (e.g. 24GiB) to check the device tier")
    else:
        best = next((r for r in ranked if r.fits), None)
        if best is None:
            print("no placement fits this machine: more host memory, disk, or ranks (--world-size in estimate)")
        else:
            print(f"best placement that fits: --offload-optimizer {best.memory.optimizer} "
                  f"--offload-param {best.memory.param} ({best.prediction.step_s * 1e3:.1f} ms per step)")
    print("model: step = max over resources + the rest / blocks (exposed first fetch and last update); "
          "see `python -c 'import offload.planner.plan; help(offload.planner.plan)'`")
    return 0


def est_tiers():
    from offload.planner.estimate import TIERS
    return TIERS


def _plan_check(args, profile, nvme_path) -> int:
    from offload.planner import plan
    cases = []
    for name in args.check_models.split(","):
        name = name.strip()
        if name == "gpt":
            cases.append(_gpt_case(args))
        elif name == "bench_step":
            bench = _bench_step_case()
            if bench is None:
                print("  (benchmarks/bench_step.py is not there: its model is skipped)")
            else:
                cases.append(bench)
        else:
            raise CLIError(f"--check-models {name!r}: use gpt or bench_step")
    placements = []
    for item in args.check_placements.split(","):
        o, _, prm = item.strip().partition("/")
        if o not in est_tiers() or (prm or "none") not in est_tiers():
            raise CLIError(f"--check-placements item {item!r} must be OPTIMIZER/PARAM with none, cpu or nvme, "
                           "e.g. cpu/none")
        placements.append((o, prm or "none"))
    print(f"checking predictions against measured engine steps ({args.check_rounds} rounds per placement) ...",
          flush=True)
    results = plan.check(cases, profile, placements, nvme_path, rounds=args.check_rounds,
                         log=lambda s: print("  " + s, flush=True))
    if not results:
        raise CLIError("no placement could be measured")
    worst = max(r.error for r in results)
    mean = sum(r.error for r in results) / len(results)
    ok = worst <= args.tolerance
    print(f"prediction error: mean {mean:.0%}, worst {worst:.0%} (goal <= {args.tolerance:.0%}): "
          + ("OK" if ok else "OVER"))
    if args.json:
        print(json.dumps([{**r.__dict__, "error": r.error} for r in results]))
    return 0 if ok else 1


def _export_hf(args) -> int:
    import offload
    from offload.config.flags import parse_bytes
    if os.path.isfile(args.out):
        raise CLIError(f"{args.out!r} is a file: --format hf writes a directory")
    try:
        shard = parse_bytes(args.max_shard_size) if args.max_shard_size else 5 * 10**9
        out = offload.export_hf(args.checkpoint, args.out, max_shard_bytes=shard, dtype=args.dtype,
                                peft=args.peft or "adapter")
    except (offload.CheckpointError, offload.WeightsError, FileNotFoundError, ValueError) as exc:
        raise CLIError(f"cannot export {args.checkpoint!r}: {exc}") from None
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files if os.path.isfile(os.path.join(out, f)))
    print(f"wrote {out}: {len(files)} files ({', '.join(files[:6])}{', ...' if len(files) > 6 else ''}), "
          f"{fmt_bytes(size)}")
    return 0


# ---- bench / export -------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    script = os.path.join(REPO_ROOT, "benchmarks", f"bench_{args.name}.py")
    if not os.path.isfile(script):
        have = sorted(f[6:-3] for f in os.listdir(os.path.dirname(script))
                      if f.startswith("bench_") and f.endswith(".py")) if os.path.isdir(os.path.dirname(script)) else []
        raise CLIError(f"benchmarks/bench_{args.name}.py is not there (yet): available: "
                       f"{', '.join(have) or 'none'} (benchmarks run from a source checkout)")
    return subprocess.call([sys.executable, script, *args.bench_args])


def cmd_export(args) -> int:
    import torch
    import offload
    if not os.path.exists(args.checkpoint):
        raise CLIError(f"checkpoint {args.checkpoint!r} does not exist: give the directory save_checkpoint wrote")
    if args.format == "hf":
        return _export_hf(args)
    if args.peft or args.dtype or args.max_shard_size:
        raise CLIError("--peft, --dtype and --max-shard-size apply to --format hf")
    use_st = args.out.endswith(".safetensors")
    if use_st:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CLIError("writing .safetensors needs the safetensors package: pip install safetensors "
                           "(or give an OUT ending in .pt)") from None
    try:
        sd = offload.export_fp32(args.checkpoint)
    except (offload.CheckpointError, FileNotFoundError, ValueError) as exc:
        raise CLIError(f"cannot export {args.checkpoint!r}: {exc}") from None
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise CLIError(f"the directory of {args.out!r} does not exist")
    if use_st:   # safetensors refuses tensors that share memory (tied weights): one copy each
        save_file({k: v.detach().to(torch.float32).contiguous().clone() for k, v in sd.items()}, args.out)
    else:
        torch.save(sd, args.out)
    n = sum(v.numel() for v in sd.values())
    print(f"wrote {args.out}: {len(sd)} tensors, {n / 1e6:.2f}M values, fp32 "
          f"({'safetensors' if use_st else 'torch .pt'}, {fmt_bytes(os.path.getsize(args.out))})")
    return 0


# ---- parser ---------------------------------------------------------------------------------------
def _add_model_args(p, gpt_defaults: bool) -> None:
    g = p.add_argument_group("model (one of)")
    g.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    g.add_argument("--largest-layer", type=float, help="parameters of the largest layer, e.g. 2e8")
    g.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its directory)")
    g.add_argument("--model", metavar="MOD:FN", help="module:callable building the model (run on the meta device)")
    g.add_argument("--precision", default="bf16" if not gpt_defaults else "fp32", choices=("fp32", "bf16", "fp16"))


def _add_gpt_args(p, steps_default: bool = True) -> None:
    g = p.add_argument_group("the built-in GPT and its batches")
    g.add_argument("--n-layer", type=int, default=4)
    g.add_argument("--n-head", type=int, default=4)
    g.add_argument("--n-embd", type=int, default=256)
    g.add_argument("--seq-len", type=int, default=128, help="context length")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per micro-step")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="offload", description="ZeRO-Offload engine for PyTorch: train, estimate, plan.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    t = sub.add_parser("train", help="fine-tune the built-in small GPT on a local corpus",
                       description="Train the built-in GPT through the engine. Default tiers: parameters and "
                                   "optimizer state on NVMe, in a temporary directory.")
    t.set_defaults(func=cmd_train, _parser=t)
    t.add_argument("--corpus", metavar="PATH", help="a text file (default: pydoc_data.topics, shipped with Python)")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--warmup", type=int, default=30, help="LR warm-up steps (then cosine to 10%%)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", metavar="DIR", help="output directory (default runs/<timestamp>)")
    t.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of the engine's spans")
    t.add_argument("--log-every", type=float, default=10.0, metavar="S",
                   help="seconds between progress lines when stdout is not a terminal")
    t.add_argument("--max-minutes", type=float, default=4.0,
                   help="stop training after this long (0: no limit); the run is still saved")
    t.add_argument("--sample", type=int, default=120, metavar="N", help="bytes of text to sample at the end (0: none)")
    t.add_argument("--no-checkpoint", action="store_true", help="do not write checkpoint/")
    _add_gpt_args(t)
    config_mod.add_config_arguments(t)

    e = sub.add_parser("estimate", help="bytes per tier for each placement, against this machine")
    e.set_defaults(func=cmd_estimate, _parser=e)
    _add_model_args(e, gpt_defaults=False)
    e.add_argument("--world-size", type=int, default=1, help="data-parallel ranks on this node")
    e.add_argument("--buffer-count", type=int, default=4, help="swap slots per NVMe tier")
    e.add_argument("--gradient-clipping", type=float, default=0.0,
                   help="clipping (> 0) makes gradients wait for the global norm: parked on NVMe")
    e.add_argument("--gradient-accumulation-steps", type=int, default=1)
    e.add_argument("--grad-host-bytes", metavar="SIZE",
                   help="offload_optimizer.grad_host_bytes: host memory for gradient buffers")
    e.add_argument("--device-memory", metavar="SIZE", help="accelerator memory per rank, e.g. 24GiB")
    e.add_argument("--nvme-path", metavar="DIR", help="where the NVMe tier would live (free space is checked)")
    e.add_argument("--deepspeed", action="store_true", help="also print DeepSpeed's estimator figures")
    e.add_argument("--json", action="store_true")

    p = sub.add_parser("plan", help="measure this machine and rank the placements by predicted step time")
    p.set_defaults(func=cmd_plan, _parser=p)
    _add_model_args(p, gpt_defaults=True)
    _add_gpt_args(p)
    p.add_argument("--device-memory", metavar="SIZE", help="accelerator memory per rank, e.g. 24GiB")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--gradient-clipping", type=float, default=0.0)
    p.add_argument("--nvme-path", metavar="DIR", help="where to measure NVMe bandwidth (default: the temp dir)")
    p.add_argument("--profile", metavar="FILE", help="read the machine profile instead of measuring")
    p.add_argument("--save-profile", metavar="FILE", help="save the measured profile as JSON")
    p.add_argument("--check", action="store_true",
                   help="run the GPT (and bench_step's model) through the engine at several placements and "
                        "compare measured with predicted step times")
    p.add_argument("--check-rounds", type=int, default=5, help="measured rounds per placement (--check)")
    p.add_argument("--check-placements", default="none/none,cpu/none,nvme/none,cpu/cpu,nvme/nvme",
                   metavar="O/P,...", help="placements --check runs (optimizer/param)")
    p.add_argument("--check-models", default="gpt,bench_step", metavar="NAME,...",
                   help="models --check runs: gpt (offload train's model), bench_step (benchmarks/bench_step.py's)")
    p.add_argument("--tolerance", type=float, default=0.25, help="--check fails above this relative error")
    p.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="run benchmarks/bench_<name>.py (other arguments pass through)")
    b.set_defaults(func=cmd_bench, _parser=b)
    b.add_argument("name", help="adam | io | prefetch | step")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark")

    x = sub.add_parser("export", help="a checkpoint's weights: one fp32 file, or the Hugging Face layout")
    x.set_defaults(func=cmd_export, _parser=x)
    x.add_argument("checkpoint", help="a checkpoint directory (engine.save_checkpoint)")
    x.add_argument("out", help="output file: .pt (torch) or .safetensors; with --format hf a directory")
    x.add_argument("--format", choices=("fp32", "hf"), default="fp32",
                   help="fp32: one consolidated file; hf: sharded safetensors + index + config.json "
                        "(from_pretrained loads it), a PEFT model's adapter in PEFT's layout")
    x.add_argument("--peft", choices=("adapter", "merged"), default=None,
                   help="a PEFT model: its adapter in PEFT's layout (default) or merged into the base")
    x.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="convert floating-point tensors (default: each tensor's training dtype)")
    x.add_argument("--max-shard-size", default=None, help="largest safetensors shard (default 5GB), e.g. 2GB")
    return parser


def _warning_line(message, category, filename, lineno, file=None, line=None):
    print(f"offload: warning: {message}", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    warnings.showwarning = _warning_line
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help()
            return EXIT_USAGE
        return args.func(args)
    except (CLIError, ConfigError) as exc:
        print(f"offload: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except _user_errors() as exc:
        print(f"offload: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("offload: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:          # `offload estimate ... | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _user_errors():
    from offload.planner.estimate import EstimateError
    errs = [EstimateError]
    try:
        from offload.engine.blocks import ModelError
        errs.append(ModelError)
    except ImportError:
        pass
    try:
        from offload.storage import NvmeSpaceError
        errs.append(NvmeSpaceError)
    except ImportError:
        pass
    return tuple(errs)


if __name__ == "__main__":
    sys.exit(main())
