"""Adafactor as torch.optim.Adafactor (torch >= 2.5; Shazeer & Stern 2018, torch's variant):
the second moment of a parameter with >= 2 dimensions is factored over its last two: rows
``row_var`` (shape[:-1] + (1,)) and ``col_var`` (shape[:-2] + (1, shape[-1])); a 1-D parameter
keeps an unfactored ``variance``. No first moment. Hyper-parameters as torch: lr, beta2_decay,
eps = (eps1 or None, eps2), d, weight_decay.

Passes: besides the factored update, each step reads the whole parameter twice more for its
norm (the relative step size) and the update's norm (the clipping threshold d), so it is
not a single-pass rule. The CPU step runs in torch (no native kernel): the reductions over
rows and columns need the parameter's shape.

The factored rows are tiny (R + C values for an R x C matrix) and stay fp32 whatever the
state dtype; only an unfactored ``variance`` follows ``state_dtype``.

In the engine (optim/pipeline.py, optim/state.py) the rule is stepped per tensor
(``per_tensor``): a parameter of >= 2 dimensions wholly inside the rank's shard keeps its
factored ``row_var`` / ``col_var``; a 1-D parameter its ``variance``. Sharding: the factored
statistics need every row and column of the matrix, so a tensor that ZeRO splits across
ranks keeps, on each rank, the unfactored ``variance`` of its piece (``rows(group,
shape=None)``), and its relative step size (RMS of the parameter) and update clipping (RMS
of the update) are those of the piece, where torch uses the whole tensor: exact on one rank,
an approximation for split tensors (documented in the README's optimizer section).
"""
from __future__ import annotations

import math

import torch

from offload.optim.rule import Row, UpdateRule


class Adafactor(UpdateRule):
    name = "Adafactor"
    torch_optimizer = "Adafactor"
    per_tensor = True
    defaults = dict(lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0)

    def rows(self, group, shape=None):
        if shape is None or len(shape) < 2:
            return (Row("variance", signed=False),)
        shape = tuple(int(s) for s in shape)
        return (Row("row_var", signed=False, shape=shape[:-1] + (1,)),
                Row("col_var", signed=False, shape=shape[:-2] + (1, shape[-1])))

    def passes(self):
        return 3

    def validate(self, group):
        for key in ("lr", "weight_decay"):
            v = float(group[key])
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"Adafactor: {key}={group[key]!r} must be a finite number >= 0")
        if not float(group["beta2_decay"]) <= 0.0:
            raise ValueError(f"Adafactor: beta2_decay={group['beta2_decay']!r} must be <= 0")
        eps = tuple(group["eps"])
        if len(eps) != 2 or (eps[0] is not None and not float(eps[0]) >= 0) or not float(eps[1]) >= 0:
            raise ValueError(f"Adafactor: eps={group['eps']!r} must be a pair (eps1 >= 0 or None, eps2 >= 0)")
        if not float(group["d"]) >= 1.0:
            raise ValueError(f"Adafactor: d={group['d']!r} must be >= 1")

    def state_bytes_per_param(self, state_dtype="fp32", group=None):
        return 4.0  # unfactored worst case (a 1-D or a sharded tensor); factored: ~4 (R + C) / (R C)

    def reference(self, param, grad, state, group, step, grad_scale=1.0):
        g = grad.mul(grad_scale) if grad_scale != 1.0 else grad
        lr, wd, d = float(group["lr"]), float(group["weight_decay"]), float(group["d"])
        eps1, eps2 = group["eps"]
        if eps1 is None:
            eps1 = torch.finfo(param.dtype).eps
        one_minus_beta2_t = float(step) ** float(group["beta2_decay"])
        rho_t = min(lr, 1 / (float(step) ** 0.5))
        alpha = max(eps2, param.norm(2).item() / (param.numel() ** 0.5)) * rho_t
        if wd != 0:
            param.mul_(1 - lr * wd)
        if "row_var" in state:
            row_var = state["row_var"].view(g.shape[:-1] + (1,))
            col_var = state["col_var"].view(g.shape[:-2] + (1, g.shape[-1]))
            row_mean = torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1))
            row_var.lerp_(row_mean, one_minus_beta2_t)
            col_mean = torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2))
            col_var.lerp_(col_mean, one_minus_beta2_t)
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            variance = state["variance"].view(g.shape)
            variance.lerp_(g * g, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(g)
        denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * d))
        param.add_(update, alpha=-alpha / denom)
