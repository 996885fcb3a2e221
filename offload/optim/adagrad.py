"""Adagrad as torch.optim.Adagrad: lr_decay, initial_accumulator_value, eps, L2 weight decay.
One row, sum (non-negative, the unsigned int8 code), starting at initial_accumulator_value."""
from __future__ import annotations

import ctypes

import torch

from offload.optim.rule import Row, UpdateRule


class AdagradHparams(ctypes.Structure):
    """Mirror of offload_adagrad_hparams (native/adagrad.c)."""
    _fields_ = [(name, ctypes.c_float) for name in ("grad_scale", "weight_decay", "eps", "neg_clr")]


class Adagrad(UpdateRule):
    name = "Adagrad"
    kernel = "adagrad"
    hparams_type = AdagradHparams
    torch_optimizer = "Adagrad"
    defaults = dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10)

    def rows(self, group, shape=None):
        return (Row("sum", signed=False, init="initial_accumulator_value"),)

    def validate(self, group):
        super().validate(group)
        for key in ("lr_decay", "initial_accumulator_value"):
            v = float(group.get(key, 0.0))
            if not (v >= 0.0 and v != float("inf")):
                raise ValueError(f"Adagrad: {key}={group.get(key)!r} must be a finite number >= 0")

    def native_hparams(self, group, step, grad_scale):
        clr = float(group["lr"]) / (1 + (step - 1) * float(group["lr_decay"]))
        return AdagradHparams(grad_scale=float(grad_scale), weight_decay=float(group["weight_decay"]),
                              eps=float(group["eps"]), neg_clr=-clr)

    def reference(self, param, grad, state, group, step, grad_scale=1.0):
        g = grad.mul(grad_scale) if grad_scale != 1.0 else grad
        wd = float(group["weight_decay"])
        if wd != 0:
            g = g.add(param, alpha=wd)
        clr = float(group["lr"]) / (1 + (step - 1) * float(group["lr_decay"]))
        s = state["sum"].view(param.shape)
        s.addcmul_(g, g, value=1)
        std = s.sqrt().add_(float(group["eps"]))
        param.addcdiv_(g, std, value=-clr)

    def device_step(self, params, grads, states, group, steps):
        sums = [s["sum"].view(p.shape) for p, s in zip(params, states)]
        step_t = [torch.full((), float(s - 1), dtype=torch.float32, device=p.device)   # torch adds 1; filled
                  for p, s in zip(params, steps)]                                      # on the device: no sync
        torch.optim.adagrad.adagrad(params, grads, sums, step_t, lr=float(group["lr"]),
                                    weight_decay=float(group["weight_decay"]), lr_decay=float(group["lr_decay"]),
                                    eps=float(group["eps"]), maximize=False, foreach=True, has_sparse_grad=False)
