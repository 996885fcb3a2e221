"""Every update rule as a standalone ``torch.optim.Optimizer`` over fp32 CPU parameters:
``CPULion``, ``CPUSGD``, ``CPUAdagrad``, ``CPUAdafactor``, ``CPUAdamW``, ``CPURuleAdam``
(``CPUAdam`` in cpu_adam.py is the historical Adam / AdamW one), or ``RuleOptimizer.of(name)``.

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

from offload import _native
from offload.optim.rule import STATE_DTYPES, get_rule, load_row, state_dtype_of, store_row


class RuleOptimizer(torch.optim.Optimizer):
    rule_name: ClassVar[str] = ""

    def __init__(self, params, *, state_dtype: str = "fp32", **hparams):
        self.rule = get_rule(self.rule_name)
        unknown = sorted(set(hparams) - set(self.rule.defaults))
        if unknown:
            raise TypeError(f"{self.rule.name}: unknown hyper-parameter(s) {unknown}; its keys are "
                            f"{sorted(self.rule.defaults)} (torch's names)")
        if state_dtype not in STATE_DTYPES or state_dtype not in self.rule.state_dtypes:
            raise ValueError(f"state_dtype={state_dtype!r}: {self.rule.name} takes one of {self.rule.state_dtypes}")
        defaults = dict(self.rule.defaults, **hparams)
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

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with _native.pool_held():   # one registration with torch's OpenMP for the whole step
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise TypeError(f"{self.rule.name} does not support sparse gradients")
                    if not p.is_contiguous() or not p.grad.is_contiguous():
                        raise ValueError(f"{self.rule.name} updates parameters in place through a flat view: "
                                         f"make the parameter and its gradient contiguous")
                    flat, done = self._state_of(p, group)
                    self.state[p]["step"] += 1
                    self.rule.cpu_step(p.view(-1), p.grad.view(-1), flat, group, done + 1, shape=tuple(p.shape))
        return loss


CPUAdamW = RuleOptimizer.of("AdamW")
CPURuleAdam = RuleOptimizer.of("Adam")
CPULion = RuleOptimizer.of("Lion")
CPUSGD = RuleOptimizer.of("SGD")
CPUAdagrad = RuleOptimizer.of("Adagrad")
CPUAdafactor = RuleOptimizer.of("Adafactor")
