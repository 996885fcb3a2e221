"""Where one block's parameters live between uses (parameter offload), and their moves.

The block's canonical parameter copy (compute dtype, 1-D, padded numel) lives on its home
tier: a persistent host buffer (``HOST``) or a swap-file extent (``NVME``). It is
materialized on the device only around its use; in between, each parameter's ``.data`` is
an empty placeholder, so a use that bypasses the engine fails loudly instead of reading
stale values.

Transitions (guarded by assertions)::

    NVME home:  HOME --stage()--> STAGING --(read done)--> STAGED --to_device()--> FETCHING
    HOST home:  HOME --to_device()--> FETCHING
    FETCHING --ensure()--> ON_DEVICE --release()--> HOME

``ensure()`` walks the whole chain on demand. Lifetimes: the host staging buffer of an NVMe
block is returned to the pool once the H2D copy has completed (CUDA), or, on a CPU device,
serves as the device copy itself until ``release()``. A copy is valid only for the home
version it was read from: the optimizer bumps ``home_version`` when it writes the home
copy, and ``ensure()`` refetches a stale copy, so a stale block is never served.
"""
from __future__ import annotations

import enum
import threading
from typing import Optional

import torch

from offload import device as dev
from offload.engine.blocks import BlockLayout


class ParamState(enum.Enum):
    HOME = "home"
    STAGING = "staging"
    STAGED = "staged"
    FETCHING = "fetching"
    ON_DEVICE = "on_device"


class BlockParams:
    def __init__(self, layout: BlockLayout, dtype: torch.dtype, device: torch.device, *, home_buf=None,
                 store=None, pool=None, write_pool=None, key: str = "", home_numel: int = 0, gather=None):
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.numel = layout.padded_numel  # the device copy: the full flat
        self.nbytes = self.numel * torch.empty((), dtype=dtype).element_size()
        # The home copy: the full flat, or (ZeRO-3) only this rank's shard; then ``gather(full,
        # shard)`` (an async all-gather returning a work handle) assembles the device copy.
        self.home_numel = home_numel or self.numel
        self.home_nbytes = self.home_numel * torch.empty((), dtype=dtype).element_size()
        self._gather = gather
        self._work = None                 # all-gather in flight (FETCHING)
        self.home_buf = home_buf          # 1-D host tensor (HOST home), else None
        self._store, self._pool, self.key = store, pool, key
        self._write_pool = write_pool     # host buffers for writing an unaligned source
        self.state = ParamState.HOME
        self.device_buf: Optional[torch.Tensor] = None   # 1-D on the device while FETCHING/ON_DEVICE
        self.users = 0                    # modules of this block running now (forward)
        self.home_version = 0
        self._copy_version = -1
        self._loan = None                 # host pool buffer (NVME home) while staged
        self._io = None                   # NVMe read in flight
        self._event = None                # H2D copy in flight
        self._lock = threading.RLock()
        self.placeholder = torch.empty(0, dtype=dtype, device=device)

    @property
    def on_nvme(self) -> bool:
        return self._store is not None

    @property
    def device_bytes(self) -> int:
        """Bytes this block holds on the device now (in flight or resident)."""
        return self.nbytes if self.state in (ParamState.FETCHING, ParamState.ON_DEVICE) else 0

    @property
    def stale(self) -> bool:
        return self.state is not ParamState.HOME and self._copy_version != self.home_version

    def slot_free(self) -> bool:
        """Whether a host staging buffer for this block is free now (NVMe home)."""
        loan = self.try_slot()
        if loan is None:
            return False
        loan.release()
        return True

    def try_slot(self):
        """A host staging buffer for this block's home copy, or None when none is free (the
        caller releases it)."""
        return self._pool.try_acquire(self.home_nbytes)

    # ---- transitions ------------------------------------------------------------------
    def stage(self) -> bool:
        """NVMe -> host pool buffer, asynchronously (HOME -> STAGING). False: no buffer free."""
        with self._lock:
            assert self.on_nvme and self.state is ParamState.HOME, self.state
            loan = self._pool.try_acquire(self.home_nbytes)
            if loan is None:
                return False
            self._loan = loan
            self._copy_version = self.home_version
            self._io = self._store.read(self.key, loan.view(self.dtype, self.home_numel))
            self.state = ParamState.STAGING
            return True

    def poll(self) -> None:
        """STAGING -> STAGED if the read has completed (never waits)."""
        with self._lock:
            if self.state is ParamState.STAGING and self._io.done():
                self._finish_staging()

    def _finish_staging(self) -> None:
        if self.state is ParamState.STAGING:
            io, self._io = self._io, None
            try:
                io.wait()
            except BaseException:
                self._drop_host()
                self.state = ParamState.HOME
                raise
            self.state = ParamState.STAGED

    def to_device(self, h2d_stream) -> None:
        """Start the host -> device copy (-> FETCHING)."""
        with self._lock:
            if self.state is ParamState.HOME:
                if self.on_nvme:
                    self._loan = self._pool.acquire(self.home_nbytes)
                    self._copy_version = self.home_version
                    self._io = self._store.read(self.key, self._loan.view(self.dtype, self.home_numel))
                    self.state = ParamState.STAGING
                else:
                    self._copy_version = self.home_version
            self._finish_staging()
            assert self.state in (ParamState.HOME, ParamState.STAGED), self.state
            src = self._loan.view(self.dtype, self.home_numel) if self.on_nvme else self.home_buf
            if self._gather is not None:       # ZeRO-3: every rank's shard into the device copy
                self.device_buf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
                self._work = self._gather(self.device_buf, src.to(self.device))
            elif self.device.type == "cpu":
                self.device_buf = src          # host memory is device memory: no copy
            else:
                self.device_buf = dev.empty_on(h2d_stream, self.numel, self.dtype, self.device)
                self._event = dev.copy_(self.device_buf, src, h2d_stream)
            self.state = ParamState.FETCHING

    def ensure(self, h2d_stream) -> torch.Tensor:
        """The parameters on the device, current, with every parameter bound to its view."""
        with self._lock:
            if self.stale:
                self.release()                 # stale: the optimizer wrote the home copy since
            if self.state in (ParamState.HOME, ParamState.STAGING, ParamState.STAGED):
                self.to_device(h2d_stream)
            if self.state is ParamState.FETCHING:
                self._wait_gather()
                ev, self._event = self._event, None
                if ev is not None:
                    compute = dev.current_stream(self.device)
                    dev.wait_event(compute, ev)
                    dev.mark_used(self.device_buf, compute)
                    if self.on_nvme:           # the host buffer may go back once the copy is done
                        dev.sync_event(ev)
                        self._drop_host()
                for s in self.layout.segments:
                    s.param.data = self.device_buf[s.offset:s.offset + s.numel].view(s.shape)
                self.state = ParamState.ON_DEVICE
            return self.device_buf

    def release(self) -> None:
        """Drop the device copy (any state -> HOME); parameters become empty placeholders."""
        with self._lock:
            if self.state is ParamState.HOME:
                return
            if self.state is ParamState.STAGING:
                try:
                    self._io.wait()
                except BaseException:
                    pass                       # the data is discarded anyway
                self._io = None
            if self._event is not None:
                dev.sync_event(self._event)
                self._event = None
            self._wait_gather()                # a collective in flight completes on every rank
            for s in self.layout.segments:
                s.param.data = self.placeholder
            self.device_buf = None
            self._drop_host()
            self.state = ParamState.HOME

    def _wait_gather(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            work.wait()
            if self.on_nvme:                   # the staged shard may go back to the pool
                self._drop_host()

    def _drop_host(self) -> None:
        loan, self._loan = self._loan, None
        if loan is not None:
            loan.release()

    def release_initial(self) -> None:
        """After construction: the parameters' original memory goes, placeholders come."""
        with self._lock:
            for s in self.layout.segments:
                s.param.data = self.placeholder

    # ---- the home copy ----------------------------------------------------------------
    def write_home(self, src: torch.Tensor) -> None:
        """Replace the home copy with ``src`` (1-D, compute dtype, host) and wait for it to be
        durable on its tier; device copies made before this are stale from now on. A source
        that is not 4 KiB-aligned (NVMe) goes through a write buffer, so I/O stays O_DIRECT."""
        with self._lock:
            if self.on_nvme and src.data_ptr() % 4096:
                # (frozen parts have no write pool: they are written rarely, through a staging buffer)
                with (self._write_pool or self._pool).acquire(self.home_nbytes) as loan:
                    buf = loan.view(self.dtype, self.home_numel)
                    buf.copy_(src)
                    self._store.write(self.key, buf).wait()
            elif self.on_nvme:
                self._store.write(self.key, src).wait()
            elif src.data_ptr() != self.home_buf.data_ptr():
                self.home_buf.copy_(src)
            self.home_version += 1

    def read_home(self) -> torch.Tensor:
        """A new host tensor holding the home copy (1-D, ``home_numel``): for checkpoints
        and state dicts, not the training path. The device copy is not touched."""
        with self._lock:
            if not self.on_nvme:
                return self.home_buf.clone()
            self._finish_staging()             # a read in flight on the key completes first
            if self._loan is not None and not self.stale:
                return self._loan.view(self.dtype, self.home_numel).clone()   # the staged copy
            with self._pool.acquire(self.home_nbytes) as loan:
                buf = loan.view(self.dtype, self.home_numel)
                self._store.read(self.key, buf).wait()
                return buf.clone()

    def home_view_for_write(self):
        """Where the optimizer may write the new home copy directly (HOST home), else None."""
        return None if self.on_nvme else self.home_buf
