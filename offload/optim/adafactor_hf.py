"""Adafactor as transformers' ``transformers.optimization.Adafactor`` (fairseq's variant, the
one most Adafactor users run): its relative step (``lr=None``, ``relative_step``,
``warmup_init``), its parameter scaling (``scale_parameter``: the step times the parameter's
RMS), update clipping (``clip_threshold``), the optional first moment (``beta1``) and its
weight decay. It is another rule than torch's Adafactor (adafactor.py): ``eps1`` is added to
the squared gradient, the decay is ``decay_rate``, the step size may be absolute.

State per parameter (transformers' names): a parameter of >= 2 dimensions keeps its factored
second moment ``exp_avg_sq_row`` (shape[:-1]) and ``exp_avg_sq_col`` (shape[:-2] +
shape[-1:]), a 1-D one ``exp_avg_sq``; with ``beta1`` also ``exp_avg``. The step count is the
engine's per-block count and the RMS is read from the parameter at each step, so nothing
else is kept: a checkpoint of the rows and the count resumes it exactly.

Stepped per tensor in torch (``per_tensor``; no native kernel: the reductions need the
shape), with the same operations in the same order as transformers, so fp32 results are
bitwise equal. A tensor that ZeRO splits across ranks keeps the unfactored ``exp_avg_sq`` of
its piece, and its RMS (scaling, clipping) is the piece's: exact on one rank, an
approximation for split tensors, as for torch's Adafactor (README, optimizer section).
"""
from __future__ import annotations

import math

import torch

from offload.optim.rule import Row, UpdateRule


class TransformersAdafactor(UpdateRule):
    name = "TransformersAdafactor"
    optimizer_class = "transformers.optimization.Adafactor"   # the class whose update this is (from_torch.py)
    per_tensor = True
    defaults = dict(lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None, weight_decay=0.0,
                    scale_parameter=True, relative_step=True, warmup_init=False)

    def rows(self, group, shape=None):
        first = (Row("exp_avg", signed=True),) if group.get("beta1") is not None else ()
        if shape is None or len(shape) < 2:
            return first + (Row("exp_avg_sq", signed=False),)
        shape = tuple(int(s) for s in shape)
        return first + (Row("exp_avg_sq_row", signed=False, shape=shape[:-1]),
                        Row("exp_avg_sq_col", signed=False, shape=shape[:-2] + shape[-1:]))

    def passes(self):
        return 3

    def state_bytes_per_param(self, state_dtype="fp32", group=None):
        first = (group or {}).get("beta1") is not None
        return 8.0 if first else 4.0      # unfactored worst case (a 1-D or a split tensor)

    def validate(self, group):
        lr = group["lr"]
        if lr is not None and not (math.isfinite(float(lr)) and float(lr) >= 0):
            raise ValueError(f"TransformersAdafactor: lr={lr!r} must be None (relative step) or a finite number >= 0")
        if lr is None and not group["relative_step"]:
            raise ValueError("TransformersAdafactor: lr=None needs relative_step=True (the step size it computes); "
                             "give lr or set relative_step=True")
        if group["warmup_init"] and not group["relative_step"]:
            raise ValueError("TransformersAdafactor: warmup_init=True requires relative_step=True")
        eps = tuple(group["eps"])
        if len(eps) != 2 or any(e is None or not float(e) >= 0 for e in eps):
            raise ValueError(f"TransformersAdafactor: eps={group['eps']!r} must be a pair of numbers >= 0 (eps1 added "
                             f"to the squared gradient, eps2 the least parameter scale)")
        if not float(group["clip_threshold"]) > 0:
            raise ValueError(f"TransformersAdafactor: clip_threshold={group['clip_threshold']!r} must be > 0")
        if not float(group["decay_rate"]) <= 0:
            raise ValueError(f"TransformersAdafactor: decay_rate={group['decay_rate']!r} must be <= 0")
        b1 = group["beta1"]
        if b1 is not None and not 0.0 <= float(b1) < 1.0:
            raise ValueError(f"TransformersAdafactor: beta1={b1!r} must be None or in [0, 1)")
        if not (math.isfinite(float(group["weight_decay"])) and float(group["weight_decay"]) >= 0):
            raise ValueError(f"TransformersAdafactor: weight_decay={group['weight_decay']!r} must be a finite "
                             f"number >= 0")

    @staticmethod
    def step_size(group, step, rms):
        """transformers' ``Adafactor._get_lr``: the relative step (1/sqrt(step), at most 1e-2,
        or 1e-6 * step with warmup_init) or the group's lr, times max(eps2, RMS of the
        parameter) with scale_parameter (a 0-d tensor then, as in transformers)."""
        rel_step_sz = group["lr"]
        if group["relative_step"]:
            min_step = 1e-6 * step if group["warmup_init"] else 1e-2
            rel_step_sz = min(min_step, 1.0 / math.sqrt(step))
        param_scale = 1.0
        if group["scale_parameter"]:
            param_scale = max(group["eps"][1], rms)
        return param_scale * rel_step_sz

    def reference(self, param, grad, state, group, step, grad_scale=1.0):
        g = grad.mul(grad_scale) if grad_scale != 1.0 else grad
        rms = param.norm(2) / (param.numel() ** 0.5)
        lr = self.step_size(group, step, rms)
        eps1 = float(group["eps"][0])
        beta2t = 1.0 - math.pow(step, float(group["decay_rate"]))
        update = (g**2) + eps1
        if "exp_avg_sq_row" in state:
            row = state["exp_avg_sq_row"].view(g.shape[:-1])
            col = state["exp_avg_sq_col"].view(g.shape[:-2] + g.shape[-1:])
            row.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
            col.mul_(beta2t).add_(update.mean(dim=-2), alpha=(1.0 - beta2t))
            r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            c_factor = col.unsqueeze(-2).rsqrt()
            update = torch.mul(r_factor, c_factor)
            update.mul_(g)
        else:
            v = state["exp_avg_sq"].view(g.shape)
            v.mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
            update = v.rsqrt().mul_(g)
        update.div_((update.norm(2) / (update.numel() ** 0.5) / float(group["clip_threshold"])).clamp_(min=1.0))
        update.mul_(lr)
        if group["beta1"] is not None:
            b1 = float(group["beta1"])
            exp_avg = state["exp_avg"].view(g.shape)
            exp_avg.mul_(b1).add_(update, alpha=(1 - b1))
            update = exp_avg
        wd = float(group["weight_decay"])
        if wd != 0:
            param.add_(param, alpha=(-wd * lr))
        param.add_(-update)
