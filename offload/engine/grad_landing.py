"""Gradient landing: where a block's gradients land and are summed over an accumulation
window (``GradBuffer``), and how a window's running sum is parked on NVMe between uses
(``Spill``). The window itself (when gradients are summed, committed or discarded) is
engine/step_control.py's."""
from __future__ import annotations

import enum
import threading
from typing import List, Optional, Sequence, Tuple

import torch

from offload import device as dev
from offload.optim.pipeline import Stage
from offload.storage.pool import OwnedBuffer, Room
from offload.storage.loan import LoanState, TierTimeout


_POLL_S = 0.05        # a borrow waiting for a pool buffer re-checks whether any will come back this often


class Spill(enum.Enum):
    NONE = "none"            # no sum of this window anywhere but the buffer (if borrowed)
    PARKED = "parked"        # this window's running sum is on NVMe; no buffer held


class GradBuffer:
    """The accumulated gradients of one block, and how a parameter's gradient lands in them.

    Layout: 1-D, ``dtype`` (fp32, or the compute dtype when there is no accumulation), the
    block's padded numel, in the optimizer state's memory (host for the cpu/nvme tiers, the
    device for tier none). A parameter's gradient lands once per backward, from its
    post-accumulate-grad hook: the first landing of an accumulation window overwrites the
    parameter's range, later ones add to it, so no zeroing pass runs between windows. Ranges
    whose parameter received no gradient in a window are zeroed when the window closes.

    Synchronization: a CUDA landing is an asynchronous copy on the D2H stream; ``events``
    holds the completion events, which the optimizer waits for (``wait_landed``) before it
    reads the buffer. The device gradient is freed by the caller right after the landing is
    queued (its memory is protected by ``record_stream``).

    Landing copies, also on a CPU device, and the caller frees autograd's tensor right after
    (engine/update_and_grads.py): the buffer is allocated once, and autograd's next gradient
    reuses the memory just freed, still in cache, where keeping autograd's tensors until the
    update would keep a fresh allocation per parameter alive through the step.

    Spilling (a ``tier``: an ``NvmeTier`` over the offload-grads pool): the buffer is the key
    ``b<i>.grad``'s ``Loan`` (storage/loan.py, the loaned-buffer state machine optimizer state
    and parameter homes use), so gradients that must outlive their buffer (the update waits for
    the global norm; the window spans several micro-steps) are parked on NVMe between uses::

        window    Spill    Loan
        empty     NONE     ON_TIER          (no buffer; the key holds nothing of this window)
        landing   NONE     READY            --land/_borrow: try_fill() (a fresh window) or fetch()
        parked    PARKED   ON_TIER          <--park(): commit() -> WRITING, release() (write waited)
        back      NONE     READY            <--resident()/land: fetch()/acquire() (the sum read back)
        any --reset_window()--> NONE, ON_TIER (release(): a READY buffer is discarded; the update
                                               consumed it)

    ``park`` runs on an optimizer worker; a later borrow waits for it (``_parking``). Zeroing the
    ranges of parameters without a gradient (``close_window``) on a parked buffer is applied when
    it comes back. A borrow waits for a pool buffer only while an update or a park in flight will
    give one back, at most ``tier.wait_timeout_s``; when none will (every buffer is held by a
    block still collecting gradients) the loan takes a buffer outside the pool (``OwnedBuffer``)
    rather than wait forever.

    With a ``tier`` the buffer is the key's loan, taken at the window's first landing and
    returned when the window is consumed (``reset_window``), so host memory for gradients is
    bounded by the tier's pool, not the model. ``has_jobs`` tells whether an update or park in
    flight will return a pool buffer; if none will, the loan takes one outside the pool."""

    def __init__(self, tensor: Optional[torch.Tensor], num_segments: int, *, numel: int = 0,
                 dtype: torch.dtype = torch.float32, tier=None, has_jobs=None, device=None,
                 key: str = "", what: str = "", gaps: Sequence[Tuple[int, int]] = ()):
        self.tensor = tensor                          # 1-D, padded numel (None while not borrowed)
        # transient (no tensor, no pool): allocated on ``device`` at the first landing and
        # freed by reset_window (ZeRO-2/3 landing buffers, live only until reduce-scattered)
        self._device = device
        self.num_segments = num_segments
        self._numel, self._dtype = (tensor.numel(), tensor.dtype) if tensor is not None else (numel, dtype)
        self._has_jobs = has_jobs
        self._nbytes = self._numel * self._dtype.itemsize
        # the key's Loan on the NVMe tier (parked sums), None without a tier
        self._loan = tier.loan(key, self._nbytes, what or key) if tier is not None else None
        self._seen = [False] * num_segments           # landed in the current window
        self.arrived = 0                              # landings in the current backward
        self.events: List = []                        # CUDA copies still in flight
        self._staging: Optional[torch.Tensor] = None  # pinned, for accumulating CUDA landings
        self.spill = Spill.NONE
        self._parking = None                          # Future of park() in flight
        self._park_thread = None                      # the worker running the park job
        self._zero_on_return = None                   # segments to zero when a parked sum returns
        # [a, b) ranges no parameter covers (alignment gaps, padding): zeroed in a borrowed
        # buffer, which holds another block's bytes (an int8 scale block may span a gap)
        self._gaps = tuple(gaps)

    @property
    def device(self) -> torch.device:
        """Where the buffer lives: the device (a transient landing buffer, or one allocated
        there), else host memory."""
        if self._device is not None:
            return self._device
        return self.tensor.device if self.tensor is not None else torch.device("cpu")

    # ---- one backward ------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.arrived = 0

    @property
    def complete(self) -> bool:
        return self.arrived == self.num_segments

    def land(self, index: int, offset: int, grad: torch.Tensor, stream) -> None:
        """Add parameter ``index``'s gradient (any device, any float dtype) at ``offset``."""
        flat = grad.detach().reshape(-1)
        if self._parking is not None:
            self._wait_parking()                      # the park of the last micro-step first
        if self.tensor is None:
            self._borrow()
        dst = self.tensor[offset:offset + flat.numel()]
        if not self._seen[index]:
            if dst.device == flat.device:
                dst.copy_(flat)
            else:
                ev = dev.copy_to_host_async(dst, flat, stream)
                if ev is not None:
                    self.events.append(ev)
            self._seen[index] = True
        else:
            self._add(dst, flat, stream)
        self.arrived += 1

    def _add(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """``dst`` (a range of the buffer) += ``src`` (1-D, any device). The one rule of where
        a landed gradient is summed: in the buffer's memory. A source on another device (a
        device gradient, a reduce-scattered device shard, into host memory) is copied next to
        the buffer first (the pinned staging buffer), then added there."""
        if dst.device == src.device:
            self.wait_landed()                        # a copy of this window may be in flight
            dst.add_(src)
            return
        if self._staging is None or self._staging.numel() < src.numel() or self._staging.dtype != src.dtype:
            self._staging = dev.empty_host(max(self.tensor.numel(), src.numel()), src.dtype, pin=True)
        tmp = self._staging[:src.numel()]
        dev.sync_event(dev.copy_to_host_async(tmp, src, stream))
        self.wait_landed()
        dst.add_(tmp)

    def _borrow(self) -> None:
        """The buffer in memory: a fresh one for a new window, or the parked sum read back."""
        self._wait_parking()
        if self._loan is None:
            self.tensor = torch.zeros(self._numel, dtype=self._dtype, device=self._device)
            return
        parked = self.spill is Spill.PARKED
        if not (self._loan.fetch() if parked else self._loan.try_fill() is not None):
            self._lend_when_free(parked)
        self.tensor = self._loan.acquire().view(self._dtype)     # a read in flight: waited (bounded)
        if not parked:
            for a, b in self._gaps:
                self.tensor[a:b].zero_()
        if parked:                                   # the window's sum so far is back
            self.spill = Spill.NONE
            segs, self._zero_on_return = self._zero_on_return, None
            if segs is not None:
                self._zero_unseen(segs)

    def _lend_when_free(self, read: bool) -> None:
        """Wait for a pool buffer while work in flight will give one back (the pool's one
        bounded wait, within the tier's wait_timeout_s); when none will, lend the loan a
        buffer outside the pool."""
        tier = self._loan.tier
        try:
            buf = tier.pool.acquire(self._nbytes, tier.wait_timeout_s, holder=self._loan.what, poll_s=_POLL_S,
                                    make_room=lambda: Room.WAIT if self._has_jobs() else Room.NEVER)
        except TimeoutError as exc:
            raise TierTimeout(f"buffer for {self._loan.what}: no gradient buffer came back after "
                              f"{tier.wait_timeout_s} s (an update or park in flight is stuck; {exc})") from None
        if buf is None:      # every buffer is held by a block still collecting gradients: outside the pool
            buf = OwnedBuffer(self._nbytes)
        self._loan.lend(buf, read)

    # ---- spilling ------------------------------------------------------------------------------
    @property
    def spills(self) -> bool:
        return self._loan is not None

    def park(self) -> None:
        """Write the window's sum so far to the NVMe tier and give the buffer back (READY ->
        WRITING -> ON_TIER: PARKED); a no-op without a buffer. Runs on a worker; see
        ``start_park``. A failed write gives the buffer back, then raises (naming the block)."""
        if self.tensor is None or self._loan is None or self._loan.state is not LoanState.READY:
            return
        self.wait_landed()
        self.tensor = None
        self._loan.commit()
        self._loan.release()                          # waits for the write (bounded)
        self.spill = Spill.PARKED

    def start_park(self, run, first=None, fail=None):
        """Park on a worker (``run(fn)`` returns a Future), after ``first()`` (a reader of the
        buffer, e.g. its norms) if given; the next borrow waits for it. Returns the Future,
        whose result is ``first()``'s. ``fail(stage, exc)`` turns a failure of ``first``
        (``Stage.GRAD_NORM``) or of the write (``Stage.GRAD_PARK``) into the error the Future raises
        (the engine's: it names the block and is raised from the user's next call)."""
        self._wait_parking()

        def job():
            self._park_thread = threading.get_ident()   # first() reads the buffer before the park
            stage = Stage.GRAD_NORM
            try:
                out = first() if first is not None else None
                stage = Stage.GRAD_PARK
                self.park()
            except BaseException as exc:
                err = fail(stage, exc) if fail is not None else exc
                if err is exc:
                    raise
                raise err from exc
            finally:
                self._park_thread = None
            return out
        self._parking = run(job)
        return self._parking

    @property
    def parking(self) -> bool:
        return self._parking is not None and not self._parking.done()

    def _wait_parking(self) -> None:
        fut, self._parking = self._parking, None
        if fut is not None:
            fut.result()

    def resident(self) -> torch.Tensor:
        """The buffer in memory (a parked sum is read back into a borrowed buffer)."""
        if self._park_thread != threading.get_ident():
            self._wait_parking()
        if self.tensor is None and self.spill is Spill.PARKED:
            self._borrow()
        return self.tensor

    def seen(self, index: int) -> bool:
        """Whether parameter ``index`` got a gradient in the current window."""
        return self._seen[index]

    def wait_landed(self) -> None:
        for ev in self.events:
            dev.sync_event(ev)
        self.events.clear()

    # ---- the accumulation window -------------------------------------------------------------
    def close_window(self, segments) -> bool:
        """Zero the ranges of parameters that got no gradient in this window.
        Returns whether any gradient landed at all."""
        any_seen = any(self._seen)
        if not any_seen:
            return False
        self._wait_parking()
        if self.tensor is None and self.spill is Spill.PARKED:
            self._zero_on_return = segments           # applied when the sum comes back
            return True
        if self.tensor is None:     # every landing was whole-shard (land_whole) and none came
            return False
        self._zero_unseen(segments)
        return any_seen

    def _zero_unseen(self, segments) -> None:
        for i, s in enumerate(segments):
            if not self._seen[i]:
                self.tensor[s.offset:s.offset + s.numel].zero_()

    @property
    def any_landed(self) -> bool:
        return any(self._seen)

    def fill_missing(self, segments) -> None:
        """Make the buffer exist and zero every range that got no gradient (a rank must take
        part in a collective even when none of its parameters got a gradient)."""
        if self.tensor is None:
            self._borrow()
            self.tensor.zero_()
            self._seen = [True] * self.num_segments
        self.close_window(segments)
        self._seen = [True] * self.num_segments

    def land_whole(self, src: torch.Tensor, stream=None) -> None:
        """Add a whole-buffer gradient (a reduce-scattered shard, on any device): the window's
        first landing overwrites, later ones add (``_add``: summed in the buffer's memory).
        ``stream``: where a device source's copy runs (None: the current stream)."""
        if self.tensor is None:
            self._borrow()
        self.wait_landed()
        if not any(self._seen):
            self.tensor.copy_(src)
        else:
            self._add(self.tensor, src.reshape(-1), stream)
        self._seen = [True] * self.num_segments

    def reset_window(self) -> None:
        """After the optimizer consumed the buffer: the next landing overwrites (a borrowed
        buffer goes back to the pool)."""
        self._wait_parking()
        self.wait_landed()                            # no copy writes into the next window
        self._seen = [False] * self.num_segments
        self.spill, self._zero_on_return = Spill.NONE, None
        if self._loan is None and self._device is not None:
            self.tensor = None                        # transient: freed
        elif self._loan is not None and self.tensor is not None:
            self.tensor = None
            self._loan.release()                      # READY: discarded, the buffer goes back
