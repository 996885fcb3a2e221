"""The data-parallel process group: collectives, their byte accounting, and clear errors.

The group comes from ``torch.distributed`` (initialized by the user or from torchrun's
environment). Without one, or with world_size 1, every collective is a no-op and the engine
runs the same code path. With several ranks the engine makes its own groups
(``dist.new_group(timeout=zero_optimization.timeout_s)``), so a rank that diverged or died
makes the others fail with an error naming the rank, the step and the collective, instead
of hanging:

* ``main``: collectives issued by the main thread (gradient reductions in backward, the
  global norm, ZeRO-3 parameter gathers, checks) in program order;
* ``side``: the post-update parameter all-gathers (ZeRO-1/2), issued by one thread in the
  fixed block order.

Each group's issue order is identical on every rank; two threads never share a group.

Accounting (``comm_bytes``), per rank, ring-equivalent: for a buffer of N bytes over W
ranks, all-reduce moves 2 (W-1)/W N, reduce-scatter and all-gather (W-1)/W N each
(N = the full, padded buffer; a rank sends and receives this much in a ring algorithm).
"""
from __future__ import annotations

import collections
import datetime
import threading
import warnings
from typing import Any, List, Optional

import torch
import torch.distributed as dist


# torch >= 2.13 names it reduce_scatter_single (reduce_scatter_tensor is deprecated there)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

class CommError(RuntimeError):
    """A collective failed or timed out: ranks diverged, or one died."""


class _Work:
    """A collective in flight; ``wait()`` re-raises failures as CommError."""

    def __init__(self, comm: "Comm", work, what: str):
        self.comm, self.work, self.what = comm, work, what

    def wait(self) -> None:
        if self.work is None:
            return
        work, self.work = self.work, None
        try:
            work.wait()
        except Exception as exc:  # gloo: timeout, closed connection, size mismatch
            raise self.comm.error(self.what, exc) from exc


class Comm:
    def __init__(self, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self.step = 0                      # set by the engine, for error messages
        self.bytes = collections.defaultdict(int)   # kind -> ring-equivalent bytes, this rank
        self._lock = threading.Lock()
        self.main = self.side = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
            t = datetime.timedelta(seconds=timeout_s)
            self.main = dist.new_group(timeout=t)
            self.side = dist.new_group(timeout=t)
        else:
            self.world, self.rank = 1, 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def error(self, what: str, exc: BaseException) -> CommError:
        return CommError(f"rank {self.rank}/{self.world}: collective {what} at step {self.step} failed "
                         f"(another rank diverged, died, or exceeded zero_optimization.timeout_s="
                         f"{self.timeout_s:g}): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")

    def _count(self, kind: str, nbytes: float) -> None:
        with self._lock:
            self.bytes[kind] += int(nbytes)

    def _run(self, what: str, fn, *args, async_op: bool, **kw) -> _Work:
        try:
            work = fn(*args, async_op=True, **kw)
        except Exception as exc:
            raise self.error(what, exc) from exc
        w = _Work(self, work, what)
        if not async_op:
            w.wait()
        return w

    # ---- collectives (tensors on the host for gloo) -------------------------------------
    def all_reduce(self, t: torch.Tensor, what: str, op=None, async_op: bool = False,
                   group: str = "main") -> _Work:
        if not self.active:
            return _Work(self, None, what)
        n = t.numel() * t.element_size()
        self._count("allreduce", 2 * (self.world - 1) / self.world * n)
        return self._run(what, dist.all_reduce, t, op=op or dist.ReduceOp.SUM, group=getattr(self, group),
                         async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, what: str, async_op: bool = False) -> _Work:
        """``out`` (this rank's shard) = sum over ranks of ``full``'s shard ``rank``."""
        if not self.active:
            if out.data_ptr() != full.data_ptr():
                out.copy_(full)
            return _Work(self, None, what)
        self._count("reduce_scatter", (self.world - 1) / self.world * full.numel() * full.element_size())
        return self._run(what, _REDUCE_SCATTER, out, full, group=self.main, async_op=async_op)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, what: str, async_op: bool = False,
                   group: str = "main") -> _Work:
        """``full`` = the concatenation of every rank's ``shard``."""
        if not self.active:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return _Work(self, None, what)
        self._count("allgather", (self.world - 1) / self.world * full.numel() * full.element_size())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return self._run(what, dist.all_gather_into_tensor, full, shard, group=getattr(self, group),
                             async_op=async_op)

    def check_same(self, what: str, value: Any) -> None:
        """Fail on every rank, naming the ranks, unless all ranks pass an equal ``value``
        (a small picklable object; not counted in ``comm_bytes``)."""
        if not self.active:
            return
        got: List[Optional[Any]] = [None] * self.world
        try:
            dist.all_gather_object(got, value, group=self.main)
        except Exception as exc:
            raise self.error(f"check of {what}", exc) from exc
        if any(v != got[0] for v in got):
            bad = [r for r, v in enumerate(got) if v != got[0]]
            raise CommError(f"rank {self.rank}/{self.world}: ranks {bad} differ from rank 0 in {what} at step "
                            f"{self.step}: {_first_difference(got[0], got[bad[0]])}")

    def barrier(self, what: str) -> None:
        if self.active:   # not model traffic: not counted
            self._run(what, dist.all_reduce, torch.zeros(1), group=self.main, async_op=False)

    def gather_objects(self, value: Any, what: str) -> List[Any]:
        if not self.active:
            return [value]
        got: List[Optional[Any]] = [None] * self.world
        try:
            dist.all_gather_object(got, value, group=self.main)
        except Exception as exc:
            raise self.error(what, exc) from exc
        return got


def _first_difference(a, b) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return f"{k}: rank 0 has {_short(a.get(k))}, the other has {_short(b.get(k))}"
    return f"rank 0 has {_short(a)}, the other has {_short(b)}"


def _short(v) -> str:
    s = repr(v)
    return s if len(s) < 300 else s[:300] + "..."
