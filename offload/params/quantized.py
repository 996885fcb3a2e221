"""A frozen part stored quantized in its home (``offload_param.frozen_dtype`` int8 / nf4).

A frozen part (core/blocks.py ``frozen_parts``: a block's frozen parameters, one flat) is
kept in its home (a host pool slot, an NVMe extent) as one byte blob and materialized on the
device as the usual flat of ``dtype`` values (the dtype the part is kept in), so everything
downstream of ``ParamPart.ensure`` sees a plain frozen flat. Which tensors are quantized:
2-D and 3-D floating tensors of at least ``min_numel`` elements; the others (norms, biases,
small tensors) are stored as their values in ``dtype`` beside them. Trainable parameters never
reach this module (they are not frozen parts).

A 3-D tensor [E, R, C] is a mixture-of-experts layer's fused experts (transformers'
``experts.gate_up_proj`` / ``experts.down_proj``): it is quantized per expert, each of its E
slices as its own tensor, so no quantization block straddles two experts and expert e
dequantizes without its neighbours (``dequantize_expert``): int8 rows are rows of one expert
(the tensor as [E * R, C]); NF4 blocks restart at each expert (each expert ``ceil(R * C / 2)``
packed bytes and ``ceil(R * C / 64)`` scales, so a tensor whose experts hold a multiple of 64
elements has exactly the codes of the whole flat); the double quantization's groups of 256
scales restart at each expert too, around one offset (the mean of the whole tensor's scales).

Byte layout of the blob, each piece starting on a 64-byte boundary, segments in part order::

    raw   values  dtype [numel]
    int8  codes   int8 [rows * cols]      absmax fp32 [rows]                  (offload.quantize)
    nf4   packed  uint8 [E * ceil(n / 2)] absmax fp32 [E * nb]                (no double quant)
    nf4   packed  uint8 [E * ceil(n / 2)] absmax_q uint8 [E * nb] absmax_scale fp32 [E * ceil(nb / 256)]

with E experts (1 for a 2-D tensor), n = numel / E elements per expert, nb = ceil(n / 64),
rows the product of all dimensions but the last;
the blob rounded up to 4 KiB (O_DIRECT). The mean subtracted before the double quantization
is one fp32 value per tensor, kept in this object (``SegmentCode.absmax_offset``).

Quantization runs once, chunk by chunk over each tensor while its values are in memory
(``fill``; the loader streams the checkpoint part by part): NF4 blocks and int8 rows are
independent, so the codes equal ``offload.quantize``'s of the whole tensor, and the double
quantization runs over the whole tensor's absmax as ``quantize_nf4`` does. The same pass
records each tensor's quantization error (max abs, relative RMS) of its dequantized fp32
values against the values quantized, for ``Engine.stats()``.

Dequantization (``materialize``): on a CPU device the native kernels (``offload.quantize``)
write straight into the new flat; on CUDA the blob is copied (a quarter of the bytes for nf4)
and dequantized on the copy stream with torch ops that compute the same fp32 operations, so
both give the same bits.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from typing import Dict, List, Optional, Tuple

import torch

from offload import quantize as qz
from offload.core.blocks import BlockLayout
from offload.optim import quant as q8
from offload.units import PAGE, round_up

FORMATS = ("int8", "nf4")           # offload_param.frozen_dtype other than "compute"
_ALIGN = 64                         # every piece of the blob starts on this byte boundary
_CHUNK = 1 << 20                    # elements quantized at once (a multiple of 64 and of 256 * 64)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _align(n: int, unit: int = _ALIGN) -> int:
    return (n + unit - 1) // unit * unit


def quantizes(shape, dtype: torch.dtype, fmt: str, min_numel: int) -> bool:
    """Whether a frozen tensor of ``shape`` / ``dtype`` is stored quantized under ``fmt``:
    2-D (a linear weight) and 3-D (a MoE layer's fused experts, quantized per expert)
    floating tensors of at least ``min_numel`` elements (a norm, a bias, a small tensor would
    gain little and lose precision where it matters most)."""
    return fmt in FORMATS and len(shape) in (2, 3) and dtype in _FLOATS and math.prod(shape) >= max(min_numel, 1)


def experts_of(shape) -> int:
    """Slices quantized independently: a 3-D tensor's leading dimension (its experts), else 1."""
    return int(shape[0]) if len(shape) == 3 else 1


def tensor_bytes(shape, fmt: str, double_quant: bool = False) -> int:
    """Bytes a tensor of ``shape`` takes quantized under ``fmt`` (its pieces, unaligned):
    nf4 n/2 + 4 n/64 (double quant: n/2 + n/64 + 4 n/(64 * 256)), int8 n + 4 rows; a 3-D
    tensor per expert (each expert's n its own)."""
    n, e = math.prod(shape), experts_of(shape)
    if fmt == "int8":
        return n + 4 * (n // max(int(shape[-1]), 1) if n else 0)
    per = n // e
    nb = qz.nblocks_of(per)
    return e * ((per + 1) // 2 + (nb + 4 * q8.nblocks(nb) if double_quant else 4 * nb))


@dataclasses.dataclass
class SegmentCode:
    """Where one tensor of the part lies in the blob, and how it is coded."""
    name: str
    param: torch.nn.Parameter
    offset: int                             # elements into the part's flat
    numel: int
    shape: Tuple[int, ...]
    fmt: str                                # "raw", "int8" or "nf4"
    pieces: Dict[str, Tuple[int, int]]      # piece -> (byte offset in the blob, bytes)
    experts: int = 1                        # slices quantized independently (a 3-D tensor's first dim)
    absmax_offset: float = 0.0              # nf4 double quant: the mean subtracted
    max_abs_error: float = 0.0
    rel_rms_error: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.pieces.values())


class QuantizedPart:
    """The codec of one frozen part: its blob layout, quantization into a home, and
    dequantization from a home into the part's flat of ``dtype`` values."""

    def __init__(self, layout: BlockLayout, dtype: torch.dtype, fmt: str, double_quant: bool = False,
                 min_numel: int = 0):
        if fmt not in FORMATS:
            raise ValueError(f"fmt={fmt!r}: a quantized part is stored as one of {FORMATS}")
        self.layout = layout
        self.dtype = dtype
        self.fmt = fmt
        self.double_quant = double_quant and fmt == "nf4"
        self.numel = layout.padded_numel
        self.segments: List[SegmentCode] = []
        at = 0
        for s in layout.segments:
            kind = fmt if quantizes(s.shape, s.param.dtype, fmt, min_numel) else "raw"
            pieces = {}
            experts = experts_of(s.shape) if kind != "raw" else 1
            for piece, nbytes in self._pieces(kind, s.numel, tuple(s.shape), experts):
                pieces[piece] = (at, nbytes)
                at = _align(at + nbytes)
            self.segments.append(SegmentCode(s.name, s.param, s.offset, s.numel, tuple(s.shape), kind, pieces,
                                             experts=experts))
        self.nbytes = max(round_up(at), PAGE)          # whole pages (O_DIRECT homes)

    @classmethod
    def for_part(cls, layout: BlockLayout, dtype: torch.dtype, fmt: str, double_quant: bool,
                 min_numel: int) -> Optional["QuantizedPart"]:
        """The codec of a frozen part, or None when no tensor of it is quantized (the part
        stays in ``dtype`` as it would without ``frozen_dtype``: nothing to gain)."""
        if not all(s.param.dtype in _FLOATS for s in layout.segments) \
                or not any(quantizes(s.shape, s.param.dtype, fmt, min_numel) for s in layout.segments):
            return None
        return cls(layout, dtype, fmt, double_quant, min_numel)

    def _pieces(self, kind: str, n: int, shape, experts: int) -> list:
        if kind == "raw":
            return [("values", n * self.dtype.itemsize)]
        if kind == "int8":
            return [("codes", n), ("absmax", 4 * (n // shape[-1]))]
        per = n // experts
        nb = qz.nblocks_of(per)
        if self.double_quant:
            return [("packed", experts * ((per + 1) // 2)), ("absmax_q", experts * nb),
                    ("absmax_scale", 4 * experts * q8.nblocks(nb))]
        return [("packed", experts * ((per + 1) // 2)), ("absmax", 4 * experts * nb)]

    @property
    def quantized_bytes(self) -> int:
        """Bytes of the quantized tensors' pieces (codes and scales)."""
        return sum(sc.nbytes for sc in self.segments if sc.fmt != "raw")

    @property
    def quantized_numel(self) -> int:
        return sum(sc.numel for sc in self.segments if sc.fmt != "raw")

    # ---- views of a blob ----------------------------------------------------------------
    @staticmethod
    def _piece(blob: torch.Tensor, sc: SegmentCode, name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        off, nbytes = sc.pieces[name]
        return blob[off:off + nbytes].view(dtype)

    def _nf4(self, blob: torch.Tensor, sc: SegmentCode, e: int = 0) -> qz.NF4Tensor:
        """Expert ``e``'s NF4 codes (the whole tensor's for a 2-D one): its slices of the
        pieces alone."""
        per = sc.numel // sc.experts
        nb, half = qz.nblocks_of(per), (per + 1) // 2
        packed = self._piece(blob, sc, "packed")[e * half:(e + 1) * half]
        if self.double_quant:
            ng = q8.nblocks(nb)
            return qz.NF4Tensor(packed, None, torch.Size((per,)), self.dtype, qz.NF4_BLOCK,
                                self._piece(blob, sc, "absmax_q")[e * nb:(e + 1) * nb],
                                self._piece(blob, sc, "absmax_scale", torch.float32)[e * ng:(e + 1) * ng],
                                sc.absmax_offset)
        return qz.NF4Tensor(packed, self._piece(blob, sc, "absmax", torch.float32)[e * nb:(e + 1) * nb],
                            torch.Size((per,)), self.dtype)

    def _int8(self, blob: torch.Tensor, sc: SegmentCode, e: Optional[int] = None) -> qz.Int8RowTensor:
        """The int8 rows of expert ``e`` (None: all rows of the tensor, as [rows, cols])."""
        cols = sc.shape[-1]
        rows = sc.numel // cols
        codes = self._piece(blob, sc, "codes", torch.int8).view(rows, cols)
        absmax = self._piece(blob, sc, "absmax", torch.float32)
        if e is not None:
            per = rows // sc.experts
            codes, absmax = codes[e * per:(e + 1) * per], absmax[e * per:(e + 1) * per]
        return qz.Int8RowTensor(codes, absmax, self.dtype)

    # ---- quantize into a home -----------------------------------------------------------
    def fill(self, blob: torch.Tensor, values: Optional[Dict[int, torch.Tensor]] = None) -> torch.Tensor:
        """Write the part's values into ``blob`` (uint8 host tensor of at least ``nbytes``),
        quantizing the quantized tensors chunk by chunk, and record each one's error: the
        parameters' current values, or ``values`` (``id(param) -> tensor``), whose tensors
        alone are written: the others keep the bytes ``blob`` holds, so a tensor not given is
        never quantized a second time. Returns the blob's first ``nbytes``."""
        blob = blob.view(torch.uint8)[:self.nbytes]
        with torch.no_grad():
            if values is None:
                blob.zero_()
            for sc in self.segments:
                if values is not None and id(sc.param) not in values:
                    continue
                src = sc.param.detach() if values is None else values[id(sc.param)]
                if src.device.type != "cpu":
                    src = src.cpu()
                if sc.fmt == "raw":
                    self._piece(blob, sc, "values", self.dtype).copy_(src.reshape(-1))
                elif sc.fmt == "int8":
                    self._fill_int8(blob, sc, src.reshape(-1, sc.shape[-1]))
                else:
                    self._fill_nf4(blob, sc, src.reshape(-1))
        return blob

    def _fill_int8(self, blob: torch.Tensor, sc: SegmentCode, x: torch.Tensor) -> None:
        codes = self._piece(blob, sc, "codes", torch.int8)
        absmax = self._piece(blob, sc, "absmax", torch.float32)
        cols = sc.shape[-1]
        rows = sc.numel // cols
        x = x.reshape(rows, cols)
        step = max(1, _CHUNK // max(cols, 1))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            t = qz.quantize_int8_rows(x[r0:r1])
            codes[r0 * cols:r1 * cols].copy_(t.codes.reshape(-1))
            absmax[r0:r1].copy_(t.absmax)
        err = _Error()
        t = self._int8(blob, sc)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            err.add(x[r0:r1], qz.dequantize_int8_rows(qz.Int8RowTensor(t.codes[r0:r1], t.absmax[r0:r1], self.dtype),
                                                      torch.float32))
        sc.max_abs_error, sc.rel_rms_error = err.result()

    def _fill_nf4(self, blob: torch.Tensor, sc: SegmentCode, flat: torch.Tensor) -> None:
        per, bs, E = sc.numel // sc.experts, qz.NF4_BLOCK, sc.experts
        nb, half = qz.nblocks_of(per), (per + 1) // 2
        packed = self._piece(blob, sc, "packed")
        absmax = torch.empty(E * nb) if self.double_quant else self._piece(blob, sc, "absmax", torch.float32)
        for e in range(E):                  # each expert its own tensor; chunks of whole blocks
            src, pk, am = flat[e * per:(e + 1) * per], packed[e * half:(e + 1) * half], absmax[e * nb:(e + 1) * nb]
            for i in range(0, per, _CHUNK):
                t = qz.quantize_nf4(src[i:i + _CHUNK], bs)
                pk[i // 2:i // 2 + t.packed.numel()].copy_(t.packed)
                am[i // bs:i // bs + t.absmax.numel()].copy_(t.absmax)
        if self.double_quant:     # as quantize_nf4 / quantize_nf4_experts do
            sc.absmax_offset = qz.double_quantize_absmax(absmax, E, self._piece(blob, sc, "absmax_q"),
                                                         self._piece(blob, sc, "absmax_scale", torch.float32))
        err = _Error()
        for e in range(E):
            t = self._nf4(blob, sc, e)
            restored = qz.nf4_absmax(t)
            for i in range(0, per, _CHUNK):
                m = min(per, i + _CHUNK) - i
                sub = qz.NF4Tensor(t.packed[i // 2:i // 2 + (m + 1) // 2],
                                   restored[i // bs:i // bs + qz.nblocks_of(m)], torch.Size((m,)), self.dtype, bs)
                err.add(flat[e * per + i:e * per + i + m], qz.dequantize_nf4(sub, torch.float32))
        sc.max_abs_error, sc.rel_rms_error = err.result()

    # ---- dequantize from a home ---------------------------------------------------------
    def dequantize(self, blob: torch.Tensor, out: torch.Tensor, reference: bool = False) -> torch.Tensor:
        """The part's flat (``numel`` values of ``dtype``, padding zeroed) from ``blob`` (a
        uint8 tensor holding what ``fill`` wrote) into ``out`` (contiguous, on the blob's
        device). ``reference``: ``offload.quantize``'s torch references, which run on any
        device and give the native kernels' bits; else the native kernels (CPU)."""
        blob = blob.view(torch.uint8)
        with torch.no_grad():
            end = 0
            for sc in self.segments:
                dst = out[sc.offset:sc.offset + sc.numel]
                if sc.fmt == "raw":
                    dst.copy_(self._piece(blob, sc, "values", self.dtype))
                elif sc.fmt == "int8":
                    self._dequantize_int8(self._int8(blob, sc), dst, reference)
                else:
                    per = sc.numel // sc.experts
                    for e in range(sc.experts):
                        self._dequantize_nf4(self._nf4(blob, sc, e), dst[e * per:(e + 1) * per], reference)
                end = max(end, sc.offset + sc.numel)
            out[end:].zero_()
        return out

    def _dequantize_int8(self, t: qz.Int8RowTensor, dst: torch.Tensor, reference: bool) -> None:
        if reference:
            dst.copy_(qz.dequantize_int8_rows_reference(t, self.dtype).reshape(-1))
        else:
            qz.dequantize_int8_rows(t, self.dtype, out=dst)

    def _dequantize_nf4(self, t: qz.NF4Tensor, dst: torch.Tensor, reference: bool) -> None:
        if reference:
            dst.copy_(qz.dequantize_nf4_reference(t, self.dtype).reshape(-1))
        else:
            qz.dequantize_nf4(t, self.dtype, out=dst)

    def dequantize_expert(self, blob: torch.Tensor, name: str, e: int, out: Optional[torch.Tensor] = None,
                          reference: bool = False) -> torch.Tensor:
        """Expert ``e`` of the 3-D tensor ``name`` (values of ``dtype``, shape ``shape[1:]``)
        from ``blob``, reading that expert's codes and scales alone (into ``out`` when given:
        contiguous, on the blob's device). Why: a layer materialized in expert chunks
        dequantizes only the experts its tokens reach. A raw (unquantized) tensor gives its
        stored slice."""
        sc = next((c for c in self.segments if c.name == name), None)
        if sc is None or len(sc.shape) != 3:
            raise KeyError(f"{name!r} is not a 3-D tensor of this part: "
                           f"{[c.name for c in self.segments if len(c.shape) == 3]}")
        if not 0 <= e < sc.shape[0]:
            raise IndexError(f"expert {e} of {name!r}: it has {sc.shape[0]}")
        per = sc.numel // sc.shape[0]
        if out is None:
            out = torch.empty(per, dtype=self.dtype, device=blob.device)
        dst = out.view(-1)
        blob = blob.view(torch.uint8)
        with torch.no_grad():
            if sc.fmt == "raw":
                dst.copy_(self._piece(blob, sc, "values", self.dtype)[e * per:(e + 1) * per])
            elif sc.fmt == "int8":
                self._dequantize_int8(self._int8(blob, sc, e), dst, reference)
            else:
                self._dequantize_nf4(self._nf4(blob, sc, e), dst, reference)
        return out.view(sc.shape[1:])

    def values(self, blob: torch.Tensor) -> torch.Tensor:
        """A new host flat of the part's values (checkpoints, state dicts, hand-back)."""
        return self.dequantize(blob, torch.empty(self.numel, dtype=self.dtype))

    def materialize(self, blob: torch.Tensor, device: torch.device, stream=None, out=None):
        """``(flat, event)``: the part's values on ``device`` from its home's ``blob`` (host
        uint8). CPU: dequantized there, into ``out`` when given (event None). CUDA: the blob
        copied on ``stream`` and dequantized there; ``event`` marks the flat ready (the caller
        waits on it)."""
        if device.type == "cpu":
            return self.dequantize(blob, out if out is not None else torch.empty(self.numel, dtype=self.dtype)), None
        from offload import device as dev
        blob = blob.view(torch.uint8)[:self.nbytes]
        with dev.use_stream(stream):
            qb = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            qb.copy_(blob, non_blocking=True)
            out = torch.empty(self.numel, dtype=self.dtype, device=device)
            self.dequantize(qb, out, reference=True)
            return out, dev.record_event(stream)

    # ---- the blob as a checkpoint keeps it ----------------------------------------------
    def code(self) -> dict:
        """What a blob of this part means without the part (picklable): the format, the
        values' dtype, each segment's place, pieces and double-quant offset, and its error.
        A checkpoint keeps it beside the blob (``from_code`` reads it back)."""
        return {"fmt": self.fmt, "double_quant": self.double_quant, "dtype": str(self.dtype).split(".")[-1],
                "numel": self.numel, "nbytes": self.nbytes,
                "segments": [{**{f.name: getattr(sc, f.name) for f in dataclasses.fields(sc) if f.name != "param"},
                              "pieces": dict(sc.pieces)} for sc in self.segments]}

    @classmethod
    def from_code(cls, code: dict) -> "QuantizedPart":
        """A codec that dequantizes blobs described by ``code`` (no parameters behind it:
        ``dequantize`` / ``values`` only)."""
        self = cls.__new__(cls)
        self.layout, self.fmt, self.double_quant = None, code["fmt"], code["double_quant"]
        self.dtype, self.numel, self.nbytes = getattr(torch, code["dtype"]), code["numel"], code["nbytes"]
        self.segments = [SegmentCode(param=None, **{**sc, "shape": tuple(sc["shape"]),
                                                    "pieces": {k: tuple(v) for k, v in sc["pieces"].items()}})
                         for sc in code["segments"]]
        return self

    def adopt(self, code: dict) -> bool:
        """Take a stored blob's per-tensor values (double-quant offsets, errors) when its
        ``code`` lays the blob out as this part does; False (nothing taken) otherwise."""
        if _layout(code) != _layout(self.code()):
            return False
        for sc, c in zip(self.segments, code["segments"]):
            sc.absmax_offset, sc.max_abs_error, sc.rel_rms_error = c["absmax_offset"], c["max_abs_error"], c["rel_rms_error"]
        return True

    # ---- what it stores -----------------------------------------------------------------
    def tensor_stats(self) -> Dict[str, dict]:
        """Per quantized tensor: its format, elements, bytes stored and its error."""
        return {sc.name: {"format": sc.fmt, "numel": sc.numel, "bytes": sc.nbytes,
                          "max_abs_error": sc.max_abs_error, "rel_rms_error": sc.rel_rms_error}
                for sc in self.segments if sc.fmt != "raw"}


def _layout(code: dict) -> tuple:
    """What of a ``code`` fixes the blob's layout (not the values' offsets and errors)."""
    return (code["fmt"], code["double_quant"], code["dtype"], code["numel"], code["nbytes"],
            tuple((c["name"], c["offset"], c["numel"], tuple(c["shape"]), c["fmt"],
                   tuple(sorted((k, tuple(v)) for k, v in c["pieces"].items()))) for c in code["segments"]))


class DequantFlats:
    """The flats a CPU compute device dequantizes frozen parts into, kept when a block is
    released for the next block of the same size, up to ``limit_bytes`` (the device budget:
    no more are alive at once). Why: on a CPU device a new flat is a fresh mapping whose
    pages fault in at every materialize, costing more than the dequantization; on CUDA the
    caching allocator reuses device memory already. A flat given back must have no other
    user: the engine's contract for a released block's device copy. Thread-safe."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._free: Dict[Tuple[int, torch.dtype], List[torch.Tensor]] = {}
        self._kept = 0
        self.reused = 0                 # flats handed out again
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            free = self._free.get((numel, dtype))
            if free:
                self._kept -= numel * dtype.itemsize
                self.reused += 1
                return free.pop()
        return torch.empty(numel, dtype=dtype)

    def give(self, flat: torch.Tensor) -> None:
        nbytes = flat.numel() * flat.element_size()
        with self._lock:
            if self._kept + nbytes <= self.limit_bytes:
                self._free.setdefault((flat.numel(), flat.dtype), []).append(flat)
                self._kept += nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._kept = 0


class _Error:
    """Max abs error and relative RMS error, accumulated chunk by chunk."""

    def __init__(self):
        self.max_abs, self.sq_err, self.sq_ref = 0.0, 0.0, 0.0

    def add(self, ref: torch.Tensor, got: torch.Tensor) -> None:
        """``got``: the dequantized fp32 values of ``ref`` (consumed)."""
        if not ref.numel():
            return
        r = ref.reshape(-1).float()
        d = got.reshape(-1).sub_(r)
        lo, hi = torch.aminmax(d)
        self.max_abs = max(self.max_abs, float(hi), -float(lo))
        self.sq_err += float(torch.linalg.vector_norm(d)) ** 2      # fp32 with torch's cascaded sums
        self.sq_ref += float(torch.linalg.vector_norm(r)) ** 2

    def result(self) -> Tuple[float, float]:
        return self.max_abs, (math.sqrt(self.sq_err / self.sq_ref) if self.sq_ref > 0 else 0.0)


def codecs(frozen, offload_param, dtype_of) -> Dict[int, QuantizedPart]:
    """``id(part) -> QuantizedPart`` of the frozen parts stored quantized under the
    ``offload_param`` config section (``frozen_dtype``, ``frozen_double_quant``,
    ``frozen_quant_min_numel``); ``frozen`` as ``core.blocks.frozen_parts`` gives it,
    ``dtype_of(param)`` the dtype a frozen parameter is kept in."""
    fmt = getattr(offload_param, "frozen_dtype", "compute")
    if fmt not in FORMATS:
        return {}
    out = {}
    for _, _, parts in frozen:
        for part in parts:
            codec = QuantizedPart.for_part(part, dtype_of(part.segments[0].param), fmt,
                                           offload_param.frozen_double_quant, offload_param.frozen_quant_min_numel)
            if codec is not None:
                out[id(part)] = codec
    return out


def stats(parts, fmt: str) -> dict:
    """``Engine.stats()["frozen_quant"]``: the format, the bytes the quantized tensors take
    and would take in the compute dtype, the worst errors and each tensor's own."""
    tensors = {}
    qbytes = cbytes = 0
    for p in parts:
        tensors.update(p.tensor_stats())
        qbytes += p.quantized_bytes
        cbytes += p.quantized_numel * p.dtype.itemsize
    return {"frozen_dtype": fmt, "tensors": len(tensors), "quantized_bytes": qbytes, "compute_bytes": cbytes,
            "home_bytes": sum(p.nbytes for p in parts),
            "max_abs_error": max((t["max_abs_error"] for t in tensors.values()), default=0.0),
            "rel_rms_error": max((t["rel_rms_error"] for t in tensors.values()), default=0.0),
            "per_tensor": tensors}


def round_trip(t: torch.Tensor, fmt: str, double_quant: bool = False) -> torch.Tensor:
    """``t`` (CPU, 2-D, or 3-D per expert) through the codec's quantization and back, in its
    own dtype: the values a frozen tensor had while the engine trained over it (a merge into
    the base it trained against, a plain reference)."""
    t = t.detach()
    if fmt == "int8":
        rows = t.reshape(-1, t.shape[-1])
        return qz.dequantize_int8_rows(qz.quantize_int8_rows(rows), t.dtype).view(t.shape)
    if t.dim() == 3:
        return torch.stack([qz.dequantize_nf4(x, t.dtype).view(t.shape[1:])
                            for x in qz.quantize_nf4_experts(t, double_quant=double_quant)])
    return qz.dequantize_nf4(qz.quantize_nf4(t, double_quant=double_quant), t.dtype)


def round_trip_base_(model, offload_param) -> int:
    """Replace, in place, every parameter of ``model`` the engine stores quantized under the
    ``offload_param`` section (``quantizes``; for a LoRA base loaded alone: every one of its
    tensors counts as frozen) by its ``round_trip`` values. Returns how many were replaced."""
    fmt = getattr(offload_param, "frozen_dtype", "compute")
    if fmt not in FORMATS:
        return 0
    n = 0
    with torch.no_grad():
        for p in {id(p): p for p in model.parameters()}.values():
            if quantizes(p.shape, p.dtype, fmt, offload_param.frozen_quant_min_numel) and p.device.type == "cpu":
                p.copy_(round_trip(p, fmt, offload_param.frozen_double_quant))
                n += 1
    return n
