"""The engine's config for a Lightning run: the user's ``offload_config`` with what the
Lightning loop decides filled in (offload/config/decided.py says how the two may meet).

Lightning decides, as it does for its own strategies: the update rule and hyper-parameters
(the torch optimizer ``configure_optimizers`` returns or ``fabric.setup`` is given), the
accumulation window (``Trainer(accumulate_grad_batches)``; a Fabric loop marks it with
``no_backward_sync``), the clipping norm (``Trainer(gradient_clip_val)``; Fabric's
``clip_gradients``) and the precision (``precision=``). The precision names map as
``offload.hf.Trainer`` maps ``bf16`` / ``fp16``: the engine keeps fp32 master weights and
computes in fp32, bf16 or fp16; the "true" half precisions (no fp32 copy) and the other
plugins have no engine equivalent and are refused, naming the ones it takes.
"""
from __future__ import annotations

from typing import Any, Optional

from offload.config import Config, ConfigError
from offload.config.decided import Decided, config_with, get, optimizer_keys, raw_mapping

# Lightning precision flag -> the engine's precision
PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}


def engine_precision(flag: Any) -> str:
    """The engine's precision for Lightning's ``precision`` flag, or a ConfigError naming the
    flags the engine runs."""
    name = str(flag)
    if name not in PRECISIONS:
        raise ConfigError(f"precision={name!r}: the engine keeps fp32 master weights and computes in fp32, bf16 or "
                          f"fp16; use precision='32-true', 'bf16-mixed' or '16-mixed' with the offload strategy")
    return PRECISIONS[name]


def plugin_flag(plugin) -> str:
    """Lightning's ``precision`` flag of the plugin its connector built for it (the plain or the
    mixed-precision one); another plugin, or a flag the engine has no precision for, is a
    ConfigError naming the flags it runs."""
    flag = getattr(plugin, "precision", None)
    if type(plugin).__name__ not in ("Precision", "MixedPrecision") or flag not in PRECISIONS:
        engine_precision(f"{flag} ({type(plugin).__name__})")
    return flag


def precision_asked(offload_config: Any, precision: str) -> bool:
    """Whether the run's precision was chosen (not fp32 by default): a low precision in
    Lightning's flag, or a ``precision`` in a native ``offload_config``."""
    if precision != "fp32":
        return True
    if isinstance(offload_config, Config):
        return False
    return get(raw_mapping(offload_config), "precision") is not None


def engine_config(offload_config: Any, optimizer, *, precision: str, where: str,
                  accumulate: Optional[int] = None, clip: Optional[float] = None) -> Config:
    """The engine's ``Config`` for ``offload_config`` and the Lightning settings: ``optimizer``
    (a torch optimizer: its rule, hyper-parameters and groups), ``precision`` (the engine's
    name), ``accumulate`` / ``clip`` where the loop decides them (None: the config's).
    ``where`` names the Lightning object in errors (``Trainer``, ``Fabric``)."""
    decided: Decided = dict(optimizer_keys(optimizer))
    decided["precision"] = (precision, f"{where} precision")
    if accumulate is not None:
        decided["gradient_accumulation_steps"] = (int(accumulate), f"{where} accumulate_grad_batches")
    if clip is not None:
        decided["gradient_clipping"] = (float(clip), f"{where} gradient_clip_val")
    try:
        return config_with(offload_config, decided, f"the offload strategy under {where}")
    except ConfigError as exc:
        raise ConfigError(f"offload strategy: {exc}") from None
