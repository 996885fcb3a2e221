"""The engine's config for a Hugging Face ``Trainer`` run: the user's ``offload_config`` with
what ``TrainingArguments`` decides filled in.

``TrainingArguments`` owns the optimizer hyper-parameters it passes to its own optimizer
(learning rate and weight decay; Adam's betas and epsilon for AdamW / Adam, the betas for
Lion; ``optim_args``' momentum / dampening / nesterov for SGD and lr_decay / eps for
Adagrad, as transformers reads them), ``gradient_accumulation_steps``, ``max_grad_norm`` and
the precision (``bf16`` / ``fp16``). A config may leave them out, give them as ``"auto"``
(DeepSpeed's convention: filled from the arguments as transformers' DeepSpeed integration
does) or give the same value; a different value is an error naming both. The rest (tiers,
NVMe path, prefetch, ZeRO stage, ...) comes from the config.

The update rule: ``TrainingArguments.optim`` names map to the engine's rules (``OPTIM_RULES``;
the 8-bit names to ``optimizer.state_dtype: int8``), and the config's ``optimizer.type`` may
choose one too. An AdamW name (transformers' default) leaves the choice to the config; any
other name and a config type that differs are an error naming both. ``adafactor`` runs
transformers' own Adafactor as transformers' Trainer builds it (``TransformersAdafactor``:
``scale_parameter=False, relative_step=False``, the learning rate from ``learning_rate``);
torch's Adafactor is ``optimizer.type: Adafactor`` or ``torch.optim.Adafactor`` given.

A torch optimizer given to Trainer (``optimizers=(optimizer, scheduler)``, or built from
``optimizer_cls_and_kwargs``) decides instead of ``optim`` and the optimizer arguments, as in
transformers: its class the rule (``offload/optim/from_torch.py``), its ``defaults`` the
optimizer section's hyper-parameters; the config may repeat them, not contradict them.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from offload.config import Config, ConfigError, build_config, is_deepspeed_config
from offload.config.decided import config_dict, get, merge, put, raw_mapping


def precision_of(args) -> str:
    if args.bf16 and args.fp16:
        raise ConfigError("TrainingArguments: bf16 and fp16 are both set: choose one")
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


# TrainingArguments.optim -> (the engine's update rule, state dtype or None: the config's)
OPTIM_RULES = {
    "adamw_torch": ("AdamW", None), "adamw_torch_fused": ("AdamW", None), "paged_adamw_32bit": ("AdamW", None),
    "adamw_8bit": ("AdamW", "int8"), "adamw_bnb_8bit": ("AdamW", "int8"), "adamw_torch_8bit": ("AdamW", "int8"),
    "paged_adamw_8bit": ("AdamW", "int8"),
    "lion_32bit": ("Lion", None), "paged_lion_32bit": ("Lion", None),
    "lion_8bit": ("Lion", "int8"), "paged_lion_8bit": ("Lion", "int8"),
    "sgd": ("SGD", None), "adagrad": ("Adagrad", None),
    "adafactor": ("TransformersAdafactor", None),
}
_DEFAULT_NAMES = ("adamw_torch", "adamw_torch_fused")     # transformers' defaults: the config may choose


def optim_name(args) -> str:
    return str(getattr(args.optim, "value", args.optim))


def rule_of(args, config_type=None, config_state_dtype=None) -> tuple:
    """(rule, state dtype or None) for ``args.optim`` and the config's optimizer type / state
    dtype (``OPTIM_RULES``); a name without a rule, or a disagreement, is a ConfigError."""
    name = optim_name(args)
    if name not in OPTIM_RULES:
        raise ConfigError(f"TrainingArguments optim={name!r} has no update rule in the engine: use one of "
                          f"{', '.join(sorted(OPTIM_RULES))}, or choose the rule with offload_config "
                          "optimizer.type (AdamW, Adam, Lion, SGD, Adagrad, Adafactor, TransformersAdafactor)")
    rule, sd = OPTIM_RULES[name]
    if config_type is not None and config_type != rule:
        if name not in _DEFAULT_NAMES:
            raise ConfigError(f"offload_config optimizer.type={config_type!r} disagrees with TrainingArguments "
                              f"optim={name!r} ({rule}): remove one of them or make them agree")
        rule = config_type
    if sd is not None and config_state_dtype not in (None, sd):
        raise ConfigError(f"offload_config optimizer.state_dtype={config_state_dtype!r} disagrees with "
                          f"TrainingArguments optim={name!r} ({sd} state): remove one of them or make them agree")
    return rule, sd


def _optim_args(args) -> dict:
    text = getattr(args, "optim_args", None) or ""
    out = {}
    for item in text.replace(" ", "").split(","):
        if item:
            k, sep, v = item.partition("=")
            if not sep:
                raise ConfigError(f"TrainingArguments optim_args item {item!r} must be key=value")
            out[k] = v
    return out


def _owned(args, rule: str = "AdamW") -> dict:
    """The engine keys TrainingArguments decides for ``rule``, dotted, with their values (only
    hyper-parameters that transformers passes to that optimizer itself)."""
    owned = {"optimizer.type": rule, "optimizer.lr": float(args.learning_rate),
             "optimizer.weight_decay": float(args.weight_decay)}
    if rule in ("AdamW", "Adam", "Lion"):
        owned["optimizer.betas"] = (float(args.adam_beta1), float(args.adam_beta2))
    if rule in ("AdamW", "Adam"):
        owned["optimizer.eps"] = float(args.adam_epsilon)
    if rule == "TransformersAdafactor":     # transformers' Trainer: an absolute step size, unscaled
        owned.update({"optimizer.scale_parameter": False, "optimizer.relative_step": False})
    extra = _optim_args(args)
    keys = {"SGD": {"momentum": float, "dampening": float, "nesterov": lambda v: v.lower() in ("true", "1", "yes")},
            "Adagrad": {"lr_decay": float, "eps": float}}.get(rule, {})
    for k, conv in keys.items():
        if k in extra:
            owned[f"optimizer.{k}"] = conv(extra[k])
    owned.update({
        "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
        "gradient_clipping": float(args.max_grad_norm or 0.0),
        "precision": precision_of(args),
    })
    return owned


_WHERE = {"optimizer.type": "optim", "optimizer.lr": "learning_rate", "optimizer.betas": "adam_beta1/adam_beta2",
          "optimizer.eps": "adam_epsilon", "optimizer.weight_decay": "weight_decay",
          "optimizer.momentum": "optim_args momentum", "optimizer.dampening": "optim_args dampening",
          "optimizer.nesterov": "optim_args nesterov", "optimizer.lr_decay": "optim_args lr_decay",
          "optimizer.scale_parameter": "optim (adafactor: False)",
          "optimizer.relative_step": "optim (adafactor: False)",
          "gradient_accumulation_steps": "gradient_accumulation_steps",
          "gradient_clipping": "max_grad_norm", "precision": "bf16/fp16"}


def _owned_by_optimizer(optimizer, args) -> tuple:
    """(the engine keys a torch optimizer and TrainingArguments decide, where each comes
    from) when Trainer is given the optimizer."""
    from offload.config.decided import optimizer_keys
    decided = optimizer_keys(optimizer)      # its groups checked now, before training
    owned = {k: v for k, (v, _) in decided.items()}
    where = {k: w for k, (_, w) in decided.items()}
    owned.update({"gradient_accumulation_steps": int(args.gradient_accumulation_steps),
                  "gradient_clipping": float(args.max_grad_norm or 0.0), "precision": precision_of(args)})
    return owned, dict(where, **{k: f"TrainingArguments {_WHERE[k]}"
                                 for k in ("gradient_accumulation_steps", "gradient_clipping", "precision")})


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


def precision_asked(offload_config: Any, args) -> bool:
    """Whether the run's precision was chosen: bf16 / fp16 in ``args``, or a ``precision`` in
    a native ``offload_config`` (an ``offload.Config``'s and a DeepSpeed config's follow the
    arguments, which must agree with them). Otherwise ``Trainer`` trains in fp32 and says
    why where bf16 is slow (``offload.planner.precision``)."""
    if args.bf16 or args.fp16:
        return True
    if isinstance(offload_config, Config):
        return False
    raw = raw_mapping(offload_config)
    return not is_deepspeed_config(raw) and raw.get("precision") is not None


def engine_config(offload_config: Any, args, optimizer=None) -> Config:
    """The engine's ``Config`` for ``offload_config`` (dict, JSON path, DeepSpeed dict or
    ``offload.Config``) and ``TrainingArguments`` ``args``; with ``optimizer`` (a torch
    optimizer Trainer was given) its rule and hyper-parameters instead of ``args.optim`` and
    the optimizer arguments."""
    if isinstance(offload_config, Config):
        # A Config has every key set: the arguments decide the keys they own (its optimizer
        # type counts as chosen where it is not the default AdamW).
        d = offload_config.to_dict()
        if optimizer is not None:
            owned, _ = _owned_by_optimizer(optimizer, args)
            d["optimizer"] = {"state_dtype": get(d, "optimizer.state_dtype")}
            for key, value in owned.items():
                put(d, key, value)
            return build_config(d)
        t = get(d, "optimizer.type")
        rule, sd = rule_of(args, None if t == "AdamW" else t)
        for key, value in _owned(args, rule).items():
            put(d, key, value)
        if sd is not None:
            put(d, "optimizer.state_dtype", sd)
        return build_config(d)
    d = config_dict(raw_mapping(offload_config), "TrainingArguments", lambda raw: fill_deepspeed_auto(raw, args))
    if optimizer is not None:
        owned, where = _owned_by_optimizer(optimizer, args)
    else:
        rule, sd = rule_of(args, get(d, "optimizer.type"), get(d, "optimizer.state_dtype"))
        if sd is not None:
            put(d, "optimizer.state_dtype", sd)
        if get(d, "optimizer.type") is not None:
            put(d, "optimizer.type", rule)          # a default AdamW name left the choice to the config
        owned, where = _owned(args, rule), {k: f"TrainingArguments {v}" for k, v in _WHERE.items()}
    return build_config(merge(d, {k: (v, where[k]) for k, v in owned.items()}))
