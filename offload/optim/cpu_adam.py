"""CPU Adam / AdamW on flat fp32 master shards: the native fused kernel or a torch fallback.

``adam_step`` is the engine's entry point (one call per block shard); ``CPUAdam`` wraps it
as a ``torch.optim.Optimizer`` whose state_dict has torch.optim.AdamW's layout.

Backend (``OFFLOAD_NATIVE``, read on every call, see offload/_native.py):
  * native: native/adam.c, one pass per element, on the library's own thread pool; the GIL
    is released for the call, so it may run on a worker thread while torch computes.
  * torch: torch's fused CPU AdamW/Adam for fp32 state (any grad dtype, widened first), else
    the readable reference (offload/optim/reference.py). Both give the native kernel's result up
    to the rounding differences between torch's fused and single-tensor kernels.
"""
from __future__ import annotations

import contextlib
import math
import operator

import torch

from offload import _native
from offload.optim import reference
from offload.optim.adam import AdamHparams, adam_hparams
from offload.optim.rule import COPY_DTYPES

_GRAD_DTYPES = {torch.float32: _native.DTYPE_F32, torch.bfloat16: _native.DTYPE_BF16,
                torch.float16: _native.DTYPE_F16}
_STATE_DTYPES = {torch.float32: _native.DTYPE_F32, torch.bfloat16: _native.DTYPE_BF16}
_PARAM_DTYPES = {torch.float32: _native.DTYPE_F32}


def _check_tensor(name: str, t, dtypes: dict, n: int | None) -> None:
    """Raise a clear error unless t is a dense, contiguous, flat CPU tensor of an allowed dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} has layout {t.layout}; adam_step takes dense tensors: densify it first")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; adam_step updates CPU tensors: keep the fp32 "
                         f"master, grad and state in host memory (e.g. move them once with .cpu())")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; it must be one of {allowed} "
                        f"(adam_step converts nothing: allocate it with an allowed dtype)")
    if t.dim() != 1:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; adam_step takes flat 1-D tensors: "
                         f"pass {name}.view(-1)")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (stride {t.stride()}); adam_step never copies: "
                         f"pass a contiguous tensor, e.g. a slice of a flat buffer")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} elements but param has {n}: every tensor of a "
                         f"step must cover the same elements")


def _check_args(param, grad, exp_avg, exp_avg_sq, param_copy, step, lr, betas, eps, weight_decay, grad_scale) -> None:
    _check_tensor("param", param, _PARAM_DTYPES, None)
    n = param.numel()
    _check_tensor("grad", grad, _GRAD_DTYPES, n)
    _check_tensor("exp_avg", exp_avg, _STATE_DTYPES, n)
    _check_tensor("exp_avg_sq", exp_avg_sq, _STATE_DTYPES, n)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise TypeError(f"exp_avg is {exp_avg.dtype} but exp_avg_sq is {exp_avg_sq.dtype}: "
                        f"both moments must have the same dtype")
    if param_copy is not None:
        _check_tensor("param_copy", param_copy, COPY_DTYPES, n)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step={step!r} must be an int >= 1 (the 1-based count of this update)")
    beta1, beta2 = betas
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas={tuple(betas)} must each be in [0, 1)")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    if not math.isfinite(grad_scale):
        raise ValueError(f"grad_scale={grad_scale!r} must be finite (skip the step on overflow instead)")


def _hparams(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             adamw_mode: bool, grad_scale: float) -> AdamHparams:
    """The kernel's scalars, computed in double exactly as torch's single-tensor Adam does."""
    return adam_hparams(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale)


def _torch_step(param, grad, exp_avg, exp_avg_sq, param_copy, step, lr, beta1, beta2, eps,
                weight_decay, adamw_mode, grad_scale) -> None:
    """The fallback: torch's fused CPU kernel for fp32 state, else the readable reference."""
    if exp_avg.dtype != torch.float32:
        reference.adam_step(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, betas=(beta1, beta2),
                            eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                            param_copy=param_copy, grad_scale=grad_scale)
        return
    # The fused kernel takes fp32 grads only, and its grad_scale divides and writes back
    # into grad; so a low-precision or scaled grad goes through an fp32 temporary (exact
    # widening, then one fp32 multiply: the same values the native kernel computes with).
    if grad.dtype != torch.float32 or grad_scale != 1.0:
        grad = grad.to(torch.float32, copy=True).mul_(grad_scale)
    fused = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    fused([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))],
          lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
          amsgrad=False, maximize=False)
    if param_copy is not None:
        param_copy.copy_(param)


def _profiler_range():
    """The named range "offload::cpu_adam", entered only while a profiler records (entering
    one costs ~7 us, a third of a small step's overhead)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function("offload::cpu_adam")
    return contextlib.nullcontext()


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              *, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
              adamw_mode: bool = True, param_copy: torch.Tensor | None = None,
              grad_scale: float = 1.0) -> None:
    """One Adam (``adamw_mode=False``, L2 decay) or AdamW step, in place, on flat CPU tensors.

    param: 1-D fp32 (the master), updated in place. grad: 1-D fp32, bf16 or fp16, read only.
    exp_avg, exp_avg_sq: 1-D, both fp32 or both bf16 (memory-saving; see reference.py for its
    accuracy cost), updated in place. param_copy: None, or a 1-D bf16 / fp16 tensor that
    receives the updated param rounded to nearest even, in the same pass, or a 1-D fp32
    tensor that receives the updated param itself (where it goes next: no second pass over
    the master). All contiguous,
    same number of elements, any alignment.

    step is the 1-based count of this update (bias correction). grad_scale multiplies the
    gradient, in fp32, before anything else (loss-scale unscaling times the clipping
    coefficient): the result is bit-identical to ``grad.mul_(grad_scale)`` then the step.

    Wrong dtype / device / size / layout raises TypeError or ValueError naming the argument;
    the caller's tensors are never converted or swapped for copies (the torch fallback may
    use temporaries). Releases the GIL while the native kernel runs.
    """
    lr, eps, weight_decay, grad_scale = float(lr), float(eps), float(weight_decay), float(grad_scale)
    if not isinstance(step, (bool, int)):
        try:
            step = operator.index(step)  # numpy / torch integers
        except TypeError:
            pass  # _check_args says what is wrong
    beta1, beta2 = (float(b) for b in betas)
    _check_args(param, grad, exp_avg, exp_avg_sq, param_copy, step, lr, (beta1, beta2), eps,
                weight_decay, grad_scale)
    with _profiler_range():
        L = _native.lib()
        if L is None:
            with torch.no_grad():  # like the native kernel, blind to autograd
                _torch_step(param, grad, exp_avg, exp_avg_sq, param_copy, step, lr, beta1, beta2, eps,
                            weight_decay, adamw_mode, grad_scale)
            return
        hp = _hparams(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale)
        copy_dtype = _native.DTYPE_NONE if param_copy is None else COPY_DTYPES[param_copy.dtype]
        args = _native.StepArgs(param=param.data_ptr(), grad=grad.data_ptr(), n=param.numel(), nrows=2,
                                grad_dtype=_GRAD_DTYPES[grad.dtype], state_dtype=_STATE_DTYPES[exp_avg.dtype],
                                copy_dtype=copy_dtype, param_copy=None if param_copy is None else param_copy.data_ptr())
        args.state[0], args.state[1] = exp_avg.data_ptr(), exp_avg_sq.data_ptr()
        _native.kernel_step(L, "adam", args, hp)


_requested_threads: int | None = None


def set_num_threads(n: int) -> None:
    """Threads the native kernel uses per call, the calling thread included (default: the
    CPUs this process may run on). Workers persist; the torch fallback ignores it."""
    global _requested_threads
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
        raise ValueError(f"set_num_threads({n!r}): n must be an int in [1, 256]")
    _requested_threads = n
    L = _native.lib()
    if L is not None:
        _native.kernel_set_num_threads(L, n)


def get_num_threads() -> int:
    """Threads the native kernel uses per call (the value set, when the library is off)."""
    L = _native.lib()
    if L is not None:
        return L.offload_kernel_get_num_threads()
    return _requested_threads if _requested_threads is not None else torch.get_num_threads()


def _flat(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (stride {t.stride()}); CPUAdam updates tensors "
                         f"in place through a flat view: make the parameter contiguous")
    return t.view(-1)


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW for fp32 parameters on the CPU, one fused native pass per parameter.

    Same hyper-parameters and state layout as torch.optim.AdamW (``adamw_mode=True``) or
    torch.optim.Adam (``adamw_mode=False``): state[p] = {"step": 0-dim fp32 tensor,
    "exp_avg", "exp_avg_sq"}, so state_dict() loads into either and theirs load here.
    Works with param groups and LR schedulers (group["lr"] is read at every step).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True):
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # a torch Adam/AdamW state_dict says which it was
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))

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
                        raise TypeError("CPUAdam does not support sparse gradients")
                    state = self.state[p]
                    if len(state) == 0:
                        state["step"] = torch.tensor(0.0, dtype=torch.float32)
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["step"] += 1
                    adam_step(_flat(p, "param"), _flat(p.grad, "param.grad"), _flat(state["exp_avg"], "exp_avg"),
                              _flat(state["exp_avg_sq"], "exp_avg_sq"), step=int(state["step"].item()),
                              lr=group["lr"], betas=group["betas"], eps=group["eps"],
                              weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"])
        return loss
