"""Parameter offload: blocks live on their home tier and visit the device around each use.

This is a participant of the engine's hook owner (core/hooks.py), which installs every
hook and calls the verbs below. Uses are found three ways, all ending in ``materialize(block)``:
  * ``pre_forward(i)``: a module that owns (or shares, for tied weights) a block's parameters
    starts; ``post_forward(i)`` releases the block unless the trace uses it again soon;
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
unpack. A block is a ``BlockParts``: its trainable part and its frozen parts (one per dtype)
move together.

The device budget is a contract on the bytes of offloaded parameters on the device,
prefetches in flight included: blocks not in use are evicted furthest-next-use first, and
``working_set`` (the blocks a module's forward needs at once: its own and those of enclosing
modules and tied parameters) is checked against it at ``initialize``. A use that would still
exceed it (parameters of a third block read outside any module of theirs) raises
``DeviceBudgetError`` with the bytes needed; it never runs over silently. The blocks one torch
op reads outside their modules are held until the op returns (``param_read`` /
``param_read_done``), so fetching the second cannot evict the first.

What is read ahead of use is the ``Prefetcher`` (at the end of this file): the recorded order
of block uses, over core/lookahead.py, kept in flight within the lookahead bytes.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from offload import device as dev
from offload.core.hooks import NOT_MINE, in_backward
from offload.core.errors import BlockError, BudgetError
from offload.core.lookahead import Lookahead
from offload.core.telemetry import Telemetry
from offload.params.residency import BlockParts, ParamState
from offload.units import fmt_exact


class DeviceBudgetError(RuntimeError, BudgetError):
    """offload_param.device_budget_bytes cannot hold the parameters needed at once."""


class _Handle:
    """What autograd keeps of a saved parameter (or view of one): where it lies in block
    ``i``'s part ``k``. Weakly referenced by the block's live set; its death ends the save."""
    __slots__ = ("i", "k", "rel", "shape", "stride", "__weakref__")

    def __init__(self, i: int, k: int, rel: int, shape: tuple, stride: tuple):
        self.i, self.k, self.rel, self.shape, self.stride = i, k, rel, shape, stride


def working_set(model: nn.Module, owner: Dict[int, int], module_of: Sequence[nn.Module],
                nbytes: Sequence[int]) -> tuple:
    """(bytes, blocks) of the largest set of blocks that one module's forward needs on the
    device at once: the blocks whose parameters the module holds (tied ones included) or
    whose root it is, together with those of every enclosing module with such hooks (a
    parent block stays in use while its children run). ``owner`` maps ``id(param)`` to its
    block, ``module_of[i]`` is block i's root module, ``nbytes[i]`` its device bytes."""
    roots = {id(m): i for i, m in enumerate(module_of)}
    best = (0, ())

    def visit(m: nn.Module, above: frozenset) -> None:
        nonlocal best
        used = {owner[id(p)] for p in m.parameters(recurse=False) if id(p) in owner}
        if id(m) in roots:
            used.add(roots[id(m)])
        here = above | used
        total = sum(nbytes[i] for i in here)
        if total > best[0]:
            best = (total, tuple(sorted(here)))
        for c in m.children():
            visit(c, here)
    visit(model, frozenset())
    return best


class ParamOffload:
    innermost = True      # its saved-tensor handler claims parameters inside checkpoint's contexts too

    def __init__(self, engine, params: List[Optional[BlockParts]], *, budget: int, device_lookahead: int,
                 host_lookahead: int, prefetch: bool):
        self.engine = engine
        self.params = params
        self.budget = budget
        self.busy = False
        self._h2d = dev.new_stream(engine.device)
        self._one_rank = not engine.comm.active   # fixed: read once, not on the step's path
        self._owner: Dict[int, int] = {id(s.param): i for i, bp in enumerate(params) if bp is not None
                                       for _, s in bp.segments}
        self.prefetcher = Prefetcher(params, budget=budget, device_lookahead=device_lookahead,
                                     host_lookahead=host_lookahead, enabled=prefetch,
                                     telemetry=engine.telemetry, h2d_stream=self._h2d,
                                     blocked=self._update_in_flight,
                                     deterministic=engine.comm.active and engine.stage == 3)
        self.resident_bytes = 0          # parameters that always stay on the device
        self.peak_step = 0               # peak device parameter bytes in the current step
        self.peak_last = 0               # ... in the last completed step
        self.peak_all = 0                # ... in any completed step
        self.overruns = 0
        self._by_storage: Dict[int, List[int]] = {}   # storage address -> blocks bound in it
        self._keep: frozenset = frozenset()           # blocks written through (plan_write_through)
        # block -> its parameter handles packed since the last root forward began and still
        # alive (autograd drops a handle once its node has run): post_backward keeps a block
        # while any is, in ``_kept`` until the last goes
        self._live: Dict[int, weakref.WeakSet] = {}
        self._kept: set = set()
        self.saved_tensors = self                     # joins the saved-tensor chain (pack/unpack)

    # ---- lifecycle verbs (called by core/hooks.py) ---------------------------------------
    def begin_forward(self, recompute: bool) -> None:
        if not recompute:
            self._live = {}                # handles of an earlier graph are not waited for
            self._kept.clear()
            self.rewind()

    def _saved_alive(self, i: int) -> bool:
        live = self._live.get(i)
        return live is not None and len(live) > 0

    def pre_forward(self, i: int) -> None:
        if self.params[i] is None:
            return
        self.materialize(i)
        self.params[i].users += 1

    def post_forward(self, i: int) -> None:
        bp = self.params[i]
        if bp is None:
            return
        bp.users = max(0, bp.users - 1)
        if bp.users == 0 and not in_backward() and \
                not self.prefetcher.next_use_within(i, self.prefetcher.device_lookahead):
            self._release(i)

    def grad_ready(self, i: int, k: int) -> None:
        """AccumulateGrad lays a new gradient out like its parameter, so while it runs a
        released parameter wears a shape-only stub (stride-0, one element); right after
        (``grad_accumulated``), it is the empty placeholder again."""
        bp = self.params[i]
        part = bp.trainable if bp is not None else None
        if part is not None and part.state is not ParamState.ON_DEVICE:
            seg = part.layout.segments[k]
            seg.param.data = torch.zeros((), dtype=part.dtype, device=part.device).expand(seg.shape)

    def grad_accumulated(self, i: int, k: int, param) -> None:
        bp = self.params[i]
        part = bp.trainable if bp is not None else None
        if part is not None and part.state is not ParamState.ON_DEVICE:
            param.data = part.placeholder

    def post_backward(self, i: int) -> None:
        bp = self.params[i]
        # kept while handles of its saved parameters live (frozen weights used for the input
        # gradient after the last adapter's gradient landed; a recomputed block's saves), or
        # when the trace uses it again soon; a kept block is evicted like any other under
        # the budget, and released by a later sweep once its handles are gone
        if bp is not None and bp.users == 0:
            if self._saved_alive(i):
                self._kept.add(i)
            elif not self.prefetcher.next_use_within(i, self.prefetcher.device_lookahead):
                self._release(i)
        self._sweep_kept()

    def end_backward(self) -> None:
        self._sweep_kept()

    def _sweep_kept(self, but: int = -1) -> None:
        """Release the blocks kept past their backward whose saved handles are all gone."""
        for j in [j for j in self._kept if j != but and not self._saved_alive(j)]:
            self._kept.discard(j)
            if self.params[j].users == 0 and not self.prefetcher.next_use_within(j, self.prefetcher.device_lookahead):
                self._release(j)

    def release_before_update(self, i: int) -> None:
        """Block ``i``'s gradients are all in and its update is about to be computed ahead
        (optim/ahead.py), into the buffer its home may hold as the staged copy: that copy,
        stale once the update is committed, goes now unless something still uses it. Never
        waits: a write-back still in flight keeps the buffer until it completes (WRITING),
        which the update's job waits for on its worker."""
        bp = self.params[i]
        if bp is None or bp.users or self._saved_alive(i):
            return
        if bp.writing:
            try:
                bp.poll_write()
            except BlockError:             # recorded by its home: raised from the next call
                pass
        self._release(i)

    def param_read(self, p: nn.Parameter):
        """A parameter reached a torch function outside its module's forward: its block on
        the device, held until the op returns (``param_read_done`` with what this returns)."""
        if self.busy:
            return None
        i = self._owner.get(id(p))
        if i is None:
            return None
        if self.params[i].state is not ParamState.ON_DEVICE:
            self.telemetry.count("param_reads_outside_forward")
            self.materialize(i)
        self.params[i].users += 1
        return i

    def param_read_done(self, held) -> None:
        for i in held:
            if i is not None:
                self.params[i].users -= 1

    # ---- the saved-tensor chain: parameters (and views of them) become handles ----------------
    def pack(self, t: torch.Tensor):
        if not self.params or t.layout is not torch.strided or t.device.type == "meta":
            return NOT_MINE
        ptr = t.untyped_storage().data_ptr()
        for i in self._by_storage.get(ptr, ()):       # blocks materialized in this storage
            for k, part in enumerate(self.params[i].parts):
                buf = part.device_buf
                if buf is not None and buf.untyped_storage().data_ptr() == ptr and buf.dtype == t.dtype:
                    rel = t.storage_offset() - buf.storage_offset()
                    if 0 <= rel < part.numel:
                        h = _Handle(i, k, rel, tuple(t.shape), tuple(t.stride()))
                        self._live.setdefault(i, weakref.WeakSet()).add(h)
                        return h
        return NOT_MINE

    def unpack(self, h: _Handle) -> torch.Tensor:
        """The saved parameter from the block's current device copy (fetched again if it was
        evicted); the block stays while ``h`` lives, i.e. until the node reading it has run."""
        self._sweep_kept(but=h.i)
        self.materialize(h.i)
        buf = self.params[h.i].parts[h.k].device_buf
        return buf.as_strided(h.shape, h.stride, buf.storage_offset() + h.rel)

    @property
    def telemetry(self):
        return self.engine.telemetry

    # ---- residency ----------------------------------------------------------------------------
    def _block(self, i: int):
        """The engine's block i (its optimizer side), or None for a frozen-only block."""
        blocks = self.engine.blocks
        return blocks[i] if i < len(blocks) else None

    def _update_in_flight(self, i: int) -> bool:
        block = self._block(i)
        fut = block.pending if block is not None else None
        if self.prefetcher.deterministic:      # queued, whether or not done: timing-free
            return fut is not None
        # a failed update stays pending: its home copy is not to be read (the use raises it)
        return fut is not None and (not fut.done() or fut.exception() is not None)

    def materialize(self, i: int) -> None:
        """Block ``i`` (every part) on the device, current (waits for its update and its copies). An
        earlier failure of any block's update or write-back is raised here first, naming that
        block.

        A use that repeats the last one (the next module of the same block, the next saved
        parameter of it that backward unpacks: most of a step's uses) of a block on
        the device fetches nothing: the write-backs are settled, the lookahead windows
        advanced and the peak noted only at a new use or a fetch, each a walk over the blocks."""
        bp = self.params[i]
        new_use = self.prefetcher.request(i)
        if new_use:
            self.poll_writes()
        self.engine.pipeline.raise_failure()
        self.busy = True
        try:
            block = self._block(i)
            if block is not None and block.pending is not None:
                with self.telemetry.span("offload::wait_update"):
                    block.wait_update()
            if bp.stale:
                self._release(i)             # the optimizer wrote the home copy since
            for part in bp.parts:
                if part.state is ParamState.WRITING:
                    with self.telemetry.span("offload::param_write_wait"):
                        part.finish_write()  # read back once written (bounded)
            fetch = bp.state is not ParamState.ON_DEVICE
            if fetch:
                self._make_room(i, bp.nbytes - bp.device_bytes)
                self.telemetry.count("param_fetched_bytes", bp.nbytes - bp.device_bytes)
                with self.telemetry.span("offload::param_fetch", "h2d") as span:
                    span.moved(bp.ensure(self._h2d))
                for buf in bp.device_bufs():
                    holders = self._by_storage.setdefault(buf.untyped_storage().data_ptr(), [])
                    if i not in holders:
                        holders.append(i)      # for pack; entries are checked on use
            if new_use or fetch:
                self.prefetcher.issue()
                self._note_peak()
        finally:
            self.busy = False

    def _make_room(self, want: int, nbytes: int) -> None:
        """Evict unused blocks, furthest next use first, until ``want`` fits in the device
        budget and (NVMe home) holds a host staging buffer (its read started)."""
        bp_want = self.params[want]
        while True:
            self.poll_writes()
            over = self.resident_bytes + self.prefetcher.device_bytes() + nbytes > self.budget
            no_slot = bp_want.on_nvme and bp_want.state is ParamState.HOME and not bp_want.slot_free()
            if not over and not no_slot:
                # the slot is taken now (its read starts): a worker's write-through could
                # otherwise take it before the fetch, which would then wait for a buffer that
                # only this thread's polls give back
                if bp_want.on_nvme and bp_want.state is ParamState.HOME and not bp_want.stage():
                    continue
                return
            upcoming = self.prefetcher.upcoming()
            # a block whose update is in flight may be filling its staging buffer (write-through)
            held = [j for j, bp in enumerate(self.params) if bp is not None and j != want and bp.users == 0
                    and bp.state not in (ParamState.HOME, ParamState.WRITING)]
            waiting = [j for j in held if self._update_in_flight(j)]
            victims = [j for j in held if j not in waiting and (self.params[j].device_bytes > 0 or not over)]
            if not victims and waiting:
                with self.telemetry.span("offload::wait_update"):
                    self._block(waiting[0]).wait_update()    # bounded: the job's waits are
                continue
            # released, their staging buffers come back once their write-backs complete
            writing = [j for j, bp in enumerate(self.params) if bp is not None and bp.state is ParamState.WRITING]
            if not victims and no_slot and writing:
                with self.telemetry.span("offload::param_write_wait"):
                    self.params[writing[0]].finish_write()   # bounded
                continue
            if not victims:
                if no_slot:
                    raise DeviceBudgetError(
                        f"no host staging buffer is free for block {bp_want.name!r}: every buffer holds a "
                        f"block in use; raise offload_param.device_budget_bytes or prefetch.host_lookahead_bytes")
                in_use = [j for j, bp in enumerate(self.params) if bp is not None and bp.device_bytes > 0]
                need = sum(self.params[j].device_bytes for j in in_use) + nbytes + self.resident_bytes
                self.overruns += 1
                raise DeviceBudgetError(
                    f"offload_param.device_budget_bytes={self.budget} cannot hold block {bp_want.name!r} "
                    f"({fmt_exact(nbytes)}) beside the blocks in use now "
                    f"({', '.join(self.params[j].name for j in in_use)}): {fmt_exact(need)} are needed at once "
                    f"(a parameter read outside the modules of its block); raise the budget to at least {need}")

            def next_use(j):
                return upcoming.index(j) if j in upcoming else math.inf
            self._release(max(victims, key=next_use))

    def _release(self, i: int) -> None:
        self.busy = True
        try:
            for buf in self.params[i].device_bufs():
                holders = self._by_storage.get(buf.untyped_storage().data_ptr())
                if holders and i in holders:
                    holders.remove(i)
            self.params[i].release()
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
        """Before a commit queues the updates: the blocks whose new parameters stay staged in
        host memory after their write-back (``keeps_staged``), so the next forward reads
        them without an NVMe read. Those the next forward uses first, within the device
        budget plus the host lookahead (what the staging pool holds beside its spare slot:
        the blocks the forward would have on the device and staged ahead), when prefetch
        is on and the order known (``Prefetcher.next_order``: at the first commit, the order
        this step recorded); none across ranks (decisions there must not depend on
        free buffers). A block kept finds its staging buffer at its update or is written
        through a write buffer instead; a kept block not yet used is evicted like any
        staged block when another needs its buffer."""
        pf = self.prefetcher
        keep = set()
        # device copies the commit makes stale go now, not after the updates are queued: an
        # update that finds its block on the device cannot keep the new copy staged
        for i, bp in enumerate(self.params):
            if bp is not None and bp.users == 0 and bp.device_bytes and bp.trainable is not None:
                self._release(i)
        order = pf.next_order()
        if pf.enabled and order is not None and self._one_rank:
            seen = 0
            for i in order:
                if i in keep:
                    continue
                bp = self.params[i]
                seen += bp.nbytes
                if seen > self.budget + pf.host_lookahead:
                    break
                if bp.on_nvme:
                    keep.add(i)
        self._keep = frozenset(keep)

    def keeps_staged(self, i: int) -> bool:
        """Whether block ``i``'s write-back keeps the new home copy staged (worker threads
        read this; the main thread sets it before the updates are queued)."""
        return i in self._keep

    def after_step(self) -> None:
        """Updates are queued: drop device copies they make stale, prefetch the next forward."""
        for i, bp in enumerate(self.params):
            block = self._block(i)
            if bp is not None and bp.users == 0 and bp.device_bytes and block is not None \
                    and block.pending is not None:
                self._release(i)
        self.prefetcher.rewind()
        self.prefetcher.issue()

    def device_param_bytes_peak(self) -> int:
        """The most device parameter bytes at any point since initialize."""
        return max(self.peak_all, self.peak_step)

    def _frozen_parts(self):
        """``(block index, part)`` of every offloaded frozen part."""
        for i, bp in enumerate(self.params):
            for part in (bp.frozen if bp is not None else ()):
                yield i, part

    def read_frozen(self, wanted=None) -> Dict[int, torch.Tensor]:
        """``id(param) -> host tensor`` of every offloaded frozen parameter (those in
        ``wanted``, ids, when given), read from its home (one read per part; for checkpoints
        and state dicts)."""
        out = {}
        for _, part in self._frozen_parts():
            if wanted is not None and not any(id(s.param) in wanted for s in part.layout.segments):
                continue
            flat = part.read_home()
            for s in part.layout.segments:
                out[id(s.param)] = flat[s.offset:s.offset + s.numel].view(s.shape)
        return out

    def write_frozen(self, values: Dict[int, torch.Tensor]) -> None:
        """Replace offloaded frozen parameters' home values (``id(param) -> tensor``); parts
        with no entry keep theirs (in a part stored quantized, only the tensors given are
        quantized, the others keep their stored bytes). Device copies become stale and are
        refetched on use."""
        for i, part in self._frozen_parts():
            mine = [s for s in part.layout.segments if id(s.param) in values]
            if not mine:
                continue
            self._release(i)
            if part.codec is not None:
                home = part.codec.fill(part.read_home(raw=True), {id(s.param): values[id(s.param)] for s in mine})
            else:
                home = part.read_home()
                for s in mine:
                    home[s.offset:s.offset + s.numel].copy_(values[id(s.param)].reshape(-1))
            part.write_home(home)

    def read_frozen_quantized(self, wanted=None) -> List[Tuple[List[int], torch.Tensor, dict]]:
        """The offloaded frozen parts stored quantized (those with a parameter in ``wanted``,
        ids, when given), as stored: ``(parameter ids in part order, blob, codec.code())``
        each, so a checkpoint keeps a quantized base as it is, not its dequantized values."""
        out = []
        for _, part in self._frozen_parts():
            ids = [id(s.param) for s in part.layout.segments]
            if part.codec is not None and (wanted is None or any(i in wanted for i in ids)):
                out.append((ids, part.read_home(raw=True), part.codec.code()))
        return out

    def write_frozen_quantized(self, ids: List[int], blob: torch.Tensor, code: dict) -> bool:
        """Restore one part stored quantized from a blob ``read_frozen_quantized`` gave (the
        part holding exactly the parameters ``ids``, in order): written as it is, not
        quantized again. False (nothing written) where no part of this engine has those
        parameters laid out and coded as ``code`` says (another ``frozen_dtype``, another
        grouping): the caller restores the values instead."""
        for i, part in self._frozen_parts():
            if part.codec is None or [id(s.param) for s in part.layout.segments] != list(ids):
                continue
            if not part.codec.adopt(code):
                return False
            self._release(i)
            part.write_home(blob.view(torch.uint8)[:part.home_nbytes].contiguous())
            return True
        return False

    def frozen_ids(self) -> set:
        return {id(s.param) for bp in self.params if bp is not None for part in bp.frozen
                for s in part.layout.segments}

    def poll_writes(self) -> None:
        """Settle the parameter write-backs that completed (their buffers go back); never
        waits. A failure is recorded by its block's home (raised from the next engine call)."""
        self._settle_writes(wait=False)

    def wait_writes(self) -> None:
        """Wait (bounded) until every parameter write-back has completed or failed (a failure
        is recorded by its block's home; the caller raises the first one)."""
        self._settle_writes(wait=True)

    def _settle_writes(self, wait: bool) -> None:
        for bp in self.params:
            if bp is not None and bp.writing:
                try:
                    bp.finish_write() if wait else bp.poll_write()
                except BlockError:
                    pass

    def release_all(self) -> None:
        for i, bp in enumerate(self.params):
            if bp is not None:
                self._release(i)

    def close(self) -> None:
        """Every block released and every buffer back: write-backs in flight are waited for
        (bounded; their failures were recorded or are moot now), never raised from here."""
        self.wait_writes()
        for bp in self.params:
            if bp is not None:
                bp.release()
        for _, part in self._frozen_parts():
            if part.flats is not None:
                part.flats.clear()            # the dequantized flats kept for reuse go too


class Prefetcher:
    """Trace-based prefetch of offloaded parameter blocks, on the engine's one ``Lookahead``.

    The order of block uses (forward pre-hooks, saved parameters unpacked by backward, reads
    caught outside a module's forward) is recorded by a ``core.lookahead.Lookahead`` named
    ``prefetch``: the first step's order becomes the trace, a use off the trace diverges (served
    on demand, the new order replaces the trace at the next ``rewind``), and hits, misses,
    divergences and retraces are counted as ``prefetch_*``. What is parameter-specific lives
    here: the blocks ahead of the cursor are kept in flight on each link,

    * NVMe -> host: blocks within ``host_lookahead_bytes`` ahead are staged into host buffers;
    * host -> device: blocks within ``device_lookahead_bytes`` ahead are copied to the device,
      never beyond the device budget (bytes on the device, in flight included);

    and which passes see the next pass's start: inference passes repeat with no update between
    them (the whole trace, cyclically); training sees only the next forward's first blocks
    without a trainable part (an embedding no update changes), so their reads overlap this
    pass's end while a block with a trainable part is read only once its update is queued.

    The blocks a training forward uses first are not read back at all after an update: the
    commit marks those within ``host_lookahead_bytes`` at the start of the trace (parameter
    offload's ``plan_write_through``), and their updates assemble the new parameters in a
    staging buffer, write it through to NVMe and leave it staged, current, for that forward.

    A block is never read ahead while its optimizer update is in flight (``blocked``), so a
    prefetch never serves stale data, and nothing here waits on anything but I/O already
    issued: it cannot hang. Once the update has returned its write-back may still be in flight:
    a block kept staged (STAGED_WRITING) is served from its held buffer at once; one written
    through a write buffer (WRITING) is read back once the write has completed (polled here;
    never waited for, except when ``deterministic``).

    ``deterministic`` (ZeRO-3 across ranks, where a fetch is an all-gather that every rank must
    issue in the same order): decisions depend only on the trace, the budgets and state changed
    by the main thread, never on I/O or worker timing. A staged NVMe read is waited for rather
    than polled, and ``blocked`` must itself be timing-free (an update queued, not "in flight")."""

    def __init__(self, params: Sequence[Optional[BlockParts]], *, budget: int, device_lookahead: int,
                 host_lookahead: int, enabled: bool, telemetry: Telemetry, h2d_stream,
                 blocked: Callable[[int], bool], deterministic: bool = False):
        self.params = list(params)          # by block index; None: the block is not offloaded
        self.budget = budget
        self.device_lookahead = device_lookahead
        self.host_lookahead = host_lookahead
        self.enabled = enabled
        self.telemetry = telemetry
        self.h2d = h2d_stream
        self.blocked = blocked
        self.deterministic = deterministic
        self.lookahead = Lookahead("prefetch", telemetry)
        self._backward = False              # whether the last request came from backward
        self._head_of: Optional[list] = None   # the trace ``_frozen_head`` was counted on
        self._frozen_head = 0               # the trace's first blocks without a trainable part

    @property
    def trace(self) -> Optional[List[int]]:
        return self.lookahead.order

    def next_order(self) -> Optional[List[int]]:
        """The order the next forward is expected to follow (``Lookahead.next_order``)."""
        return self.lookahead.next_order()

    def rewind(self) -> None:
        """A new step (or forward) starts: install what was recorded, restart the cursor."""
        self.lookahead.rewind()

    def request(self, index: int) -> bool:
        """Block ``index`` is about to be used: account hit/miss, follow or leave the trace.
        False when it is the same block as the last request of the same pass (one use,
        nothing recorded). The first use in backward is a use of its own even where the
        forward ended with the same block (a tied lm_head's weight, read again by its
        backward at once): recorded, so the forward's end keeps the block for it."""
        la = self.lookahead
        backward = in_backward()
        again = backward != self._backward
        if la.last == index and not again:
            return False                        # the same block again: one use
        self._backward = backward
        la.hit() if self.params[index].state is not ParamState.HOME else la.miss()
        la.record(index, again=True)
        return True

    def _cyclic(self) -> bool:
        # inference passes repeat (grad mode off outside backward; backward runs with grad
        # mode off too, and is not an inference pass)
        return not torch.is_grad_enabled() and not in_backward()

    def _head(self) -> int:
        """How many of the trace's first blocks have no trainable part."""
        order = self.lookahead.order
        if order is not self._head_of:
            self._head_of, self._frozen_head = order, 0
            for i in order or ():
                if getattr(self.params[i], "trainable", None) is not None:
                    break
                self._frozen_head += 1
        return self._frozen_head

    def upcoming(self) -> List[int]:
        if not self.enabled:
            return []
        cyclic = self._cyclic()
        return self.lookahead.upcoming(cyclic, 0 if cyclic else self._head())

    def _size(self, i: int) -> int:
        return self.params[i].nbytes

    def next_use_within(self, index: int, nbytes: int) -> bool:
        """Whether ``index`` is used again within the next ``nbytes`` of trace."""
        if not self.enabled:
            return False
        cyclic = self._cyclic()
        return self.lookahead.used_within(index, self._size, nbytes, cyclic, 0 if cyclic else self._head())

    # ---- keeping blocks in flight ------------------------------------------------------------
    def device_bytes(self) -> int:
        return sum(bp.device_bytes for bp in self.params if bp is not None)

    def issue(self) -> None:
        """Start the copies the lookahead windows allow (called on every request)."""
        if not self.enabled:
            return
        on_device = self.device_bytes()
        ahead = 0
        cyclic = self._cyclic()
        for i in self.lookahead.window(self._size, max(self.host_lookahead, self.device_lookahead),
                                       cyclic=cyclic, head=0 if cyclic else self._head()):
            bp = self.params[i]
            ahead += bp.nbytes
            if self.blocked(i):
                continue                        # its update is in flight: read it later
            if self.deterministic:
                if bp.state is ParamState.WRITING:
                    bp.finish_write()           # bounded; read back after the write, as every rank does
            else:
                bp.poll()                       # a completed write-back: WRITING -> HOME
            if bp.state is ParamState.HOME and bp.on_nvme and ahead <= self.host_lookahead:
                with self.telemetry.span("offload::prefetch_nvme"):
                    bp.stage()
            if not self.deterministic:
                bp.poll()
            ready = (ParamState.STAGED, ParamState.STAGED_WRITING) + \
                ((ParamState.STAGING,) if self.deterministic else ())
            if bp.state in ready or (bp.state is ParamState.HOME and not bp.on_nvme):
                if ahead <= self.device_lookahead and on_device + bp.nbytes <= self.budget:
                    self.telemetry.count("param_fetched_bytes", bp.nbytes - bp.device_bytes)
                    with self.telemetry.span("offload::prefetch_h2d", "h2d") as span:
                        span.moved(bp.to_device(self.h2d))
                    on_device += bp.nbytes
