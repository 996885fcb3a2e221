"""``offload train``: train the built-in small GPT on a local corpus through the engine
(default tiers: parameters and optimizer state on NVMe, in a temporary directory)."""
from __future__ import annotations

import csv
import json
import math
import os
import shutil
import tempfile
import time
from typing import Optional

from offload import config as config_mod
from offload.cli.common import CLIError, activations_tier, add_gpt_args, format_summary, prefer_huge_pages



TRAIN_DEFAULTS = {"optimizer": {"lr": 2e-3, "betas": (0.9, 0.95), "weight_decay": 0.0},
                  "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}
# --optimizer other than AdamW / Adam: the rule's own defaults (torch's), not Adam's above
_ADAM_TYPES = ("AdamW", "Adam")


def _train_config(args) -> tuple:
    """(Config, temporary NVMe dir or None, whether the precision was asked for). Without
    --config the train defaults apply (parameters and optimizer state on NVMe, in a temporary
    directory unless --nvme-path; saved activations sent to NVMe without a path go there too;
    bf16 on CUDA, else fp32, unless bf16 is slow there: see ``_precision``)."""
    import copy
    import torch
    base = None if args.config else copy.deepcopy(TRAIN_DEFAULTS)
    if base is not None and vars(args).get("cfg:optimizer.type", "AdamW") not in _ADAM_TYPES:
        base["optimizer"] = {}
    d = config_mod.flags_to_dict(args, base=base)
    asked = "precision" in d
    if not asked and not args.config:
        d["precision"] = "bf16" if torch.cuda.is_available() else "fp32"
    tmp = None
    for tier in ("offload_optimizer", "offload_param", "offload_activations"):
        sec = d.get(tier) or {}
        if sec.get("device") == "nvme" and not sec.get("nvme_path"):
            if tmp is None:
                tmp = tempfile.mkdtemp(prefix="nvme-tier-")   # not "offload-*": that is the store's run-dir prefix
            sec["nvme_path"] = tmp
    try:
        cfg = config_mod.build_config(d)
        cfg.check_paths()      # before any model memory: the same messages initialize gives
        return cfg, tmp, asked
    except BaseException:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _precision(cfg, asked: bool):
    """``cfg`` in the precision ``offload.planner.precision`` decides (its default, when not
    asked for, the one ``_train_config`` filled in), its reason told once. Measures the
    device: called after ``prefer_huge_pages``, which must come before any tensor."""
    import dataclasses
    from offload.planner import precision
    choice = precision.decide(cfg.precision if asked else None, default=cfg.precision)
    precision.announce(choice, say=print)
    return cfg if choice.precision == cfg.precision else dataclasses.replace(cfg, precision=choice.precision)


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
    cfg, tmp_nvme, asked = _train_config(args)     # validated before any model memory is allocated
    huge = prefer_huge_pages(cfg)           # before any tensor
    cfg = _precision(cfg, asked)
    try:
        corpus = Corpus.load(args.corpus)
    except (FileNotFoundError, ValueError) as exc:
        if tmp_nvme:
            shutil.rmtree(tmp_nvme, ignore_errors=True)
        raise CLIError(f"--corpus: {exc}") from None
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
            f"{cfg.offload_param.device}" + activations_tier(cfg, huge)
            + (f", nvme path {tmp_nvme} (temporary)" if tmp_nvme else "")
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


def register(sub) -> None:
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
    add_gpt_args(t)
    config_mod.add_config_arguments(t)
