"""The engine's optimizer as torch sees it (``make_optimizer``): the param groups and their
hyper-parameters that LR schedulers drive, checked by the update rule; every update of a
commit shares what the groups hold at the commit (``hyperparams``)."""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
from torch.optim import optimizer as _torch_optimizer

from offload.core.telemetry import profiler_range


class _ParamGroups(torch.optim.Optimizer):
    """The engine's optimizer as torch sees it: param groups and their hyper-parameters, so
    torch LR schedulers work (built by ``make_optimizer``, each group checked by the update
    rule). ``step()`` is bookkeeping (hooks, the scheduler's call count); ``zero_grad()`` is
    the owner's (it discards the open window's gradients, which the engine holds in its own
    buffers). Built
    from a user's torch optimizer (``shared``), it shares that optimizer's ``param_groups``
    list: the groups are one set of dicts, so a scheduler built on either drives the
    engine's learning rate. (The class name is what torch's profiler range shows.)"""

    def __init__(self, groups, defaults, owner, shared: Optional[torch.optim.Optimizer] = None):
        super().__init__(groups, defaults)
        self._owner = weakref.ref(owner)       # the owner holds this object, not the reverse
        self._shared = shared
        if shared is not None:
            self.param_groups = shared.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        """Called by the owner after each committed update (the LR scheduler tracks the
        call). Runs the optimizer step hooks registered with torch, global and this
        optimizer's, pre then post, as torch's own step wrapper does, and its
        ``Optimizer.step#_ParamGroups.step`` profiler range only while a profiler records
        (torch's wrapper would enter it at every call, on the commit's critical path)."""
        args = (self,) if closure is None else (self, closure)
        if self._shared is not None:
            # the user's optimizer counts as stepped: torch's schedulers built on it check this
            # flag (set by their wrapper of its step(), which the engine never calls)
            self._shared._opt_called = True
        with profiler_range(f"Optimizer.step#{type(self).__name__}.step"):
            for hook in (*torch_step_hooks("pre"), *self._optimizer_step_pre_hooks.values()):
                if hook(self, args, {}) is not None:
                    raise RuntimeError("an optimizer step pre-hook returned new arguments: the engine's "
                                       "step() takes none")
            for hook in (*self._optimizer_step_post_hooks.values(), *torch_step_hooks("post")):
                hook(self, args, {})

    step.hooked = True       # torch wraps an unmarked step() in its profiling wrapper

    def zero_grad(self, set_to_none: bool = True) -> None:
        owner = self._owner()
        if owner is not None:
            owner.zero_grad(set_to_none)


_TORCH_STEP_HOOKS = {kind: getattr(_torch_optimizer, f"_global_optimizer_{kind}_hooks", {})
                     for kind in ("pre", "post")}


def torch_step_hooks(kind: str) -> tuple:
    """The optimizer step hooks registered for every optimizer (torch.optim.optimizer's
    register_optimizer_step_{pre,post}_hook), or none where a torch version keeps them
    elsewhere. torch registers and removes them in place in one dict per kind, looked up
    once at import (not inside step())."""
    return tuple(_TORCH_STEP_HOOKS[kind].values())


def check_group(where: str, group: dict, rule, defaults: dict) -> None:
    """A param group's hyper-parameters pass the same checks as the config's optimizer
    section (finite, in range: the rule's ``validate``); the error names the group and the key."""
    from offload.core.errors import ConfigError
    hp = dict(defaults, **{k: v for k, v in group.items() if k in defaults})
    for k, v in hp.items():
        for x in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(x, float) and not math.isfinite(x):
                raise ConfigError(f"{where}.{k}={v!r} must be a finite number")
    if isinstance(hp.get("eps"), (int, float)) and not hp["eps"] > 0:    # as the config's optimizer.eps
        raise ConfigError(f"{where}.eps={hp['eps']!r} must be > 0")
    try:
        rule.validate(hp)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        raise ConfigError(f"{where}." + msg.split(": ", 1)[1] if msg.startswith(rule.name + ": ")
                          else f"{where}: {msg}") from None


def make_optimizer(model: torch.nn.Module, param_groups, optimizer_config, rule, owner) -> _ParamGroups:
    """torch-style param groups carrying the update rule's hyper-parameters (torch's
    names), defaults from the config's optimizer section (``optimizer_config``); each group
    is checked by the rule (``UpdateRule.validate``) and must keep the same state rows as
    the config. ``param_groups``: None (one group of every parameter with
    ``requires_grad``), torch-style dicts, or a torch optimizer whose groups are shared
    (optim/from_torch.py). ``owner``: whose ``zero_grad`` the optimizer's is (held weakly)."""
    from offload.core.errors import ConfigError
    o = optimizer_config
    defaults = o.hparams()
    rows = [r.name for r in rule.rows(defaults)]
    shared = None
    if isinstance(param_groups, torch.optim.Optimizer):
        from offload.optim import from_torch
        name = from_torch.rule_name(param_groups)
        if name != rule.name:
            raise ConfigError(f"param_groups is a {type(param_groups).__name__}, whose update is {name}, but the "
                              f"config's optimizer.type is {rule.name!r}: set optimizer.type={name!r}")
        shared, param_groups = param_groups, from_torch.param_groups(param_groups, rule)
    if param_groups is None:
        param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    groups = []
    for g in param_groups:
        g = dict(g)
        where = f"param_groups[{len(groups)}]"
        g["params"] = [p for p in g["params"] if p.requires_grad]
        unknown = set(g) - set(defaults) - {"params", "name"}
        if unknown:
            raise ConfigError(f"{where} keys {sorted(unknown)} are not hyper-parameters of {o.type}: "
                              f"use {', '.join(defaults)}")
        check_group(where, g, rule, defaults)
        if [r.name for r in rule.rows(dict(defaults, **g))] != rows:
            raise ConfigError(f"{where} changes the state {o.type} keeps ({rows} for the config's optimizer "
                              f"section): every group keeps the same rows; set it in the optimizer section")
        groups.append(g)
    return _ParamGroups(groups, defaults, owner, shared=shared)


def hyperparams(optimizer: torch.optim.Optimizer) -> tuple:
    """Each group's hyper-parameters as it holds them now (the rule's keys only): what every
    block's update of one commit shares."""
    keys = optimizer.defaults
    return tuple({k: g[k] for k in keys} for g in optimizer.param_groups)
