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

Host tensors (gradient buffers in pinned memory, the norm, barriers, object exchanges) need
a backend that takes CPU tensors. When the user's default group cannot (``torchrun`` with
NCCL), each role gets a gloo group beside its NCCL group, created here on every rank in the
same order: device tensors go to the default backend's group, host tensors to the gloo one
(``group_for``). With gloo (or ``cpu:gloo,cuda:nccl``) by default the two are the same group.

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

from offload.core.errors import OffloadError


_HOST_BACKENDS = ("gloo", "mpi", "ucc")   # backends whose groups take CPU tensors


def _reduce_scatter(*args, **kw):
    # torch >= 2.13 names it reduce_scatter_single (reduce_scatter_tensor is deprecated there)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kw)


def takes_host_tensors(backend: str) -> bool:
    """Whether a group of ``backend`` (``dist.get_backend()``'s answer: "gloo", "nccl",
    "cpu:gloo,cuda:nccl", ...) runs collectives on CPU tensors."""
    backend = str(backend).lower()
    if ":" in backend:   # a per-device map
        return any(part.split(":")[0].strip() == "cpu" for part in backend.split(","))
    return backend in _HOST_BACKENDS

class CommError(RuntimeError, OffloadError):
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
        self.main = self.side = None          # the default backend's groups (device tensors)
        self.host_main = self.host_side = None  # groups for host tensors: the same, or gloo
        self.backend = self.host_backend = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
            t = datetime.timedelta(seconds=timeout_s)
            self.backend = str(dist.get_backend())
            self.main = dist.new_group(timeout=t)
            self.side = dist.new_group(timeout=t)
            if takes_host_tensors(self.backend):
                self.host_main, self.host_side, self.host_backend = self.main, self.side, self.backend
            else:   # every rank takes this branch: the default group is the same everywhere
                self.host_main = dist.new_group(timeout=t, backend="gloo")
                self.host_side = dist.new_group(timeout=t, backend="gloo")
                self.host_backend = "gloo"
        else:
            self.world, self.rank = 1, 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def close(self) -> None:
        """Destroy the groups made here (never the user's default group), once, on every rank
        as each closes its engine: torch asks that every group be destroyed before the
        process exits, and gloo's threads left running at exit can abort a rank. Local: no
        collective. Groups the user already tore down with the default group are skipped."""
        made = {id(g): g for g in (self.main, self.side, self.host_main, self.host_side) if g is not None}
        self.main = self.side = self.host_main = self.host_side = None
        if not (dist.is_available() and dist.is_initialized()):
            return
        for g in made.values():
            try:
                dist.destroy_process_group(g)
            except (ValueError, RuntimeError):   # already gone with the default group
                pass

    def group_for(self, t: torch.Tensor, role: str = "main"):
        """The group of ``role`` ("main" or "side") that takes tensors on ``t``'s device."""
        if role not in ("main", "side"):
            raise ValueError(f"group role {role!r}: use 'main' or 'side'")
        return getattr(self, role if t.device.type != "cpu" else f"host_{role}")

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

    # ---- collectives (each on the group that takes its tensors' device) -------------------
    def all_reduce(self, t: torch.Tensor, what: str, op=None, async_op: bool = False,
                   group: str = "main") -> _Work:
        if not self.active:
            return _Work(self, None, what)
        n = t.numel() * t.element_size()
        self._count("allreduce", 2 * (self.world - 1) / self.world * n)
        return self._run(what, dist.all_reduce, t, op=op or dist.ReduceOp.SUM, group=self.group_for(t, group),
                         async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, what: str, async_op: bool = False) -> _Work:
        """``out`` (this rank's shard) = sum over ranks of ``full``'s shard ``rank``."""
        if not self.active:
            if out.data_ptr() != full.data_ptr():
                out.copy_(full)
            return _Work(self, None, what)
        self._count("reduce_scatter", (self.world - 1) / self.world * full.numel() * full.element_size())
        return self._run(what, _reduce_scatter, out, full, group=self.group_for(full), async_op=async_op)

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
            return self._run(what, dist.all_gather_into_tensor, full, shard, group=self.group_for(full, group),
                             async_op=async_op)

    def check_same(self, what: str, value: Any) -> None:
        """Fail on every rank, naming the ranks, unless all ranks pass an equal ``value``
        (a small picklable object; not counted in ``comm_bytes``)."""
        if not self.active:
            return
        got: List[Optional[Any]] = [None] * self.world
        try:
            dist.all_gather_object(got, value, group=self.host_main)   # pickles travel as CPU tensors
        except Exception as exc:
            raise self.error(f"check of {what}", exc) from exc
        if any(v != got[0] for v in got):
            bad = [r for r, v in enumerate(got) if v != got[0]]
            raise CommError(f"rank {self.rank}/{self.world}: ranks {bad} differ from rank 0 in {what} at step "
                            f"{self.step}: {_first_difference(got[0], got[bad[0]])}")

    def barrier(self, what: str) -> None:
        if self.active:   # not model traffic: not counted
            self._run(what, dist.all_reduce, torch.zeros(1), group=self.host_main, async_op=False)

    def gather_objects(self, value: Any, what: str) -> List[Any]:
        if not self.active:
            return [value]
        got: List[Optional[Any]] = [None] * self.world
        try:
            dist.all_gather_object(got, value, group=self.host_main)
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
