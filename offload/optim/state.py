"""The owner of one block shard's optimizer state, and that state's residency transitions.

The state is one flat uint8 buffer laid out by the update rule's ``StateLayout``
(``StateLayout``, below): ``[master fp32 | the rule's rows at state_dtype | int8 scales]``,
every region 4 KiB-aligned (O_DIRECT), e.g. AdamW fp32 ``[master | exp_avg | exp_avg_sq]``,
AdamW int8 ``[master | exp_avg codes | exp_avg_sq codes | their absmax scales]``, SGD with
momentum ``[master | momentum_buffer]``. The same bytes on every tier. Its home tier is fixed
at construction:

* ``DEVICE``: a tensor on the compute device (``offload_optimizer.device = none``);
* ``HOST``: a persistent host-pool buffer (``cpu``);
* ``NVME``: a swap-file extent; the bytes visit a host-pool buffer only around the step.

Chunks. On NVMe a shard whose state is larger than ``offload_optimizer.state_chunk_bytes``
is kept as consecutive element ranges ``[a, b)`` of the shard (``StateChunk``, ranges from
``memory_plan.state_chunks``), each with its own layout (the same rows and dtype over
``b - a`` elements), its own swap-file key (``<key>.c<k>``) and its own loan: the optimizer
pipeline reads, steps and writes one chunk at a time, so a swap-pool slot holds a chunk,
never the largest block. Chunk starts are multiples of 4096 elements, hence of the int8
scale block (256): element ``i`` has the same scale block, counted from its chunk's start,
as counted from the shard's, and a chunked update is bit-for-bit the unchunked one. A rule
whose rows are per tensor (Adafactor) is never chunked (``memory_plan.state_chunks``).
Every other shard has one chunk, ``[0, numel)``, whose layout and key are the shard's.

Residency is each chunk's ``offload.storage.loan.Loan`` (the one loaned-buffer state
machine, shared with the parameter homes, the gradients and the activations; its diagram is
in storage/loan.py). A chunk's verbs are the loan's, with the same names and transitions:
``fetch``, ``acquire``, ``commit``, ``finish_write``, ``poll``, ``release``, ``discard``,
``overwrite`` and ``replace_resident``. ``release()`` of READY returns an unmodified buffer
without writing it; a pool buffer on loan may be reused by another chunk only once the chunk
is back ON_TIER. HOST and DEVICE states are always RESIDENT and every transition is a no-op.
Every wait is bounded; a failed read or write gives its buffer back before its error (naming
the block, the chunk, the operation, the file and the errno) is raised.

The whole-shard verbs of ``OptimState`` (``acquire`` / ``views`` / ``release``, ``overwrite``,
for checkpoints and ``full_state_dict``) act on the single chunk of an unchunked state; for
a chunked one they assemble the shard's bytes in the whole layout in a transient buffer of
``nbytes`` outside the pools (chunk by chunk through the pool), so a checkpoint file holds
the same bytes either way. ``initialize`` fills a fresh state chunk by chunk.

The byte layout (``StateLayout``) of one flat shard's optimizer state in one buffer, for any
rule and state dtype: what a host-pool slot, an NVMe extent and a checkpoint block file hold.

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
from offload.core.errors import InvariantError
from offload.optim import quant
from offload.optim.rule import Row, UpdateRule
from offload.placement import Placement
from offload.storage.loan import Loan, LoanState
from offload.storage.tier import NvmeTier
from offload.units import PAGE, round_up


# ---- the byte layout of a shard's state ----------------------------------------------------
ALIGN = PAGE                     # every region starts on a page (O_DIRECT)
_TORCH = {name: dtypes.state_storage_dtype(name) for name in dtypes.STATE_DTYPES}   # read at import, not per step
_ITEM = {name: dtypes.element_size(t) for name, t in _TORCH.items()}


def _align(n: int) -> int:
    return round_up(n, ALIGN)


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


def chunk_key(key: str, k: int, n: int) -> str:
    """The swap-file key of chunk ``k`` of ``n`` of the state under ``key``."""
    return key if n == 1 else f"{key}.c{k}"


def chunk_layout(layout: StateLayout, a: int, b: int) -> StateLayout:
    """The layout of elements ``[a, b)`` of a shard laid out by ``layout`` (its rows and dtype)."""
    if (a, b) == (0, layout.numel):
        return layout
    if layout.tensors:
        raise ValueError("a per-tensor layout (Adafactor) is not chunked: its rows need whole tensors")
    if a % quant.BLOCK:
        raise ValueError(f"a state chunk must start on a {quant.BLOCK}-element scale block, got {a}")
    return StateLayout(layout.rows, b - a, layout.state_dtype)


class StateChunk:
    """Elements ``[a, b)`` of one shard's state: ``layout``, ``nbytes``, one loan."""

    def __init__(self, key: str, index: int, count: int, a: int, b: int, layout: StateLayout, tier: Placement, *,
                 tensor: Optional[torch.Tensor] = None, pool=None, store=None, what: str = "",
                 wait_timeout_s: Optional[float] = None):
        self.key, self.index, self.count, self.a, self.b = key, index, count, a, b
        self.layout = layout
        self.nbytes = layout.nbytes
        self.tier = tier
        # "" for the one chunk of an unchunked state: its errors read as before
        self.where = "" if count == 1 else f" (chunk {index + 1} of {count}, elements [{a}, {b}) of the shard)"
        self.what = f"optimizer state of {what or key}{self.where}"
        if tier is Placement.NVME:
            if not (tensor is None and pool is not None and store is not None):
                raise InvariantError(f"{self.what}: an NVMe state takes a pool and a store and no tensor")
            kw = {} if wait_timeout_s is None else {"wait_timeout_s": wait_timeout_s}
            self._loan = NvmeTier(store, pool, **kw).loan(key, self.nbytes, self.what)
        else:
            if not (tensor is not None and tensor.dtype == torch.uint8 and tensor.numel() == self.nbytes):
                raise InvariantError(f"{self.what}: a resident state takes a uint8 tensor of {self.nbytes} bytes")
            self._loan = Loan.resident(tensor, key, self.what)
        # The views of the buffer last acquired, built once per buffer: a HOST or DEVICE state
        # keeps one buffer for its life, and an NVMe chunk meets the same few pool buffers
        # again. Each view is a torch call that releases the GIL, and on the optimizer worker
        # each release can wait for the main thread's forward to give the GIL back.
        self._src: Optional[torch.Tensor] = None      # the loan's buffer ...
        self._buf: Optional[torch.Tensor] = None      # ... as this chunk's bytes
        self._views: Optional[tuple] = None           # ... and as (master, rows)

    def _bytes(self, data: torch.Tensor) -> torch.Tensor:
        if data is not self._src:
            self._src, self._buf, self._views = data, data.view(torch.uint8).view(-1)[:self.nbytes], None
        return self._buf

    def views(self, buf: torch.Tensor) -> tuple:
        """(master fp32 [b - a], {row name: tensor}) as views of an acquired buffer (the same
        objects for the same buffer: read them, never rebind their entries)."""
        if buf is self._buf:
            if self._views is None:
                self._views = self.layout.views(buf)
            return self._views
        return self.layout.views(buf)

    @property
    def state(self) -> LoanState:
        """Where the chunk's bytes are now: its loan's state."""
        return self._loan.state

    @property
    def in_memory(self) -> bool:
        return self._loan.in_memory

    # ---- transitions: the loan's verbs (storage/loan.py) --------------------------------------
    def fetch(self, timeout: Optional[float] = None, *, make_room=None, poll_s: Optional[float] = None) -> bool:
        """Start reading from NVMe (ON_TIER -> READING) into a pool buffer: ``Loan.fetch``
        (without ``timeout`` False, nothing started, when no pool buffer is free now)."""
        return self._loan.fetch(timeout, make_room=make_room, poll_s=poll_s)

    def acquire(self, timeout: Optional[float] = None) -> torch.Tensor:
        """The chunk's bytes (flat uint8, ``nbytes``; ``views()`` splits them), resident in
        memory (waits for a read in flight; from ON_TIER, first waits for a pool buffer)."""
        return self._bytes(self._loan.acquire(timeout))

    def overwrite(self, write, timeout: Optional[float] = None) -> None:
        """Replace the whole chunk: ``write(buf)`` writes every byte (no read from NVMe
        first); the NVME tier then writes it back (-> WRITING)."""
        self._loan.overwrite(lambda data: write(self._bytes(data)), timeout)

    def replace_resident(self, data: torch.Tensor) -> torch.Tensor:
        """A HOST or DEVICE chunk's bytes become ``data`` (an update computed ahead into a
        second buffer, optim/ahead.py); returns the old buffer."""
        return self._loan.replace_resident(data)

    def commit(self) -> None:
        """The chunk was modified: start writing it back (READY -> WRITING)."""
        self._loan.commit()

    def finish_write(self, timeout: Optional[float] = None) -> None:
        """WRITING -> ON_TIER once the write has completed (bounded wait); the pool buffer
        goes back (a failed write raises after that). No-op in any other state."""
        self._loan.finish_write(timeout)

    def poll(self) -> bool:
        """Settle a finished read or write without waiting; True when nothing is in flight."""
        return self._loan.poll()

    def release(self, timeout: Optional[float] = None) -> None:
        """Back to ON_TIER: READY (or READING) without writing (the chunk was only read), a
        write in flight waited for."""
        self._loan.release(timeout)

    def discard(self) -> None:
        """After a failure: back to ON_TIER whatever the state, errors swallowed."""
        self._loan.discard()


class OptimState:
    """The fp32 master and the rule's state rows of one block shard (``layout``), as
    ``chunks`` (one, unless the state is chunked on NVMe; see the module docstring)."""

    def __init__(self, key: str, layout: StateLayout, tier: Placement, *, tensor: Optional[torch.Tensor] = None,
                 pool=None, store=None, what: str = "", wait_timeout_s: Optional[float] = None,
                 chunks: Sequence[tuple] = ()):
        self.key = key
        self.layout = layout
        self.numel = layout.numel
        self.nbytes = layout.nbytes
        self.tier = tier
        self.what = f"optimizer state of {what or key}"
        ranges = tuple(chunks) or ((0, layout.numel),)
        if ranges[0][0] != 0 or ranges[-1][1] != layout.numel or any(
                x[1] != y[0] for x, y in zip(ranges, ranges[1:])):
            raise ValueError(f"{self.what}: chunks {ranges} do not cover [0, {layout.numel}) in order")
        if len(ranges) > 1 and tier is not Placement.NVME:
            raise ValueError(f"{self.what}: only a state on NVMe is chunked (tier {tier.value})")
        self.chunks = [StateChunk(chunk_key(key, k, len(ranges)), k, len(ranges), a, b,
                                  chunk_layout(layout, a, b), tier, tensor=tensor, pool=pool, store=store,
                                  what=what or key, wait_timeout_s=wait_timeout_s)
                       for k, (a, b) in enumerate(ranges)]
        self._whole: Optional[torch.Tensor] = None     # a chunked state assembled (acquire .. release)

    @property
    def chunked(self) -> bool:
        return len(self.chunks) > 1

    def views(self, buf: torch.Tensor) -> tuple:
        """(master fp32 [numel], {row name: tensor}) as views of ``acquire()``'s buffer."""
        return self.layout.views(buf)

    @property
    def state(self) -> LoanState:
        """The one chunk's state; a chunked state: READY while assembled, else the first
        chunk that is not ON_TIER's, else ON_TIER."""
        if not self.chunked:
            return self.chunks[0].state
        if self._whole is not None:
            return LoanState.READY
        return next((c.state for c in self.chunks if c.in_memory), LoanState.ON_TIER)

    @property
    def in_memory(self) -> bool:
        return self._whole is not None or any(c.in_memory for c in self.chunks)

    # ---- whole-shard verbs (fresh state, checkpoints, full_state_dict) -----------------------
    def initialize(self, master: torch.Tensor, ranges: Sequence[tuple] = ()) -> None:
        """Write a fresh state, chunk by chunk (``StateLayout.init``: ``master`` fp32 of
        ``numel`` or fewer elements, rows at their initial values over ``ranges``) and wait
        until it is on its tier."""
        for c in self.chunks:
            part = master[c.a:c.b]
            sub = [(v, max(a, c.a) - c.a, min(b, c.b) - c.a) for v, a, b in ranges if max(a, c.a) < min(b, c.b)]
            c.overwrite(lambda buf, c=c, part=part, sub=sub: c.layout.init(buf, part.to(buf.device), sub))
            c.finish_write()

    def acquire(self, timeout: Optional[float] = None) -> torch.Tensor:
        """The state's bytes (flat uint8, ``nbytes``, the whole layout), resident in memory;
        ``release()`` gives them back. A chunked state is assembled in a transient buffer."""
        if not self.chunked:
            return self.chunks[0].acquire(timeout)
        if self._whole is None:
            whole = torch.empty(self.nbytes, dtype=torch.uint8)
            for c in self.chunks:
                try:
                    self._copy(c, c.acquire(timeout), whole, into_whole=True)
                finally:
                    c.release(timeout)
            self._whole = whole
        return self._whole

    def release(self, timeout: Optional[float] = None) -> None:
        """Back to ON_TIER: READY (or READING) without writing (the state was only read)."""
        self._whole = None
        for c in self.chunks:
            c.release(timeout)

    def overwrite(self, write, timeout: Optional[float] = None) -> None:
        """Replace the whole state: ``write(buf)`` writes every byte of the whole layout (no
        read from NVMe first); the NVME tier writes it back (-> WRITING; a chunked state's
        chunks are written one by one and waited for, -> ON_TIER)."""
        if not self.chunked:
            return self.chunks[0].overwrite(write, timeout)
        self._whole = None
        whole = torch.empty(self.nbytes, dtype=torch.uint8)
        write(whole)
        for c in self.chunks:
            c.overwrite(lambda buf, c=c: self._copy(c, buf, whole, into_whole=False), timeout)
            c.finish_write(timeout)

    def finish_write(self, timeout: Optional[float] = None) -> None:
        """Every chunk's write completed (see ``StateChunk.finish_write``)."""
        for c in self.chunks:
            c.finish_write(timeout)

    def discard(self) -> None:
        self._whole = None
        for c in self.chunks:
            c.discard()

    def _copy(self, c: StateChunk, buf: torch.Tensor, whole: torch.Tensor, into_whole: bool) -> None:
        """Copy chunk ``c``'s bytes between its own layout (``buf``) and the whole layout."""
        m, rows = c.views(buf)
        wm, wrows = self.layout.views(whole)
        pairs = [(m, wm[c.a:c.b])]
        for r in self.layout.rows:
            pairs.append((rows[r.name], wrows[r.name][c.a:c.b]))
            if self.layout.state_dtype == "int8":
                s = c.a // quant.BLOCK
                pairs.append((rows[r.name + "_absmax"], wrows[r.name + "_absmax"][s:s + quant.nblocks(c.b - c.a)]))
        if not into_whole:
            buf.zero_()                       # alignment padding: defined bytes on the tier
        for mine, theirs in pairs:
            (theirs if into_whole else mine).copy_(mine if into_whole else theirs)
