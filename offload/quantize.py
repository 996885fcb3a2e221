"""Quantized frozen weights: NF4 (QLoRA) and int8 per row, with their torch reference.

NF4 (Dettmers et al. 2023, "QLoRA"). A flat tensor of n values is cut into blocks of
``blocksize`` (64) elements, the last one shorter. Each block keeps ``absmax`` = max |x| in
fp32 and each element the index (4 bits) of the nearest of 16 NormalFloat values
(``nf4_code()``: quantiles of N(0, 1) scaled into [-1, 1], zero included):
``scaled = clamp(x * (1 / max(absmax, 1e-38)), -1, 1)``, ``q = #{k : scaled > mid[k]}`` over
the 15 fp32 midpoints ``mid[k] = (code[k] + code[k + 1]) / 2`` (ties to the lower value).
Two indices share a byte: element 2i in the high half of byte i, 2i + 1 in the low half (an
odd n pads the last low half with the index of 0.0). This is bitsandbytes' ``quantize_4bit``
(``quant_type="nf4"``) layout and arithmetic. Value of element i of block b:
``code[q] * absmax[b]`` (fp32), then the output dtype, rounded to nearest even.

Double quantization (QLoRA's, ``compress_statistics=True`` in bitsandbytes): the absmax
values themselves, less their mean ``offset``, are stored as int8 blockwise codes over blocks
of 256 with bitsandbytes' signed dynamic map (offload/optim/quant.py: ``absmax_q``, one fp32
``absmax_scale`` per 256) and restored as ``code8[q] * scale + offset``: 0.127 instead of 0.5
bits per weight for the scales.

int8 per row (LLM.int8()'s vector-wise quantization, bitsandbytes' ``int8_vectorwise_quant``):
a 2-D tensor's row r keeps ``absmax[r] = max |x_r|`` (fp32) and ``q = round(x * f[r])`` with
``f[r] = fp32(1 / absmax[r]) * 127`` (what torch's ``127 / t`` computes, and so bitsandbytes;
the correctly rounded quotient would move a code where ``x * f`` lands beside a half), half to
even, within [-127, 127] (an all-zero row stores zeros); its values are
``(q * absmax[r]) * fp32(1 / 127)``.

Against bitsandbytes' CPU backend (tests/params/test_quantize.py): the same bits (codes, absmax,
offset and 8-bit scales of the double quantization, dequantized values) except (1) a short
last NF4 block, which its torch op scales by ``x / max(absmax, 1e-38)`` and stores
``max(absmax, 1e-38)`` where its other blocks and its CUDA kernel, like this module, multiply
by the reciprocal (a code can differ by one beside a midpoint); (2) the 8-bit codes of the
double-quantized absmax, where its CPU search now and then returns the neighbour of the
nearest code (these are the nearest); (3) bf16 subnormal results, which its AVX-512 BF16
conversion flushes to zero; (4) int8 rows whose ``f`` overflows (absmax below ~3.7e-37), its
codes the int8 cast of +-inf, these clamped to +-127.

``quantize_*`` and ``dequantize_*`` run the native SIMD kernels (native/quant.c) when the
library is in use and else the torch reference (``*_reference``), which computes the same
fp32 operations: both give the same bits (the double quantization of the absmax is torch's
either way: 1/64 of the elements).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch

from offload import _native
from offload.optim import quant as q8

NF4_BLOCK = 64          # elements per absmax (QLoRA)
ABSMAX_BLOCK = 256      # absmax values per scale of the double quantization (QLoRA)
_OUT_DTYPES = {torch.float32: _native.DTYPE_F32, torch.bfloat16: _native.DTYPE_BF16,
               torch.float16: _native.DTYPE_F16}
_IN_DTYPES = tuple(_OUT_DTYPES)


@functools.lru_cache(maxsize=1)
def nf4_code() -> torch.Tensor:
    """The 16 NF4 values, fp32, sorted, as QLoRA constructs them: the normal quantiles of 8
    evenly spaced probabilities from 0.9677083 to 0.5 (the positive half) and of 7 (the
    negative half), 0, all divided by the largest."""
    offset = 0.9677083
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9)[:-1].double())
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8)[:-1].double())
    values = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).float().sort().values
    return values / values.max()


@functools.lru_cache(maxsize=1)
def _nf4_midpoints() -> torch.Tensor:
    code = nf4_code()
    return (code[:-1] + code[1:]) / 2


@dataclasses.dataclass(frozen=True)
class NF4Tensor:
    """A tensor stored as NF4 (see the module docstring).

    packed         uint8 [ceil(numel / 2)]
    absmax         fp32 [nblocks], or None when double-quantized
    absmax_q       uint8 [nblocks] (double quantization), else None
    absmax_scale   fp32 [ceil(nblocks / 256)] (double quantization), else None
    absmax_offset  the mean subtracted before the double quantization (fp32 value), else 0
    """
    packed: torch.Tensor
    absmax: Optional[torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    blocksize: int = NF4_BLOCK
    absmax_q: Optional[torch.Tensor] = None
    absmax_scale: Optional[torch.Tensor] = None
    absmax_offset: float = 0.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def double_quant(self) -> bool:
        return self.absmax_q is not None

    @property
    def nbytes(self) -> int:
        """Bytes stored: the codes and the scales."""
        parts = [self.packed, self.absmax, self.absmax_q, self.absmax_scale]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


@dataclasses.dataclass(frozen=True)
class Int8RowTensor:
    """A 2-D tensor stored as int8 per row: codes int8 [rows, cols], absmax fp32 [rows]."""
    codes: torch.Tensor
    absmax: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.absmax.numel()


def nblocks_of(numel: int, blocksize: int = NF4_BLOCK) -> int:
    """Scales (absmax values) a tensor of ``numel`` elements has."""
    return (numel + blocksize - 1) // blocksize


def _check_input(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{what} takes float32, bfloat16 or float16 tensors, got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"{what} runs on CPU tensors, got one on {x.device}: move it with .cpu() first")
    return x


def _blockwise_absmax(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    """max |x| per block of ``blocksize`` (the last one shorter), fp32."""
    n = flat.numel()
    full = n - n % blocksize
    parts = [flat[:full].view(-1, blocksize).abs().amax(dim=1)] if full else []
    if full < n:
        parts.append(flat[full:].abs().amax().view(1))
    return torch.cat(parts).float()


def _nf4_codes_reference(flat: torch.Tensor, blocksize: int) -> tuple:
    """The torch reference of NF4's codes: (packed, absmax) of a flat fp32 tensor."""
    n = flat.numel()
    absmax = _blockwise_absmax(flat, blocksize)
    with torch.no_grad():
        inv = 1.0 / absmax.clamp(min=1e-38)
        scale = inv.repeat_interleave(blocksize)[:n]
        scaled = torch.clamp(flat * scale, -1, 1)
        if n % 2:
            scaled = torch.cat([scaled, scaled.new_zeros(1)])
        q = torch.bucketize(scaled, _nf4_midpoints(), out_int32=True).to(torch.uint8)
        return (q[0::2] << 4) | q[1::2], absmax


def _check_nf4_args(x: torch.Tensor, blocksize: int) -> None:
    _check_input(x, "quantize_nf4")
    if blocksize < 2 or blocksize % 2:
        raise ValueError(f"blocksize={blocksize}: use an even number of elements (QLoRA uses 64)")
    if x.numel() == 0:
        raise ValueError("quantize_nf4 of an empty tensor: nothing to store")


def quantize_nf4(x: torch.Tensor, blocksize: int = NF4_BLOCK, double_quant: bool = False) -> NF4Tensor:
    """``x`` (fp32 / bf16 / fp16, any shape, CPU) as NF4; ``double_quant``: the absmax values
    8-bit quantized as QLoRA does. Equals bitsandbytes' ``quantize_4bit(x, blocksize,
    quant_type="nf4", compress_statistics=double_quant)`` bit for bit but for the cases the
    module docstring lists (tests/params/test_quantize.py).
    The codes come from the native kernel when the library is in use, else from the torch
    reference (``quantize_nf4_reference``; the same bits)."""
    _check_nf4_args(x, blocksize)
    L = _native.lib()
    if L is None:
        return quantize_nf4_reference(x, blocksize, double_quant)
    src = x.detach().contiguous()
    n = src.numel()
    packed, absmax = torch.empty((n + 1) // 2, dtype=torch.uint8), torch.empty(nblocks_of(n, blocksize))
    _native.quantize(L, _native.QuantArgs(x=src.data_ptr(), codes=packed.data_ptr(), absmax=absmax.data_ptr(),
                                          code=nf4_code().data_ptr(), n=n, blocksize=blocksize,
                                          format=_native.QFMT_NF4, in_dtype=_OUT_DTYPES[src.dtype]))
    return _nf4_tensor(packed, absmax, x, blocksize, double_quant)


def quantize_nf4_reference(x: torch.Tensor, blocksize: int = NF4_BLOCK, double_quant: bool = False) -> NF4Tensor:
    """``quantize_nf4`` in torch alone (the reference and the fallback)."""
    _check_nf4_args(x, blocksize)
    packed, absmax = _nf4_codes_reference(x.detach().reshape(-1).float(), blocksize)
    return _nf4_tensor(packed, absmax, x, blocksize, double_quant)


def _nf4_tensor(packed: torch.Tensor, absmax: torch.Tensor, x: torch.Tensor, blocksize: int,
                double_quant: bool) -> NF4Tensor:
    if not double_quant:
        return NF4Tensor(packed, absmax, x.shape, x.dtype, blocksize)
    absmax_q = torch.empty(absmax.numel(), dtype=torch.uint8)
    absmax_scale = torch.empty(q8.nblocks(absmax.numel()))
    offset = double_quantize_absmax(absmax, 1, absmax_q, absmax_scale)
    return NF4Tensor(packed, None, x.shape, x.dtype, blocksize, absmax_q, absmax_scale, offset)


def double_quantize_absmax(absmax: torch.Tensor, experts: int, absmax_q: torch.Tensor,
                           absmax_scale: torch.Tensor) -> float:
    """QLoRA's double quantization of ``absmax`` (fp32, ``experts`` equal slices, one per
    expert) into ``absmax_q`` (uint8, same numel) and ``absmax_scale`` (fp32, each expert's
    ``ceil(nb / 256)`` scales): the groups of 256 restart at each expert, around one offset,
    the mean of all the scales, which is returned. One expert (a 2-D tensor) is exactly
    ``quantize_nf4(double_quant=True)``'s."""
    offset = absmax.mean()
    nb = absmax.numel() // experts
    ng = q8.nblocks(nb)
    centred = absmax - offset
    for e in range(experts):
        q8.quantize(centred[e * nb:(e + 1) * nb], absmax_q[e * nb:(e + 1) * nb], absmax_scale[e * ng:(e + 1) * ng],
                    signed=True)
    return float(offset)


def quantize_nf4_experts(x: torch.Tensor, blocksize: int = NF4_BLOCK, double_quant: bool = False) -> list:
    """A mixture-of-experts tensor ``x`` [E, ...] (CPU) as E NF4 tensors, each expert quantized
    as its own tensor (no block straddles two experts, each dequantizes alone); with
    ``double_quant`` each expert's scales are 8-bit quantized in groups of 256 of its own,
    around the mean of all experts' scales (``double_quantize_absmax``). One expert equals
    ``quantize_nf4`` of it; experts of a multiple of ``blocksize`` elements have together
    the codes of ``quantize_nf4`` of the whole flat."""
    if x.dim() < 2:
        raise ValueError(f"quantize_nf4_experts takes [experts, ...], got shape {tuple(x.shape)}")
    ts = [quantize_nf4(x[e], blocksize) for e in range(x.shape[0])]
    if not double_quant:
        return ts
    absmax = torch.cat([t.absmax for t in ts])
    absmax_q = torch.empty(absmax.numel(), dtype=torch.uint8)
    nb, ng = ts[0].absmax.numel(), q8.nblocks(ts[0].absmax.numel())
    absmax_scale = torch.empty(len(ts) * ng)
    offset = double_quantize_absmax(absmax, len(ts), absmax_q, absmax_scale)
    return [NF4Tensor(t.packed, None, t.shape, t.dtype, blocksize, absmax_q[e * nb:(e + 1) * nb],
                      absmax_scale[e * ng:(e + 1) * ng], offset) for e, t in enumerate(ts)]


def nf4_absmax(t: NF4Tensor) -> torch.Tensor:
    """Each block's scale, fp32 [nblocks] (the double quantization undone)."""
    if not t.double_quant:
        return t.absmax
    offset = float(t.absmax_offset)
    return (q8.dequantize(t.absmax_q, t.absmax_scale, signed=True)
            + q8.on_device(("absmax_offset", offset), t.absmax_q.device, lambda: torch.tensor(offset)))


def dequantize_nf4_reference(t: NF4Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The torch reference: ``t``'s values in ``dtype`` (default: the quantized tensor's), on
    the device ``t`` is on (the CUDA path of a quantized frozen base runs it)."""
    n = t.numel
    q = torch.stack([t.packed >> 4, t.packed & 15], dim=1).view(-1)[:n].long()
    values = q8.on_device("nf4_code", t.packed.device, nf4_code)[q] * nf4_absmax(t).repeat_interleave(t.blocksize)[:n]
    return values.to(dtype or t.dtype).view(t.shape)


def _out_tensor(out: Optional[torch.Tensor], shape, dtype: torch.dtype, what: str) -> torch.Tensor:
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"{what} writes float32, bfloat16 or float16, got {dtype}")
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if out.dtype != dtype or out.numel() != math.prod(shape) or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"{what}: out must be a contiguous CPU {dtype} tensor of {math.prod(shape)} elements, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def dequantize_nf4(t: NF4Tensor, dtype: Optional[torch.dtype] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``t``'s values in ``dtype`` (default: the quantized tensor's), written into ``out``
    when given (contiguous, ``t.shape``'s element count): the native kernel on the pool's
    threads when the library is in use, else ``dequantize_nf4_reference`` (the same bits)."""
    dtype = dtype or t.dtype
    out = _out_tensor(out, t.shape, dtype, "dequantize_nf4")
    L = _native.lib()
    if L is None:
        return out.copy_(dequantize_nf4_reference(t, dtype).view(out.shape))
    packed = t.packed.contiguous()
    args = _native.DequantArgs(codes=packed.data_ptr(), code=nf4_code().data_ptr(), out=out.data_ptr(),
                               n=t.numel, blocksize=t.blocksize, format=_native.QFMT_NF4,
                               out_dtype=_OUT_DTYPES[dtype])
    keep = [packed]
    if t.double_quant:
        aq, sc, code8 = t.absmax_q.contiguous(), t.absmax_scale.contiguous(), q8.dynamic_map(True)
        keep += [aq, sc, code8]
        args.absmax_q, args.absmax_scale, args.absmax_code = aq.data_ptr(), sc.data_ptr(), code8.data_ptr()
        args.absmax_offset = t.absmax_offset
    else:
        absmax = t.absmax.contiguous()
        keep.append(absmax)
        args.absmax = absmax.data_ptr()
    _native.dequantize(L, args)
    del keep
    return out


def _check_int8_args(x: torch.Tensor) -> None:
    _check_input(x, "quantize_int8_rows")
    if x.dim() != 2:
        raise ValueError(f"quantize_int8_rows takes a 2-D tensor (rows, cols), got shape {tuple(x.shape)}: "
                         f"reshape it first")


def quantize_int8_rows(x: torch.Tensor) -> Int8RowTensor:
    """A 2-D ``x`` (fp32 / bf16 / fp16, CPU) as int8 per row; equals bitsandbytes'
    ``int8_vectorwise_quant(x)`` (threshold 0) but in rows whose absmax is below ~3.7e-37
    (the module docstring). Native kernel
    when the library is in use, else ``quantize_int8_rows_reference`` (the same bits)."""
    _check_int8_args(x)
    L = _native.lib()
    if L is None or x.numel() == 0:
        return quantize_int8_rows_reference(x)
    src = x.detach().contiguous()
    codes, absmax = torch.empty(src.shape, dtype=torch.int8), torch.empty(src.shape[0])
    _native.quantize(L, _native.QuantArgs(x=src.data_ptr(), codes=codes.data_ptr(), absmax=absmax.data_ptr(),
                                          n=src.numel(), blocksize=src.shape[1], format=_native.QFMT_INT8_ROWS,
                                          in_dtype=_OUT_DTYPES[src.dtype]))
    return Int8RowTensor(codes, absmax, x.dtype)


def quantize_int8_rows_reference(x: torch.Tensor) -> Int8RowTensor:
    """``quantize_int8_rows`` in torch alone (the reference and the fallback). Codes are clamped
    to [-127, 127] (which moves values only where ``f`` overflows: absmax below ~3.7e-37)
    and NaN stores 0."""
    _check_int8_args(x)
    with torch.no_grad():
        xf = x.detach().float()
        absmax = xf.abs().amax(dim=1)
        factor = torch.where(absmax > 0, absmax.reciprocal() * 127.0, torch.zeros_like(absmax))
        codes = torch.round(xf * factor[:, None]).clamp_(-127, 127).nan_to_num_(0.0).to(torch.int8)
    return Int8RowTensor(codes, absmax, x.dtype)


def dequantize_int8_rows_reference(t: Int8RowTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The torch reference: ``(q * absmax[r]) * fp32(1 / 127)`` in ``dtype``."""
    inv127 = q8.on_device("inv127", t.codes.device, lambda: torch.tensor(1.0 / 127.0, dtype=torch.float32))
    return ((t.codes.float() * t.absmax[:, None]) * inv127).to(dtype or t.dtype)


def dequantize_int8_rows(t: Int8RowTensor, dtype: Optional[torch.dtype] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``t``'s values in ``dtype`` (native kernel, else the reference; the same bits)."""
    dtype = dtype or t.dtype
    out = _out_tensor(out, t.shape, dtype, "dequantize_int8_rows")
    L = _native.lib()
    if L is None:
        return out.copy_(dequantize_int8_rows_reference(t, dtype).view(out.shape))
    codes, absmax = t.codes.contiguous(), t.absmax.contiguous()
    rows, cols = codes.shape
    if rows * cols:
        _native.dequantize(L, _native.DequantArgs(codes=codes.data_ptr(), absmax=absmax.data_ptr(),
                                                  out=out.data_ptr(), n=rows * cols, blocksize=cols,
                                                  format=_native.QFMT_INT8_ROWS, out_dtype=_OUT_DTYPES[dtype]))
    return out
