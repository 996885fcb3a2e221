"""The engine's config for a loop under ``offload.accelerate.Accelerator``: the user's
``offload_config`` with what the loop decides filled in.

The prepared optimizer decides the update rule and its hyper-parameters (its class and
``defaults``, ``offload/optim/from_torch.py``), the Accelerator decides
``gradient_accumulation_steps`` and the precision (``mixed_precision``: ``no`` is fp32), and the
loop clips (``clip_grad_norm_``), so the config's ``gradient_clipping`` stays 0. A config may
leave these out or repeat them; a different value is an error naming both. The rest (tiers,
NVMe path, prefetch, ZeRO stage, ...) comes from the config. A DeepSpeed config is read as the
engine reads one; its ``"auto"`` values are for transformers' Trainer and are refused here.
"""
from __future__ import annotations

import json
from typing import Any

from offload.config import Config, ConfigError, build_config, is_deepspeed_config, translate_deepspeed
from offload.hf.config import _get, _leftover_auto, _raw, _set

PRECISIONS = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def precision_of(accelerator) -> str:
    """The engine's precision for ``accelerator.mixed_precision``, or a ConfigError naming it."""
    mp = str(getattr(accelerator.mixed_precision, "value", accelerator.mixed_precision))
    if mp not in PRECISIONS:
        raise ConfigError(f"Accelerator mixed_precision={mp!r}: the engine trains in fp32, bf16 or fp16: use "
                          f"mixed_precision 'no', 'bf16' or 'fp16'")
    return PRECISIONS[mp]


def owned_keys(accelerator, optimizer) -> tuple:
    """(the engine keys the optimizer and the Accelerator decide, where each comes from)."""
    from offload.optim import get_rule
    from offload.optim.from_torch import param_groups, rule_name
    name = rule_name(optimizer)
    param_groups(optimizer, get_rule(name))          # its groups checked now, at prepare
    owned = {"optimizer.type": name}
    where = {"optimizer.type": f"the prepared optimizer's class ({type(optimizer).__name__})"}
    for k in get_rule(name).defaults:
        v = optimizer.defaults[k]
        v = float(v) if hasattr(v, "item") and not isinstance(v, (list, tuple)) else v
        owned[f"optimizer.{k}"] = tuple(v) if isinstance(v, list) else v
        where[f"optimizer.{k}"] = f"the prepared optimizer's {k}"
    owned.update({"gradient_accumulation_steps": int(accelerator.gradient_accumulation_steps),
                  "precision": precision_of(accelerator), "gradient_clipping": 0.0})
    where.update({"gradient_accumulation_steps": "Accelerator gradient_accumulation_steps",
                  "precision": "Accelerator mixed_precision",
                  "gradient_clipping": "the loop (accelerator.clip_grad_norm_ clips each step it is called)"})
    return owned, where


def engine_config(offload_config: Any, accelerator, optimizer) -> Config:
    """The engine's ``Config`` for ``offload_config`` (dict, JSON path, DeepSpeed dict or
    ``offload.Config``), the Accelerator and the prepared torch optimizer."""
    owned, where = owned_keys(accelerator, optimizer)
    if isinstance(offload_config, Config):
        # a Config has every key set: the loop decides the keys it owns
        d = offload_config.to_dict()
        d["optimizer"] = {"state_dtype": _get(d, "optimizer.state_dtype")}
        for key, value in owned.items():
            _set(d, key, value)
        return build_config(d)
    raw = _raw(offload_config)
    left = list(_leftover_auto(raw))
    if left:
        raise ConfigError(f"offload_config: {', '.join(left)} is 'auto', which only transformers' Trainer fills: "
                          f"give a value, or leave the key out (the prepared optimizer and the Accelerator decide "
                          f"the optimizer, accumulation and precision)")
    d = translate_deepspeed(raw) if is_deepspeed_config(raw) else json.loads(json.dumps(raw))
    for key, value in owned.items():
        given = _get(d, key)
        if given is None:
            _set(d, key, value)
            continue
        same = tuple(given) == value if isinstance(value, tuple) and isinstance(given, (list, tuple)) \
            else given == value
        if not same:
            raise ConfigError(f"offload_config {key}={given!r} disagrees with {where[key]} ({value!r}): remove it "
                              f"from offload_config (that decides it) or make them equal")
    return build_config(d)
