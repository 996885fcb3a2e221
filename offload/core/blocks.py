"""Grouping a model's parameters into blocks, and each block's flat layout.

A block is the unit of residency, I/O and optimizer work: the trainable parameters of one
module subtree (a transformer layer, the embedding, ...) laid out in one flat buffer.
Automatic grouping makes each element of an ``nn.ModuleList`` / ``nn.Sequential`` /
``nn.ModuleDict`` a block, descends through modules that contain such containers, and makes
every other child that holds parameters a block of its own; parameters owned directly by
modules that are not blocks go to a final root block. ``Config.blocks`` overrides this with
a list of module names.

A parameter shared between modules (tied weights) belongs to the first block that reaches
it, and is one parameter everywhere. Frozen parameters (``requires_grad=False``) are not in
the trainable flat buffer: they get no gradient buffer and no optimizer state. When
parameters are offloaded, ``frozen_parts`` groups them by the same block roots into one flat
buffer per dtype (a bf16 frozen base beside fp32 adapters is two parts of one block).

Layout of one block's flat buffer (1-D, one dtype)::

    [ group 0 params | group 1 params | ... | padding to a multiple of world_size * 1024 ]

Parameters are ordered by optimizer group, so each group's hyper-parameters apply to one
contiguous range (``group_ranges``). With ``param_align`` (int8 optimizer state: 256, its
scale block) every parameter starts on a multiple of it, the gaps zero padding, so no scale
block spans two parameters (each tensor is quantized on its own, as 8-bit Adam does: a
LayerNorm gain sharing a block's absmax with a weight matrix would lose the matrix's small
second moments) nor two groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from offload.core import sharding
from offload.core.errors import OffloadError

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


class ModelError(ValueError, OffloadError):
    """The engine cannot handle this model as it is; the message names the fix."""


@dataclass
class Segment:
    """One parameter's place in its block's flat buffer."""
    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    group: int


@dataclass
class BlockLayout:
    index: int
    name: str                      # module name ("" for the root block)
    module: nn.Module
    segments: List[Segment]
    numel: int                     # end of the last segment (segment sizes plus group gaps)
    padded_numel: int              # numel padded for world_size equal shards
    group_ranges: List[Tuple[int, int, int]] = field(default_factory=list)  # (group, start, end)


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _contains_container(m: nn.Module) -> bool:
    return any(isinstance(c, _CONTAINERS) for c in m.modules() if c is not m)


def auto_block_roots(model: nn.Module) -> List[str]:
    """Module names that become blocks, in module order."""
    roots: List[str] = []

    def visit(mod: nn.Module, prefix: str) -> None:
        for cname, child in mod.named_children():
            full = f"{prefix}{cname}"
            if not _has_params(child):
                continue
            if isinstance(mod, _CONTAINERS):
                if isinstance(child, _CONTAINERS):
                    visit(child, full + ".")
                else:
                    roots.append(full)
            elif isinstance(child, _CONTAINERS) or _contains_container(child):
                visit(child, full + ".")
            else:
                roots.append(full)

    visit(model, "")
    return roots


def block_roots(model: nn.Module, block_names: Optional[Sequence[str]]) -> List[str]:
    """The module names that become blocks (``Config.blocks`` or automatic), checked."""
    modules = dict(model.named_modules())
    names = list(block_names) if block_names is not None else auto_block_roots(model)
    for n in names:
        if n not in modules:
            raise ModelError(f"config blocks names module {n!r}, which the model does not have; "
                             f"use names from model.named_modules()")
    return names


def build_layouts(model: nn.Module, block_names: Optional[Sequence[str]], param_group_of: Dict[int, int],
                  world_size: int = 1, param_align: int = 1) -> List[BlockLayout]:
    """Assign every trainable parameter to exactly one block and lay the blocks out.

    ``param_group_of`` maps ``id(param)`` to its optimizer group index."""
    modules = dict(model.named_modules())
    names = block_roots(model, block_names)
    claimed: Dict[int, int] = {}
    per_block: List[List[Tuple[str, nn.Parameter]]] = []
    for bi, n in enumerate(names):
        items = []
        for pname, p in modules[n].named_parameters(prefix=n, remove_duplicate=True):
            if p.requires_grad and id(p) not in claimed:
                claimed[id(p)] = bi
                items.append((pname, p))
        per_block.append(items)
    rest = [(pn, p) for pn, p in model.named_parameters() if p.requires_grad and id(p) not in claimed]
    if rest:
        names.append("")
        per_block.append(rest)

    layouts = []
    for n, items in zip(names, per_block):
        if not items:
            continue
        dtypes = {p.dtype for _, p in items}
        if len(dtypes) > 1:
            raise ModelError(f"block {n or '<root>'!r} mixes parameter dtypes {sorted(map(str, dtypes))}: "
                             f"convert the model to one dtype first (model.float())")
        for pn, p in items:
            if id(p) not in param_group_of:
                raise ModelError(f"trainable parameter {pn!r} is in no param group: add it to one, "
                                 f"or set requires_grad=False to freeze it")
        items.sort(key=lambda it: param_group_of[id(it[1])])  # stable: module order within a group
        segs, off = [], 0
        for pn, p in items:
            off = -(-off // param_align) * param_align           # aligned start (1: contiguous)
            segs.append(Segment(pn, p, off, p.numel(), p.shape, param_group_of[id(p)]))
            off += p.numel()
        lay = BlockLayout(len(layouts), n, modules[n], segs, off, sharding.padded_numel(off, world_size))
        for s in segs:
            if lay.group_ranges and lay.group_ranges[-1][0] == s.group:
                g, a, _ = lay.group_ranges[-1]
                lay.group_ranges[-1] = (g, a, s.offset + s.numel)
            else:
                lay.group_ranges.append((s.group, s.offset, s.offset + s.numel))
        layouts.append(lay)
    if not layouts:
        raise ModelError("the model has no trainable parameters: nothing to optimize")
    return layouts


def gaps(lay: "BlockLayout", numel: int) -> List[Tuple[int, int]]:
    """The [a, b) ranges of a block's flat ``[0, numel)`` that no parameter covers: the
    alignment gaps between parameters and the padding at the end."""
    out, off = [], 0
    for s in sorted(lay.segments, key=lambda s: s.offset):
        if s.offset > off:
            out.append((off, s.offset))
        off = max(off, s.offset + s.numel)
    if off < numel:
        out.append((off, numel))
    return out


def frozen_parts(model: nn.Module, block_names: Optional[Sequence[str]],
                 dtype_of) -> List[Tuple[str, nn.Module, List[BlockLayout]]]:
    """The frozen parameters grouped by the same block roots as ``build_layouts``: per root
    ``(name, module, parts)``, one part (a ``BlockLayout`` with ``group`` -1 segments) per
    storage dtype, ``dtype_of(param)`` giving it. Parameters under no root go to the root
    block ``""``; roots without frozen parameters are left out. A part is padded to the
    4 KiB element unit (never sharded: every rank keeps the whole frozen part)."""
    modules = dict(model.named_modules())
    names = block_roots(model, block_names)
    seen = set()
    per_root: List[Tuple[str, List[Tuple[str, nn.Parameter]]]] = []
    for n in names:
        items = []
        for pname, p in modules[n].named_parameters(prefix=n, remove_duplicate=True):
            if id(p) not in seen:
                seen.add(id(p))              # a tied parameter belongs to its first root
                if not p.requires_grad:
                    items.append((pname, p))
        per_root.append((n, items))
    rest = [(pn, p) for pn, p in model.named_parameters() if id(p) not in seen and not p.requires_grad]
    if rest:
        per_root.append(("", rest))
    out = []
    for n, items in per_root:
        by_dtype: Dict[torch.dtype, List[Tuple[str, nn.Parameter]]] = {}
        for pn, p in items:
            by_dtype.setdefault(dtype_of(p), []).append((pn, p))
        parts = []
        for dt in sorted(by_dtype, key=str):
            segs, off = [], 0
            for pn, p in by_dtype[dt]:
                segs.append(Segment(pn, p, off, p.numel(), p.shape, -1))
                off += p.numel()
            parts.append(BlockLayout(-1, n, modules[n], segs, off, sharding.padded_numel(off, 1)))
        if parts:
            out.append((n, modules[n], parts))
    return out


def materialize_meta(layout: BlockLayout, loader) -> None:
    """Give the block's parameters their values from ``loader`` (``offload.io.loader.WeightLoader``):
    read from a pretrained checkpoint, or, for a block built on the meta device, set by the
    model's own initialisation. Meta parameters become real CPU tensors in their own dtype;
    parameter objects keep their identity (tied weights and hooks stay valid), so a model
    larger than host memory is materialized one block at a time."""
    loader.load([s.param for s in layout.segments])


def gather_flat(layout: BlockLayout, dtype: torch.dtype, device) -> torch.Tensor:
    """A new flat buffer holding the block's current parameter values (padding zeroed)."""
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    with torch.no_grad():
        for s in layout.segments:
            flat[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
    return flat


def bind_views(layout: BlockLayout, flat: torch.Tensor) -> None:
    """Make each parameter of the block a view into ``flat`` (the parameter objects keep
    their identity, so optimizers, hooks and tied references stay valid)."""
    for s in layout.segments:
        s.param.data = flat[s.offset:s.offset + s.numel].view(s.shape)
