"""The CPU optimizer as a pipeline over blocks, on worker threads.

One update job per block shard::

    read state (NVMe, ahead) -> Adam with fused unscale/clip -> parameters back to the device
                              -> write state back (NVMe) -> gradient window reset

Jobs run on ``workers`` threads while the main thread goes on with backward or the next
forward; the native kernel releases the GIL and has its own thread pool. Reads run ahead of
the jobs along ``order`` (the order in which jobs are expected), bounded by the host pool:
at most ``slots - workers`` states are fetched ahead, so a job that finds its state not yet
fetched always gets a buffer once a write in flight completes (``_fetch``), never deadlocks.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from offload import device as dev
from offload.engine.block_shard import BlockShard
from offload.optim.state import Residency, Tier
from offload.engine.telemetry import Telemetry


@dataclass(frozen=True)
class StepArgs:
    """Everything one optimizer step needs, captured when the job is submitted."""
    step: int                      # 1-based step for bias correction
    groups: tuple                  # per param group: (lr, beta1, beta2, eps, weight_decay)
    adamw: bool
    grad_scale: float = 1.0        # 1 / loss_scale * clip_coef, applied in the kernel
    compute_done: object = None    # CUDA event: the compute stream's work queued before the
                                   # submission (the block's backward) ends here; the new
                                   # parameters are not written to the device before it fires


class StepPipeline:
    def __init__(self, blocks: Sequence[BlockShard], *, workers: int, slots: int, telemetry: Telemetry,
                 compute_device: torch.device, copy_param: bool, param_write_pool=None, grad_sync=None):
        self.blocks = list(blocks)
        self.telemetry = telemetry
        self.device = compute_device
        self.workers = workers
        self.read_ahead = max(0, slots - workers)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="offload-step")
        self._lock = threading.Lock()
        self._order: List[int] = []
        self._cursor = 0
        self._writing = collections.deque()       # OptimStates with a write in flight
        self._h2d = dev.new_stream(compute_device)
        self._copy_param = copy_param             # fp32 device params: copy from the master
        self._staging = threading.local()         # per worker: pinned param copy for the H2D
        self._param_write_pool = param_write_pool # host buffers for NVMe-home parameter write-back
        self._grad_sync = grad_sync               # the block's gradient collectives, waited per job

    # ---- read-ahead ----------------------------------------------------------------------
    def set_order(self, order: Sequence[int]) -> None:
        """The block indices in the order their jobs are expected; starts reading ahead."""
        with self._lock:
            self._order = list(order)
            self._cursor = 0
        self.prefetch()

    def prefetch(self) -> None:
        with self._lock:
            self._reclaim(block=False)
            fetched = sum(1 for b in self.blocks
                          if b.state.residency in (Residency.READING, Residency.READY))
            while self._cursor < len(self._order) and fetched < self.read_ahead:
                st = self.blocks[self._order[self._cursor]].state
                if st.tier is not Tier.NVME or st.in_memory:
                    self._cursor += 1
                    continue
                with self.telemetry.span("offload::state_prefetch"):
                    if not st.fetch():
                        break
                self._cursor += 1
                fetched += 1

    def _reclaim(self, block: bool) -> bool:
        """Return pool buffers of completed writes; with ``block``, wait for the oldest."""
        progressed = False
        while self._writing:
            st = self._writing[0]
            if not st.reclaim(block=block):
                break
            self._writing.popleft()
            progressed = True
            if block:
                break
        return progressed

    def _fetch(self, st) -> None:
        while not st.fetch():
            with self._lock:
                progressed = self._reclaim(block=True)
            if not progressed:
                time.sleep(0.0005)  # buffers are with another worker's job; it commits soon

    # ---- jobs ------------------------------------------------------------------------------
    def run(self, fn, *args) -> Future:
        """Run other per-block work (gradient norms) on the optimizer workers, in order."""
        return self._pool.submit(fn, *args)

    def submit(self, block: BlockShard, args: StepArgs) -> Future:
        assert block.pending is None, f"block {block.name} already has an update in flight"
        fut = self._pool.submit(self._job, block, args)
        block.pending = fut
        return fut

    def _job(self, block: BlockShard, args: StepArgs) -> None:
        """One block's update. Tier none on CUDA: every kernel of the job (gradient scaling,
        the device Adam, the parameter copy) is queued on the pipeline's stream behind the
        block's backward (``args.compute_done``); the host never waits for the device, and the
        next forward's compute stream waits on ``block.update_event``."""
        if block.state.tier is not Tier.DEVICE or self._h2d is None:
            return self._run(block, args)
        dev.wait_event(self._h2d, args.compute_done)
        with dev.use_stream(self._h2d):
            self._run(block, args)
            block.update_event = dev.record_event(self._h2d)   # every kernel of the job

    def _run(self, block: BlockShard, args: StepArgs) -> None:
        from offload.optim import adam_step
        st = block.state
        if st.tier is Tier.NVME and not st.in_memory:
            self._fetch(st)
        with self.telemetry.span("offload::state_read"):   # waits for the read issued ahead
            state = st.acquire()
        if self._grad_sync is not None:
            self._grad_sync.wait(block)
        block.grad.wait_landed()
        master, exp_avg, exp_avg_sq = state[0], state[1], state[2]
        grad = block.grad_shard()
        s0, s1 = block.shard
        out = self._param_out(block)
        with self.telemetry.span("offload::cpu_adam", "adam", st.nbytes + grad.numel() * grad.element_size()):
            for g, a, b in block.layout.group_ranges:
                a, b = max(a, s0) - s0, min(b, s1) - s0
                if a >= b:
                    continue
                lr, b1, b2, eps, wd = args.groups[g]
                if st.tier is Tier.DEVICE and master.is_cuda:
                    _device_adam(master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], args, lr, b1, b2, eps, wd)
                    if out is not None:
                        out[a:b].copy_(master[a:b])
                    continue
                adam_step(master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], step=args.step, lr=lr,
                          betas=(b1, b2), eps=eps, weight_decay=wd, adamw_mode=args.adamw,
                          param_copy=None if out is None else out[a:b], grad_scale=args.grad_scale)
        self._write_params(block, master, out, args.compute_done)
        block.stepped = args.step
        if st.tier is Tier.NVME:
            with self.telemetry.span("offload::state_write"):
                st.commit()
            with self._lock:
                self._writing.append(st)
        block.grad.reset_window()
        self.prefetch()

    def _param_out(self, block: BlockShard) -> Optional[torch.Tensor]:
        """Where the kernel writes the low-precision parameter copy (None: fp32 params,
        copied from the master afterwards): the home copy of an offloaded block, the device
        buffer itself on a CPU device, else a pinned staging buffer for the H2D."""
        s0, s1 = block.shard
        if block.params is not None:
            return None if self._copy_param else block.home_shard(self._home_target(block))
        if self._copy_param or block.state.tier is Tier.DEVICE:
            return None   # copied (and cast) from the master afterwards
        if not block.param_flat.is_cuda:
            return block.param_flat[s0:s1]
        buf = getattr(self._staging, "buf", None)
        if buf is None or buf.numel() < s1 - s0 or buf.dtype != block.param_flat.dtype:
            buf = dev.empty_host(max(s1 - s0, 1 << 20), block.param_flat.dtype, pin=True)
            self._staging.buf = buf
        return buf[:s1 - s0]

    def _home_target(self, block: BlockShard) -> torch.Tensor:
        """The buffer the new home copy of an offloaded block is assembled in: the HOST home
        itself, or (NVMe home) a write-staging buffer held by this worker until written."""
        bp = block.params
        home = bp.home_view_for_write()
        if home is not None:
            return home
        loan = getattr(self._staging, "loan", None)
        if loan is None:
            loan = self._staging.loan = self._param_write_pool.acquire(bp.home_nbytes)
        return loan.view(bp.dtype, bp.home_numel)

    def _write_params(self, block: BlockShard, master: torch.Tensor, out: Optional[torch.Tensor],
                      compute_done=None) -> None:
        s0, s1 = block.shard
        if block.params is not None:
            bp = block.params
            target = self._home_target(block)
            with self.telemetry.span("offload::param_writeback"):
                if out is None:
                    block.home_shard(target).copy_(master)
                bp.write_home(target)
            loan = getattr(self._staging, "loan", None)
            if loan is not None:
                self._staging.loan = None
                loan.release()
            return
        dst = block.param_flat[s0:s1]
        src = master if out is None else out
        if src.data_ptr() == dst.data_ptr():
            return
        if src.device == dst.device:      # tier none: the master is on the device already
            # CUDA: on the job's stream, after the device Adam and the block's backward (see
            # _job); the next forward's compute stream waits on update_event
            with torch.no_grad():
                block.update_event = dev.copy_(dst, src, self._h2d)
            return
        with self.telemetry.span("offload::param_h2d", "h2d", dst.numel() * dst.element_size()):
            # kernels of the block's backward may still be queued: they read these parameters
            dev.wait_event(self._h2d, compute_done)
            ev = dev.copy_(dst, src, self._h2d)
            # The staging buffer is reused by this worker's next job: wait for the copy here,
            # on the worker thread; the compute stream waits on update_event, not the host.
            dev.sync_event(ev)
            block.update_event = ev

    # ---- synchronization -------------------------------------------------------------------
    def wait_all(self) -> None:
        """All updates applied and all state writes completed (buffers back in the pool)."""
        err = None
        for b in self.blocks:
            try:
                b.wait_update()
            except BaseException as exc:  # keep draining; re-raise the first error
                err = err or exc
        with self._lock:
            while self._writing:
                self._writing.popleft().reclaim(block=True)
        for b in self.blocks:
            if b.state.tier is Tier.NVME and b.state.in_memory:
                b.state.drop()   # read ahead for a step that was skipped
        with self._lock:
            self._cursor = len(self._order)
        if err is not None:
            raise err

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            self._pool.shutdown(wait=True)


def _device_adam(p, g, m, v, args: StepArgs, lr, b1, b2, eps, wd) -> None:
    """Adam on CUDA tensors (tier none): torch's fused kernel on the fp32 master, queued on
    the current stream (the job's, see StepPipeline._job). Never synchronises the device: the
    step count is written on the device by a fill kernel (``torch.tensor(step, device=...)``
    would be a pageable, synchronising copy). ``g`` is marked as used by this stream, so a
    transient gradient buffer freed by the job is not reused before the kernel has read it."""
    dev.mark_used(g, dev.current_stream(g.device))
    if args.grad_scale != 1.0:
        g.mul_(args.grad_scale)
    step = torch.full((), float(args.step), dtype=torch.float32, device=p.device)  # 1-based
    fn = torch._fused_adamw_ if args.adamw else torch._fused_adam_
    fn([p], [g], [m], [v], [], [step], lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
       amsgrad=False, maximize=False)
