"""Activation offload's movement: saved tensors off the device in forward, back ahead of their
use in backward, and the host pool and NVMe keys their copies occupy.

The handler's contract (``pack`` / ``unpack``) is the package's (activations/__init__.py).
One saved tensor is a ``Saved`` record (saved.py), moved through its states here; its host
and NVMe copies are loans of one ``storage.tier.NvmeTier`` over the store and the pool
(ranges of the pool lent with ``Loan.lend``, keys from keys.py's free list), moved by their
verbs: nothing here reads or writes the store itself.

Lifetimes. The device copy of a packed tensor is autograd's to free; on CUDA the D2H runs on
a side stream after the producing kernels and ``record_stream`` keeps its memory from reuse
until the copy ends. Every host copy is a range lent by the budgeted host pool
``offload-activations`` (a ``HostArena`` the engine sizes from the memory plan,
``offload_activations.host_bytes``; pinned on CUDA, page-aligned for O_DIRECT), never memory
of its own. With ``cpu`` the range lives while any handle does (a retained graph may unpack
twice); with ``nvme`` only until its write is durable, and on CUDA again from the read ahead
of backward to the end of the copy back (on the CPU device the read lands straight in the
tensor autograd gets: device memory, as an H2D copy's target would be, lent by the read
window (``read_window.py``: reused pages, a range back when autograd frees the tensor over
it, free pages trimmed before each forward); the pool's pages are trimmed at the end of
forward, so it adds nothing to backward's RSS). On the CPU device with ``nvme`` a dense
tensor is not copied at all (``_pack_direct``): from its first page boundary on it is
written straight from device memory, held (counted in ``device_bytes``) until that write is
durable, and only the bytes before that boundary go through a one-page range of the pool; a
tensor needed again before its write is durable is handed back as it is. The NVMe extent (a
key of the store, checksummed per extent like all the engine's swap data) returns to a free
list when the last handle goes; ranges and keys of retired records are given back on this
engine's thread (``NvmeTier.settle_retired``), never from a finalizer.

Budget. Bytes in flight to NVMe are bounded by ``lookahead_bytes``: packing waits (bounded)
for the oldest write, never for the newest (a tensor larger than the lookahead is written
while forward goes on, and waited for at the next pack if still in flight). A pack that
finds the pool full makes room (``_lend``): it finishes the oldest D2H copy, the oldest
write (``nvme``: the copy then lives on NVMe only) or the oldest copy back, and waits at
most ``wait_timeout_s`` in all. With ``cpu`` nothing of the forward leaves the pool before
its backward, so a forward whose copies exceed the pool fails at once with
``ActivationHostBudgetError`` naming the fix; copies held by an earlier graph still alive
are waited for (bounded) first.

Backward order (``core.lookahead.Lookahead`` named ``act_prefetch``, a given order). Saved
tensors are expected back in the order the last backward unpacked them (the first step:
reverse pack order). Each unpack advances the cursor past its tensor and starts bringing
back the tensors ahead of it within ``lookahead_bytes``, and always the next one however
large (NVMe read, then the H2D copy on a side stream); an unpack that finds its tensor not
yet on its way counts a miss and fetches on demand. Restored tensors wait on the device
only until unpacked.
"""
from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Dict, List, Optional

import torch
from torch import nn

from offload import device as dev
from offload.core.hooks import NOT_MINE, in_backward
from offload.core.lookahead import Lookahead
from offload.engine.activations.keys import SwapKeys
from offload.engine.activations.saved import Saved, SavedState, direct_head, layout_of
from offload.engine.read_window import ReadWindow
from offload.storage.pool import CallerBuffer, HostBuffer, PoolBudgetError, Room
from offload.storage.loan import LoanState
from offload.placement import Placement
from offload.storage.tier import NvmeTier
from offload.units import PAGE, fmt_exact
from offload.core.errors import BudgetError

_POLL_S = 0.05        # a full pool waiting for another thread's graph to go: re-check this often
_HOLDER = "saved activations"   # who holds the pool's ranges (named when a wait runs out)
_HOST = torch.device("cpu")   # where the pool's copies live (telemetry's link names)


class ActivationHostBudgetError(RuntimeError, BudgetError):
    """The host copies of saved activations do not fit in ``offload_activations.host_bytes``."""


def _aligned_cpu_device(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor of ``nbytes`` on the CPU device (the process heap) starting on a
    4 KiB page, so an O_DIRECT read can land in it: the memory autograd gets back."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip:skip + nbytes]


class ActivationOffload:
    """The activation side of the saved-tensor chain; ``saved_tensors`` is itself."""

    def __init__(self, *, model: nn.Module, device: torch.device, tier: Placement, min_bytes: int,
                 lookahead_bytes: int, pool, store=None, telemetry, wait_timeout_s: float = 600.0):
        if tier not in (Placement.HOST, Placement.NVME):
            raise ValueError(f"offload_activations.device={tier!r}: use cpu or nvme")
        self.model = model
        self.device = device
        self.tier = tier
        self.min_bytes = max(1, int(min_bytes))
        self.lookahead = int(lookahead_bytes)
        self.pool = pool                    # HostArena offload-activations: every host copy's range
        self.wait_timeout_s = float(wait_timeout_s)
        self.store = store                  # NvmeStore for tier nvme
        # every host / NVMe copy is a loan of this tier (cpu: no store, the loans only hold ranges)
        self._tier = NvmeTier(store, pool, wait_timeout_s=self.wait_timeout_s)
        self.telemetry = telemetry
        self.saved_tensors = self
        # CPU device, nvme: dense tensors are written straight from device memory (_pack_direct)
        self._direct = tier is Placement.NVME and device.type == "cpu"
        # ... and read back into a window of reused memory (read_window.py): no page faults
        self._window = ReadWindow() if self._direct else None
        self._d2h = dev.new_stream(device)
        self._h2d = dev.new_stream(device)
        # Records retire (``__del__``) on whichever thread drops the graph, possibly inside a
        # locked section of this one: counters take a re-entrant lock, retired loans go
        # through the tier's deque (atomic appends) and are settled on this thread later.
        self._lock = threading.RLock()
        self._keys = SwapKeys(self._tier) if store is not None else None   # NVMe keys of the copies
        self._param_storages: set = set()
        self._records: List[weakref.ref] = []        # this forward's records, pack order
        self._by_src: Dict[int, weakref.ref] = {}    # id(tensor) -> record (saved twice)
        self._copying = collections.deque()          # records with a D2H in flight (CUDA), oldest first
        self._writing = collections.deque()          # records with an NVMe write in flight
        self._copying_in: Dict[int, Saved] = {}     # nvme on CUDA: H2D in flight from a loan's range, oldest first
        self._in_forward = False
        self._writing_bytes = 0
        self._order: Optional[List[int]] = None      # the last backward's unpack order (record indices)
        self._unpacked: List[int] = []               # this backward's unpack order
        self._ahead = Lookahead("act_prefetch", telemetry)   # the order expected now, and its cursor
        self._armed: Optional[int] = None            # records ``_ahead``'s order covers (None: not armed)
        self.device_bytes = 0               # offloaded tensors' bytes on the device held here
        self.stats_ = collections.Counter()

    # ---- lifecycle verbs --------------------------------------------------------------------
    def begin_forward(self, recompute: bool) -> None:
        if recompute:
            return
        self._in_forward = True
        if self._unpacked and len(self._unpacked) == len(self._records):
            self._order = list(self._unpacked)       # the order the last backward used
        elif self._records:
            self._order = None
        self._records, self._by_src, self._unpacked = [], {}, []
        self._armed = None
        self._tier.settle_retired()                  # the last graph's ranges and keys come back
        if self._window is not None:
            self._window.trim()                      # the forward's RSS does not carry the reads' pages
        self._param_storages = {t.untyped_storage().data_ptr()
                                for t in list(self.model.parameters()) + list(self.model.buffers())
                                if t.numel() and t.device.type != "meta"}

    def end_forward(self) -> None:
        """Copies of this forward are off the device; the first tensors backward needs start
        coming back now (backward begins right after the forward, typically)."""
        self._pump(final=True)
        self._in_forward = False
        if self.tier is Placement.NVME and self.device.type == "cpu":
            # every copy of this forward is on NVMe and backward reads straight into device
            # memory: the pool's pages leave the RSS until the next forward
            self._tier.settle_retired()
            self.pool.trim()
            # room to read the whole forward back (address space; pages fault in once used)
            recs = [r() for r in self._records]
            self._window.ensure(sum(r.nbytes + PAGE for r in recs if r is not None))
        if torch.is_grad_enabled() and self._records:
            self._prefetch()

    # ---- pack: off the device ------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        if (t.layout is not torch.strided or t.device.type == "meta" or isinstance(t, nn.Parameter)
                or t.numel() * t.element_size() < self.min_bytes or in_backward()):
            return NOT_MINE
        if t.device != self.device or t.untyped_storage().data_ptr() in self._param_storages:
            return NOT_MINE                          # not on the device; a parameter, a view of one, a buffer
        ref = self._by_src.get(id(t))
        rec = ref() if ref is not None else None
        if rec is not None and rec.src() is t and rec.version == t._version:
            self.stats_["saved_twice"] += 1
            rec.handles += 1
            return rec                               # the same tensor again: one copy
        layout = layout_of(t.shape, t.stride())
        if layout == "overlapping":
            return NOT_MINE
        nbytes = t.numel() * t.element_size()
        if (self._direct and layout == "dense" and nbytes - direct_head(t) >= PAGE
                and t.data_ptr() % t.element_size() == 0):
            return self._pack_direct(t, nbytes)
        host = self._lend(nbytes, t)                 # a range of the budgeted pool (may wait, bounded)
        rec = Saved(self, len(self._records), t, layout == "dense")
        rec.loans = (self._loan(rec, nbytes),)
        rec.loans[0].lend(host, read=False)          # -> READY: the host copy
        self._records.append(weakref.ref(rec))
        self._by_src[id(t)] = weakref.ref(rec)
        with self.telemetry.span("offload::act_d2h", "act_" + dev.link(t.device, _HOST), rec.nbytes):
            dst = rec.loans[0].acquire().view(rec.dtype)
            # dense: its bytes in memory order (any permutation of dims); gapped: packed
            src = t.as_strided((t.numel(),), (1,)) if rec.dense else t.contiguous().view(-1)
            rec.event = dev.copy_to_host_async(dst, src, self._d2h)
        with self._lock:
            self.stats_["saved_bytes"] += rec.nbytes
            self.stats_["d2h_bytes"] += rec.nbytes
            self.stats_["tensors"] += 1
        if rec.event is not None:
            self._device_hold(rec.nbytes)            # until the D2H ends, its memory is held
            self._copying.append(rec)
        else:
            rec.state = SavedState.OFF_DEVICE
            self._write(rec)
        self._pump()
        return rec

    def _loan(self, rec: Saved, nbytes: int, what: str = ""):
        """A loan of ``nbytes`` for ``rec``, its key taken from the free list at its write."""
        return self._tier.loan(None, nbytes, f"saved tensor {rec.index}{what} (shape {rec.shape}, {rec.dtype})",
                               keys=self._keys)

    def _pack_direct(self, t: torch.Tensor, nbytes: int) -> Saved:
        """CPU device, nvme: host and device are one memory, so a copy to the pool would only
        cost a memcpy and RSS. The tensor's bytes from its first page boundary on are written
        to NVMe straight from the tensor (O_DIRECT needs page-aligned memory), which is held
        (device bytes, within the write window) until the write is durable; the few bytes
        before that boundary go through a one-page range of the pool. The mirror of
        backward's read straight into device memory."""
        head = direct_head(t)
        host = self._lend(PAGE, t) if head else None
        rec = Saved(self, len(self._records), t, True)
        rec.head, rec.held = head, t
        flat = t.as_strided((t.numel(),), (1,)).view(torch.uint8)
        rec.loans = (self._loan(rec, nbytes - head),)
        rec.loans[0].lend(CallerBuffer(flat[head:]), read=False)     # written from the tensor itself
        if head:
            rec.loans += (self._loan(rec, PAGE, " head page"),)
            rec.loans[1].lend(host, read=False)
        self._records.append(weakref.ref(rec))
        self._by_src[id(t)] = weakref.ref(rec)
        self._device_hold(nbytes)                    # until its write is durable
        with self.telemetry.span("offload::act_d2h", "act_h2h", head):   # only the head page is copied
            if head:
                rec.loans[1].acquire()[PAGE - head:].copy_(flat[:head])
        with self._lock:
            self.stats_["saved_bytes"] += nbytes
            self.stats_["d2h_bytes"] += nbytes
            self.stats_["direct_bytes"] += nbytes
            self.stats_["direct_tensors"] += 1
            self.stats_["tensors"] += 1
        rec.state = SavedState.OFF_DEVICE
        self._write(rec)
        self._pump()
        return rec

    def _device_hold(self, n: int) -> None:
        with self._lock:
            self.device_bytes += n
            self.telemetry.peak("act_device_bytes", self.device_bytes)

    def _pump(self, final: bool = False) -> None:
        """Advance transfers started in forward: finished D2H copies go on to NVMe (more than
        ``lookahead_bytes`` of D2H in flight, or ``final``: the forward ended, waits for the
        oldest, so the device holds at most that much beyond what the forward itself keeps);
        finished writes give their host copies back; more than ``lookahead_bytes`` in flight
        to NVMe waits for the oldest, never for the newest: a tensor larger than the lookahead
        is written while forward goes on, and waited for only when the next one is saved
        (if it is still in flight then)."""
        while self._copying and (final or self.device_bytes > self.lookahead or self._copying[0].event.query()):
            self._finish_copy_out()
        while self._writing:
            rec = self._writing[0]
            over = self._writing_bytes > self.lookahead and len(self._writing) > 1
            if rec.writing and not (over or self._polled(rec)):
                break
            self._finish_write(rec)

    def _finish_copy_out(self) -> None:
        """The oldest D2H: wait for it (CUDA), then on to NVMe (the loan READY -> WRITING)."""
        rec = self._copying.popleft()
        if rec.state is SavedState.COPYING_OUT:
            dev.sync_event(rec.event)
            rec.event = None
            rec.state = SavedState.OFF_DEVICE
            self._device_hold(-rec.nbytes)
            self._write(rec)

    def _reap_writes(self) -> None:
        """Dequeue writes that finished (or were finished by a fetch), never wait."""
        while self._writing and (not self._writing[0].writing or self._polled(self._writing[0])):
            self._finish_write(self._writing[0])

    @staticmethod
    def _polled(rec: Saved) -> bool:
        """Settle ``rec``'s finished transfers (``Loan.poll``: never waits); True when none is in flight."""
        return all([loan.poll() for loan in rec.loans])

    def _write(self, rec: Saved) -> None:
        """nvme: commit the loans (each takes its key from the free list)."""
        if self.tier is not Placement.NVME:
            return
        self._tier.settle_retired()                  # retired keys come back before new ones are reserved
        with self.telemetry.span("offload::act_nvme_write"):
            for loan in rec.loans:                   # a direct write: body, then head page
                loan.commit()
        rec.writing = True
        self._writing.append(rec)
        self._writing_bytes += rec.nbytes

    def _finish_write(self, rec: Saved) -> None:
        """The oldest write: dequeue it, waiting for it unless a fetch already did."""
        self._writing.popleft()
        self._complete_write(rec)

    def _complete_write(self, rec: Saved) -> None:
        """Wait (bounded) for ``rec``'s write, if still in flight (it stays in ``_writing``
        until dequeued). Its loans go ON_TIER (their ranges back), or READY when a fetch kept
        the host copy (``Loan.keep``). A direct write's device tensor is let go
        (``_release_held``) unless unpack already handed it out (then it is autograd's,
        counted by the unpack)."""
        if not rec.writing:
            return
        rec.writing = False
        self._writing_bytes -= rec.nbytes
        self._wait(rec, "write")
        self._release_held(rec, counted=rec.state is SavedState.OFF_DEVICE and not rec.unpacks)

    def _release_held(self, rec: Saved, counted: bool = True) -> None:
        """A direct write is durable: the device tensor it was written from is autograd's
        again (freed unless something else holds it; ``counted``: its device bytes were
        still counted here). Its bytes must be what was saved: a tensor modified in place
        while its write ran has no good copy anywhere."""
        held, rec.held = rec.held, None
        if held is None:
            return
        if counted:
            self._device_hold(-rec.nbytes)
        if held._version != rec.version:
            raise RuntimeError(
                f"activation offload: a tensor saved for backward (shape {rec.shape}, {rec.dtype}) was modified by "
                "an inplace operation while it was written to NVMe; plain torch fails at backward on this too "
                "(a variable needed for gradient computation has been modified by an inplace operation): clone "
                "it before modifying it")

    # ---- the host pool -------------------------------------------------------------------------
    def _lend(self, nbytes: int, t: Optional[torch.Tensor] = None, wait: bool = True):
        """A range of ``nbytes`` from the pool. Without ``wait`` (a prefetch): None when none is
        free now. Else, while the pool is full, make room from the oldest transfer in flight
        (``_make_room``); when nothing here can give a range back, wait for other threads'
        graphs to go, all within ``wait_timeout_s``; then raise ActivationHostBudgetError."""
        try:
            buf = self.pool.try_acquire(nbytes, _HOLDER)
        except PoolBudgetError:
            raise self._budget_error(nbytes, t, single=True) from None
        if buf is not None or not wait:
            return self._lent(buf)

        def make_room() -> Room:
            before = self.pool.in_use_bytes
            self._tier.settle_retired()
            if self.pool.in_use_bytes < before or self._make_room():
                return Room.MADE
            mine = self._forward_host_bytes()
            if self.pool.in_use_bytes <= mine or mine + nbytes > self.pool.capacity_bytes:
                raise self._budget_error(nbytes, t)      # this forward's own copies fill it
            return Room.WAIT                             # ranges held by an earlier graph, freed on another thread
        with self.telemetry.span("offload::act_pool_wait"):
            try:      # the pool's one bounded wait
                buf = self.pool.acquire(nbytes, self.wait_timeout_s, holder=_HOLDER, make_room=make_room,
                                        poll_s=_POLL_S)
            except TimeoutError:
                raise self._budget_error(nbytes, t, waited=True) from None
        return self._lent(buf)

    def _lent(self, buf):
        if buf is not None:   # the pool lends to host copies only: its bytes in use are theirs
            self.telemetry.peak("act_host_bytes", self.pool.in_use_bytes)
        return buf

    def _make_room(self) -> bool:
        """Move the oldest transfer in flight one state on, so that a range comes back (or
        will: a finished D2H goes on to NVMe). False when nothing here is in flight."""
        if self._copying:
            self._finish_copy_out()
            return True
        if self._writing:
            self._finish_write(self._writing[0])
            return True
        if self._copying_in:
            rec = self._copying_in.pop(next(iter(self._copying_in)))
            dev.sync_event(rec.event)
            rec.event = None
            rec.state = SavedState.ON_DEVICE
            rec.loans[0].release()                   # the range back; the NVMe copy remains
            return True
        return False

    def _forward_host_bytes(self) -> int:
        """Pool bytes held by this forward's own host copies."""
        recs = [r() for r in self._records]
        return sum(loan.buffer.nbytes for r in recs if r is not None for loan in r.loans
                   if isinstance(loan.buffer, HostBuffer))

    def _budget_error(self, nbytes: int, t, single: bool = False, waited: bool = False) -> ActivationHostBudgetError:
        what = f"a saved tensor of {fmt_exact(nbytes)}" + (f" (shape {tuple(t.shape)}, {t.dtype})" if t is not None else "")
        cap = self.pool.capacity_bytes
        key = "offload_activations.host_bytes"
        if single:
            need = -(-nbytes // PAGE) * PAGE
            return ActivationHostBudgetError(
                f"activation offload ({self.tier}): {what} does not fit in the host pool ({key}={fmt_exact(cap)}): "
                f"raise {key} to at least {need}, or raise offload_activations.min_bytes above {nbytes - 1} to "
                "keep tensors this large on the device")
        if waited:
            return ActivationHostBudgetError(
                f"activation offload ({self.tier}): no room for {what} in the host pool ({key}={fmt_exact(cap)}, "
                f"{fmt_exact(self.pool.in_use_bytes)} in use) after {self.wait_timeout_s} s: the host copies of an "
                "earlier forward are still alive (a loss not yet backwarded, a graph kept with retain_graph); "
                f"free it before the next forward, or raise {key}")
        held = self._forward_host_bytes()
        return ActivationHostBudgetError(
            f"activation offload (cpu): the tensors this forward saves for backward need more than the host pool "
            f"({key}={fmt_exact(cap)}): {fmt_exact(held)} are held already and {what} does not fit; raise {key}, set "
            "offload_activations.device to nvme (host copies go on to NVMe as the pool fills), raise "
            "offload_activations.min_bytes, or checkpoint activations (torch.utils.checkpoint)")

    # ---- retired records: their loans' ranges and keys back -----------------------------------
    def _retire(self, rec: Saved) -> None:
        """The last handle of ``rec`` is gone: its loans retire (their ranges and keys go back
        at the tier's next ``settle_retired``: a finalizer may run inside the pool's own
        critical section). A transfer in flight keeps what it reads or writes alive until it
        ends (the loan holds its buffer: a pool range, or the caller's memory)."""
        with self._lock:
            if rec.restored is not None or rec.direct is not None or rec.held is not None:
                self.device_bytes -= rec.nbytes
        for loan in rec.loans:
            loan.retire()

    # ---- unpack: back to the device ------------------------------------------------------------
    def unpack(self, rec: Saved) -> torch.Tensor:
        with self.telemetry.span("offload::act_unpack"):
            last = rec.last() if rec.last is not None else None
            if last is not None:                     # saved twice, still alive: the same tensor
                rec.unpacks += 1
                if rec.unpacks >= rec.handles:
                    rec.keep = None
                return last
            if not self._unpacked or self._unpacked[-1] != rec.index:
                self._unpacked.append(rec.index)
            self._reap_writes()
            if self._on_its_way(rec):
                self._expected().hit()
            else:
                self._expected().miss()
            self._expected().advance(rec.index)
            t = self._restore(rec)
            self._prefetch()
            return t

    def _expected(self) -> Lookahead:
        """The lookahead over this forward's records, armed with the order the last backward
        used when it covered every record, else the reverse pack order (armed again, the
        cursor kept, when records were saved since: an unpack before the forward ended)."""
        n = len(self._records)
        if self._armed != n:
            order = self._order if self._order is not None and len(self._order) == n else range(n - 1, -1, -1)
            cursor = self._ahead.cursor if self._armed is not None else 0
            self._ahead.set_order(order)
            self._ahead.cursor = min(cursor, n)
            self._armed = n
        return self._ahead

    def _ahead_bytes(self, i: int) -> int:
        """What bringing record ``i`` back costs the window: none when there is nothing to
        bring (its graph is gone, or it was unpacked and is still alive)."""
        rec = self._records[i]() if i < len(self._records) else None
        return 0 if rec is None or rec.last is not None else rec.nbytes

    def _prefetch(self) -> None:
        """Bring back the tensors ahead of the cursor, within ``lookahead_bytes`` on the device
        (and always the next one, however large: it is needed soonest)."""
        for i in self._expected().window(self._ahead_bytes, self.lookahead, first=True):
            rec = self._records[i]() if i < len(self._records) else None
            if rec is None or rec.last is not None:
                continue
            if rec.state is SavedState.OFF_DEVICE and not self._on_its_way(rec):
                with self.telemetry.span("offload::act_prefetch"):
                    if not self._fetch(rec, wait=False):
                        break                        # the pool is full: on demand from here
            if rec.state is SavedState.OFF_DEVICE and self._polled(rec):   # its reads landed
                self._to_device(rec)

    def _on_its_way(self, rec: Saved) -> bool:
        """A fetch brought ``rec`` back or started to: on the device, or (nvme) its loans
        read or reading (a cpu tier's host copy is at rest READY)."""
        if rec.state in (SavedState.COPYING_IN, SavedState.ON_DEVICE):
            return True
        return (rec.state is SavedState.OFF_DEVICE and self.tier is Placement.NVME and not rec.writing
                and all(loan.state in (LoanState.READING, LoanState.READY) for loan in rec.loans))

    def _fetch(self, rec: Saved, wait: bool = True) -> bool:
        """Bring ``rec``'s bytes into memory: a host copy in flight or still written is kept
        (its loans READY); on NVMe: read (into a pool range; on the CPU device straight into
        device memory, the loans over it). Without ``wait``: False, nothing started, when
        the pool has no range now."""
        if rec.state is SavedState.COPYING_OUT:      # unpacked before its forward ended
            dev.sync_event(rec.event)
            rec.event = None
            self._device_hold(-rec.nbytes)
            rec.state = SavedState.OFF_DEVICE         # the loan READY; _pump only dequeues it
            return True
        if rec.writing and rec.held is not None and not rec.unpacks:
            # written from device memory, which is still here: handed back as it is (its
            # device bytes, counted since pack, go with it); the write goes on, and lets it go
            # when it is durable (_complete_write)
            rec.restored = rec.held
            rec.state = SavedState.ON_DEVICE
            with self._lock:
                self.stats_["h2d_bytes"] += rec.nbytes
                self.stats_["held_hits"] += 1
            return True
        if rec.writing:
            if rec.held is None:
                rec.loans[0].keep()                  # its host copy is still here: kept for the copy back
            self._complete_write(rec)                # (a direct write unpacked before it was durable: read)
        if rec.loans[0].state is not LoanState.ON_TIER:
            return True                              # in memory, or its read in flight
        if self.device.type == "cpu":                # host and device are one memory: no pool range
            if rec.head:                             # direct write: head page, then the body
                rec.direct = self._read_target(PAGE + rec.nbytes - rec.head)
                targets = (rec.direct[PAGE:], rec.direct[:PAGE])
            else:
                rec.direct = self._read_target(rec.nbytes)
                targets = (rec.direct,)
            self._device_hold(rec.nbytes)
            for loan, target in zip(rec.loans, targets):
                loan.lend(CallerBuffer(target), read=True)
            return True
        host = self._lend(rec.nbytes, wait=wait)
        if host is None:
            return False
        rec.loans[0].lend(host, read=True)
        return True

    def _read_target(self, nbytes: int) -> torch.Tensor:
        """CPU device: page-aligned device memory for a read, from the read window when it has
        room (reused pages), else fresh."""
        t = self._window.lend(nbytes) if self._window is not None else None
        return t if t is not None else _aligned_cpu_device(nbytes)

    def _wait(self, rec: Saved, direction: str) -> bool:
        """Settle ``rec``'s loans' reads or writes, waiting (bounded by ``wait_timeout_s`` in
        all) for those in flight; a wait that is needed is timed as ``offload::act_nvme_wait``
        and counted in ``wait_s[direction]``. Raises a transfer's error, if any (its buffer
        back first); returns whether it had to wait."""
        if self._polled(rec):
            return False
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.wait_timeout_s
        with self.telemetry.span("offload::act_nvme_wait"):
            for loan in rec.loans:
                left = max(0.0, deadline - time.monotonic())
                loan.acquire(left) if direction == "read" else loan.finish_write(left)
        with self._lock:
            self.stats_[f"{direction}_wait_s"] += time.perf_counter() - t0
        return True

    def _to_device(self, rec: Saved) -> None:
        """Loans READY -> COPYING_IN (CUDA) or ON_DEVICE (CPU): the tensor with its strides."""
        if rec.direct is not None:                    # CPU device, read from NVMe into device memory
            off = PAGE - rec.head if rec.head else 0   # a direct write's head page: the tensor starts in it
            src, rec.direct = rec.direct[off:off + rec.nbytes].view(rec.dtype), None
            for loan in rec.loans:
                loan.release()                        # the read target is the tensor's now
            with self.telemetry.span("offload::act_h2d", "act_h2h", 0 if rec.dense else rec.nbytes):
                if rec.dense:
                    t = src.as_strided(rec.shape, rec.stride)     # the read's target is the tensor
                else:
                    t = torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype, device=self.device)
                    t.copy_(src.view(rec.shape))
            rec.restored, rec.event = t, None
            rec.state = SavedState.ON_DEVICE          # device bytes held since the read began
            with self._lock:
                self.stats_["h2d_bytes"] += rec.nbytes
            return
        host = rec.loans[0].acquire().view(rec.dtype)
        with self.telemetry.span("offload::act_h2d", "act_" + dev.link(_HOST, self.device), rec.nbytes):
            if rec.dense:
                flat = self._empty_on_h2d(rec, (host.numel(),), (1,))
                ev = dev.copy_(flat, host, self._h2d)
                t = flat.as_strided(rec.shape, rec.stride)
            else:
                t = self._empty_on_h2d(rec, rec.shape, rec.stride)
                ev = dev.copy_(t, host.view(rec.shape), self._h2d)
        rec.restored, rec.event = t, ev
        rec.state = SavedState.COPYING_IN if ev is not None else SavedState.ON_DEVICE
        self._device_hold(rec.nbytes)
        with self._lock:
            self.stats_["h2d_bytes"] += rec.nbytes
        if self.tier is Placement.NVME and ev is None:
            rec.loans[0].release()                   # the range back; the NVMe copy remains for a second unpack
        elif self.tier is Placement.NVME:
            self._copying_in[id(rec)] = rec          # its range comes back when the copy ends

    def _empty_on_h2d(self, rec: Saved, shape, stride) -> torch.Tensor:
        """Device memory from the H2D stream's share of the caching allocator (device.py)."""
        if self._h2d is None:
            return torch.empty_strided(shape, stride, dtype=rec.dtype, device=self.device)
        with dev.use_stream(self._h2d):
            return torch.empty_strided(shape, stride, dtype=rec.dtype, device=self.device)

    def _restore(self, rec: Saved) -> torch.Tensor:
        if rec.state in (SavedState.COPYING_OUT, SavedState.OFF_DEVICE):
            self._fetch(rec)
        if rec.state is SavedState.OFF_DEVICE:
            if self._wait(rec, "read"):              # backward needed it before its read landed
                with self._lock:
                    self.stats_["late_reads"] += 1
            self._to_device(rec)
        if rec.state is SavedState.ON_DEVICE and rec.restored is not None and self._h2d is not None:
            dev.mark_used(rec.restored, dev.current_stream(self.device))   # copy synced by _make_room
        if rec.state is SavedState.COPYING_IN:
            self._copying_in.pop(id(rec), None)
            compute = dev.current_stream(self.device)
            dev.wait_event(compute, rec.event)
            dev.mark_used(rec.restored, compute)
            if self.tier is Placement.NVME:
                dev.sync_event(rec.event)
                rec.loans[0].release()
            rec.event = None
            rec.state = SavedState.ON_DEVICE
        if rec.state is not SavedState.ON_DEVICE:
            raise RuntimeError(f"a saved activation is {rec.state.value} after its restore, not on the device")
        t, rec.restored = rec.restored, None
        with self._lock:
            self.device_bytes -= rec.nbytes
        rec.last = weakref.ref(t)
        rec.unpacks += 1
        rec.keep = t if rec.unpacks < rec.handles else None   # another handle unpacks it soon
        # back to where it waits: the host copy (cpu tier) or the NVMe copy stays for a second unpack
        rec.state = SavedState.OFF_DEVICE
        return t

    # ---- report ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        snap = self.telemetry.snapshot()
        with self._lock:
            c = dict(self.stats_)
        out = {"device": self.tier, "tensors": c.get("tensors", 0), "saved_bytes": c.get("saved_bytes", 0),
               "saved_twice": c.get("saved_twice", 0), "direct_bytes": c.get("direct_bytes", 0),
               "direct_tensors": c.get("direct_tensors", 0),
               "bytes_moved": {"d2h": c.get("d2h_bytes", 0), "h2d": c.get("h2d_bytes", 0)},
               "gbps": {k[4:]: v for k, v in snap["gbps"].items() if k.startswith("act_")},   # per link copied over
               "device_bytes_peak": snap["peaks"].get("act_device_bytes", 0),
               "host_bytes_peak": snap["peaks"].get("act_host_bytes", 0),
               "host_pool_bytes": self.pool.capacity_bytes,
               "prefetch": {"hits": snap["counters"].get("act_prefetch_hits", 0),
                            "misses": snap["counters"].get("act_prefetch_misses", 0),
                            "before_durable": c.get("held_hits", 0), "late": c.get("late_reads", 0)},
               # seconds the engine's thread waited for NVMe: a pack for the writes ahead of it
               # (more than lookahead_bytes in flight), an unpack for its read ("late": reads
               # not landed when their unpack came, misses included)
               "wait_s": {"write": c.get("write_wait_s", 0.0), "read": c.get("read_wait_s", 0.0)}}
        if self._window is not None:
            self._window.settle()
            out["read_window"] = self._window.stats()
        if self.store is not None:
            st = self.store.stats()
            for d, key in (("read", "bytes_read"), ("write", "bytes_written")):
                out["bytes_moved"][f"nvme_{d}"] = st[key]
                sec = st[f"{d}_seconds"]
                out["gbps"][f"nvme_{d}"] = st[key] / sec / 1e9 if sec > 0 else 0.0
        return out

    def close(self) -> None:
        for rec in list(self._writing):
            for loan in rec.loans:
                try:
                    loan.finish_write(self.wait_timeout_s)
                except Exception:   # noqa: BLE001 - closing: the data is discarded anyway
                    pass
        self._writing.clear()
        self._records = []
        if self._window is not None:
            self._window.close()
