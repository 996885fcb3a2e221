"""What the ``offload`` commands share: the one-line error, the argument parser that names the
nearest flag, byte formatting, the engine-stats summary and the model arguments of
``estimate`` / ``plan``."""
from __future__ import annotations

import argparse
import os
from typing import List

from offload import config as config_mod
from offload.cli.progress import fmt_bytes

EXIT_USAGE = 2
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CLIError(Exception):
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


def parse_size(text, flag):
    return None if text is None else config_mod.parse_bytes(text, flag)


def add_model_args(p, gpt_defaults: bool) -> None:
    g = p.add_argument_group("model (one of)")
    g.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    g.add_argument("--largest-layer", type=float, help="parameters of the largest layer, e.g. 2e8")
    g.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its directory)")
    g.add_argument("--model", metavar="MOD:FN", help="module:callable building the model (run on the meta device)")
    g.add_argument("--precision", default="bf16" if not gpt_defaults else "fp32", choices=("fp32", "bf16", "fp16"))
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
