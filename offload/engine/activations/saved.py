"""One saved tensor that activation offload moved off the device (``Saved``): what it was
(dtype, shape, strides, layout), where its bytes are now, and the transfers in flight.

Its states (``SavedState``), moved by activations/offload.py::

    pack:      COPYING_OUT --(D2H done)--> ON_HOST [--write--> WRITING --(done)--> ON_NVME]
    backward:  ON_HOST | ON_NVME --fetch()--> READING --(read done)--> STAGED
               --to_device()--> COPYING_IN --(H2D done)--> ON_DEVICE --unpack--> (handed to autograd)
    direct (CPU device, nvme): ON_HOST --write--> WRITING --(done)--> ON_NVME, as above; a fetch
               while WRITING hands the held tensor over: WRITING --> ON_DEVICE (its write goes on)

The host/NVMe part looks like ``storage.tier.Loan`` (ON_HOST ~ READY, WRITING, ON_NVME ~
ON_TIER, READING, STAGED ~ READY) but is not one: a saved tensor's NVMe key is taken from a
free list at its write and given back at retirement (a loan's key is fixed), a fetch during
the write keeps the host copy (decided after the write started), a direct write or read
moves device memory in two transfers (head page, body) that no pool lent, and retirement
runs in a finalizer that must not wait for a transfer (a loan's release waits).

A record lives as long as autograd keeps a handle to it (``handles`` packs returned it);
when the last goes (``__del__``) its owner retires it: its host range and NVMe keys come
back on the owner's thread, never from the finalizer itself.
"""
from __future__ import annotations

import enum
import time
import weakref
from typing import Optional

import torch

from offload.storage.tier import PAGE


class SavedState(enum.Enum):
    COPYING_OUT = "copying_out"      # D2H in flight (CUDA)
    ON_HOST = "on_host"
    WRITING = "writing"              # NVMe write in flight from the host copy
    ON_NVME = "on_nvme"
    READING = "reading"              # NVMe read in flight into a host buffer
    STAGED = "staged"                # on the host again, ready for the H2D
    COPYING_IN = "copying_in"        # H2D in flight (CUDA)
    ON_DEVICE = "on_device"          # restored, waiting for its unpack


def layout_of(shape, stride) -> str:
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


class Transfers:
    """The NVMe transfers of one saved tensor moving together (a direct write's head page and
    body): done when all are; ``wait`` bounds them all by one ``timeout``."""

    __slots__ = ("ios",)

    def __init__(self, ios):
        self.ios = list(ios)

    def done(self) -> bool:
        return all(io.done() for io in self.ios)

    def wait(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for io in self.ios:
            io.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))


def direct_head(t: torch.Tensor) -> int:
    """Bytes of ``t`` before its first 4 KiB page boundary (0: it starts on one)."""
    return (-t.data_ptr()) % PAGE


class Saved:
    """One offloaded saved tensor: its metadata, where its bytes are, and its transfers."""

    __slots__ = ("owner", "index", "nbytes", "dtype", "shape", "stride", "dense", "device", "state", "host",
                 "direct", "key", "io", "event", "restored", "last", "src", "version", "handles", "unpacks", "keep",
                 "head", "head_key", "held", "wio", "__weakref__")

    def __init__(self, owner, index: int, t: torch.Tensor, dense: bool, host):
        self.owner = owner
        self.index = index                 # pack order within its forward
        self.nbytes = t.numel() * t.element_size()
        self.dtype, self.shape, self.stride = t.dtype, tuple(t.shape), tuple(t.stride())
        self.dense = dense                 # bytes copied in memory order; else gapped: element by element
        self.device = t.device
        self.state = SavedState.COPYING_OUT
        self.host = host                             # HostBuffer lent by the pool: the host copy
        self.direct: Optional[torch.Tensor] = None   # CPU device, nvme: 1-D uint8 read target (device memory)
        self.key: Optional[str] = None               # NVMe key
        self.io = None                               # NVMe read in flight
        self.wio = None                              # NVMe write in flight (while in ``_writing``)
        self.event = None                            # CUDA copy in flight (either way)
        self.restored: Optional[torch.Tensor] = None  # device tensor ahead of its unpack
        self.last = None                             # weakref to the tensor last handed out
        self.src = weakref.ref(t)                    # identifies "the same tensor saved twice"
        self.version = t._version
        self.handles = 1                             # packs that returned this record
        self.unpacks = 0
        self.keep: Optional[torch.Tensor] = None     # the restored tensor, until every handle unpacked it
        # Written straight from device memory (CPU device, nvme; ``head`` is not None): the body
        # (from the first page boundary on) goes to ``key`` from the tensor itself, which
        # ``held`` keeps alive until the write is durable; the ``head`` bytes before that
        # boundary go through a one-page range of the pool (``host``) to ``head_key``.
        self.head: Optional[int] = None
        self.head_key: Optional[str] = None
        self.held: Optional[torch.Tensor] = None

    def __del__(self):
        # the last handle is gone: the graph that saved it was freed (backward, or dropped)
        try:
            self.owner._retire(self)
        except Exception:   # noqa: BLE001 - interpreter shutdown: nothing left to return
            pass
