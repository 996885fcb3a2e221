"""AdamW / Adam as update rules: the CPU Adam kernel (native/adam.c, bit-exact with torch's
single-tensor order, see reference.py) behind the UpdateRule protocol, and ``adam_step``, the
same rule as a function of flat CPU tensors."""
from __future__ import annotations

import ctypes
import math
import operator

import torch

from offload.optim import reference as _reference
from offload.optim.rule import Row, UpdateRule, state_dtype_of


class AdamHparams(ctypes.Structure):
    """Mirror of offload_adam_hparams (native/adam.c)."""
    _fields_ = [(name, ctypes.c_float) for name in (
        "grad_scale", "l2", "decay", "lerp_weight", "beta2", "one_minus_beta2",
        "bias_correction2_sqrt", "eps", "neg_step_size")]


def adam_hparams(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 adamw_mode: bool, grad_scale: float) -> AdamHparams:
    """The kernel's scalars, computed in double exactly as torch's single-tensor Adam does."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return AdamHparams(
        grad_scale=grad_scale, l2=0.0 if adamw_mode else weight_decay,
        decay=1 - lr * weight_decay if adamw_mode else 1.0, lerp_weight=1 - beta1, beta2=beta2,
        one_minus_beta2=1 - beta2, bias_correction2_sqrt=bias_correction2**0.5, eps=eps,
        neg_step_size=-(lr / bias_correction1))


class AdamW(UpdateRule):
    """torch.optim.AdamW: decoupled weight decay. Rows exp_avg (signed), exp_avg_sq (unsigned)."""
    name = "AdamW"
    kernel = "adam"
    hparams_type = AdamHparams
    torch_optimizer = "AdamW"
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    decoupled = True

    def rows(self, group, shape=None):
        return (Row("exp_avg", signed=True), Row("exp_avg_sq", signed=False))

    def native_hparams(self, group, step, grad_scale):
        b1, b2 = (float(b) for b in group["betas"])
        return adam_hparams(step, float(group["lr"]), b1, b2, float(group["eps"]), float(group["weight_decay"]),
                            self.decoupled, float(grad_scale))

    def reference(self, param, grad, state, group, step, grad_scale=1.0):
        _reference.adam_step(param.view(-1), grad.reshape(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                             step=step, lr=float(group["lr"]), betas=tuple(float(b) for b in group["betas"]),
                             eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                             adamw_mode=self.decoupled, grad_scale=grad_scale)

    def _torch_step(self, param, grad, state, rows, group, step, param_copy, grad_scale, shape):
        if state_dtype_of(state, rows) != "fp32":
            return super()._torch_step(param, grad, state, rows, group, step, param_copy, grad_scale, shape)
        # torch's fused CPU kernel: fp32 grads only, and its grad_scale divides in place, so a
        # low-precision or scaled grad goes through an fp32 temporary (the kernel's values).
        if grad.dtype != torch.float32 or grad_scale != 1.0:
            grad = grad.to(torch.float32, copy=True).mul_(grad_scale)
        b1, b2 = (float(b) for b in group["betas"])
        fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        fused([param], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [torch.tensor(float(step))],
              lr=float(group["lr"]), beta1=b1, beta2=b2, weight_decay=float(group["weight_decay"]),
              eps=float(group["eps"]), amsgrad=False, maximize=False)
        if param_copy is not None:
            param_copy.copy_(param)

    def device_step(self, params, grads, states, group, steps):
        b1, b2 = (float(b) for b in group["betas"])
        fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        # the step count filled on the device (torch.tensor(..., device=) would be a synchronising copy)
        step_t = [torch.full((), float(s), dtype=torch.float32, device=p.device) for p, s in zip(params, steps)]
        fused(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [], step_t,
              lr=float(group["lr"]), beta1=b1, beta2=b2, weight_decay=float(group["weight_decay"]),
              eps=float(group["eps"]), amsgrad=False, maximize=False)


class Adam(AdamW):
    """torch.optim.Adam: L2 weight decay added to the gradient."""
    name = "Adam"
    torch_optimizer = "Adam"
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    decoupled = False


_RULES = {True: AdamW(), False: Adam()}   # adamw_mode -> the rule adam_step runs


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              *, step: int, lr: float, betas: tuple, eps: float, weight_decay: float,
              adamw_mode: bool = True, param_copy: torch.Tensor | None = None, grad_scale: float = 1.0) -> None:
    """One AdamW (``adamw_mode=True``) or Adam (L2 decay) step, in place, on flat CPU tensors:
    the rule's ``cpu_step`` (native kernel, else torch), with its hyper-parameters as arguments.

    param: 1-D fp32, updated in place. grad: 1-D fp32, bf16 or fp16, read only. exp_avg,
    exp_avg_sq: 1-D, both fp32 or both bf16, updated in place. param_copy: None, or a 1-D bf16 /
    fp16 tensor that receives the updated param rounded to nearest even, or fp32, the param
    itself, in the same pass. All contiguous, same number of elements, any alignment. step:
    the 1-based count of this update. grad_scale multiplies the gradient in fp32 first (loss
    unscaling times the clipping coefficient). Wrong dtype / device / size / layout raises
    TypeError or ValueError naming the argument; nothing is converted or copied."""
    if not isinstance(step, (bool, int)):
        try:
            step = operator.index(step)  # numpy / torch integers
        except TypeError:
            pass
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step={step!r} must be an int >= 1 (the 1-based count of this update)")
    grad_scale = float(grad_scale)
    if not math.isfinite(grad_scale):
        raise ValueError(f"grad_scale={grad_scale!r} must be finite (skip the step on overflow instead)")
    rule = _RULES[bool(adamw_mode)]
    group = {"lr": float(lr), "betas": tuple(float(b) for b in betas), "eps": float(eps),
             "weight_decay": float(weight_decay)}
    rule.validate(group)
    rule.cpu_step(param, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, group, step,
                  param_copy=param_copy, grad_scale=grad_scale)
