"""Every update rule as a standalone ``torch.optim.Optimizer`` over fp32 CPU parameters:
``CPULion``, ``CPUSGD``, ``CPUAdagrad``, ``CPUAdafactor``, ``CPUAdamW``, ``CPURuleAdam``, or
``RuleOptimizer.of(name)``; ``CPUAdam`` is Adam / AdamW picked per param group by ``adamw_mode``
(torch.optim.AdamW's defaults but ``weight_decay=0``), over the same rules.

Hyper-parameters take torch's names and defaults (the rule's ``defaults``); ``state_dtype``
(fp32 | bf16 | int8) picks how the rows are stored. With fp32 state, ``state_dict()`` has the
torch optimizer's layout (same keys, shapes, dtypes), so state dicts move both ways between
this optimizer and its torch counterpart. bf16 / int8 optimizers convert state they load
(from torch or from another state dtype) at their next step. int8 rows are stored as
``state[name]`` (uint8 codes, the parameter's shape) and ``state[name + "_absmax"]``.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from offload.optim.rule import STATE_DTYPES, get_rule, load_row, state_dtype_of, store_row


class RuleOptimizer(torch.optim.Optimizer):
    rule_name: ClassVar[str] = ""
    group_keys: ClassVar[dict] = {}     # keys a param group holds besides the rule's (their defaults)

    def __init__(self, params, *, state_dtype: str = "fp32", **hparams):
        self.rule = get_rule(self.rule_name)
        unknown = sorted(set(hparams) - set(self.rule.defaults) - set(self.group_keys))
        if unknown:
            raise TypeError(f"{self.rule.name}: unknown hyper-parameter(s) {unknown}; its keys are "
                            f"{sorted(self.rule.defaults)} (torch's names)")
        if state_dtype not in STATE_DTYPES or state_dtype not in self.rule.state_dtypes:
            raise ValueError(f"state_dtype={state_dtype!r}: {self.rule.name} takes one of {self.rule.state_dtypes}")
        defaults = {**self.rule.defaults, **self.group_keys, **hparams}
        self.rule.validate(defaults)
        self.state_dtype = state_dtype
        super().__init__(params, defaults)

    @classmethod
    def of(cls, name: str) -> type:
        """The optimizer class of the rule ``name``."""
        rule = get_rule(name)
        return type(f"CPU{rule.name}", (cls,), {"rule_name": rule.name, "__doc__": f"{rule.name} on CPU tensors."})

    def _state_of(self, p: torch.Tensor, group: dict) -> tuple:
        """(flat state rows for cpu_step, step count before this step), created or converted."""
        state = self.state[p]
        rows = self.rule.rows(group, tuple(p.shape))
        if not state or any(r.name not in state for r in rows):
            had_rows = bool(state) and any(r.name in state for r in rows)
            fresh = self.rule.init_state(p, group, self.state_dtype)
            for r in rows:
                if r.name not in state:
                    for key in (r.name, r.name + "_absmax"):
                        if key in fresh:
                            state[key] = fresh[key].view(r.shape or p.shape) if key == r.name else fresh[key]
            state.setdefault("step", torch.tensor(1.0 if had_rows else 0.0, dtype=torch.float32))
        if "step" not in state:  # torch's SGD keeps no step: its buffer exists, so not the first
            state["step"] = torch.tensor(1.0, dtype=torch.float32)
        flat = {}
        for r in rows:
            want = self.state_dtype if r.elementwise else "fp32"
            t = state[r.name]
            if state_dtype_of(state, (r,)) != want:  # loaded in another dtype: convert
                fp32 = load_row(state, r).clone()
                state.pop(r.name), state.pop(r.name + "_absmax", None)
                tmp = {}
                store_row(tmp, r, fp32, want)
                state[r.name] = tmp[r.name].view(r.shape or p.shape)
                if want == "int8":
                    state[r.name + "_absmax"] = tmp[r.name + "_absmax"]
                t = state[r.name]
            flat[r.name] = t.view(-1)
            if r.name + "_absmax" in state:
                flat[r.name + "_absmax"] = state[r.name + "_absmax"]
        return flat, int(state["step"].item())

    def rule_of(self, group: dict):
        """The rule that steps ``group`` (the optimizer's own)."""
        return self.rule

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            rule = self.rule_of(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError(f"{rule.name} does not support sparse gradients")
                if not p.is_contiguous() or not p.grad.is_contiguous():
                    raise ValueError(f"{rule.name} updates parameters in place through a flat view: "
                                     f"make the parameter and its gradient contiguous")
                flat, done = self._state_of(p, group)
                self.state[p]["step"] += 1
                rule.cpu_step(p.view(-1), p.grad.view(-1), flat, group, done + 1, shape=tuple(p.shape))
        return loss


CPUAdamW = RuleOptimizer.of("AdamW")
CPURuleAdam = RuleOptimizer.of("Adam")
CPULion = RuleOptimizer.of("Lion")
CPUSGD = RuleOptimizer.of("SGD")
CPUAdagrad = RuleOptimizer.of("Adagrad")
CPUAdafactor = RuleOptimizer.of("Adafactor")


class CPUAdam(RuleOptimizer):
    """Adam / AdamW on fp32 CPU parameters: the AdamW rule (``adamw_mode=True``, decoupled decay)
    or the Adam rule (L2 decay) per param group. Same hyper-parameters and state layout as
    torch.optim.AdamW / Adam (state[p] = {"step": 0-dim fp32, "exp_avg", "exp_avg_sq"}), so
    state dicts move both ways; works with param groups and LR schedulers."""
    rule_name = "AdamW"
    group_keys = {"adamw_mode": True}

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # a torch Adam/AdamW state_dict says which it was
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))

    def rule_of(self, group: dict):
        modes = self.__dict__.get("_modes")
        if modes is None:
            modes = self._modes = {True: self.rule, False: get_rule("Adam")}
        return modes[bool(group["adamw_mode"])]
