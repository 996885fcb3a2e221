"""A torch optimizer read as the engine's update rule, its param groups and hyper-parameters.

The engine computes the update itself, so it takes from a ``torch.optim.Optimizer`` what
decides the update: the rule (the class: ``torch.optim.SGD``, ``Adam``, ``AdamW``,
``Adagrad``, ``Adafactor`` and offload.optim's own ``CPU*`` classes, each the rule whose
``torch_optimizer`` names it; ``Adam(decoupled_weight_decay=True)`` is AdamW; another
library's class a rule names by ``optimizer_class``: ``transformers.optimization.Adafactor``)
and, per param group, the rule's hyper-parameters under torch's names. What only chooses torch's
implementation (``foreach``, ``fused``, ``capturable``, ``differentiable``) is ignored; an
option that changes the update the rule does not have (``maximize``, ``amsgrad``) is refused,
as is another class (a subclass may override ``step``) and state from steps taken before
(the engine starts its own).
"""
from __future__ import annotations

import sys
from typing import List

import torch

NEUTRAL = {"maximize": False, "amsgrad": False}      # options the rules have only at these values


def _rules() -> dict:
    from offload.optim.rule import RULES
    return RULES


def _torch_classes() -> dict:
    """optimizer class -> rule name, for the rules that name one: a torch.optim class
    (``torch_optimizer``) or another library's (``optimizer_class``, "module.Name", looked up
    only where that module is already imported: an instance of it means it is)."""
    out = {}
    for rule in _rules().values():
        cls = getattr(torch.optim, rule.torch_optimizer or "", None)
        if isinstance(cls, type):
            out[cls] = rule.name
        module, _, name = (rule.optimizer_class or "").rpartition(".")
        cls = getattr(sys.modules.get(module), name, None) if module else None
        if isinstance(cls, type):
            out[cls] = rule.name
    return out


def _public_name(cls: type) -> str:
    """torch.optim.AdamW, transformers.optimization.Adafactor: where users import it from."""
    if cls.__module__.startswith("torch.optim"):
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _error(msg: str):
    from offload.core.errors import ConfigError
    return ConfigError(msg)


def rule_name(optimizer: torch.optim.Optimizer) -> str:
    """The engine's rule for ``optimizer``'s update, or a ConfigError naming the classes that
    have one."""
    from offload.optim.optimizer import RuleOptimizer
    if isinstance(optimizer, RuleOptimizer):
        return optimizer.rule.name
    classes = _torch_classes()
    cls = type(optimizer)
    if cls not in classes:
        have = ", ".join(f"{_public_name(c)} ({r})" for c, r in classes.items())
        raise _error(f"the engine computes the update itself and has no rule for {cls.__module__}.{cls.__qualname__}: "
                     f"give one of {have} or offload.optim's CPU optimizers, or choose the engine's rule by name "
                     f"(TrainingArguments optim, offload_config optimizer.type)")
    name = classes[cls]
    if name == "Adam" and any(g.get("decoupled_weight_decay") for g in optimizer.param_groups):
        if not all(g.get("decoupled_weight_decay") for g in optimizer.param_groups):
            raise _error("torch.optim.Adam: decoupled_weight_decay differs between param groups; the engine runs "
                         "one rule (Adam or AdamW) for all of them")
        return "AdamW"
    return name


def _stepped(state) -> bool:
    """Whether a parameter's torch state records a step (Adagrad creates its state, at step
    0, when it is constructed; the others at their first step)."""
    if not state:
        return False
    return "step" not in state or float(state["step"]) > 0


def param_groups(optimizer: torch.optim.Optimizer, rule) -> List[dict]:
    """``optimizer``'s param groups, in order, each with its parameters and ``rule``'s
    hyper-parameters (torch's names; a tensor learning rate as a number)."""
    cls = type(optimizer).__name__
    if any(_stepped(optimizer.state.get(p)) for g in optimizer.param_groups for p in g["params"]):
        raise _error(f"{cls} holds state from steps taken before: the engine starts its own optimizer state; "
                     f"give an optimizer that has not stepped yet")
    out = []
    for gi, g in enumerate(optimizer.param_groups):
        for key, neutral in NEUTRAL.items():
            if key in g and bool(g[key]) != neutral:
                raise _error(f"{cls} param_groups[{gi}] sets {key}={g[key]!r}: the engine's {rule.name} rule has no "
                             f"such option; leave it at {neutral}")
        missing = [k for k in rule.defaults if k not in g]
        if missing:
            raise _error(f"{cls} param_groups[{gi}] lacks {missing}, which the {rule.name} rule needs")
        group = {"params": list(g["params"])}
        for k in rule.defaults:
            v = g[k]
            group[k] = float(v) if isinstance(v, torch.Tensor) else v
        if "name" in g:
            group["name"] = g["name"]
        out.append(group)
    return out
