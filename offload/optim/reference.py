"""The readable reference for offload's CPU Adam / AdamW: the oracle the native kernel is
tested against, and the torch fallback for bf16 state (which torch's fused kernel lacks).

It is torch.optim.Adam/AdamW(foreach=False)'s single-tensor update, written out for one
flat shard, with three additions the engine needs: a gradient scale, low-precision grads
and state, and a low-precision copy of the updated param.

Element order: elements are independent; there is no reduction, so no order among them.

Operation order, per element (native/adam.c performs the same IEEE fp32 operations):
  1. g = float32(grad) * grad_scale        widening is exact; unscale / clip happens here
  2. Adam (L2):   g = g + weight_decay * p  (torch's add with alpha: one fused multiply-add)
     AdamW:       p = p * (1 - lr * weight_decay)
  3. m = lerp(m, g, 1 - beta1)             m + w * (g - m), one fused multiply-add
  4. v = v * beta2;  v = v + ((1 - beta2) * g) * g   (torch's addcmul: the last multiply-add
     is one fused multiply-add)
  5. denom = sqrt(v) / sqrt(1 - beta2**step) + eps   (sqrt correctly rounded, as the CPU's
     sqrt instruction and torch's fused kernel give; torch.sqrt on CPU float tensors is
     not: this torch build computes it through MKL, 1 ulp off for about 1 element in 5.
     That is the one place where this reference differs from torch's single-tensor Adam.)
  6. p = p + (-lr / (1 - beta1**step)) * m / denom     ((value * m) / denom, then the add)
  7. m, v are stored (rounded to nearest even when the state is bf16: once, after step 4;
     steps 5-6 use the unrounded fp32 values); param_copy = p rounded to nearest even (an
     fp32 copy: p itself).
Every scalar (1 - beta1, -lr / bias_correction1, ...) is computed in double from the
Python floats, then rounded to fp32 where it meets a tensor, as torch does.

Accuracy of bf16 state (the memory-saving mode: 2 bytes instead of 4 per moment, 8
significant bits): a moment moves only when a step changes it by more than about 2**-9 of
its value. exp_avg (beta1 = 0.9, ~10 % per step) barely notices. exp_avg_sq with
beta2 = 0.999 changes by 0.001 * (g*g/v - 1) of v per step: early on (v still building up,
relative change ~ 1/step) it is fine, but past a few hundred steps it stops decaying
(0.999 * v rounds back to v) and only rises when g*g > ~3 v, so it drifts above the fp32
value and steps come out smaller, more so the longer it trains (measured against fp32-state
Adam: benchmarks/RESULTS.md). Use it when the memory matters more than matching fp32 Adam
exactly.
"""
from __future__ import annotations

import torch


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              *, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
              adamw_mode: bool = True, param_copy: torch.Tensor | None = None,
              grad_scale: float = 1.0) -> None:
    """One Adam/AdamW step in place on flat CPU tensors (same contract as
    offload.optim.adam_step; arguments are not checked here)."""
    beta1, beta2 = betas
    # 1. fp32 working copy of the gradient; the caller's grad is never modified.
    g = grad.to(torch.float32, copy=True).mul_(grad_scale)
    # fp32 working moments: the state itself when it is fp32, else widened copies.
    m = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()
    v = exp_avg_sq if exp_avg_sq.dtype == torch.float32 else exp_avg_sq.float()

    # 2. weight decay
    if weight_decay != 0:
        if adamw_mode:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)

    # 3-4. moments
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)

    # 5-6. bias-corrected update
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    # sqrt in double, rounded once to fp32: correctly rounded (double has > 2*24+2 bits).
    denom = (v.double().sqrt_().float() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(m, denom, value=-step_size)

    # 7. stores
    if m is not exp_avg:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    if param_copy is not None:
        param_copy.copy_(param)
