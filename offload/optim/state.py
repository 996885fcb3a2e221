"""The owner of one block shard's optimizer state, and its residency transitions.

The state is one flat uint8 buffer laid out by the update rule's ``StateLayout``
(optim/state_layout.py): ``[master fp32 | the rule's rows at state_dtype | int8 scales]``,
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

Residency is each chunk's ``offload.storage.tier.Loan`` (the one loaned-buffer state
machine, shared with the parameter homes)::

    ON_TIER --fetch()--> READING --acquire()--> READY --commit()--> WRITING --reclaim()--> ON_TIER
                                                  \\--drop()-----------------------------> ON_TIER

``drop()`` returns an unmodified buffer without writing it. A pool buffer on loan may be
reused by another chunk only after ``reclaim()`` (the write has completed) or ``drop()``.
HOST and DEVICE states are always RESIDENT and every transition is a no-op. Every wait is
bounded; a failed read or write gives its buffer back before its error (naming the block,
the chunk, the operation, the file and the errno) is raised.

The whole-shard verbs of ``OptimState`` (``acquire`` / ``views`` / ``drop``, ``overwrite``,
for checkpoints and ``full_state_dict``) act on the single chunk of an unchunked state; for
a chunked one they assemble the shard's bytes in the whole layout in a transient buffer of
``nbytes`` outside the pools (chunk by chunk through the pool), so a checkpoint file holds
the same bytes either way. ``initialize`` fills a fresh state chunk by chunk.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from offload.optim import quant
from offload.optim.state_layout import StateLayout
from offload.storage.tier import Loan, NvmeTier, LoanState, TierKind

Tier = TierKind             # where the state lives
Residency = LoanState       # where it is now


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

    def __init__(self, key: str, index: int, count: int, a: int, b: int, layout: StateLayout, tier: Tier, *,
                 tensor: Optional[torch.Tensor] = None, pool=None, store=None, what: str = "",
                 wait_timeout_s: Optional[float] = None):
        self.key, self.index, self.count, self.a, self.b = key, index, count, a, b
        self.layout = layout
        self.nbytes = layout.nbytes
        self.tier = tier
        # "" for the one chunk of an unchunked state: its errors read as before
        self.where = "" if count == 1 else f" (chunk {index + 1} of {count}, elements [{a}, {b}) of the shard)"
        self.what = f"optimizer state of {what or key}{self.where}"
        if tier is Tier.NVME:
            assert tensor is None and pool is not None and store is not None
            kw = {} if wait_timeout_s is None else {"wait_timeout_s": wait_timeout_s}
            self._loan = NvmeTier(store, pool, **kw).loan(key, self.nbytes, self.what)
        else:
            assert tensor is not None and tensor.dtype == torch.uint8 and tensor.numel() == self.nbytes
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
    def residency(self) -> Residency:
        return self._loan.state

    @property
    def in_memory(self) -> bool:
        return self._loan.in_memory

    # ---- transitions ------------------------------------------------------------------------
    def fetch(self) -> bool:
        """Start reading from NVMe (ON_TIER -> READING) into a free pool buffer.
        Returns False, with nothing started, when no pool buffer is free."""
        return self._loan.fetch()

    def acquire(self, timeout: Optional[float] = None) -> torch.Tensor:
        """The chunk's bytes (flat uint8, ``nbytes``; ``views()`` splits them), resident in
        memory (waits for a read in flight; from ON_TIER, first waits for a pool buffer)."""
        return self._bytes(self._loan.acquire(timeout))

    def overwrite(self, fill, timeout: Optional[float] = None) -> None:
        """Replace the whole chunk: ``fill(buf)`` writes every byte (no read from NVMe
        first); the NVME tier then writes it back (-> WRITING)."""
        buf = self._bytes(self._loan.fill(timeout))
        try:
            fill(buf)
        except BaseException:
            self._loan.release()
            raise
        self._loan.commit()

    def trade(self, data: torch.Tensor) -> torch.Tensor:
        """A HOST or DEVICE chunk's bytes become ``data`` (an update computed ahead into a
        second buffer, optim/ahead.py); returns the old buffer."""
        return self._loan.replace_resident(data)

    def commit(self) -> None:
        """The chunk was modified: start writing it back (READY -> WRITING)."""
        self._loan.commit()

    def reclaim(self, block: bool = True, timeout: Optional[float] = None) -> bool:
        """WRITING -> ON_TIER once the write has completed; the pool buffer goes back (a
        failed write raises after that). With ``block=False`` returns False while the write
        is still in flight."""
        if self._loan.state is not Residency.WRITING:
            return True
        if not block:
            return self._loan.poll()
        self._loan.release(timeout)
        return True

    def drop(self, timeout: Optional[float] = None) -> None:
        """READY (or READING) -> ON_TIER without writing (the chunk was only read)."""
        if self._loan.state in (Residency.READING, Residency.READY):
            self._loan.release(timeout)

    def discard(self) -> None:
        """After a failure: back to ON_TIER whatever the state (a write in flight is waited
        for, its error swallowed: the caller is already raising one)."""
        try:
            self._loan.release()
        except BaseException:   # noqa: BLE001 - the first error is the one reported
            pass


class OptimState:
    """The fp32 master and the rule's state rows of one block shard (``layout``), as
    ``chunks`` (one, unless the state is chunked on NVMe; see the module docstring)."""

    def __init__(self, key: str, layout: StateLayout, tier: Tier, *, tensor: Optional[torch.Tensor] = None,
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
        if len(ranges) > 1 and tier is not Tier.NVME:
            raise ValueError(f"{self.what}: only a state on NVMe is chunked (tier {tier.value})")
        self.chunks = [StateChunk(chunk_key(key, k, len(ranges)), k, len(ranges), a, b,
                                  chunk_layout(layout, a, b), tier, tensor=tensor, pool=pool, store=store,
                                  what=what or key, wait_timeout_s=wait_timeout_s)
                       for k, (a, b) in enumerate(ranges)]
        self._whole: Optional[torch.Tensor] = None     # a chunked state assembled (acquire .. drop)

    @property
    def chunked(self) -> bool:
        return len(self.chunks) > 1

    def views(self, buf: torch.Tensor) -> tuple:
        """(master fp32 [numel], {row name: tensor}) as views of ``acquire()``'s buffer."""
        return self.layout.views(buf)

    @property
    def residency(self) -> Residency:
        """The one chunk's residency; a chunked state: READY while assembled, else the
        first chunk that is not ON_TIER's, else ON_TIER."""
        if not self.chunked:
            return self.chunks[0].residency
        if self._whole is not None:
            return Residency.READY
        return next((c.residency for c in self.chunks if c.in_memory), Residency.ON_TIER)

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
            c.reclaim(block=True)

    def acquire(self, timeout: Optional[float] = None) -> torch.Tensor:
        """The state's bytes (flat uint8, ``nbytes``, the whole layout), resident in memory;
        ``drop()`` gives them back. A chunked state is assembled in a transient buffer."""
        if not self.chunked:
            return self.chunks[0].acquire(timeout)
        if self._whole is None:
            whole = torch.empty(self.nbytes, dtype=torch.uint8)
            for c in self.chunks:
                try:
                    self._copy(c, c.acquire(timeout), whole, into_whole=True)
                finally:
                    c.drop(timeout)
            self._whole = whole
        return self._whole

    def drop(self, timeout: Optional[float] = None) -> None:
        """READY (or READING) -> ON_TIER without writing (the state was only read)."""
        self._whole = None
        for c in self.chunks:
            c.drop(timeout)

    def overwrite(self, fill, timeout: Optional[float] = None) -> None:
        """Replace the whole state: ``fill(buf)`` writes every byte of the whole layout (no
        read from NVMe first); the NVME tier writes it back (-> WRITING; a chunked state's
        chunks are written one by one and waited for, -> ON_TIER)."""
        if not self.chunked:
            return self.chunks[0].overwrite(fill, timeout)
        self._whole = None
        whole = torch.empty(self.nbytes, dtype=torch.uint8)
        fill(whole)
        for c in self.chunks:
            c.overwrite(lambda buf, c=c: self._copy(c, buf, whole, into_whole=False), timeout)
            c.reclaim(block=True, timeout=timeout)

    def reclaim(self, block: bool = True, timeout: Optional[float] = None) -> bool:
        """Every chunk's write completed (see ``StateChunk.reclaim``)."""
        return all([c.reclaim(block, timeout) for c in self.chunks])

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
