"""Trace-based prefetch of offloaded parameter blocks.

During the first step the order in which blocks are requested (forward pre-hooks, saved
parameters unpacked by backward, reads caught outside a module's forward) is recorded. From
then on every request advances a cursor along the recorded trace, and the blocks ahead of
the cursor are kept in flight on each link:

* NVMe -> host: blocks within ``host_lookahead_bytes`` ahead are staged into host buffers;
* host -> device: blocks within ``device_lookahead_bytes`` ahead are copied to the device,
  never beyond the device budget (bytes on the device, in flight included).

The blocks a training forward uses first are not read back at all after an update: the
commit marks those within ``host_lookahead_bytes`` at the start of the trace (parameter
offload's ``plan_write_through``), and their updates assemble the new parameters in a
staging buffer, write it through to NVMe and leave it staged, current, for that forward.

When a request does not match the trace (control flow, a module used a different number of
times, eval instead of train) the step counts a miss, the block is served on demand, and the
new order is recorded and replaces the trace at the end of the step. A block is never read
ahead while its optimizer update is in flight (``blocked``), so a prefetch never serves
stale data, and nothing here waits on anything but I/O already issued: it cannot hang. Once
the update has returned its write-back may still be in flight: a block kept staged
(STAGED_WRITING) is served from its held buffer at once; one written through a write
buffer (WRITING) is read back once the write has completed (polled here; never waited for,
except when ``deterministic``).

``deterministic`` (ZeRO-3 across ranks, where a fetch is an all-gather that every rank must
issue in the same order): decisions depend only on the trace, the budgets and state changed
by the main thread, never on I/O or worker timing. A staged NVMe read is waited for rather
than polled, and ``blocked`` must itself be timing-free (an update queued, not "in flight").
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from offload.params.residency import BlockParams, ParamState
from offload.core.hooks import in_backward
from offload.core.telemetry import Telemetry


class Prefetcher:
    def __init__(self, params: Sequence[Optional[BlockParams]], *, budget: int, device_lookahead: int,
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
        self.trace: Optional[List[int]] = None
        self._recording: List[int] = []
        self._cursor = 0
        self._diverged = False
        self._backward = False              # whether the last request came from backward
        self._frozen_head: List[int] = []   # the trace's first blocks without a trainable part

    # ---- the trace ---------------------------------------------------------------------
    def next_order(self) -> Optional[List[int]]:
        """The order the next forward is expected to follow: the trace ``rewind`` installs
        (what this pass recorded, when there was no trace yet or this pass left it), or None.
        A path that stopped early on the trace (an eval forward) keeps the trace."""
        if self._recording and (self.trace is None or self._diverged):
            return self._recording
        return self.trace

    def rewind(self) -> None:
        """A new step (or forward) starts: install what was recorded, restart the cursor."""
        order = self.next_order()
        if order is not self.trace:
            self.trace = order
            self.telemetry.count("prefetch_retraces")
            self._frozen_head = []
            for i in order or ():
                if getattr(self.params[i], "trainable", None) is not None:
                    break
                self._frozen_head.append(i)
        self._recording = []
        self._cursor = 0
        self._diverged = False

    def request(self, index: int) -> bool:
        """Block ``index`` is about to be used: account hit/miss, follow or leave the trace.
        False when it is the same block as the last request of the same pass (one use,
        nothing recorded). The first use in backward is a use of its own even where the
        forward ended with the same block (a tied lm_head's weight, read again by its
        backward at once): recorded, so the forward's end keeps the block for it."""
        backward = in_backward()
        if self._recording and self._recording[-1] == index and backward == self._backward:
            return False                        # the same block again: one use
        self._backward = backward
        self._recording.append(index)
        bp = self.params[index]
        hit = bp.state is not ParamState.HOME
        self.telemetry.count("prefetch_hits" if hit else "prefetch_misses")
        if self.trace is not None and not self._diverged:
            if self._cursor < len(self.trace) and self.trace[self._cursor] == index:
                self._cursor += 1
            else:
                self._diverged = True           # another path: on demand until re-recorded
                self.telemetry.count("prefetch_divergences")
        return True

    def upcoming(self) -> List[int]:
        if not self.enabled or self.trace is None or self._diverged:
            return []
        if not torch.is_grad_enabled() and not in_backward():
            # Inference passes repeat and no update runs between them: the next pass's
            # first blocks follow this pass's last ones. (Training prefetches the next
            # forward only after step(), once updates are queued, so reads are not wasted;
            # backward runs with grad mode off too, and is not an inference pass.)
            return self.trace[self._cursor:] + self.trace[:self._cursor]
        # training: the next forward's first blocks that no update changes (frozen only, an
        # embedding) follow this pass, so their reads overlap its end rather than the next
        # forward's start; a block with a trainable part is read only once its update is
        # queued (after step())
        return self.trace[self._cursor:] + self._frozen_head


    def next_use_within(self, index: int, nbytes: int) -> bool:
        """Whether ``index`` is used again within the next ``nbytes`` of trace."""
        seen = 0
        for i in self.upcoming():
            if i == index:
                return True
            seen += self.params[i].nbytes
            if seen > nbytes:
                return False
        return False

    # ---- keeping blocks in flight ------------------------------------------------------------
    def device_bytes(self) -> int:
        return sum(bp.device_bytes for bp in self.params if bp is not None)

    def issue(self) -> None:
        """Start the copies the lookahead windows allow (called on every request)."""
        ahead_dev = ahead_host = 0
        on_device = self.device_bytes()
        seen = set()
        for i in self.upcoming():
            if i in seen:
                continue
            seen.add(i)
            bp = self.params[i]
            ahead_dev += bp.nbytes
            ahead_host += bp.nbytes
            if ahead_host > self.host_lookahead and ahead_dev > self.device_lookahead:
                break
            if self.blocked(i):
                continue                        # its update is in flight: read it later
            if self.deterministic:
                if bp.state is ParamState.WRITING:
                    bp.finish_write()           # bounded; read back after the write, as every rank does
            else:
                bp.poll()                       # a completed write-back: WRITING -> HOME
            if bp.state is ParamState.HOME and bp.on_nvme and ahead_host <= self.host_lookahead:
                with self.telemetry.span("offload::prefetch_nvme"):
                    bp.stage()
            if not self.deterministic:
                bp.poll()
            ready = (ParamState.STAGED, ParamState.STAGED_WRITING) + \
                ((ParamState.STAGING,) if self.deterministic else ())
            if bp.state in ready or (bp.state is ParamState.HOME and not bp.on_nvme):
                if ahead_dev <= self.device_lookahead and on_device + bp.nbytes <= self.budget:
                    self.telemetry.count("param_fetched_bytes", bp.nbytes - bp.device_bytes)
                    with self.telemetry.span("offload::prefetch_h2d", "h2d") as span:
                        span.moved(bp.to_device(self.h2d))
                    on_device += bp.nbytes
