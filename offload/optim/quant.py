"""int8 blockwise optimizer state, as 8-bit Adam (Dettmers et al. 2022, bitsandbytes) keeps it.

A row of n values is stored as n uint8 codes plus one fp32 ``absmax`` per block of
``BLOCK`` = 256 elements (the last block shorter): value = ``code[q] * absmax[block]``.
``code`` is bitsandbytes' dynamic map (``create_dynamic_map``): 256 sorted values in [-1, 1]
spaced by decades (1e-6 .. 1) with a linear fraction inside each decade, so small values
keep their relative precision where a linear code would round them to 0 (the second moment
spans many decades). Signed rows (exp_avg, momentum) use the signed map; non-negative rows
(exp_avg_sq, Adagrad's sum) the unsigned one, which spends the sign bit on precision.

Quantizing a block: ``absmax = max |x|``, then each ``x / absmax`` (computed as
``x * (1 / absmax)``) goes to its nearest code: ``q = #{k : x * inv > mid[k]}`` with
``mid[k] = (code[k] + code[k + 1]) / 2`` in fp32 (ties to the lower code; an all-zero
block stores absmax 0 and the code nearest 0; NaN, greater than no midpoint, stores code 0). native/kernel.c does exactly this inside the
fused step (dequantize a block, step it in fp32, requantize), bit for bit the same as the
torch functions here, which are the fallback and the readable reference.

Bytes per element of a row: 1 + 4 / 256 = 1.016 (Adam's two moments: 2.03 instead of 8).
"""
from __future__ import annotations

import functools

import torch

from offload.core.errors import InvariantError

BLOCK = 256


_ON_DEVICE: dict = {}


def on_device(key, device: torch.device, make) -> torch.Tensor:
    """The small constant ``make()`` (a lookup table, a scalar) on ``device``, copied there once
    per device and kept: a copy from pageable host memory at each use blocks the host thread
    (inside a prefetch, per segment) until the device has taken it."""
    k = (key, torch.device(device))
    t = _ON_DEVICE.get(k)
    if t is None:
        t = _ON_DEVICE[k] = make().to(device)
    return t


@functools.lru_cache(maxsize=2)
def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``: 256
    sorted fp32 values in [-1, 1] (signed) or [0, 1] (unsigned), computed as it computes them."""
    data: list[float] = []
    max_exponent_bits, non_sign_bits = 7, 7
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        boundaries = torch.linspace(0.1, 1, items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    if len(data) != 256:
        raise InvariantError(f"the dynamic quantization map has {len(data)} values, not 256")
    return torch.tensor(sorted(data), dtype=torch.float32)


@functools.lru_cache(maxsize=2)
def _midpoints(signed: bool) -> torch.Tensor:
    code = dynamic_map(signed)
    return (code[:-1] + code[1:]) * 0.5  # fp32, as kernel.c computes them


def nblocks(numel: int) -> int:
    """fp32 scales a row of ``numel`` elements needs."""
    return (numel + BLOCK - 1) // BLOCK


def row_bytes(numel: int) -> int:
    """Bytes of one int8 row: the codes and the scales."""
    return numel + 4 * nblocks(numel)


def quantize(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
    """Store the flat fp32 ``x`` into ``codes`` (uint8, same numel) and ``absmax`` (fp32,
    nblocks) in place."""
    n = x.numel()
    full = n - n % BLOCK
    x = x.reshape(-1)
    with torch.no_grad():
        parts = [x[:full].view(-1, BLOCK)] if full else []
        if full < n:
            parts.append(x[full:].view(1, -1))
        mid = _midpoints(signed)
        start = 0
        for b0, part in enumerate(parts):
            a = part.abs().nan_to_num(nan=0.0, posinf=float("inf")).amax(dim=1)  # NaN ignored, inf kept
            inv = torch.where(a > 0, 1.0 / a, torch.zeros_like(a))
            y = (part * inv[:, None]).contiguous()
            q = torch.searchsorted(mid, y, side="left").masked_fill_(y.isnan(), 0)  # NaN: above no midpoint
            nb = part.shape[0]
            first = start // BLOCK
            absmax[first:first + nb] = a
            codes.view(-1)[start:start + part.numel()] = q.view(-1).to(torch.uint8)
            start += part.numel()


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of an int8 row (flat)."""
    n = codes.numel()
    values = on_device(("dynamic_map", signed), codes.device, lambda: dynamic_map(signed))[codes.reshape(-1).long()]
    scale = absmax.repeat_interleave(BLOCK)[:n]
    result = values * scale
    if out is not None:
        out.view(-1).copy_(result)
        return out
    return result
