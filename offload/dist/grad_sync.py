"""Gradient reduction across ranks, per block, in one fixed order on every rank.

Blocks complete in backward in whatever order autograd runs them; the collectives must not
depend on it. ``ready(block)`` marks a block complete and issues the collectives of every
block whose turn has come along ``order`` (reverse block index: the order backward usually
completes them), asynchronously, so they overlap the rest of backward. The block's
optimizer job calls ``wait(block)`` before it reads the gradients.

Per stage (W ranks, the block's padded flat of P elements, shard S = P / W):

* 0: at the accumulation boundary, all-reduce the full gradient buffer, then / W;
* 1: at the boundary, reduce-scatter the full buffer into this rank's shard of it, / W
  (each rank steps its shard only: the same result as all-reduce at half the bytes);
* 2, 3: every backward, reduce-scatter the transient full landing buffer; the shard, / W,
  is added into the shard-size accumulation buffer and the landing buffer is freed.

With one rank the collectives are no-ops; stages 2 and 3 still land in a transient buffer.
Lifetimes: a landing buffer lives from its block's first gradient until ``wait`` has added
its shard; a full buffer (stages 0, 1) is read by collectives until ``wait`` returns.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Sequence

from offload.core.block import Block
from offload.dist.comm import Comm, _Work
from offload.core.telemetry import Telemetry


class _Pending:
    def __init__(self, work: _Work, finish):
        self.work, self.finish = work, finish
        self._lock = threading.Lock()
        self.done = False

    def wait(self) -> None:
        with self._lock:
            if self.done:
                return
            self.work.wait()
            self.finish()
            self.done = True


class GradSync:
    def __init__(self, comm: Comm, blocks: Sequence[Block], stage: int, telemetry: Telemetry):
        self.comm = comm
        self.blocks = list(blocks)
        self.stage = stage
        self.telemetry = telemetry
        self.order = list(reversed(self.blocks))   # collectives issued in this fixed order
        self._ready: set = set()
        self._cursor = 0
        self._reduce = False
        self._pending: Dict[Block, _Pending] = {}

    def begin(self, boundary: bool) -> None:
        """A backward starts; ``boundary``: it closes an accumulation window."""
        self._ready = set()
        self._cursor = 0
        self._reduce = boundary or self.stage >= 2

    def ready(self, block: Block) -> List[Block]:
        """``block``'s gradients of this backward are complete. Returns the blocks whose
        collectives were issued now, in order."""
        self._ready.add(block)
        issued = []
        while self._cursor < len(self.order) and self.order[self._cursor] in self._ready:
            b = self.order[self._cursor]
            self._cursor += 1
            if self._reduce:
                self._issue(b)
            issued.append(b)
        return issued

    def _issue(self, b: Block) -> None:
        segs = b.layout.segments
        w = self.comm.world
        what = f"grad reduce of block {b.index} ({b.name})"
        with self.telemetry.span("offload::grad_reduce"):
            if self.stage >= 2:
                land = b.landing
                land.wait_landed()
                if not self.comm.active and not land.any_landed:
                    land.reset_window()       # no gradient at all: the block skips this window
                    return
                land.fill_missing(segs)
                full = land.tensor
                s0, s1 = b.shard
                out = full.new_empty(s1 - s0)     # reduce_scatter writes here (no aliasing)
                work = self.comm.reduce_scatter(out, full, what, async_op=True)

                def finish(b=b, out=out):
                    if w > 1:
                        out.div_(w)
                    b.grads.land_whole(out)
                    b.landing.reset_window()
            else:
                g = b.grads
                if not self.comm.active:
                    return                    # no collective: the update waits for the landing
                g.wait_landed()
                g.fill_missing(segs)
                full = g.tensor
                if self.stage == 0:
                    work = self.comm.all_reduce(full, what, async_op=True)

                    def finish(full=full):
                        full.div_(w)
                else:
                    s0, s1 = b.shard
                    out = full.new_empty(s1 - s0)
                    work = self.comm.reduce_scatter(out, full, what, async_op=True)

                    def finish(full=full, out=out, s0=s0, s1=s1):
                        full[s0:s1].copy_(out.div_(w))
        self._pending[b] = _Pending(work, finish)

    def wait(self, block: Block) -> None:
        """The block's reduced gradients are in its buffer (any thread)."""
        p = self._pending.get(block)
        if p is not None:
            p.wait()
            self._pending.pop(block, None)

    def wait_all(self) -> None:
        for b in list(self._pending):
            self.wait(b)

    def reopen(self) -> None:
        """Another backward joins the micro-step whose collectives were issued (stages 0, 1 at
        the boundary): wait for them, then keep what can be reduced again. Stage 0 keeps the
        mean (every rank holds the same values, so after the next backward a second mean
        gives mean(g1) + mean(g2)); stage 1 drops the scattered shard and keeps the local
        sums, reduced again after the next backward. Stages 2 and 3 reduce every backward
        into the shard (a sum): they only finish."""
        for i in list(self._pending):
            p = self._pending.pop(i)
            if self.stage == 1:
                p.work.wait()             # the full buffer still holds this rank's own sums
            else:
                p.wait()

    def discard(self) -> None:
        """The window's gradients are thrown away: wait for the collectives in flight (they
        read the buffers) and keep nothing they produce."""
        for i in list(self._pending):
            self._pending.pop(i).work.wait()
