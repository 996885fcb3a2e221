"""The engine's config for a loop under ``offload.accelerate.Accelerator``: the user's
``offload_config`` with what the loop decides filled in (offload/config/decided.py says how
the two may meet).

The prepared optimizer decides the update rule and its hyper-parameters (its class and
``defaults``, ``offload/optim/from_torch.py``), the Accelerator decides
``gradient_accumulation_steps`` and the precision (``mixed_precision``: ``no`` is fp32), and the
loop clips (``clip_grad_norm_``), so the config's ``gradient_clipping`` stays 0. A config may
leave these out or repeat them; a different value is an error naming both. The rest (tiers,
NVMe path, prefetch, ZeRO stage, ...) comes from the config. A DeepSpeed config is read as the
engine reads one; an ``"auto"`` value the loop does not fill is an error naming the key.
"""
from __future__ import annotations

from typing import Any

from offload.config import Config, ConfigError
from offload.config.decided import Decided, config_with, optimizer_keys

PRECISIONS = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def precision_of(accelerator) -> str:
    """The engine's precision for ``accelerator.mixed_precision``, or a ConfigError naming it."""
    mp = str(getattr(accelerator.mixed_precision, "value", accelerator.mixed_precision))
    if mp not in PRECISIONS:
        raise ConfigError(f"Accelerator mixed_precision={mp!r}: the engine trains in fp32, bf16 or fp16: use "
                          f"mixed_precision 'no', 'bf16' or 'fp16'")
    return PRECISIONS[mp]


def decided_keys(accelerator, optimizer) -> Decided:
    """The engine keys the prepared optimizer and the Accelerator decide, each with where it
    comes from (named in errors); the optimizer's param groups are checked now, at prepare."""
    decided: Decided = {k: (v, where.replace("the optimizer's", "the prepared optimizer's", 1))
                        for k, (v, where) in optimizer_keys(optimizer).items()}
    decided["gradient_accumulation_steps"] = (int(accelerator.gradient_accumulation_steps),
                                              "Accelerator gradient_accumulation_steps")
    decided["precision"] = (precision_of(accelerator), "Accelerator mixed_precision")
    decided["gradient_clipping"] = (0.0, "the loop (accelerator.clip_grad_norm_ clips each step it is called)")
    return decided


def engine_config(offload_config: Any, accelerator, optimizer) -> Config:
    """The engine's ``Config`` for ``offload_config`` (dict, JSON path, DeepSpeed dict or
    ``offload.Config``), the Accelerator and the prepared torch optimizer."""
    return config_with(offload_config, decided_keys(accelerator, optimizer), "offload.accelerate.Accelerator")
