"""Parameter offload: blocks live on their home tier and visit the device around each use.

This is a participant of the engine's hook owner (core/hooks.py), which installs every
hook and calls the verbs below. Uses are found three ways, all ending in ``materialize(block)``:
  * ``pre_forward(block)``: a module that owns (or shares, for tied weights) a block's parameters
    starts; ``post_forward(block)`` releases the block unless the trace uses it again soon;
  * the saved-tensor chain (``pack`` / ``unpack``): autograd does not keep a device parameter
    (or a view of one) from forward to backward; it keeps a handle, and backward
    materializes the block again;
  * ``param_read(p)``: a parameter read outside its module's forward
    (``F.linear(x, self.embed.weight)`` in a parent's forward).
In backward a block is released once all its gradients have landed (``post_backward``)
and no parameter handle of it is alive (a LoRA layer's frozen base weights are read for the
input gradient after its adapters' gradients landed: released at the gradients, the whole
block would be read again for them). A handle (``_Handle``) lives exactly as long as autograd
keeps the saved tensor: it is dropped once the node that saved it has run (or its graph is
freed), so "no handle alive" is "the backward that reads its saved tensors is done". This
handler is innermost (core/hooks.py): parameters saved inside ``torch.utils.checkpoint``
regions and by their recomputation (reentrant or not) are handles too, so a block re-entered
by recomputation stays on the device from the recompute until the backward that reads what
it saved is done; a block evicted meanwhile (the budget holds) is fetched again by the
unpack. A block (core/block.py ``Block``) has its trainable part and its frozen parts (one
per dtype), moved together.

The device budget is a contract on the bytes of offloaded parameters on the device,
prefetches in flight included: blocks not in use are evicted furthest-next-use first, and
``working_set`` (params/budget.py: the blocks a module's forward needs at once, its own and
those of enclosing modules and tied parameters) is checked against it at ``initialize``. A use that would still
exceed it (parameters of a third block read outside any module of theirs) raises
``DeviceBudgetError`` with the bytes needed; it never runs over silently. The blocks one torch
op reads outside their modules are held until the op returns (``param_read`` /
``param_read_done``), so fetching the second cannot evict the first.

What is read ahead of use is params/prefetch.py's ``Prefetcher``; which updated blocks stay
staged for the next forward, params/write_through.py; checkpoints read and write the frozen
parts through params/frozen_io.py.
"""
from __future__ import annotations

import math
import weakref
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from offload import device as dev
from offload.core.block import Block
from offload.core.hooks import NOT_MINE, in_backward
from offload.core.errors import BlockError
from offload.core.telemetry import Telemetry
from offload.params.budget import DeviceBudgetError
from offload.units import fmt_exact
from offload.params.frozen_io import FrozenIO
from offload.params.part import ParamState
from offload.params.prefetch import Prefetcher


class _Handle:
    """What autograd keeps of a saved parameter (or view of one): where it lies in block
    ``i``'s part ``k``. Weakly referenced by the block's live set; its death ends the save."""
    __slots__ = ("i", "k", "rel", "shape", "stride", "__weakref__")

    def __init__(self, i: int, k: int, rel: int, shape: tuple, stride: tuple):
        self.i, self.k, self.rel, self.shape, self.stride = i, k, rel, shape, stride


class ParamOffload:
    innermost = True      # its saved-tensor handler claims parameters inside checkpoint's contexts too

    def __init__(self, blocks: Sequence[Block], *, failures, telemetry: Telemetry, device: torch.device,
                 one_rank: bool, deterministic: bool, budget: int, device_lookahead: int, host_lookahead: int,
                 prefetch: bool, write_through):
        """``blocks``: the engine's blocks (``blocks[i].index == i``); those with ``parts`` are
        offloaded. ``failures``: the optimizer pipeline, whose recorded failure is raised at
        every use. ``write_through``: the commit's ``WriteThrough`` plan, which this object
        makes (``plan_write_through``) and the parameter write-back reads.
        ``deterministic``: ZeRO-3 across ranks (``Prefetcher``)."""
        self.blocks = list(blocks)
        self.offloaded = [b for b in self.blocks if b.parts]
        self.failures = failures
        self.telemetry = telemetry
        self.budget = budget
        self.busy = False
        self._h2d = dev.new_stream(device)
        self._one_rank = one_rank
        self.write_through = write_through
        self._owner: Dict[int, Block] = {id(s.param): b for b in self.offloaded for _, s in b.segments}
        self.prefetcher = Prefetcher(self.offloaded, budget=budget, device_lookahead=device_lookahead,
                                     host_lookahead=host_lookahead, enabled=prefetch,
                                     telemetry=telemetry, h2d_stream=self._h2d,
                                     blocked=self._update_in_flight, deterministic=deterministic)
        self.resident_bytes = 0          # parameters that always stay on the device
        self.peak_step = 0               # peak device parameter bytes in the current step
        self.peak_last = 0               # ... in the last completed step
        self.peak_all = 0                # ... in any completed step
        self.overruns = 0
        self._by_storage: Dict[int, List[Block]] = {}   # storage address -> blocks bound in it
        # block -> its parameter handles packed since the last root forward began and still
        # alive (autograd drops a handle once its node has run): post_backward keeps a block
        # while any is, in ``_kept`` until the last goes
        self._live: Dict[Block, weakref.WeakSet] = {}
        self._kept: set = set()                       # of Blocks
        self.saved_tensors = self                     # joins the saved-tensor chain (pack/unpack)
        self.frozen_io = FrozenIO(self.offloaded, self._release)   # checkpoints' reads and writes

    # ---- lifecycle verbs (called by core/hooks.py) ---------------------------------------
    def begin_forward(self, recompute: bool) -> None:
        if not recompute:
            self._live = {}                # handles of an earlier graph are not waited for
            self._kept.clear()
            self.rewind()

    def _saved_alive(self, block: Block) -> bool:
        live = self._live.get(block)
        return live is not None and len(live) > 0

    def pre_forward(self, block: Block) -> None:
        if not block.parts:
            return
        self.materialize(block)
        block.users += 1

    def post_forward(self, block: Block) -> None:
        if not block.parts:
            return
        block.users = max(0, block.users - 1)
        if block.users == 0 and not in_backward() and \
                not self.prefetcher.next_use_within(block, self.prefetcher.device_lookahead):
            self._release(block)

    def grad_ready(self, block: Block, k: int) -> None:
        """AccumulateGrad lays a new gradient out like its parameter, so while it runs a
        released parameter wears a shape-only stub (stride-0, one element); right after
        (``grad_accumulated``), it is the empty placeholder again."""
        part = block.trainable
        if part is not None and part.state is not ParamState.ON_DEVICE:
            seg = part.layout.segments[k]
            seg.param.data = torch.zeros((), dtype=part.dtype, device=part.device).expand(seg.shape)

    def grad_accumulated(self, block: Block, k: int, param) -> None:
        part = block.trainable
        if part is not None and part.state is not ParamState.ON_DEVICE:
            param.data = part.placeholder

    def post_backward(self, block: Block) -> None:
        # kept while handles of its saved parameters live (frozen weights used for the input
        # gradient after the last adapter's gradient landed; a recomputed block's saves), or
        # when the trace uses it again soon; a kept block is evicted like any other under
        # the budget, and released by a later sweep once its handles are gone
        if block.parts and block.users == 0:
            if self._saved_alive(block):
                self._kept.add(block)
            elif not self.prefetcher.next_use_within(block, self.prefetcher.device_lookahead):
                self._release(block)
        self._sweep_kept()

    def end_backward(self) -> None:
        self._sweep_kept()

    def _sweep_kept(self, but: Optional[Block] = None) -> None:
        """Release the blocks kept past their backward whose saved handles are all gone."""
        for b in [b for b in self._kept if b is not but and not self._saved_alive(b)]:
            self._kept.discard(b)
            if b.users == 0 and not self.prefetcher.next_use_within(b, self.prefetcher.device_lookahead):
                self._release(b)

    def release_before_update(self, block: Block) -> None:
        """``block``'s gradients are all in and its update is about to be computed ahead
        (optim/ahead.py), into the buffer its home may hold as the staged copy: that copy,
        stale once the update is committed, goes now unless something still uses it. Never
        waits: a write-back still in flight keeps the buffer until it completes (WRITING),
        which the update's job waits for on its worker."""
        if not block.parts or block.users or self._saved_alive(block):
            return
        if block.writing:
            try:
                block.poll_write()
            except BlockError:             # recorded by its home: raised from the next call
                pass
        self._release(block)

    def param_read(self, p: nn.Parameter):
        """A parameter reached a torch function outside its module's forward: its block on
        the device, held until the op returns (``param_read_done`` with what this returns)."""
        if self.busy:
            return None
        b = self._owner.get(id(p))
        if b is None:
            return None
        if b.residency is not ParamState.ON_DEVICE:
            self.telemetry.count("param_reads_outside_forward")
            self.materialize(b)
        b.users += 1
        return b

    def param_read_done(self, held) -> None:
        for b in held:
            if b is not None:
                b.users -= 1

    # ---- the saved-tensor chain: parameters (and views of them) become handles ----------------
    def pack(self, t: torch.Tensor):
        if not self.offloaded or t.layout is not torch.strided or t.device.type == "meta":
            return NOT_MINE
        ptr = t.untyped_storage().data_ptr()
        for b in self._by_storage.get(ptr, ()):       # blocks materialized in this storage
            for k, part in enumerate(b.parts):
                buf = part.device_buf
                if buf is not None and buf.untyped_storage().data_ptr() == ptr and buf.dtype == t.dtype:
                    rel = t.storage_offset() - buf.storage_offset()
                    if 0 <= rel < part.numel:
                        h = _Handle(b.index, k, rel, tuple(t.shape), tuple(t.stride()))
                        self._live.setdefault(b, weakref.WeakSet()).add(h)
                        return h
        return NOT_MINE

    def unpack(self, h: _Handle) -> torch.Tensor:
        """The saved parameter from the block's current device copy (fetched again if it was
        evicted); the block stays while ``h`` lives, i.e. until the node reading it has run."""
        b = self.blocks[h.i]
        self._sweep_kept(but=b)
        self.materialize(b)
        buf = b.parts[h.k].device_buf
        return buf.as_strided(h.shape, h.stride, buf.storage_offset() + h.rel)

    # ---- residency ----------------------------------------------------------------------------
    def _update_in_flight(self, block: Block) -> bool:
        fut = block.update.future
        if self.prefetcher.deterministic:      # queued, whether or not done: timing-free
            return fut is not None
        # a failed update stays pending: its home copy is not to be read (the use raises it)
        return fut is not None and (not fut.done() or fut.exception() is not None)

    def materialize(self, block: Block) -> None:
        """``block`` (every part) on the device, current (waits for its update and its copies). An
        earlier failure of any block's update or write-back is raised here first, naming that
        block.

        A use that repeats the last one (the next module of the same block, the next saved
        parameter of it that backward unpacks: most of a step's uses) of a block on
        the device fetches nothing: the write-backs are settled, the lookahead windows
        advanced and the peak noted only at a new use or a fetch, each a walk over the blocks."""
        bp = block
        new_use = self.prefetcher.request(block)
        if new_use:
            self.poll_writes()
        self.failures.raise_failure()
        self.busy = True
        try:
            if block.update.future is not None:
                with self.telemetry.span("offload::wait_update"):
                    block.wait_update()
            if bp.stale:
                self._release(block)         # the optimizer wrote the home copy since
            for part in bp.parts:
                if part.state is ParamState.WRITING:
                    with self.telemetry.span("offload::param_write_wait"):
                        part.finish_write()  # read back once written (bounded)
            fetch = bp.residency is not ParamState.ON_DEVICE
            if fetch:
                self._make_room(block, bp.nbytes - bp.device_bytes)
                self.telemetry.count("param_fetched_bytes", bp.nbytes - bp.device_bytes)
                with self.telemetry.span("offload::param_fetch", "h2d") as span:
                    span.moved(bp.ensure(self._h2d))
                for buf in bp.device_bufs():
                    holders = self._by_storage.setdefault(buf.untyped_storage().data_ptr(), [])
                    if block not in holders:
                        holders.append(block)  # for pack; entries are checked on use
            if new_use or fetch:
                self.prefetcher.issue()
                self._note_peak()
        finally:
            self.busy = False

    def _make_room(self, want: Block, nbytes: int) -> None:
        """Evict unused blocks, furthest next use first, until ``want`` fits in the device
        budget and (NVMe home) holds a host staging buffer (its read started)."""
        bp_want = want
        while True:
            self.poll_writes()
            over = self.resident_bytes + self.prefetcher.device_bytes() + nbytes > self.budget
            no_slot = bp_want.on_nvme and bp_want.residency is ParamState.HOME and not bp_want.slot_free()
            if not over and not no_slot:
                # the slot is taken now (its read starts): a worker's write-through could
                # otherwise take it before the fetch, which would then wait for a buffer that
                # only this thread's polls give back
                if bp_want.on_nvme and bp_want.residency is ParamState.HOME and not bp_want.stage():
                    continue
                return
            upcoming = self.prefetcher.upcoming()
            # a block whose update is in flight may be filling its staging buffer (write-through)
            held = [b for b in self.offloaded if b is not want and b.users == 0
                    and b.residency not in (ParamState.HOME, ParamState.WRITING)]
            waiting = [b for b in held if self._update_in_flight(b)]
            victims = [b for b in held if b not in waiting and (b.device_bytes > 0 or not over)]
            if not victims and waiting:
                with self.telemetry.span("offload::wait_update"):
                    waiting[0].wait_update()    # bounded: the job's waits are
                continue
            # released, their staging buffers come back once their write-backs complete
            writing = [b for b in self.offloaded if b.residency is ParamState.WRITING]
            if not victims and no_slot and writing:
                with self.telemetry.span("offload::param_write_wait"):
                    writing[0].finish_write()   # bounded
                continue
            if not victims:
                if no_slot:
                    raise DeviceBudgetError(
                        f"no host staging buffer is free for block {bp_want.name!r}: every buffer holds a "
                        f"block in use; raise offload_param.device_budget_bytes or prefetch.host_lookahead_bytes")
                in_use = [b for b in self.offloaded if b.device_bytes > 0]
                need = sum(b.device_bytes for b in in_use) + nbytes + self.resident_bytes
                self.overruns += 1
                raise DeviceBudgetError(
                    f"offload_param.device_budget_bytes={self.budget} cannot hold block {bp_want.name!r} "
                    f"({fmt_exact(nbytes)}) beside the blocks in use now "
                    f"({', '.join(b.name for b in in_use)}): {fmt_exact(need)} are needed at once "
                    f"(a parameter read outside the modules of its block); raise the budget to at least {need}")

            def next_use(b):
                return upcoming.index(b) if b in upcoming else math.inf
            self._release(max(victims, key=next_use))

    def _release(self, block: Block) -> None:
        self.busy = True
        try:
            for buf in block.device_bufs():
                holders = self._by_storage.get(buf.untyped_storage().data_ptr())
                if holders and block in holders:
                    holders.remove(block)
            block.release()
        finally:
            self.busy = False

    def _note_peak(self) -> None:
        now = self.prefetcher.device_bytes() + self.resident_bytes
        if now > self.peak_step:
            self.peak_step = now

    # ---- step boundaries --------------------------------------------------------------------------
    def rewind(self) -> None:
        """A new forward starts: close the last step's accounting, restart the trace."""
        if self.peak_step:
            self.peak_last = self.peak_step
            self.peak_all = max(self.peak_all, self.peak_step)
        self.peak_step = 0
        self._note_peak()
        self.prefetcher.rewind()

    def plan_write_through(self) -> None:
        """Before a commit queues the updates: device copies the commit makes stale go now,
        not after the updates are queued (an update that finds its block on the device cannot
        keep the new copy staged); then the write-through plan (params/write_through.py) over
        the order the next forward is expected to follow, within the device budget plus the
        host lookahead; none across ranks (decisions there must not depend on free buffers)."""
        pf = self.prefetcher
        for b in self.offloaded:
            if b.users == 0 and b.device_bytes and b.trainable is not None:
                self._release(b)
        order = pf.next_order() if pf.enabled and self._one_rank else None
        self.write_through.plan(order, self.budget + pf.host_lookahead)

    def after_step(self) -> None:
        """Updates are queued: drop device copies they make stale, prefetch the next forward."""
        for b in self.offloaded:
            if b.users == 0 and b.device_bytes and b.update.future is not None:
                self._release(b)
        self.prefetcher.rewind()
        self.prefetcher.issue()

    def device_param_bytes_peak(self) -> int:
        """The most device parameter bytes at any point since initialize."""
        return max(self.peak_all, self.peak_step)

    def poll_writes(self) -> None:
        """Settle the parameter write-backs that completed (their buffers go back); never
        waits. A failure is recorded by its block's home (raised from the next engine call)."""
        self._settle_writes(wait=False)

    def wait_writes(self) -> None:
        """Wait (bounded) until every parameter write-back has completed or failed (a failure
        is recorded by its block's home; the caller raises the first one)."""
        self._settle_writes(wait=True)

    def _settle_writes(self, wait: bool) -> None:
        for b in self.offloaded:
            if b.writing:
                try:
                    b.finish_write() if wait else b.poll_write()
                except BlockError:
                    pass

    def release_all(self) -> None:
        for b in self.offloaded:
            self._release(b)

    def close(self) -> None:
        """Every block released and every buffer back: write-backs in flight are waited for
        (bounded; their failures were recorded or are moot now), never raised from here."""
        self.wait_writes()
        for b in self.offloaded:
            b.release()
        for _, part in self.frozen_io.parts():
            if part.flats is not None:
                part.flats.clear()            # the dequantized flats kept for reuse go too


