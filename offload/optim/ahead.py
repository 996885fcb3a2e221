"""One block's update computed ahead: during backward, committed by step().

With ``offload_optimizer.update_ahead`` the optimizer does not wait for step() to start: as
soon as a block's gradients of the window's last backward are in, a worker computes its
update: the kernel reads the committed state and writes the new one into a second state
buffer (``spare``) in one pass (``UpdateRule.cpu_step(src=...)``), and the new parameters
into a staged copy (``out``; None where the parameters are resident fp32 and are copied
from the master). Nothing a checkpoint records changes: the committed state
buffer, the parameters and the counters stay as they were. step() commits: the two state
buffers trade places (or, where the parameters are views of the master, the new bytes are
copied over it) and the staged parameters are written back, so the next forward waits for
write-backs, not for the optimizer. Everything that would make the result stale drops it:
another backward in the window, zero_grad(), a checkpoint load (engine/step_control.py), a
hyper-parameter changed before step() (``pending_for`` compares them).

The slot's lifecycle::

    IDLE --start()--> RUNNING --(the job returns)--> READY --take()--> IDLE   (step() commits)
    RUNNING / READY --drop()--> IDLE        (waits for a running job; its result is discarded)

A job that fails leaves the slot IDLE; its error is recorded by the pipeline, against its
block, and raised from the user's next call.
"""
from __future__ import annotations

import enum
import threading
from concurrent.futures import Future
from typing import Optional

import torch

from offload.core.block import BlockPhaseError
from offload.storage.loan import TierTimeout


class Ahead(enum.Enum):
    IDLE = "idle"          # nothing computed ahead: step() runs the update itself
    RUNNING = "running"    # a worker computes the update into the spare buffers
    READY = "ready"        # computed for step ``step``: step() commits it


class AheadSlot:
    """The spare state buffer and staged parameters of one block shard, and their job.

    ``out_buf`` (the HostBuffer ``out`` views; parameters homed on NVMe): at the commit the
    parameter home takes that buffer as its new home copy, written from it and read by the
    next forward, instead of a copy into a buffer of its own (``lend_out``;
    params/part.py ``ParamPart.adopt_home``). It comes back when the home lets it go
    (``_LentOut.release``). An update due while the home still holds it (``out_lent``)
    waits on its worker for the home's write-back from it (``StepControl._submit_ahead`` drops
    the stale staged copy first); one whose home holds it for a use is left to step()."""

    def __init__(self, spare: torch.Tensor, out: Optional[torch.Tensor], out_buf=None):
        if spare.dtype != torch.uint8 or spare.dim() != 1:
            raise ValueError(f"the spare state buffer is flat uint8, not {spare.dtype} of {spare.dim()} dims")
        self.spare = spare                 # the state's bytes after the update (flat uint8)
        self.out = out                     # the new parameters (this rank's shard), or None
        self.out_buf = out_buf             # the HostBuffer ``out`` views, when it can be lent
        self._out_lent = False
        self.state = Ahead.IDLE
        self.step = 0                      # the step it was computed for
        self.groups: tuple = ()            # with these hyper-parameters (StepArgs.groups)
        self.future: Optional[Future] = None
        self._lock = threading.Lock()
        self._views = None                 # (buffer, (master, rows)): the layout's views of spare

    @property
    def out_lent(self) -> bool:
        """Whether a parameter home holds ``out`` as its home copy now."""
        return self._out_lent

    def lend_out(self) -> "_LentOut":
        """``out_buf``, lent to a parameter home (taken once per commit, while not lent)."""
        with self._lock:
            if self.out_buf is None or self._out_lent:
                raise BlockPhaseError("the staged parameters are already lent (or cannot be)")
            self._out_lent = True
        return _LentOut(self)

    def _returned(self) -> None:
        with self._lock:
            self._out_lent = False

    def views(self, layout) -> tuple:
        """(master, rows) of ``spare`` in ``layout`` (built once per buffer)."""
        if self._views is None or self._views[0] is not self.spare:
            self._views = (self.spare, layout.views(self.spare))
        return self._views[1]

    def start(self, step: int, groups: tuple, future: Future) -> None:
        with self._lock:
            if self.state is not Ahead.IDLE:
                raise BlockPhaseError(f"an update ahead is already {self.state.value}")
            self.state, self.step, self.groups, self.future = Ahead.RUNNING, step, groups, future
        future.add_done_callback(self._finished)

    def _finished(self, fut: Future) -> None:
        with self._lock:
            if self.future is fut and self.state is Ahead.RUNNING:
                failed = fut.cancelled() or fut.exception() is not None
                self.state = Ahead.IDLE if failed else Ahead.READY
                if failed:
                    self.future = None

    def pending_for(self, step: int, groups: tuple) -> Optional[Future]:
        """The job computing (or that computed) the update of ``step`` with the
        hyper-parameters ``groups``, or None."""
        with self._lock:
            if self.state is Ahead.IDLE or self.step != step or not _same(self.groups, groups):
                return None
            return self.future

    def take(self) -> None:
        """step() has committed the result: the slot is free for the next window."""
        with self._lock:
            self.state, self.future = Ahead.IDLE, None

    def settle(self, timeout: float, what: str) -> Optional[BaseException]:
        """Wait for the job, if any, at most ``timeout`` seconds (TierTimeout past that);
        returns its error (recorded against the block by the pipeline) or None."""
        fut = self.future
        if fut is None:
            return None
        try:
            fut.result(timeout)
        except BaseException as exc:   # noqa: BLE001 - the caller decides whether to raise it
            if fut.done():
                return exc
            raise TierTimeout(f"the update of {what} computed ahead did not finish within {timeout} s") from None
        return None

    def drop(self, timeout: float, what: str) -> None:
        """Discard what was computed ahead (a running job is waited for: ``settle``)."""
        fut = self.future
        self.settle(timeout, what)
        with self._lock:
            if self.future is fut:
                self.state, self.future = Ahead.IDLE, None


class _LentOut:
    """A slot's staged-parameter buffer while a parameter home holds it (a Loan's buffer:
    ``view`` and ``release`` as a pool's HostBuffer); released, it goes back to the slot."""
    __slots__ = ("_slot", "_released")

    def __init__(self, slot: AheadSlot):
        self._slot, self._released = slot, False

    def view(self, dtype: torch.dtype, numel: int, offset_bytes: int = 0) -> torch.Tensor:
        if self._released:
            raise BlockPhaseError("a released buffer is not the home's any more")
        return self._slot.out_buf.view(dtype, numel, offset_bytes)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._slot._returned()


def _same(a: tuple, b: tuple) -> bool:
    """Whether two StepArgs.groups hold the same hyper-parameters (a tensor lr compares by
    value; anything that cannot be compared counts as changed)."""
    if len(a) != len(b):
        return False
    try:
        for x, y in zip(a, b):
            if x.keys() != y.keys():
                return False
            for k in x:
                u, v = x[k], y[k]
                if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                    if not torch.equal(torch.as_tensor(u), torch.as_tensor(v)):
                        return False
                elif u != v:
                    return False
    except Exception:   # noqa: BLE001 - a value that does not compare: compute again
        return False
    return True
