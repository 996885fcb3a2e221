"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2).

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * wd) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

torch has no Lion; ``reference`` is the published algorithm in plain torch (the order of
the authors' PyTorch code), native/lion.c its per-element form. One row: exp_avg (signed).
"""
from __future__ import annotations

import ctypes

import torch

from offload.optim.rule import Row, UpdateRule


class LionHparams(ctypes.Structure):
    """Mirror of offload_lion_hparams (native/lion.c)."""
    _fields_ = [(name, ctypes.c_float) for name in (
        "grad_scale", "decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "neg_lr")]


class Lion(UpdateRule):
    name = "Lion"
    kernel = "lion"
    hparams_type = LionHparams
    defaults = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)

    def rows(self, group, shape=None):
        return (Row("exp_avg", signed=True),)

    def native_hparams(self, group, step, grad_scale):
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        b1, b2 = (float(b) for b in group["betas"])
        return LionHparams(grad_scale=float(grad_scale), decay=1 - lr * wd, beta1=b1, one_minus_beta1=1 - b1,
                           beta2=b2, one_minus_beta2=1 - b2, neg_lr=-lr)

    def reference(self, param, grad, state, group, step, grad_scale=1.0):
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        b1, b2 = (float(b) for b in group["betas"])
        m = state["exp_avg"].view(param.shape)
        g = grad.mul(grad_scale) if grad_scale != 1.0 else grad
        param.mul_(1 - lr * wd)
        update = m.mul(b1).add_(g, alpha=1 - b1).sign_()
        param.add_(update, alpha=-lr)
        m.mul_(b2).add_(g, alpha=1 - b2)

    def device_step(self, params, grads, states, group, steps):
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        b1, b2 = (float(b) for b in group["betas"])
        ms = [s["exp_avg"].view(p.shape) for p, s in zip(params, states)]
        torch._foreach_mul_(params, 1 - lr * wd)
        updates = torch._foreach_mul(ms, b1)
        torch._foreach_add_(updates, grads, alpha=1 - b1)
        torch._foreach_sign_(updates)
        torch._foreach_add_(params, updates, alpha=-lr)
        torch._foreach_mul_(ms, b2)
        torch._foreach_add_(ms, grads, alpha=1 - b2)
