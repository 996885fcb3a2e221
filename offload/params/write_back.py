"""The updated parameters' way back home (``ParamWriteBack``): the optimizer's two verbs per
block update (``target``, ``commit``), to the parameter part's home (params/part.py) or the
device flat."""
from __future__ import annotations

import collections
import threading
import time
from typing import Optional

import torch

from offload import device as dev
from offload.core.errors import BlockError
from offload.params.part import ParamStateError
from offload.storage.loan import DEFAULT_WAIT_S
from offload.storage.pool import Room


class ParamWriteBack:
    """Parameter write-back: the updated parameters go where the parameters live.

    The optimizer pipeline calls two verbs per block update, on its worker thread:

        out = writer.target(block)      # where the kernel writes the new parameter copy (or None)
        ... the rule's CPU step (writes ``out`` when it is not None) ...
        writer.commit(block, master, out, compute_done)

    Where the copy goes depends only on the parameters' residency:
      * offloaded parameters (``block.trainable``, a ParamPart): the new home copy is assembled in
        the HOST home itself, or (NVMe home) in a buffer of the write pool; ``ParamPart.write_home``
        then bumps the home version, so device copies made before are stale and refetched. An
        NVMe block the next forward uses soon (``keep_staged(index)``, decided by parameter
        offload at the commit) is assembled in a staging buffer instead and written through: it
        stays staged, current, for that use. NVMe writes are asynchronous: the job submits the
        write and moves on; the buffer belongs to the block's home until the write completes
        (params/part.py settles it). A worker that finds no write buffer free settles the
        oldest write it submitted (bounded); a failure found so is the written block's, recorded
        by its home, never raised inside the job that found it;
      * resident parameters (``block.param_flat`` on the device): on a CPU device the kernel
        writes the flat directly; on CUDA into this worker's pinned staging buffer, copied to
        the device on a side stream after the block's backward kernels (``compute_done``); the
        compute stream waits for ``block.update.event`` before the next use;
      * resident fp32 parameters, or optimizer state on the device: ``out`` is None and the copy
        is taken from the fp32 master; on a CPU device with the state in host memory (tier cpu,
        or none: the device's memory is the host's) the parameters are the master itself (engine/build.py
        ``_master_is_param``), so ``commit`` has nothing to copy.
    Offloaded parameters always get a ``target``, fp32 included: the CPU kernel writes the new
    values there in the pass that updates the master (a device-side update copies them there)."""

    def __init__(self, *, compute_device: torch.device, copy_param: bool, state_on_device: bool,
                 write_pool=None, telemetry, wait_timeout_s: Optional[float] = None,
                 keep_staged=None) -> None:
        self._copy_param = copy_param             # fp32 parameters: copied from the master
        self._state_on_device = state_on_device   # the master is on the device (tier none)
        self._write_pool = write_pool             # host buffers for NVMe-home write-back
        self._h2d = dev.new_stream(compute_device)
        self._staging = threading.local()         # per worker: pinned copy for the H2D, NVMe write loan
        self.telemetry = telemetry
        self.wait_timeout_s = wait_timeout_s      # bound on waiting for a write buffer
        self._keep_staged = keep_staged           # block index -> write through a staging buffer
        self._lock = threading.Lock()
        self._pool_writes = collections.deque()   # ParamPart whose write may hold a write buffer

    def target(self, block, whole_master: bool = True) -> Optional[torch.Tensor]:
        """Where the kernel writes this rank's shard of the new parameters, in the same pass
        as the update (None: resident fp32 parameters, copied from the master by ``commit``,
        or the master itself). Offloaded parameters always get their destination (the home
        copy being assembled), fp32 ones included: the kernel writes the updated values
        there as it streams the master, so no copy of the master follows the update.
        ``whole_master`` False (optimizer state in chunks: the master is never whole):
        resident fp32 parameters get their destination too, which the caller fills from
        each chunk's master."""
        s0, s1 = block.shard
        if block.trainable is not None:
            return block.home_shard(self._home_target(block))
        from_master = self._copy_param and whole_master
        if from_master or self._state_on_device:
            return None   # copied (and cast) from the master by commit()
        if not dev.is_cuda(block.param_flat.device):
            return block.param_flat[s0:s1]
        buf = getattr(self._staging, "buf", None)
        if buf is None or buf.numel() < s1 - s0 or buf.dtype != block.param_flat.dtype:
            buf = dev.empty_host(max(s1 - s0, 1 << 20), block.param_flat.dtype, pin=True)
            self._staging.buf = buf
        return buf[:s1 - s0]

    def _home_target(self, block) -> torch.Tensor:
        """The buffer the new home copy of an offloaded block is assembled in: the HOST home
        itself, or (NVMe home) a write buffer held by this worker until written."""
        bp = block.trainable
        home = bp.home_view_for_write()
        if home is not None:
            return home
        # Decided once per update: ``target()`` and ``commit()`` both ask, and the kernel has
        # written into the first answer by the time commit() asks again (whether the block is
        # kept staged, or a staging buffer is free, may have changed in between).
        current = getattr(self._staging, "current", None)
        if current is not None:
            return current
        if self._keep_staged is not None and self._keep_staged(block.index):
            # waits (bounded) for the home's last write-back, if it is still in flight
            with self.telemetry.span("offload::param_write_wait"):
                through = bp.begin_write_through()    # None: no staging buffer free now
            if through is not None:
                self._staging.through = through       # this worker's, until commit / abort
                self._staging.current = through
                return through
        loan = getattr(self._staging, "loan", None)
        if loan is None:
            loan = self._staging.loan = self._write_buffer(bp.home_nbytes)
        self._staging.current = loan.view(bp.dtype, bp.home_numel)
        return self._staging.current

    def _write_buffer(self, nbytes: int):
        """A write-pool buffer: the pool's one bounded wait (``wait_timeout_s`` overall), the
        oldest write-back in flight waited for while none is free."""
        timeout = self.wait_timeout_s if self.wait_timeout_s is not None else DEFAULT_WAIT_S
        deadline = time.monotonic() + timeout

        def make_room() -> Room:
            with self._lock:
                older = self._pool_writes.popleft() if self._pool_writes else None
            if older is None:           # every buffer is with another worker's job: it ends soon
                return Room.WAIT
            with self.telemetry.span("offload::param_write_wait"):
                try:
                    older.finish_write(max(0.0, deadline - time.monotonic()))
                except BlockError:      # the written block's failure, recorded by its home
                    pass
            return Room.MADE
        return self._write_pool.acquire(nbytes, timeout, holder="a parameter write-back", make_room=make_room)

    def abort(self, block=None) -> None:
        """After a failed update on this worker: give back the write buffer it held (and
        ``block``'s staging buffer, when it was being written through)."""
        self._staging.current = None
        if getattr(self._staging, "through", None) is not None:
            self._staging.through = None
            if block is not None and block.trainable is not None:
                block.trainable.abort_write_through()
        loan = getattr(self._staging, "loan", None)
        if loan is not None:
            self._staging.loan = None
            loan.release()

    def adopt(self, block, slot) -> bool:
        """An update computed ahead (optim/ahead.py) wrote the new parameters into its slot's
        staged copy: an NVMe home takes that buffer as its new home copy, written from it and
        kept staged when the next use is near, as ``target`` would decide, with no copy
        (``ParamPart.adopt_home``). False, nothing done, where it cannot: the caller copies
        into ``target`` and commits."""
        bp = block.trainable
        if bp is None or slot.out_buf is None:
            return False
        keep = self._keep_staged is not None and self._keep_staged(block.index)
        with self.telemetry.span("offload::param_writeback"):
            return bp.adopt_home(slot.lend_out, keep)

    def commit(self, block, master: torch.Tensor, out: Optional[torch.Tensor], compute_done=None) -> None:
        """Make the new parameters (``out``, or ``master`` when ``out`` is None) the block's
        parameters on their tier. Returns once host buffers may be reused by this worker.
        ``master`` may be None when ``out`` holds the new parameters (chunked state)."""
        s0, s1 = block.shard
        if block.trainable is not None:
            bp = block.trainable
            target = self._home_target(block)
            if out is None:
                raise ParamStateError(f"block {block.name}: the update wrote no new parameters (target())")
            with self.telemetry.span("offload::param_writeback"):
                self._staging.through = None          # write_home settles it, or gives it back on failure
                self._staging.current = None
                loan, self._staging.loan = getattr(self._staging, "loan", None), None
                if loan is not None:
                    with self._lock:           # (settled ones dropped: the deque stays short)
                        self._pool_writes = collections.deque(
                            [b for b in self._pool_writes if b.writing and b is not bp] + [bp])
                bp.write_home(target, buffer=loan)    # submitted; the buffer is the home's now
            return
        dst = block.param_flat[s0:s1]
        src = master if out is None else out
        if src.data_ptr() == dst.data_ptr():
            return
        if src.device == dst.device:      # tier none: the master is on the device already
            with torch.no_grad():
                dst.copy_(src)
            return
        with self.telemetry.span("offload::param_h2d", "h2d", dst.numel() * dst.element_size()):
            # kernels of the block's backward may still be queued: they read these parameters
            dev.wait_event(self._h2d, compute_done)
            ev = dev.copy_(dst, src, self._h2d)
            # The staging buffer is reused by this worker's next job: wait for the copy here,
            # on the worker thread; the compute stream waits on update_event, not the host.
            dev.sync_event(ev)
            block.update.event = ev
