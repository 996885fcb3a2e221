"""The engine's optimizer pipeline: the block jobs on worker threads that do the update (the
param groups torch sees, which every update of a commit reads, are optim/torch_face.py's).

One update job per block shard::

    read state (NVMe, ahead) -> the update rule with fused unscale/clip -> parameter write-back
    (params/write_back.py ``ParamWriteBack``) -> write state back (NVMe) -> gradient window reset

With ``offload_optimizer.update_ahead`` a block's update is computed during backward
(``submit_ahead``: the rule's step from the committed state into the block's spare buffer,
optim/ahead.py) and its commit job only trades the buffers and writes the parameters back
(``_commit_ahead``). With the state on a CUDA device (tier none) the job queues the rule's
device step on the pipeline's stream (``_job``).

A state in chunks (optim/state.py: a shard larger than ``state_chunk_bytes`` on NVMe) is read,
stepped and written chunk by chunk inside its job: the parameter write-back follows the
last chunk; the read-ahead walks chunks, so a pool buffer holds one chunk at a time.

Jobs run on ``workers`` threads while the main thread goes on with backward or the next
forward; the native kernels release the GIL. Reads of NVMe state run ahead of the jobs along
the order they are expected in (``set_order``: a ``core.lookahead.Lookahead`` over (block,
chunk), a byte window ahead of the last chunk a job took), and at most ``slots - workers``
chunks are fetched ahead, so a job that finds its chunk not yet fetched always gets a buffer
once a write in flight completes (``_fetch``), never deadlocks.

Failures. Every wait of a job is bounded (``wait_timeout_s``). A job that fails releases what
it holds (its state buffer, its gradient buffer, its write-back buffer) and raises a
``BlockError`` naming its block and stage (state read, gradient collective, adam, parameter
write-back, state write; with chunks the stage names the chunk: "state read (chunk 2 of 4,
elements [a, b) of the shard)"). A state write fails after its job has returned: its error is
attributed to its own block when the write is reclaimed, never raised inside the job that
happened to reclaim it. Every failure is recorded (``failure()``); the engine raises the
first one from the user's next call.
"""
from __future__ import annotations

import collections
import enum
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from offload import device as dev
from offload.core.errors import BlockError, block_error
from offload.core.lookahead import Lookahead
from offload.core.block import Block
from offload.placement import Placement
from offload.core.telemetry import Telemetry
from offload.storage.loan import DEFAULT_WAIT_S, LoanState, TierTimeout
from offload.storage.pool import Room

_JOB_POLL_S = 0.0005   # a job waiting for a swap buffer asks again this often whether a write can be reclaimed


@dataclass(frozen=True)
class StepArgs:
    """Everything one optimizer step needs, captured when the job is submitted."""
    step: int                      # 1-based step for bias correction
    groups: tuple                  # per param group: its hyper-parameters (dict, the rule's names)
    rule: object                   # the UpdateRule (offload/optim)
    grad_scale: float = 1.0        # 1 / loss_scale * clip_coef, applied in the kernel
    compute_done: object = None    # CUDA event: the compute stream's work queued before the
                                   # submission (the block's backward) ends here; the new
                                   # parameters are not written to the device before it fires


class Stage(enum.Enum):
    """The stages of a block's work that its errors name ("<stage> of block <i> (<name>)
    failed"); a chunk's stage adds the chunk, an update computed ahead "(update ahead)"."""
    STATE_READ = "state read"
    GRAD_COLLECTIVE = "gradient collective"
    GRAD_LANDING = "gradient landing"
    GRAD_NORM = "gradient norm"
    GRAD_PARK = "gradient park"
    STEP = "adam"                      # the rule's step, whatever the rule
    PARAM_WRITE_BACK = "parameter write-back"
    PARAM_GATHER = "parameter all-gather"
    STATE_WRITE = "state write"
    STATE_COMMIT = "state commit"
    GRAD_RESET = "gradient reset"


class _At:
    """Where a job is: its stage, the chunk (``StateChunk.where``) and whether it runs ahead;
    ``str()`` is the name its error gets."""
    __slots__ = ("stage", "where", "ahead")

    def __init__(self, stage: Stage, ahead: bool = False):
        self.stage, self.where, self.ahead = stage, "", ahead

    def set(self, stage: Stage, where: str = "", ahead: bool = False) -> None:
        self.stage, self.where, self.ahead = stage, where, ahead

    def __str__(self) -> str:
        return self.stage.value + self.where + (" (update ahead)" if self.ahead else "")


class StepPipeline:
    def __init__(self, blocks: Sequence[Block], *, workers: int, slots: int, telemetry: Telemetry,
                 compute_device: torch.device, params, grad_sync=None,
                 wait_timeout_s: float = DEFAULT_WAIT_S):
        self.blocks = list(blocks)
        self.telemetry = telemetry
        self.device = compute_device
        self.workers = workers
        self.read_ahead = max(0, slots - workers)  # chunks fetched ahead at most (module docstring)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="offload-step")
        self._lock = threading.RLock()
        # the read-ahead's order of (block, chunk index) and its byte window: the
        # read-ahead's chunk count in bytes of the largest NVMe chunk
        self._ahead = Lookahead("state_prefetch", telemetry)
        nvme = [c.nbytes for b in self.blocks for c in b.state.chunks if c.tier is Placement.NVME]
        self._window_bytes = self.read_ahead * max(nvme, default=0)
        self._unreadable: set = set()             # chunks whose read failed to start (their job says why)
        self._writing = collections.deque()       # (block, StateChunk) with a write in flight
        self._failures: List[BlockError] = []     # every failure, first first
        # block -> the failure of its update computed ahead (a failed job leaves its slot
        # idle: optim/ahead.py); its commit raises it rather than compute the update again
        self._ahead_failed: Dict[Block, BlockError] = {}
        self.wait_timeout_s = wait_timeout_s
        self._params = params                     # params/write_back.py ParamWriteBack: the new parameters' way home
        self._stream = dev.new_stream(compute_device)   # tier none on CUDA: the jobs' kernels (see _job)
        self._grad_sync = grad_sync               # the block's gradient collectives, waited per job
        self._piece_cache: dict = {}              # (block, chunk) -> (rows, the rule's pieces): _pieces
        self._nvme_state = bool(nvme)

    # ---- read-ahead ----------------------------------------------------------------------
    def set_order(self, order: Sequence[Block]) -> None:
        """The blocks in the order their jobs are expected; starts reading ahead (each
        block's chunks in order)."""
        with self._lock:
            self._ahead.set_order([(b, k) for b in order for k in range(len(b.state.chunks))])
            self._unreadable.clear()
        self.prefetch()

    def _chunk_bytes(self, item: tuple) -> int:
        """What a chunk of the order takes of the read-ahead's window: its bytes on NVMe."""
        c = item[0].state.chunks[item[1]]
        return c.nbytes if c.tier is Placement.NVME else 0

    def prefetch(self) -> None:
        """Start reads of the NVMe chunks in the window ahead, while fewer than ``read_ahead``
        chunks are read or held ahead and the pool has a buffer free."""
        if not self._nvme_state:        # nothing to read ahead nor to reclaim (after every job)
            return
        with self._lock:
            self._reclaim(block=False)
            fetched = sum(1 for b in self.blocks for c in b.state.chunks
                          if c.state in (LoanState.READING, LoanState.READY))
            for item in self._ahead.window(self._chunk_bytes, self._window_bytes):
                if fetched >= self.read_ahead:
                    break
                st = item[0].state.chunks[item[1]]
                if st.tier is not Placement.NVME or st.in_memory or item in self._unreadable:
                    continue
                with self.telemetry.span("offload::state_prefetch"):
                    try:
                        started = st.fetch()
                    except Exception:   # noqa: BLE001 - the block's own job meets it and names it
                        self._unreadable.add(item)
                        continue
                if not started:
                    break
                fetched += 1

    def _taken(self, block: Block, chunk) -> None:
        """A job takes ``chunk`` of ``block``: the read-ahead's window moves past it."""
        if self._nvme_state:
            with self._lock:
                self._ahead.advance((block, chunk.index))

    def _reclaim(self, block: bool) -> bool:
        """Return pool buffers of completed writes; with ``block``, wait for the oldest
        (bounded). A failed write is recorded against its own block. Lock held."""
        progressed = False
        while self._writing:
            b, st = self._writing[0]
            try:
                if block:
                    st.finish_write(self.wait_timeout_s)
                done = st.poll()
            except BaseException as exc:   # its buffer is back; the error is b's, not the caller's
                done = True
                self._record(b, Stage.STATE_WRITE.value + st.where, exc)
            if not done:
                break
            self._writing.popleft()
            progressed = True
            if block:
                break
        return progressed

    def _fetch(self, st) -> None:
        """A buffer for ``st`` and its read started: the pool's one bounded wait, returning the
        buffers of writes in flight while none is free; raises TierTimeout naming the holders
        when none comes back within ``wait_timeout_s``."""
        def make_room() -> Room:
            with self._lock:
                return Room.MADE if self._reclaim(block=True) else Room.WAIT
        # WAIT: the buffers are with other workers' jobs, whose commits add writes to reclaim
        st.fetch(self.wait_timeout_s, make_room=make_room, poll_s=_JOB_POLL_S)

    # ---- failures --------------------------------------------------------------------------
    def _record(self, block: Block, stage, exc: BaseException) -> BaseException:
        """``stage``: a ``Stage``, or the name of one (with its chunk, or "(update ahead)")."""
        err = block_error(f"{block.index} ({block.name})", stage.value if isinstance(stage, Stage) else stage, exc)
        if isinstance(err, BlockError):
            with self._lock:
                if err not in self._failures:
                    self._failures.append(err)
        return err

    def record_failure(self, block: Block, stage: "Stage", exc: BaseException) -> BaseException:
        """Record a failure of other per-block work (a parameter all-gather); returns the
        error to raise."""
        return self._record(block, stage, exc)

    def failure(self) -> Optional[BlockError]:
        """The first failure so far, or None."""
        with self._lock:
            return self._failures[0] if self._failures else None

    def raise_failure(self) -> None:
        """Raise the first failure (it stays: the engine cannot go on after one)."""
        err = self.failure()
        if err is not None:
            err.reported = True
            raise err

    def _abort(self, block: Block) -> None:
        """After a failed job: give back everything the job held."""
        with self._lock:
            self._writing = collections.deque(x for x in self._writing if x[0] is not block)
        block.state.discard()
        self._params.abort(block)                 # this worker's write-back buffer
        try:
            block.grads.reset_window()
        except Exception:   # noqa: BLE001 - the job's own error is the one reported
            pass

    # ---- jobs ------------------------------------------------------------------------------
    def run(self, fn, *args) -> Future:
        """Run other per-block work (gradient norms) on the optimizer workers, in order."""
        return self._pool.submit(fn, *args)

    def submit(self, block: Block, args: StepArgs) -> Future:
        """Queue ``block``'s update job; its future is the block's update in flight
        (``Block.start_update``: COMMITTING -> UPDATING)."""
        return block.start_update(lambda: self._pool.submit(self._job, block, args))

    def _job(self, block: Block, args: StepArgs) -> None:
        """One block's update. Tier none on CUDA: every kernel of the job (gradient scaling,
        the device Adam, the parameter copy) is queued on the pipeline's stream behind the
        block's backward (``args.compute_done``); the host never waits for the device, and the
        next forward's compute stream waits on ``block.update.event``."""
        if block.state.tier is not Placement.DEVICE or self._stream is None:
            return self._run(block, args)
        dev.wait_event(self._stream, args.compute_done)
        with dev.use_stream(self._stream):
            self._run(block, args)
            block.update.event = dev.record_event(self._stream)   # every kernel of the job

    def _run(self, block: Block, args: StepArgs, ahead: bool = False) -> None:
        """The job, on a worker: ``_update``; a failure is recorded against the block under
        the stage it happened in. A job computed ahead holds no shared buffer (nothing to give
        back); its failure is also the block's ahead failure, which its commit raises."""
        at = _At(Stage.GRAD_LANDING if ahead else Stage.STATE_READ, ahead=ahead)
        try:
            self._update(block, args, at, ahead)
        except BaseException as exc:
            if not ahead:
                self._abort(block)
            err = self._record(block, str(at), exc)
            if ahead and isinstance(err, BlockError):
                with self._lock:
                    self._ahead_failed.setdefault(block, err)
            if err is exc:
                raise
            raise err from exc
        if not ahead:
            self.prefetch()

    def submit_ahead(self, block: Block, args: StepArgs) -> None:
        """Start ``block``'s update of ``args.step`` now, during backward (its gradients of
        the window are all in): the same job as the commit's (``_update``), started earlier
        and writing into the block's ahead slot (optim/ahead.py: the spare state buffer and
        staged parameters), so nothing committed changes; step() commits it (``_commit_ahead``)."""
        block.update.ahead.start(args.step, args.groups, self._pool.submit(self._run, block, args, True))

    def _update(self, block: Block, args: StepArgs, at: "_At", ahead: bool = False) -> None:
        """One block's update: per state chunk, read it (NVMe: ahead of use), wait for the
        gradients, the rule's step with the new parameters written in the same pass, write
        the chunk back; then the parameters home and the gradient window reset.

        ``ahead`` (update_ahead: a HOST state, one chunk, always resident): the same step
        from the committed state into the slot's spare buffer (the kernel reads one and writes
        the other in its one pass) and the new parameters into the slot's staged copy; it
        stops there, and the commit's job (``_commit_ahead``) trades the buffers and writes
        the parameters home."""
        slot = block.update.ahead
        if ahead:
            if slot.out_lent:                     # the home's last write-back from it (StepControl._submit_ahead)
                at.set(Stage.PARAM_WRITE_BACK)
                with self.telemetry.span("offload::param_write_wait"):
                    block.trainable.finish_write(self.wait_timeout_s)
                if slot.out_lent:
                    raise RuntimeError(f"block {block.index} ({block.name}): its staged parameters are still "
                                       f"its home's after the write-back (state {block.trainable.state.value})")
        elif slot is not None:
            if slot.pending_for(args.step, args.groups) is not None:
                return self._commit_ahead(block, args, at)
            with self._lock:
                err = self._ahead_failed.get(block)
            if err is not None:                   # raised as it is, not met again by a second try
                raise err
        chunks = block.state.chunks
        out = grad = master = None
        rule = args.rule
        for c in chunks:
            self._taken(block, c)
            if c.state is LoanState.WRITING:  # this chunk's last write is still in flight (a
                at.set(Stage.STATE_WRITE, c.where)  # busy disk): it completes before it is read
                with self._lock:                  # no other thread reclaims it once it is off the list
                    self._writing = collections.deque(x for x in self._writing if x[1] is not c)
                c.finish_write(self.wait_timeout_s)                   # the wait without the pipeline's lock
            if ahead:                             # (the ahead job meets its gradients first)
                at.set(Stage.GRAD_LANDING, ahead=True)
                block.grads.wait_landed()
                grad = block.grad_shard()
                out = slot.out
            at.set(Stage.STATE_READ, c.where, ahead=ahead)
            if c.tier is Placement.NVME and not c.in_memory:
                self._fetch(c)
            if ahead:                             # a HOST state: resident, nothing to wait for
                buf = c.acquire(timeout=self.wait_timeout_s)
            else:
                with self.telemetry.span("offload::state_read"):   # waits for the read issued ahead
                    buf = c.acquire(timeout=self.wait_timeout_s)
            if grad is None:
                if self._grad_sync is not None:
                    at.set(Stage.GRAD_COLLECTIVE)
                    self._grad_sync.wait(block)
                at.set(Stage.GRAD_LANDING)
                block.grads.wait_landed()
                grad = block.grad_shard()
                # the parameter side says where the new copy goes; with chunks fp32
                # parameters too, filled from each chunk's master (never whole)
                out = self._params.target(block, whole_master=len(chunks) == 1)
                if out is None and len(chunks) != 1:
                    raise RuntimeError(f"block {block.name}: chunked state, no write-back target")
            master, rows = c.views(buf)
            src = None
            if ahead:                             # from the committed state into the spare one
                src, (master, rows) = (master, rows), slot.views(c.layout)
            at.set(Stage.STEP, c.where, ahead=ahead)   # the stage's name in errors (any rule)
            kernel = rule.kernel or rule.name.lower()
            if ahead:
                span = self.telemetry.span(f"offload::cpu_{kernel}_ahead", "adam",
                                           2 * c.nbytes + grad.numel() * grad.element_size())
            else:
                span = self.telemetry.span(f"offload::cpu_{kernel}", "adam", c.nbytes + (c.b - c.a) * grad.element_size())
            with span:
                self._step_chunk(block, c, master, rows, grad, out, args, src)
            if ahead:
                return                            # computed ahead: step() commits it
            if len(chunks) > 1:                  # written now: its buffer goes to the next chunk
                at.set(Stage.STATE_WRITE, c.where)
                with self.telemetry.span("offload::state_write"):
                    c.commit()
                with self._lock:
                    self._writing.append((block, c))
                self.prefetch()
        at.set(Stage.PARAM_WRITE_BACK)
        self._params.commit(block, master if len(chunks) == 1 else None, out, args.compute_done)
        block.update.step = args.step
        c = chunks[0]
        if len(chunks) == 1 and c.tier is Placement.NVME:
            at.set(Stage.STATE_WRITE)
            with self.telemetry.span("offload::state_write"):
                c.commit()
            with self._lock:
                self._writing.append((block, c))
        at.set(Stage.GRAD_RESET)
        block.grads.reset_window()

    def _commit_ahead(self, block: Block, args: StepArgs, at: "_At") -> None:
        """step()'s half of an update computed ahead: the slot's state becomes the block's,
        its staged parameters are written back."""
        slot = block.update.ahead
        at.set(Stage.STEP, ahead=True)
        with self.telemetry.span("offload::wait_ahead"):
            err = slot.settle(self.wait_timeout_s, f"block {block.index} ({block.name})")
        if err is not None:
            raise err                             # its own error, recorded against this block
        c, = block.state.chunks
        at.set(Stage.STATE_COMMIT, ahead=True)
        buf = c.acquire(timeout=self.wait_timeout_s)
        if block.param_flat is not None and block.param_flat.data_ptr() == buf.data_ptr():
            with self.telemetry.span("offload::ahead_copy"):
                buf.copy_(slot.spare)             # the parameters are views of this master
        else:
            slot.spare = c.replace_resident(slot.spare)      # the old buffer is the next update's spare
            buf = c.acquire(timeout=self.wait_timeout_s)
        master = c.views(buf)[0]
        slot.take()
        self.telemetry.count("updates_ahead")
        at.set(Stage.PARAM_WRITE_BACK)
        out = slot.out
        if out is None or block.trainable is None:
            self._params.commit(block, master, out, args.compute_done)
        elif self._params.adopt(block, slot):
            self.telemetry.count("ahead_params_adopted")    # the home took the slot's buffer
        else:                                     # assembled where the home copy goes
            target = self._params.target(block)
            with self.telemetry.span("offload::ahead_params"):
                target.copy_(out)
            self._params.commit(block, master, target, args.compute_done)
        block.update.step = args.step
        at.set(Stage.GRAD_RESET)
        block.grads.reset_window()

    def _step_chunk(self, block: Block, c, master, rows: dict, grad, out, args: StepArgs, src=None) -> None:
        """The rule's step of chunk ``c`` (elements [c.a, c.b) of the shard; ``master`` and
        ``rows`` its views, ``grad`` and ``out`` the whole shard's). ``src``: (master, rows)
        of the state the step reads when it writes into other buffers (an update computed
        ahead, on the CPU); None: in place."""
        rule = args.rule
        on_device = c.tier is Placement.DEVICE and dev.is_cuda(master.device)
        if on_device and args.grad_scale != 1.0:
            dev.mark_used(grad, dev.current_stream(grad.device))
            grad.mul_(args.grad_scale)
        src_states = [st for *_, st in _pieces(block, c, src[1])] if src is not None else None
        for k, (g, a, b, shape, state) in enumerate(self._pieces(block, c, rows)):
            group = args.groups[g]
            A, B = c.a + a, c.a + b                  # in the shard
            if on_device:
                _device_step(rule, master[a:b], grad[A:B], state, group, args.step, shape)
                if out is not None:
                    out[A:B].copy_(master[a:b])
                continue
            # the rule writes the new parameters into ``out`` in the same pass as the update
            # (bf16 / fp16 rounded, fp32 as they are): no second pass over the master
            rule.cpu_step(master[a:b], grad[A:B], state, group, args.step,
                          param_copy=None if out is None else out[A:B], grad_scale=args.grad_scale, shape=shape,
                          **({} if src is None else {"src": (src[0][a:b], src_states[k])}))

    def _pieces(self, block: Block, chunk, rows: dict) -> list:
        """``_pieces`` below, kept per chunk while its ``rows`` are the same objects (a chunk's
        cached views, optim/state.py): the slices are built once, not at every step."""
        key = (block.index, chunk.index)
        hit = self._piece_cache.get(key)
        if hit is None or hit[0] is not rows:
            hit = self._piece_cache[key] = (rows, list(_pieces(block, chunk, rows)))
        return hit[1]

    # ---- synchronization -------------------------------------------------------------------
    def wait_all(self) -> None:
        """All updates applied and all state writes completed (buffers back in the pool).
        Raises the first failure (a job's, or a state write's) after draining everything."""
        err = None
        for b in self.blocks:
            try:
                b.wait_update()
            except BaseException as exc:  # keep draining; re-raise the first error
                err = err or exc
            if b.update.ahead is not None:       # computed ahead: kept for the commit, its error recorded
                try:
                    b.update.ahead.settle(self.wait_timeout_s, f"block {b.index} ({b.name})")
                except TierTimeout as exc:
                    err = err or exc
        with self._lock:
            while self._writing:
                self._reclaim(block=True)
        for b in self.blocks:
            for c in b.state.chunks:
                if c.tier is Placement.NVME and c.in_memory:
                    try:
                        c.release(timeout=self.wait_timeout_s)   # read ahead for a step that was skipped
                    except BaseException as exc:
                        self._record(b, Stage.STATE_READ.value + c.where, exc)
        with self._lock:
            self._ahead.set_order([])             # nothing more to read ahead until the next commit
        err = self.failure() or err
        if err is not None:
            if isinstance(err, BlockError):
                err.reported = True
            raise err

    def close(self) -> None:
        try:
            self.wait_all()
        finally:
            self._pool.shutdown(wait=True)


def _pieces(block: Block, chunk, rows: dict):
    """(group, a, b, shape, state rows) of each range the rule steps at once, in the
    coordinates of ``chunk`` (elements [chunk.a, chunk.b) of the shard): each param group's
    range for an elementwise rule; each tensor piece for a per-tensor rule (Adafactor: its
    shape when the shard holds the whole tensor; never chunked)."""
    layout = chunk.layout
    if layout.tensors:
        if (chunk.a, chunk.b) != (0, layout.numel):
            raise RuntimeError("a per-tensor state is not chunked")
        for k, t in enumerate(layout.tensors):
            yield t.group, t.start, t.start + t.numel, t.shape, layout.tensor_state(rows, k)
        return
    s0 = block.shard[0] + chunk.a
    s1 = block.shard[0] + chunk.b
    for g, a, b in block.layout.group_ranges:
        a, b = max(a, s0) - s0, min(b, s1) - s0
        if a < b:
            yield g, a, b, None, layout.slice(rows, a, b)


def _device_step(rule, p, g, state: dict, group: dict, step: int, shape) -> None:
    """The rule's device step on CUDA tensors (tier none), queued on the current stream (the
    job's, see StepPipeline._job); the gradient is already scaled. fp32 rows are stepped in
    place; bf16 rows through fp32 copies rounded back once after the step (the CPU kernel's
    rounding). The rules' device steps never synchronise the device (step counts are
    filled on the device), except Adafactor's, whose step size reads two norms."""
    if shape is not None:
        p, g = p.view(shape), g.view(shape)
    wide = {k: (v if v.dtype == torch.float32 else v.float()) for k, v in state.items()}
    rule.device_step([p], [g], [wide], group, [step])
    for k, v in state.items():
        if wide[k] is not v:
            v.copy_(wide[k])


