"""The byte layout of one flat shard's optimizer state in one buffer, for any rule and state
dtype: what a host-pool slot, an NVMe extent and a checkpoint block file hold.

    [ master fp32 | row 0 | row 1 | ... | scales of row 0 | scales of row 1 | ... ]

Every region starts on a 4096-byte boundary (rows and scales can be read or written alone
with O_DIRECT). fp32 / bf16 rows hold ``numel`` values; int8 rows hold ``numel`` uint8 codes
and, in the scales region, ``ceil(numel / 256)`` fp32 absmax values (quant.py). The master
is always fp32. ``describe()`` is the JSON a checkpoint stores beside the bytes, so a reader
knows the rows, their dtypes and codes without the rule's code; fields may be added to it
(readers ignore what they do not know).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

import torch

from offload.optim import quant
from offload.optim.rule import Row, UpdateRule

ALIGN = 4096
_ITEM = {"fp32": 4, "bf16": 2, "int8": 1}
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}


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


class StateLayout:
    """Regions of one shard's state (see the module docstring)."""

    def __init__(self, rows: Sequence[Row], numel: int, state_dtype: str):
        if state_dtype not in _ITEM:
            raise ValueError(f"state_dtype={state_dtype!r}: use fp32, bf16 or int8")
        if any(not r.elementwise for r in rows):
            raise ValueError("a flat shard's layout holds elementwise rows only: a factored rule keeps its "
                             "unfactored row for a sharded tensor (rule.rows(group, shape=None))")
        self.numel, self.state_dtype, self.rows = numel, state_dtype, tuple(rows)
        regions, off = [Region("master", "fp32", 0, numel)], _align(4 * numel)
        for r in rows:
            regions.append(Region(r.name, state_dtype, off, numel, r.signed if state_dtype == "int8" else None))
            off += _align(numel * _ITEM[state_dtype])
        if state_dtype == "int8":
            for r in rows:
                regions.append(Region(r.name + "_absmax", "fp32", off, quant.nblocks(numel)))
                off += _align(4 * quant.nblocks(numel))
        self.regions: tuple = tuple(regions)
        self.nbytes = off

    @classmethod
    def for_rule(cls, rule: UpdateRule, group: dict, numel: int, state_dtype: str = "fp32") -> "StateLayout":
        return cls(rule.rows(group), numel, state_dtype)

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
        return {"numel": self.numel, "state_dtype": self.state_dtype, "nbytes": self.nbytes, "align": ALIGN,
                "q8_block": quant.BLOCK if self.state_dtype == "int8" else None,
                "regions": [{k: v for k, v in dataclasses.asdict(r).items() if v is not None} for r in self.regions]}

    @classmethod
    def from_description(cls, d: dict) -> "StateLayout":
        rows = [Row(r["name"], signed=bool(r.get("signed", True))) for r in d["regions"]
                if r["name"] != "master" and not r["name"].endswith("_absmax")]
        layout = cls(rows, int(d["numel"]), d["state_dtype"])
        if layout.describe()["regions"] != d["regions"]:
            raise ValueError("state layout description does not match this version's layout rules")
        return layout
