"""What the ``offload`` commands share: the one-line error, the argument parser that names the
nearest flag, byte formatting, the engine-stats summary and the model arguments of
``estimate`` / ``plan``."""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import List

from offload import dtypes
from offload import config as config_mod
from offload.core.errors import OffloadError
from offload.units import fmt_bytes

EXIT_USAGE = 2
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CLIError(OffloadError):
    """A problem with what the user asked for; printed as one line."""


class Parser(argparse.ArgumentParser):
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



def model_spec(args, default_gpt: bool = False):
    """The ModelSpec the model arguments describe (None: the built-in GPT, where allowed), with
    the fine-tuning arguments applied: ``--lora-rank`` builds the model on the meta device and
    adds PEFT adapters (the base frozen), ``--trainable-params`` trains that many parameters."""
    from offload.planner import estimate as est
    given = [x for x in ("params", "hf_config", "model") if getattr(args, x) is not None]
    if len(given) > 1:
        raise CLIError("give the model once: --params, --hf-config or --model")
    lora, trainable = getattr(args, "lora_rank", None), getattr(args, "trainable_params", None)
    if lora is not None and trainable is not None:
        raise CLIError("give --lora-rank or --trainable-params, not both")
    in_place = getattr(args, "frozen_in_place", False)
    frozen = getattr(args, "frozen_dtype", "compute") or "compute"
    if frozen != "compute" and lora is None and trainable is None and args.model is None:
        raise CLIError(f"--frozen-dtype {frozen} quantizes frozen parameters: give --lora-rank or --trainable-params too")
    if in_place and lora is None and trainable is None and args.model is None:
        raise CLIError("--frozen-in-place counts frozen parameters: give --lora-rank or --trainable-params too")
    if args.largest_layer is not None and args.params is None:
        raise CLIError("--largest-layer needs --params")
    if lora is not None:
        if args.params is not None or not given:
            raise CLIError("--lora-rank needs the model's modules: give --hf-config or --model "
                           "(with --params, give --trainable-params N)")
        model = lora_model(args)
        return est.spec_from_module(model, args.hf_config or args.model, args.precision, in_place, frozen)
    if args.params is not None:
        spec = est.spec_from_counts(args.params, args.largest_layer)
    elif args.hf_config is not None:
        spec = est.spec_from_hf_config(args.hf_config)
    elif args.model is not None:
        spec = est.spec_from_callable(args.model, args.precision, in_place, frozen)
    elif default_gpt:
        if trainable is not None:
            raise CLIError("--trainable-params needs the model: give --params, --hf-config or --model")
        return None
    else:
        raise CLIError("no model: give --params N [--largest-layer N], --hf-config PATH or --model pkg.mod:fn")
    if frozen != "compute":
        spec = dataclasses.replace(spec, frozen_dtype=frozen)
    return spec if trainable is None else est.with_trainable(spec, trainable, args.precision)


def lora_model(args):
    """The model of --hf-config / --model on the meta device, with --lora-rank adapters on
    --lora-targets (or None without --lora-rank: the model as described)."""
    from offload.planner import estimate as est
    model = est.hf_model_on_meta(args.hf_config) if args.hf_config else est.module_from_callable(args.model)
    if args.lora_rank is None:
        return model
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    return est.apply_lora(model, args.lora_rank, targets, args.hf_config or args.model)


def parse_size(text, flag):
    return None if text is None else config_mod.parse_bytes(text, flag)


def add_model_args(p, gpt_defaults: bool) -> None:
    g = p.add_argument_group("model (one of)")
    g.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    g.add_argument("--largest-layer", type=float, help="parameters of the largest layer, e.g. 2e8")
    g.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its directory)")
    g.add_argument("--model", metavar="MOD:FN", help="module:callable building the model (run on the meta device)")
    if gpt_defaults:      # plan: measured rates decide (offload.planner.precision)
        g.add_argument("--precision", default=None, choices=dtypes.PRECISIONS,
                       help="the run's precision (default fp32; a precision slow on the profile's device is told, "
                            "with its measured factor)")
    else:
        g.add_argument("--precision", default="bf16", choices=dtypes.PRECISIONS)
    f = p.add_argument_group("fine-tuning: frozen parameters have no gradient and no optimizer state")
    f.add_argument("--lora-rank", type=int, metavar="R",
                   help="PEFT LoRA adapters of rank R on --lora-targets, the base frozen (with --hf-config, "
                        "needs transformers and peft; with --model, peft)")
    f.add_argument("--lora-targets", default="attention", metavar="NAMES",
                   help="modules that get adapters, comma-separated: module names (q_proj), fused expert tensors "
                        "(experts.gate_up_proj) or the keywords attention (every linear layer of the attention "
                        "modules) and experts (a mixture of experts' routed experts) (default: %(default)s)")
    f.add_argument("--trainable-params", type=float, metavar="N",
                   help="only N parameters train, spread over the blocks (the rest frozen), e.g. 8.4e6")
    f.add_argument("--frozen-in-place", action="store_true",
                   help="frozen weights are read in place from the checkpoint's safetensors files "
                        "(offload_param nvme with weights=): no swap-file copy of them")
    f.add_argument("--frozen-dtype", default="compute", choices=("compute", "int8", "nf4"),
                   help="frozen weights stored quantized in their home (offload_param.frozen_dtype): the host and "
                        "NVMe bytes count the quantized base (default: %(default)s)")
    o = p.add_argument_group("the optimizer (its state's bytes per parameter)")
    o.add_argument("--optimizer", default="AdamW", choices=("AdamW", "Adam", "Lion", "SGD", "Adagrad", "Adafactor"),
                   help="update rule (SGD counts a momentum buffer)")
    o.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16", "int8"),
                   help="dtype of the optimizer's state rows (the master stays fp32)")


def add_gpt_args(p, steps_default: bool = True) -> None:
    g = p.add_argument_group("the built-in GPT and its batches")
    g.add_argument("--n-layer", type=int, default=4)
    g.add_argument("--n-head", type=int, default=4)
    g.add_argument("--n-embd", type=int, default=256)
    g.add_argument("--seq-len", type=int, default=128, help="context length")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per micro-step")


# ---- peak host RSS (estimate --placement, plan) ---------------------------------------------------
def add_rss_args(p, batch: bool) -> None:
    g = p.add_argument_group("peak host RSS of one placement (offload/planner/rss.py)")
    g.add_argument("--device-budget-bytes", metavar="SIZE", help="offload_param.device_budget_bytes")
    g.add_argument("--host-lookahead-bytes", metavar="SIZE", help="prefetch.host_lookahead_bytes")
    g.add_argument("--baseline-bytes", metavar="SIZE",
                   help="RSS of the training process before initialize (default: measured in a fresh "
                        "interpreter importing torch, offload, and transformers/peft when the model needs them)")
    if batch:
        g.add_argument("--batch-size", type=int, help="sequences per micro-step (activations are counted with "
                                                       "--seq-len, for --hf-config models)")
        g.add_argument("--seq-len", type=int, help="tokens per sequence")


def activation_bytes(args, batch: int, seq: int):
    """Bytes autograd saves in one micro-step of the described model at (batch, seq), counted
    on the meta device; None where the model's inputs are unknown (only --hf-config causal
    LMs and the built-in GPT are run)."""
    import torch
    from offload.planner import rss
    if not batch or not seq:
        return None
    if getattr(args, "hf_config", None):
        model = lora_model(args)
        x = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        return rss.saved_activation_bytes(model, lambda m: m(input_ids=x, labels=x).loss)
    if getattr(args, "n_layer", None) and not (args.params or getattr(args, "model", None)):
        from offload.models.gpt import GPT, GPTConfig
        with torch.device("meta"):
            model = GPT(GPTConfig(block_size=seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
        x = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        return rss.saved_activation_bytes(model, lambda m: m(x, x))
    return None


def rss_prediction(args, spec, optimizer: str, param: str, device_is_host: bool, batch=None, seq=None, **config):
    """The planner's peak host RSS of one placement, term by term (``rss.placement_rss``)."""
    from offload.planner import rss
    base = parse_size(getattr(args, "baseline_bytes", None), "--baseline-bytes")
    note = "given"
    if base is None:
        mods = ["torch", "offload"] + (["transformers"] if getattr(args, "hf_config", None) else []) + \
            (["peft"] if getattr(args, "lora_rank", None) is not None else [])
        setup = ""
        if getattr(args, "hf_config", None):     # building the model loads its library code
            setup = (f"from offload.planner import estimate as est\nm = est.hf_model_on_meta({args.hf_config!r})\n"
                     + (f"est.apply_lora(m, {args.lora_rank!r}, {args.lora_targets.split(',')!r})\n"
                        if getattr(args, "lora_rank", None) is not None else ""))
        base = rss.measure_baseline(mods, setup)
        note = f"measured: python importing {', '.join(mods)}" + (", the model built on meta" if setup else "")
    acts = activation_bytes(args, batch, seq)
    prec = getattr(args, "precision", "bf16")
    return rss.placement_rss(spec, optimizer, param, prec, baseline=base, saved_activations=acts,
                             device_is_host=device_is_host, baseline_note=note,
                             device_budget_bytes=parse_size(getattr(args, "device_budget_bytes", None),
                                                            "--device-budget-bytes"),
                             host_lookahead_bytes=parse_size(getattr(args, "host_lookahead_bytes", None),
                                                             "--host-lookahead-bytes"),
                             rule=getattr(args, "optimizer", None), state_dtype=getattr(args, "state_dtype", None),
                             **config)


def prefer_huge_pages(cfg) -> bool:
    """With saved activations offloaded, torch's large CPU tensors on huge pages
    (``device.prefer_huge_pages``); to be called before the command allocates any tensor."""
    from offload import device
    return cfg.offload_activations.device != "none" and device.prefer_huge_pages()


def activations_tier(cfg, huge: bool) -> str:
    """The tiers line's part for saved activations ("" when they stay on the device)."""
    acts = cfg.offload_activations.device
    if acts == "none":
        return ""
    return f", activations -> {acts}" + (" (large CPU tensors on huge pages)" if huge else "")
