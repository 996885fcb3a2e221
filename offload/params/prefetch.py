"""What parameter offload reads ahead of use (``Prefetcher``): the recorded order of block
uses, over core/lookahead.py, kept in flight within the lookahead bytes."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from offload.core.block import Block
from offload.core.hooks import in_backward
from offload.core.lookahead import Lookahead
from offload.core.telemetry import Telemetry
from offload.params.part import ParamState


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

    def __init__(self, blocks: Sequence[Block], *, budget: int, device_lookahead: int,
                 host_lookahead: int, enabled: bool, telemetry: Telemetry, h2d_stream,
                 blocked: Callable[[Block], bool], deterministic: bool = False):
        self.blocks = list(blocks)          # the offloaded blocks
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
    def trace(self) -> Optional[List[Block]]:
        return self.lookahead.order

    def next_order(self) -> Optional[List[Block]]:
        """The order the next forward is expected to follow (``Lookahead.next_order``)."""
        return self.lookahead.next_order()

    def rewind(self) -> None:
        """A new step (or forward) starts: install what was recorded, restart the cursor."""
        self.lookahead.rewind()

    def request(self, block: Block) -> bool:
        """``block`` is about to be used: account hit/miss, follow or leave the trace.
        False when it is the same block as the last request of the same pass (one use,
        nothing recorded). The first use in backward is a use of its own even where the
        forward ended with the same block (a tied lm_head's weight, read again by its
        backward at once): recorded, so the forward's end keeps the block for it."""
        la = self.lookahead
        backward = in_backward()
        again = backward != self._backward
        if la.last is block and not again:
            return False                        # the same block again: one use
        self._backward = backward
        la.hit() if block.residency is not ParamState.HOME else la.miss()
        la.record(block, again=True)
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
            for b in order or ():
                if b.trainable is not None:
                    break
                self._frozen_head += 1
        return self._frozen_head

    def upcoming(self) -> List[Block]:
        if not self.enabled:
            return []
        cyclic = self._cyclic()
        return self.lookahead.upcoming(cyclic, 0 if cyclic else self._head())

    @staticmethod
    def _size(b: Block) -> int:
        return b.nbytes

    def next_use_within(self, block: Block, nbytes: int) -> bool:
        """Whether ``block`` is used again within the next ``nbytes`` of trace."""
        if not self.enabled:
            return False
        cyclic = self._cyclic()
        return self.lookahead.used_within(block, self._size, nbytes, cyclic, 0 if cyclic else self._head())

    # ---- keeping blocks in flight ------------------------------------------------------------
    def device_bytes(self) -> int:
        return sum(b.device_bytes for b in self.blocks)

    def issue(self) -> None:
        """Start the copies the lookahead windows allow (called on every request)."""
        if not self.enabled:
            return
        on_device = self.device_bytes()
        ahead = 0
        cyclic = self._cyclic()
        for bp in self.lookahead.window(self._size, max(self.host_lookahead, self.device_lookahead),
                                        cyclic=cyclic, head=0 if cyclic else self._head()):
            ahead += bp.nbytes
            if self.blocked(bp):
                continue                        # its update is in flight: read it later
            if self.deterministic:
                if bp.residency is ParamState.WRITING:
                    bp.finish_write()           # bounded; read back after the write, as every rank does
            else:
                bp.poll()                       # a completed write-back: WRITING -> HOME
            if bp.residency is ParamState.HOME and bp.on_nvme and ahead <= self.host_lookahead:
                with self.telemetry.span("offload::prefetch_nvme"):
                    bp.stage()
            if not self.deterministic:
                bp.poll()
            ready = (ParamState.STAGED, ParamState.STAGED_WRITING) + \
                ((ParamState.STAGING,) if self.deterministic else ())
            if bp.residency in ready or (bp.residency is ParamState.HOME and not bp.on_nvme):
                if ahead <= self.device_lookahead and on_device + bp.nbytes <= self.budget:
                    self.telemetry.count("param_fetched_bytes", bp.nbytes - bp.device_bytes)
                    with self.telemetry.span("offload::prefetch_h2d", "h2d") as span:
                        span.moved(bp.to_device(self.h2d))
                    on_device += bp.nbytes
