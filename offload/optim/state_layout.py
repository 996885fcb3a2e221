"""The byte layout of one flat shard's optimizer state in one buffer, for any rule and state
dtype: what a host-pool slot, an NVMe extent and a checkpoint block file hold.

    [ master fp32 | row 0 | row 1 | ... | scales of row 0 | scales of row 1 | ... ]

Every region starts on a 4096-byte boundary (rows and scales can be read or written alone
with O_DIRECT). fp32 / bf16 rows hold ``numel`` values; int8 rows hold ``numel`` uint8 codes
and, in the scales region, ``ceil(numel / 256)`` fp32 absmax values (quant.py). The master
is always fp32. ``describe()`` is the JSON a checkpoint stores beside the bytes, so a reader
knows the rows, their dtypes and codes without the rule's code; fields may be added to it
(readers ignore what they do not know).

A rule whose state depends on each parameter's shape (``UpdateRule.per_tensor``: Adafactor)
keeps, after the master, one area (4096-aligned) packing every tensor's fp32 rows back to
back: for a tensor wholly inside the shard its rows for its shape (Adafactor: ``row_var`` and
``col_var``), for a piece of a tensor that the shard splits (ZeRO) the unfactored rows of the
piece (``variance``). Those regions are named ``<row>@<k>`` for the k-th tensor piece
(``tensors``: start, numel and shape in the shard) and are not 4096-aligned.

With int8 state, element ``i`` of a row belongs to scale block ``i // 256`` counted from the
shard's start; a slice ``[a, b)`` of the shard (``slice``) must start on a block boundary
(the engine aligns parameter groups to 256 elements for int8, shards are 1024-aligned).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Sequence

import torch

from offload import dtypes
from offload.optim import quant
from offload.optim.rule import Row, UpdateRule

ALIGN = 4096
_TORCH = {name: dtypes.state_storage_dtype(name) for name in dtypes.STATE_DTYPES}   # read at import, not per step
_ITEM = {name: dtypes.element_size(t) for name, t in _TORCH.items()}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True)
class Region:
    name: str        # "master", a row name, or "<row>_absmax"
    dtype: str       # fp32 | bf16 | int8
    offset: int      # bytes from the buffer's start, a multiple of ALIGN
    numel: int
    signed: Optional[bool] = None  # int8 rows: which code

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEM[self.dtype]


@dataclasses.dataclass(frozen=True)
class TensorPiece:
    """One parameter's piece in a shard, for a per-tensor rule: ``[start, start + numel)``
    of the shard; ``shape`` the whole parameter's shape when the piece is the whole
    parameter, else None (a piece of a split tensor: unfactored rows); ``group`` its
    param group."""
    start: int
    numel: int
    shape: Optional[tuple]
    group: int = 0
    rows: tuple = ()     # ((name, numel), ...) its fp32 rows, as the rule gives them


class StateLayout:
    """Regions of one shard's state (see the module docstring)."""

    def __init__(self, rows: Sequence[Row], numel: int, state_dtype: str, tensors: Sequence[TensorPiece] = ()):
        if state_dtype not in _ITEM:
            raise ValueError(f"state_dtype={state_dtype!r}: use fp32, bf16 or int8")
        if any(not r.elementwise for r in rows):
            raise ValueError("a flat shard's layout holds elementwise rows only: a factored rule keeps its "
                             "rows per tensor (StateLayout.for_shard)")
        if tensors and (rows or state_dtype != "fp32"):
            raise ValueError("a per-tensor layout holds fp32 rows per tensor only")
        self.numel, self.state_dtype, self.rows = numel, state_dtype, tuple(rows)
        self.tensors: tuple = tuple(tensors)
        regions, off = [Region("master", "fp32", 0, numel)], _align(4 * numel)
        for r in rows:
            regions.append(Region(r.name, state_dtype, off, numel, r.signed if state_dtype == "int8" else None))
            off += _align(numel * _ITEM[state_dtype])
        if state_dtype == "int8":
            for r in rows:
                regions.append(Region(r.name + "_absmax", "fp32", off, quant.nblocks(numel)))
                off += _align(4 * quant.nblocks(numel))
        if self.tensors:
            for k, t in enumerate(self.tensors):
                for name, n in t.rows:
                    regions.append(Region(f"{name}@{k}", "fp32", off, n))
                    off += 4 * n
            off = _align(off)
        self.regions: tuple = tuple(regions)
        self.nbytes = off

    @classmethod
    def for_rule(cls, rule: UpdateRule, group: dict, numel: int, state_dtype: str = "fp32") -> "StateLayout":
        return cls(rule.rows(group), numel, state_dtype)

    @classmethod
    def for_shard(cls, rule: UpdateRule, groups: Sequence[dict], numel: int, state_dtype: str,
                  params: Sequence[tuple] = ()) -> "StateLayout":
        """The layout of one shard of ``numel`` elements. ``groups``: the param groups'
        hyper-parameters; ``params``: (start, numel, shape, group) of each parameter in
        shard coordinates (start may be negative and the end past ``numel``: a parameter the
        shard splits). Elementwise rules use ``groups[0]`` for their rows; a per-tensor rule
        gets its rows per piece (see the module docstring)."""
        if not getattr(rule, "per_tensor", False):
            return cls(rule.rows(groups[0] if groups else dict(rule.defaults)), numel, state_dtype)
        pieces = []
        for start, n, shape, g in params:
            a, b = max(start, 0), min(start + n, numel)
            if a >= b:
                continue
            whole = (a, b) == (start, start + n)
            shp = tuple(int(x) for x in shape) if whole else None
            rows = tuple((r.name, (b - a) if r.elementwise else math.prod(r.shape))
                         for r in rule.rows(groups[g], shp))
            pieces.append(TensorPiece(a, b - a, shp, g, rows))
        return cls((), numel, state_dtype, pieces)

    def tensor_state(self, state: dict, k: int) -> dict:
        """The rows of tensor piece ``k`` (a per-tensor layout), by the rule's row names."""
        return {name: state[f"{name}@{k}"] for name, _ in self.tensors[k].rows}

    def slice(self, state: dict, a: int, b: int) -> dict:
        """The elementwise rows restricted to elements ``[a, b)`` of the shard (int8: ``a``
        on a 256-element block boundary, the scales of the blocks it covers)."""
        if self.tensors:
            raise ValueError("a per-tensor layout is stepped per tensor (tensor_state), not sliced")
        out = {}
        for r in self.rows:
            out[r.name] = state[r.name][a:b]
            if self.state_dtype == "int8":
                if a % quant.BLOCK:
                    raise ValueError(f"int8 state: a slice must start on a {quant.BLOCK}-element block boundary, "
                                     f"got {a}")
                out[r.name + "_absmax"] = state[r.name + "_absmax"][a // quant.BLOCK:quant.nblocks(b)]
        return out

    def init(self, buf: torch.Tensor, master: torch.Tensor, ranges: Sequence[tuple] = ()) -> None:
        """Fill ``buf`` as a fresh state: the master from ``master`` (fp32, ``numel`` or
        fewer elements; the rest zero), every row at its initial value: zero, or the
        group's ``row.init`` value over each ``(value_by_row, a, b)`` of ``ranges``
        (Adagrad's initial_accumulator_value), quantized for int8."""
        m, state = self.views(buf)
        buf.zero_()
        m[:master.numel()].copy_(master)
        for r in self.rows:
            if not ranges and self.state_dtype != "int8":
                continue                  # zero bytes are zeros
            fp32 = torch.zeros(self.numel, dtype=torch.float32)
            for values, a, b in ranges:
                fp32[a:b] = float(values.get(r.name, 0.0))
            if self.state_dtype == "int8":
                quant.quantize(fp32, state[r.name], state[r.name + "_absmax"], r.signed)
            else:
                state[r.name].copy_(fp32)

    def views(self, buf: torch.Tensor) -> tuple:
        """(master fp32 [numel], state dict for rule.cpu_step) as views of the uint8 ``buf``."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.nbytes:
            raise ValueError(f"buffer must be a flat uint8 tensor of >= {self.nbytes} bytes, got "
                             f"{buf.dtype} {tuple(buf.shape)}")
        out: Dict[str, torch.Tensor] = {}
        for r in self.regions:
            out[r.name] = buf[r.offset:r.offset + r.nbytes].view(_TORCH[r.dtype])
        return out.pop("master"), out

    def describe(self) -> dict:
        """JSON-able description (a checkpoint's per-block ``state`` entry)."""
        d = {"numel": self.numel, "state_dtype": self.state_dtype, "nbytes": self.nbytes, "align": ALIGN,
             "q8_block": quant.BLOCK if self.state_dtype == "int8" else None,
             "regions": [{k: v for k, v in dataclasses.asdict(r).items() if v is not None} for r in self.regions]}
        if self.tensors:
            d["tensors"] = [{"start": t.start, "numel": t.numel, "shape": None if t.shape is None else list(t.shape),
                             "group": t.group, "rows": [list(r) for r in t.rows]} for t in self.tensors]
        return d

    @classmethod
    def from_description(cls, d: dict) -> "StateLayout":
        tensors = [TensorPiece(int(t["start"]), int(t["numel"]), None if t["shape"] is None else tuple(t["shape"]),
                               int(t["group"]), tuple((n, int(k)) for n, k in t["rows"])) for t in d.get("tensors", ())]
        rows = [Row(r["name"], signed=bool(r.get("signed", True))) for r in d["regions"]
                if r["name"] != "master" and not r["name"].endswith("_absmax") and "@" not in r["name"]]
        layout = cls(rows, int(d["numel"]), d["state_dtype"], tensors)
        if layout.describe()["regions"] != d["regions"]:
            raise ValueError("state layout description does not match this version's layout rules")
        return layout
