"""The engine's config for a Hugging Face ``Trainer`` run: the user's ``offload_config`` with
what ``TrainingArguments`` decides filled in.

``TrainingArguments`` owns the optimizer hyper-parameters (learning rate, Adam betas and
epsilon, weight decay), ``gradient_accumulation_steps``, ``max_grad_norm`` and the precision
(``bf16`` / ``fp16``). A config may leave them out, give them as ``"auto"`` (DeepSpeed's
convention: filled from the arguments as transformers' DeepSpeed integration does) or give
the same value; a different value is an error naming both. The rest (tiers, NVMe path,
prefetch, ZeRO stage, ...) comes from the config.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from offload.config import Config, ConfigError, build_config, is_deepspeed_config, translate_deepspeed
from offload.config.schema import read_json


def precision_of(args) -> str:
    if args.bf16 and args.fp16:
        raise ConfigError("TrainingArguments: bf16 and fp16 are both set: choose one")
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _owned(args) -> dict:
    """The engine keys TrainingArguments decides, dotted, with their values."""
    return {
        "optimizer.lr": float(args.learning_rate),
        "optimizer.betas": (float(args.adam_beta1), float(args.adam_beta2)),
        "optimizer.eps": float(args.adam_epsilon),
        "optimizer.weight_decay": float(args.weight_decay),
        "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
        "gradient_clipping": float(args.max_grad_norm or 0.0),
        "precision": precision_of(args),
    }


_WHERE = {"optimizer.lr": "learning_rate", "optimizer.betas": "adam_beta1/adam_beta2",
          "optimizer.eps": "adam_epsilon", "optimizer.weight_decay": "weight_decay",
          "gradient_accumulation_steps": "gradient_accumulation_steps",
          "gradient_clipping": "max_grad_norm", "precision": "bf16/fp16"}


def fill_deepspeed_auto(ds: Mapping[str, Any], args) -> dict:
    """A copy of a DeepSpeed config with its ``"auto"`` values filled from ``args``, as
    transformers' ``HfTrainerDeepSpeedConfig`` does for the keys this engine reads. An
    ``"auto"`` left in a key the engine reads is an error naming it."""
    d = json.loads(json.dumps(ds))
    gas, micro = int(args.gradient_accumulation_steps), int(args.per_device_train_batch_size)
    fill = {
        ("train_micro_batch_size_per_gpu",): micro,
        ("gradient_accumulation_steps",): gas,
        ("train_batch_size",): micro * gas * max(1, int(args.world_size)),
        ("gradient_clipping",): float(args.max_grad_norm or 0.0),
        ("optimizer", "params", "lr"): float(args.learning_rate),
        ("optimizer", "params", "betas"): [float(args.adam_beta1), float(args.adam_beta2)],
        ("optimizer", "params", "eps"): float(args.adam_epsilon),
        ("optimizer", "params", "weight_decay"): float(args.weight_decay),
        ("fp16", "enabled"): bool(args.fp16),
        ("bf16", "enabled"): bool(args.bf16),
    }
    for path, value in fill.items():
        sec = d
        for p in path[:-1]:
            sec = sec.get(p) if isinstance(sec, dict) else None
        if isinstance(sec, dict) and sec.get(path[-1]) == "auto":
            sec[path[-1]] = value
    return d


def _leftover_auto(d, where=""):
    if isinstance(d, Mapping):
        for k, v in d.items():
            yield from _leftover_auto(v, f"{where}{k}.")
    elif d == "auto":
        yield where.rstrip(".")


def engine_config(offload_config: Any, args) -> Config:
    """The engine's ``Config`` for ``offload_config`` (dict, JSON path, DeepSpeed dict or
    ``offload.Config``) and ``TrainingArguments`` ``args``."""
    owned = _owned(args)
    if isinstance(offload_config, Config):
        # A Config has every key set: the arguments decide the keys they own.
        d = offload_config.to_dict()
        for key, value in owned.items():
            _set(d, key, value)
        return build_config(d)
    if offload_config is None:
        raw: Mapping = {}
    elif isinstance(offload_config, (str, os.PathLike)):
        raw = read_json(os.fspath(offload_config), "offload_config", ": give a JSON file, a dict or offload.Config")
    elif isinstance(offload_config, Mapping):
        raw = offload_config
    else:
        raise ConfigError(f"offload_config must be a dict, a JSON path or offload.Config, "
                          f"not {type(offload_config).__name__}")
    if not isinstance(raw, Mapping):
        raise ConfigError("offload_config must hold a JSON object")
    if is_deepspeed_config(raw):
        raw = fill_deepspeed_auto(raw, args)
        left = [k for k in _leftover_auto(raw) if not k.startswith(("scheduler.", "zero_optimization."))]
        if left:
            raise ConfigError(f"offload_config: {', '.join(left)} is 'auto' but TrainingArguments does not "
                              f"decide it: give a value")
        d = translate_deepspeed(raw)
    else:
        d = json.loads(json.dumps(raw))
        left = list(_leftover_auto(d))
        if left:
            raise ConfigError(f"offload_config: 'auto' is for DeepSpeed configs; {', '.join(left)} needs a value")
    for key, value in owned.items():
        given = _get(d, key)
        if given is None:
            _set(d, key, value)
            continue
        same = tuple(given) == value if isinstance(value, tuple) and isinstance(given, (list, tuple)) \
            else given == value
        if not same:
            raise ConfigError(f"offload_config {key}={given!r} disagrees with TrainingArguments "
                              f"{_WHERE[key]} ({value!r}): remove it from offload_config (the arguments decide it) "
                              f"or make them equal")
    return build_config(d)


def _get(d: Mapping, dotted: str):
    for p in dotted.split("."):
        if not isinstance(d, Mapping) or p not in d:
            return None
        d = d[p]
    return d


def _set(d: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value
