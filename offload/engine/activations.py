"""Activation offload: tensors saved for backward leave the device during forward and come
back ahead of their use in backward.

A handler of the saved-tensor chain (engine/hooks.py). ``pack`` claims a saved tensor of at
least ``min_bytes`` that is not a parameter, a view of a parameter or a buffer (parameter
offload owns those), copies it off the device and returns a handle; ``unpack`` returns the
tensor from the handle, bit for bit, with its shape, strides and dtype. A tensor saved twice
(the same tensor object, unmodified) gets a second handle to the same copy. Packing happens
only in the root forward: inside ``torch.utils.checkpoint`` regions the checkpoint's own
hooks take precedence, so only the checkpoint boundaries (its saved inputs) move, and
recomputation in backward saves its tensors on the device for their short life.

One saved tensor (``_Saved``) moves through explicit states::

    pack:      COPYING_OUT --(D2H done)--> ON_HOST [--write--> WRITING --(done)--> ON_NVME]
    backward:  ON_HOST | ON_NVME --fetch()--> READING --(read done)--> STAGED
               --to_device()--> COPYING_IN --(H2D done)--> ON_DEVICE --unpack--> (handed to autograd)

Lifetimes. The device copy of a packed tensor is autograd's to free; on CUDA the D2H runs
on a side stream after the producing kernels and ``record_stream`` keeps its memory from
reuse until the copy ends. The host copy (pinned on CUDA, 4 KiB-aligned for O_DIRECT) lives
while any handle does (a retained graph may unpack twice), or, with ``nvme``, only until its
write is durable; the NVMe extent (a key of the store, checksummed per extent like all the
engine's swap data) returns to a free list when the last handle goes. Bytes in flight to
NVMe are bounded by ``lookahead_bytes``: packing waits (bounded) for the oldest write.

Backward order. Saved tensors are expected back in the order the last backward unpacked
them (the first step: reverse pack order). Each unpack advances a cursor along that order
and starts bringing back the tensors ahead of it within ``lookahead_bytes`` (NVMe read, then
the H2D copy on a side stream); an unpack that finds its tensor not yet on its way counts a
miss and fetches on demand. Restored tensors wait on the device only until unpacked.
"""
from __future__ import annotations

import collections
import enum
import threading
import weakref
from typing import Dict, List, Optional

import torch
from torch import nn

from offload import device as dev
from offload.engine.hooks import NOT_MINE, in_backward

_WAIT_S = 600.0       # the longest a single NVMe transfer may take before it is an error


class SavedState(enum.Enum):
    COPYING_OUT = "copying_out"      # D2H in flight (CUDA)
    ON_HOST = "on_host"
    WRITING = "writing"              # NVMe write in flight from the host copy
    ON_NVME = "on_nvme"
    READING = "reading"              # NVMe read in flight into a host buffer
    STAGED = "staged"                # on the host again, ready for the H2D
    COPYING_IN = "copying_in"        # H2D in flight (CUDA)
    ON_DEVICE = "on_device"          # restored, waiting for its unpack


def _aligned_host(nbytes: int, pin: bool) -> torch.Tensor:
    """A 1-D uint8 host buffer of ``nbytes`` starting on a 4 KiB page (O_DIRECT)."""
    if pin and dev.can_pin():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)   # page-aligned
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % 4096
    return raw[skip:skip + nbytes]


def _layout(shape, stride) -> str:
    """"dense" (contiguous up to a permutation of dims), "gapped" (no element shared, gaps
    between them: a slice) or "overlapping" (an expanded view; not moved: its restore could
    not be written element by element). Sufficient test: dims sorted by stride each step
    past the furthest element the smaller dims reach."""
    reach, expect, dense = 0, 1, True
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride) if sz > 1):
        if st <= reach:
            return "overlapping"
        dense = dense and st == expect
        reach += (sz - 1) * st
        expect = st * sz
    return "dense" if dense else "gapped"


class _Saved:
    """One offloaded saved tensor: its metadata, where its bytes are, and its transfers."""

    __slots__ = ("owner", "index", "nbytes", "dtype", "shape", "stride", "dense", "device", "state", "host",
                 "key", "io", "event", "restored", "last", "src", "version", "handles", "unpacks", "keep",
                 "__weakref__")

    def __init__(self, owner: "ActivationOffload", index: int, t: torch.Tensor, dense: bool):
        self.owner = owner
        self.index = index                 # pack order within its forward
        self.nbytes = t.numel() * t.element_size()
        self.dtype, self.shape, self.stride = t.dtype, tuple(t.shape), tuple(t.stride())
        self.dense = dense                 # bytes copied in memory order; else gapped: element by element
        self.device = t.device
        self.state = SavedState.COPYING_OUT
        self.host: Optional[torch.Tensor] = None     # 1-D uint8 host copy
        self.key: Optional[str] = None               # NVMe key
        self.io = None                               # NVMe transfer in flight
        self.event = None                            # CUDA copy in flight (either way)
        self.restored: Optional[torch.Tensor] = None  # device tensor ahead of its unpack
        self.last = None                             # weakref to the tensor last handed out
        self.src = weakref.ref(t)                    # identifies "the same tensor saved twice"
        self.version = t._version
        self.handles = 1                             # packs that returned this record
        self.unpacks = 0
        self.keep: Optional[torch.Tensor] = None     # the restored tensor, until every handle unpacked it

    def __del__(self):
        # the last handle is gone: the graph that saved it was freed (backward, or dropped)
        try:
            self.owner._retire(self)
        except Exception:   # noqa: BLE001 - interpreter shutdown: nothing left to return
            pass


class ActivationOffload:
    """The activation side of the saved-tensor chain; ``saved_tensors`` is itself."""

    def __init__(self, *, model: nn.Module, device: torch.device, tier: str, min_bytes: int,
                 lookahead_bytes: int, pin: bool, store=None, telemetry):
        assert tier in ("cpu", "nvme"), tier
        self.model = model
        self.device = device
        self.tier = tier
        self.min_bytes = max(1, int(min_bytes))
        self.lookahead = int(lookahead_bytes)
        self.pin = pin
        self.store = store                  # NvmeStore for tier nvme
        self.telemetry = telemetry
        self.saved_tensors = self
        self._d2h = dev.new_stream(device)
        self._h2d = dev.new_stream(device)
        # Records retire (``__del__``) on whichever thread drops the graph, possibly inside a
        # locked section of this one: counters take a re-entrant lock, retired keys go
        # through a deque (atomic appends) and are settled under the lock later.
        self._lock = threading.RLock()
        self._free_keys: Dict[int, List[str]] = collections.defaultdict(list)
        self._retired = collections.deque()  # (key, size, io) whose last handle is gone
        self._draining: List[tuple] = []     # ... whose transfer was still in flight
        self._reserved = collections.Counter()   # key size -> keys reserved
        self._param_storages: set = set()
        self._records: List[weakref.ref] = []        # this forward's records, pack order
        self._by_src: Dict[int, weakref.ref] = {}    # id(tensor) -> record (saved twice)
        self._copying = collections.deque()          # records with a D2H in flight (CUDA), oldest first
        self._writing = collections.deque()          # records with an NVMe write in flight
        # nvme: host copies that went to disk come back here for the next pack of the same
        # size (no fresh pages to fault in per tensor); at most lookahead_bytes are kept
        self._spare: Dict[int, List[torch.Tensor]] = collections.defaultdict(list)
        self._spare_bytes = 0
        self._in_forward = False
        self._writing_bytes = 0
        self._order: Optional[List[int]] = None      # expected unpack order (record indices)
        self._unpacked: List[int] = []               # this backward's unpack order
        self._pos: Dict[int, int] = {}
        self._cursor = 0
        self.device_bytes = 0               # offloaded tensors' bytes on the device held here
        self.host_bytes = 0                 # host copies alive
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
        self._pos, self._cursor = {}, 0
        self._param_storages = {t.untyped_storage().data_ptr()
                                for t in list(self.model.parameters()) + list(self.model.buffers())
                                if t.numel() and t.device.type != "meta"}

    def end_forward(self) -> None:
        """Copies of this forward are off the device; the first tensors backward needs start
        coming back now (backward begins right after the forward, typically)."""
        self._pump(final=True)
        self._in_forward = False
        self._spare.clear()                          # no packs until the next forward
        self._spare_bytes = 0
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
        layout = _layout(t.shape, t.stride())
        if layout == "overlapping":
            return NOT_MINE
        rec = _Saved(self, len(self._records), t, layout == "dense")
        self._records.append(weakref.ref(rec))
        self._by_src[id(t)] = weakref.ref(rec)
        with self.telemetry.span("offload::act_d2h", "act_d2h", rec.nbytes):
            rec.host = self._host_buffer(rec.nbytes)
            dst = rec.host.view(rec.dtype) if rec.nbytes else rec.host
            # dense: its bytes in memory order (any permutation of dims); gapped: packed
            src = t.as_strided((t.numel(),), (1,)) if rec.dense else t.contiguous().view(-1)
            rec.event = dev.copy_to_host_async(dst, src, self._d2h)
        with self._lock:
            self.host_bytes += rec.nbytes
            self.stats_["saved_bytes"] += rec.nbytes
            self.stats_["d2h_bytes"] += rec.nbytes
            self.stats_["tensors"] += 1
            self.telemetry.peak("act_host_bytes", self.host_bytes)
        if rec.event is not None:
            self._device_hold(rec.nbytes)            # until the D2H ends, its memory is held
            self._copying.append(rec)
        else:
            rec.state = SavedState.ON_HOST
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
        to NVMe waits for the oldest."""
        while self._copying and (final or self.device_bytes > self.lookahead or self._copying[0].event.query()):
            rec = self._copying.popleft()
            if rec.state is SavedState.COPYING_OUT:
                dev.sync_event(rec.event)
                rec.event = None
                rec.state = SavedState.ON_HOST
                self._device_hold(-rec.nbytes)
                self._write(rec)
        while self._writing:
            rec = self._writing[0]
            if rec.state is SavedState.WRITING and not (self._writing_bytes > self.lookahead or rec.io.done()):
                break
            self._finish_write(rec)

    def _reap_writes(self) -> None:
        """Backward: dequeue writes that finished (or were finished by a fetch), never wait."""
        while self._writing and (self._writing[0].state is not SavedState.WRITING or self._writing[0].io.done()):
            self._finish_write(self._writing[0])

    def _write(self, rec: _Saved) -> None:
        if self.tier != "nvme":
            return
        rec.key = self._take_key(rec.nbytes)
        with self.telemetry.span("offload::act_nvme_write"):
            rec.io = self.store.write(rec.key, rec.host)
        rec.state = SavedState.WRITING
        self._writing.append(rec)
        self._writing_bytes += rec.nbytes

    def _finish_write(self, rec: _Saved) -> None:
        self._writing.popleft()
        if rec.state is not SavedState.WRITING:
            return                                   # already waited for by a fetch
        self._writing_bytes -= rec.nbytes
        with self.telemetry.span("offload::act_nvme_wait"):
            rec.io.wait(_WAIT_S)
        rec.io = None
        rec.state = SavedState.ON_NVME
        self._drop_host(rec, reuse=True)

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        spare = self._spare.get(nbytes)
        if spare:
            self._spare_bytes -= nbytes
            return spare.pop()
        return _aligned_host(nbytes, self.pin)

    def _drop_host(self, rec: _Saved, reuse: bool = False) -> None:
        """The host copy goes; with ``reuse`` (nobody else holds it: its write is durable)
        it is kept for the next pack of the same size, within lookahead_bytes."""
        host, rec.host = rec.host, None
        if host is not None:
            with self._lock:
                self.host_bytes -= rec.nbytes
            if reuse and self._in_forward and self._spare_bytes + rec.nbytes <= self.lookahead:
                self._spare[rec.nbytes].append(host)
                self._spare_bytes += rec.nbytes

    # ---- NVMe keys -----------------------------------------------------------------------------
    @staticmethod
    def _key_size(nbytes: int) -> int:
        return -(-max(nbytes, 1) // 4096) * 4096

    def _take_key(self, nbytes: int) -> str:
        """A free NVMe key of this size; none free: reserve as many again as this size has
        (sizes repeat per layer, so a step's keys take a few swap files, once)."""
        size = self._key_size(nbytes)
        with self._lock:
            self._settle_retired()
            free = self._free_keys[size]
            if free:
                return free.pop()
            n = max(1, self._reserved[size])
            base = sum(self._reserved.values())
            names = [f"a{base + j}" for j in range(n)]
            self._reserved[size] += n
        self.store.reserve({k: size for k in names})
        with self._lock:
            self._free_keys[size].extend(names[1:])
        return names[0]

    def _settle_retired(self) -> None:   # lock held
        while self._retired:
            self._draining.append(self._retired.popleft())
        keep = []
        for key, size, io in self._draining:
            if io is None or io.done():
                self._free_keys[size].append(key)
            else:
                keep.append((key, size, io))   # a transfer on the key is still in flight
        self._draining = keep

    def _retire(self, rec: _Saved) -> None:
        """The last handle of ``rec`` is gone: its host copy and NVMe key go back."""
        with self._lock:
            if rec.host is not None:
                self.host_bytes -= rec.nbytes
            if rec.restored is not None:
                self.device_bytes -= rec.nbytes
        if rec.key is not None:
            self._retired.append((rec.key, self._key_size(rec.nbytes), rec.io))

    # ---- unpack: back to the device ------------------------------------------------------------
    def unpack(self, rec: _Saved) -> torch.Tensor:
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
            if rec.state in (SavedState.READING, SavedState.STAGED, SavedState.COPYING_IN, SavedState.ON_DEVICE):
                self.stats_["prefetch_hits"] += 1
            else:
                self.stats_["prefetch_misses"] += 1
            self._advance(rec.index)
            t = self._restore(rec)
            self._prefetch()
            return t

    def _advance(self, index: int) -> None:
        order = self._expected_order()
        if not self._pos:
            self._pos = {i: k for k, i in enumerate(order)}
        k = self._pos.get(index)
        if k is not None and k + 1 > self._cursor:
            self._cursor = k + 1

    def _expected_order(self) -> List[int]:
        n = len(self._records)
        if self._order is not None and len(self._order) == n:
            return self._order
        self._order = list(range(n - 1, -1, -1))
        return self._order

    def _prefetch(self) -> None:
        """Bring back the tensors ahead of the cursor, within ``lookahead_bytes`` on the device."""
        order = self._expected_order()
        ahead = 0
        for i in order[self._cursor:]:
            rec = self._records[i]() if i < len(self._records) else None
            if rec is None or rec.last is not None:
                continue
            ahead += rec.nbytes
            if ahead > self.lookahead:
                break
            if rec.state in (SavedState.ON_HOST, SavedState.ON_NVME, SavedState.WRITING):
                with self.telemetry.span("offload::act_prefetch"):
                    self._fetch(rec)
            if rec.state is SavedState.READING and rec.io.done():
                self._staged(rec)
            if rec.state is SavedState.STAGED:
                self._to_device(rec)

    def _fetch(self, rec: _Saved) -> None:
        """ON_HOST (or still COPYING_OUT / WRITING: the host copy is here) -> STAGED;
        ON_NVME -> READING (a host buffer, the read in flight)."""
        if rec.state is SavedState.COPYING_OUT:      # unpacked before its forward ended
            dev.sync_event(rec.event)
            rec.event = None
            self._device_hold(-rec.nbytes)
            rec.state = SavedState.STAGED             # _pump only dequeues it
            return
        if rec.state is SavedState.WRITING:
            self._writing_bytes -= rec.nbytes         # finished here; _pump only dequeues it
            with self.telemetry.span("offload::act_nvme_wait"):
                rec.io.wait(_WAIT_S)
            rec.io = None
            rec.state = SavedState.STAGED              # its host copy is still here
            return
        if rec.state is SavedState.ON_HOST:
            rec.state = SavedState.STAGED
            return
        assert rec.state is SavedState.ON_NVME, rec.state
        rec.host = _aligned_host(rec.nbytes, self.pin)
        with self._lock:
            self.host_bytes += rec.nbytes
            self.telemetry.peak("act_host_bytes", self.host_bytes)
        rec.io = self.store.read(rec.key, rec.host)
        rec.state = SavedState.READING

    def _staged(self, rec: _Saved) -> None:
        with self.telemetry.span("offload::act_nvme_wait"):
            rec.io.wait(_WAIT_S)
        rec.io = None
        rec.state = SavedState.STAGED

    def _to_device(self, rec: _Saved) -> None:
        """STAGED -> COPYING_IN (CUDA) or ON_DEVICE (CPU): the tensor with its strides."""
        host = rec.host.view(rec.dtype) if rec.nbytes else rec.host
        with self.telemetry.span("offload::act_h2d", "act_h2d", rec.nbytes):
            if self.device.type == "cpu" and self.tier == "nvme" and rec.dense:
                t = host.as_strided(rec.shape, rec.stride)   # read from NVMe straight into it
                ev = None
            elif rec.dense:
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
        if self.tier == "nvme" and ev is None:
            self._drop_host(rec)                     # the NVMe copy remains for a second unpack

    def _empty_on_h2d(self, rec: _Saved, shape, stride) -> torch.Tensor:
        """Device memory from the H2D stream's share of the caching allocator (device.py)."""
        if self._h2d is None:
            return torch.empty_strided(shape, stride, dtype=rec.dtype, device=self.device)
        with torch.cuda.stream(self._h2d):
            return torch.empty_strided(shape, stride, dtype=rec.dtype, device=self.device)

    def _restore(self, rec: _Saved) -> torch.Tensor:
        if rec.state in (SavedState.COPYING_OUT, SavedState.ON_HOST, SavedState.ON_NVME, SavedState.WRITING):
            self._fetch(rec)
        if rec.state is SavedState.READING:
            self._staged(rec)
        if rec.state is SavedState.STAGED:
            self._to_device(rec)
        if rec.state is SavedState.COPYING_IN:
            compute = dev.current_stream(self.device)
            dev.wait_event(compute, rec.event)
            dev.mark_used(rec.restored, compute)
            if self.tier == "nvme":
                dev.sync_event(rec.event)
                self._drop_host(rec)
            rec.event = None
            rec.state = SavedState.ON_DEVICE
        assert rec.state is SavedState.ON_DEVICE, rec.state
        t, rec.restored = rec.restored, None
        with self._lock:
            self.device_bytes -= rec.nbytes
        rec.last = weakref.ref(t)
        rec.unpacks += 1
        rec.keep = t if rec.unpacks < rec.handles else None   # another handle unpacks it soon
        # back to where it waits: the host copy (cpu tier) or the NVMe copy stays for a second unpack
        rec.state = SavedState.ON_HOST if self.tier == "cpu" else SavedState.ON_NVME
        return t

    # ---- report ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        snap = self.telemetry.snapshot()
        with self._lock:
            c = dict(self.stats_)
        out = {"device": self.tier, "tensors": c.get("tensors", 0), "saved_bytes": c.get("saved_bytes", 0),
               "saved_twice": c.get("saved_twice", 0),
               "bytes_moved": {"d2h": c.get("d2h_bytes", 0), "h2d": c.get("h2d_bytes", 0)},
               "gbps": {k[4:]: snap["gbps"].get(k, 0.0) for k in ("act_d2h", "act_h2d")},
               "device_bytes_peak": snap["peaks"].get("act_device_bytes", 0),
               "host_bytes_peak": snap["peaks"].get("act_host_bytes", 0),
               "prefetch": {"hits": c.get("prefetch_hits", 0), "misses": c.get("prefetch_misses", 0)}}
        if self.store is not None:
            st = self.store.stats()
            for d, key in (("read", "bytes_read"), ("write", "bytes_written")):
                out["bytes_moved"][f"nvme_{d}"] = st[key]
                sec = st[f"{d}_seconds"]
                out["gbps"][f"nvme_{d}"] = st[key] / sec / 1e9 if sec > 0 else 0.0
        return out

    def close(self) -> None:
        for rec in list(self._writing):
            try:
                rec.io.wait(_WAIT_S)
            except Exception:   # noqa: BLE001 - closing: the data is discarded anyway
                pass
        self._writing.clear()
        self._records = []
