"""The engine's config for a run whose training framework decides some of its keys.

A framework that drives the engine (Hugging Face ``Trainer``, Lightning) owns settings the
engine also reads: the update rule and its hyper-parameters (from the torch optimizer the
user built), the accumulation window, the clipping norm, the precision. ``config_with`` takes
the user's ``offload_config`` and those decided keys, each with where it was decided: a key
the config leaves out is filled, the same value is accepted, a different one is a
ConfigError naming both places, so one setting never silently overrides the other. The rest
(tiers, NVMe path, prefetch, ZeRO stage, ...) comes from the config.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Tuple

from offload.config.deepspeed import is_deepspeed_config, translate_deepspeed
from offload.config.errors import ConfigError, read_json
from offload.config.schema import Config, build_config

# dotted engine key -> (value, where it was decided: named in errors)
Decided = Dict[str, Tuple[Any, str]]


def optimizer_keys(optimizer) -> Decided:
    """The engine keys a torch optimizer decides: its rule (the class, offload/optim/from_torch.py)
    and the rule's hyper-parameters from its ``defaults``; its param groups are checked now, so
    a group the engine cannot run fails before training."""
    from offload.optim import get_rule
    from offload.optim.from_torch import param_groups, rule_name
    name = rule_name(optimizer)
    param_groups(optimizer, get_rule(name))
    out: Decided = {"optimizer.type": (name, f"the optimizer's class ({type(optimizer).__name__})")}
    for k in get_rule(name).defaults:
        v = optimizer.defaults[k]
        v = float(v) if hasattr(v, "item") and not isinstance(v, (list, tuple)) else v
        out[f"optimizer.{k}"] = (tuple(v) if isinstance(v, list) else v, f"the optimizer's {k}")
    return out


def raw_mapping(offload_config: Any) -> Mapping:
    """The mapping of a dict / JSON path ``offload_config`` ({} for None)."""
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
    return raw


def leftover_auto(d, where=""):
    """The dotted keys of ``d`` whose value is DeepSpeed's ``"auto"``."""
    if isinstance(d, Mapping):
        for k, v in d.items():
            yield from leftover_auto(v, f"{where}{k}.")
    elif d == "auto":
        yield where.rstrip(".")


def config_with(offload_config: Any, decided: Decided, framework: str) -> Config:
    """The engine's ``Config`` for ``offload_config`` (dict, JSON path, DeepSpeed dict or
    ``offload.Config``) with the ``decided`` keys. An ``offload.Config`` has every key set, so
    the decided keys replace its values (its optimizer section but ``state_dtype`` where the
    rule is decided); a dict or file may only agree with them. ``"auto"`` values (DeepSpeed's
    convention) are an error naming the key: ``framework`` decides only the keys it names."""
    if isinstance(offload_config, Config):
        d = offload_config.to_dict()
        if "optimizer.type" in decided:
            d["optimizer"] = {"state_dtype": get(d, "optimizer.state_dtype")}
        for key, (value, _) in decided.items():
            put(d, key, value)
        return build_config(d)
    return build_config(merge(config_dict(raw_mapping(offload_config), framework), decided))


def config_dict(raw: Mapping, framework: str, fill_auto=None) -> dict:
    """A config dict (a copy) of the mapping ``raw``: a DeepSpeed config translated, its
    ``"auto"`` values first passed to ``fill_auto`` (the values ``framework`` decides; under
    ``scheduler`` and ``zero_optimization`` the translation drops or sizes them), any other
    ``"auto"`` an error naming the key; ``"auto"`` outside a DeepSpeed config is an error."""
    if is_deepspeed_config(raw):
        if fill_auto is not None:
            raw = fill_auto(raw)
        left = [k for k in leftover_auto(raw) if not k.startswith(("scheduler.", "zero_optimization."))]
        if left:
            raise ConfigError(f"offload_config: {', '.join(left)} is 'auto', which {framework} does not fill: "
                              f"give a value, or leave the key out where {framework} decides it")
        return translate_deepspeed(raw)
    d = json.loads(json.dumps(raw))
    left = list(leftover_auto(d))
    if left:
        raise ConfigError(f"offload_config: 'auto' is for DeepSpeed configs; {', '.join(left)} needs a value")
    return d


def merge(d: dict, decided: Decided) -> dict:
    """``d`` (a config dict, changed in place) with each decided key filled where it is left
    out; a different value given is a ConfigError naming both places."""
    for key, (value, where) in decided.items():
        given = get(d, key)
        if given is None:
            put(d, key, value)
            continue
        same = tuple(given) == value if isinstance(value, tuple) and isinstance(given, (list, tuple)) \
            else given == value
        if not same:
            raise ConfigError(f"offload_config {key}={given!r} disagrees with {where} ({value!r}): remove it "
                              f"from offload_config (that decides it) or make them equal")
    return d


def get(d: Mapping, dotted: str):
    for p in dotted.split("."):
        if not isinstance(d, Mapping) or p not in d:
            return None
        d = d[p]
    return d


def put(d: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value
