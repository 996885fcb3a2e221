"""One saved tensor that activation offload moved off the device (``Saved``): what it was
(dtype, shape, strides, layout), the loans its bytes are on, and its device copies.

Its host copy and NVMe copy are ``storage.loan.Loan``s of the activation tier (one, or two for
a direct write: the body and the head page), moved by their verbs: lent a pool range (or the
caller's memory, ``CallerBuffer``: the tensor itself, a read target in device memory),
committed to a key the free list gives at the write (activations/keys.py), kept
(``Loan.keep``) when a fetch comes during the write, released once copied back, retired when
the record goes. The record's own states are the device side only (``SavedState``), moved by
activations/handler.py::

    pack:      COPYING_OUT --(D2H done)--> OFF_DEVICE     (loans READY [--commit()--> WRITING --> ON_TIER])
    backward:  OFF_DEVICE (loans READY: the host copy, or read back) --to_device()--> COPYING_IN
               --(H2D done)--> ON_DEVICE (CPU device: at once) --unpack--> OFF_DEVICE
    direct (CPU device, nvme): a fetch while the write is in flight hands the held tensor
               over: OFF_DEVICE --> ON_DEVICE (the loans' write goes on)

A record lives as long as autograd keeps a handle to it (``handles`` packs returned it);
when the last goes (``__del__``) its owner retires its loans (``Loan.retire``: never waits),
whose ranges and keys come back on the owner's thread (``settle_retired``).
"""
from __future__ import annotations

import enum
import weakref
from typing import Optional

import torch

from offload.units import PAGE


class SavedState(enum.Enum):
    COPYING_OUT = "copying_out"      # D2H into the loan's buffer in flight (CUDA)
    OFF_DEVICE = "off_device"        # where the bytes are is the loans' state
    COPYING_IN = "copying_in"        # H2D from the loan's buffer in flight (CUDA)
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


def direct_head(t: torch.Tensor) -> int:
    """Bytes of ``t`` before its first 4 KiB page boundary (0: it starts on one)."""
    return (-t.data_ptr()) % PAGE


class Saved:
    """One offloaded saved tensor: its metadata, its loans, and its device copies."""

    __slots__ = ("owner", "index", "nbytes", "dtype", "shape", "stride", "dense", "device", "state", "loans",
                 "writing", "direct", "event", "restored", "last", "src", "version", "handles", "unpacks", "keep",
                 "head", "held", "__weakref__")

    def __init__(self, owner, index: int, t: torch.Tensor, dense: bool):
        self.owner = owner
        self.index = index                 # pack order within its forward
        self.nbytes = t.numel() * t.element_size()
        self.dtype, self.shape, self.stride = t.dtype, tuple(t.shape), tuple(t.stride())
        self.dense = dense                 # bytes copied in memory order; else gapped: element by element
        self.device = t.device
        self.state = SavedState.COPYING_OUT
        self.loans: tuple = ()                       # the host / NVMe copy (a direct write: body, head page)
        self.writing = False                         # its write is in flight (in the owner's ``_writing``)
        self.direct: Optional[torch.Tensor] = None   # CPU device, nvme: 1-D uint8 read target (device memory)
        self.event = None                            # CUDA copy in flight (either way)
        self.restored: Optional[torch.Tensor] = None  # device tensor ahead of its unpack
        self.last = None                             # weakref to the tensor last handed out
        self.src = weakref.ref(t)                    # identifies "the same tensor saved twice"
        self.version = t._version
        self.handles = 1                             # packs that returned this record
        self.unpacks = 0
        self.keep: Optional[torch.Tensor] = None     # the restored tensor, until every handle unpacked it
        # Written straight from device memory (CPU device, nvme; ``head`` is not None): the body
        # (from the first page boundary on) is written from the tensor itself (a loan over the
        # caller's memory), which ``held`` keeps alive until the write is durable; the ``head``
        # bytes before that boundary go through a one-page range of the pool (the second loan).
        self.head: Optional[int] = None
        self.held: Optional[torch.Tensor] = None

    def __del__(self):
        # the last handle is gone: the graph that saved it was freed (backward, or dropped)
        try:
            self.owner._retire(self)
        except Exception:   # noqa: BLE001 - interpreter shutdown: nothing left to return
            pass
