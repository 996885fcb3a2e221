"""Precision names, their torch dtypes and element sizes, and the dtype rules that follow
from them, in one place: what the engine allocates, the memory plan counts and the planner
predicts must agree.

* ``precision``: the compute dtype of parameters on the device, ``fp32`` / ``bf16`` / ``fp16``.
* ``state_dtype``: the optimizer state rows' storage, ``fp32`` / ``bf16`` / ``int8`` (blockwise,
  optim/quant.py); the fp32 master is always fp32.
* the gradient dtype on the host: the compute dtype crosses as is when a bf16 window has one
  micro-step (the kernel reads it directly); otherwise gradients are summed in fp32.
* a frozen parameter is kept in its own dtype, or the compute dtype when that is narrower.
"""
from __future__ import annotations

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
STATE_DTYPES = ("fp32", "bf16", "int8")

_COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_STATE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}

BYTES_PER_PARAM = {"fp32": 4, "bf16": 2, "fp16": 2}     # compute dtype, by precision name


def compute_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a precision name (``fp32`` / ``bf16`` / ``fp16``)."""
    try:
        return _COMPUTE[precision]
    except KeyError:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}") from None


def precision_of(dtype: torch.dtype) -> str:
    """The precision name of a compute dtype."""
    for name, d in _COMPUTE.items():
        if d == dtype:
            return name
    raise ValueError(f"{dtype} is not a compute dtype ({', '.join(PRECISIONS)})")


def state_storage_dtype(state_dtype: str) -> torch.dtype:
    """The torch dtype a state row is stored in (int8 rows as bytes)."""
    return _STATE[state_dtype]


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element, read off the dtype: allocating a probe tensor at import would be
    torch's first CPU allocation and fix its huge-page switch before ``prefer_huge_pages``."""
    return dtype.itemsize


def grad_dtype(precision: str, gradient_accumulation_steps: int) -> torch.dtype:
    """The dtype of the host gradient buffers (module docstring)."""
    if gradient_accumulation_steps == 1 and precision == "bf16":
        return torch.bfloat16
    return torch.float32


def grad_bytes(precision: str, gradient_accumulation_steps: int) -> int:
    return element_size(grad_dtype(precision, gradient_accumulation_steps))


def kept_dtype(param_dtype: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype a frozen parameter is kept in (module docstring); integer ones keep theirs."""
    if not param_dtype.is_floating_point:
        return param_dtype
    return compute if element_size(compute) < element_size(param_dtype) else param_dtype
