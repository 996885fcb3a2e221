"""ZeRO stages 1 and 2 across ranks: after each block's update, every rank's updated parameter
shard goes to every rank (an all-gather into the block's full parameter buffer), on one
thread, in submission order: the same order on every rank, so the collectives match."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from offload import device as dev
from offload.core.telemetry import Telemetry
from offload.dist.comm import Comm
from offload.core.block import Block


class ParamGather:
    """``submit(block, job)`` queues the gather of ``block`` after its update ``job``; the
    returned future is the block's ``update.future`` (its forward waits for the gather too). A
    failed gather is recorded against its block (``record_failure``) and raised."""

    def __init__(self, comm: Comm, telemetry: Telemetry, record_failure: Callable):
        self.comm = comm
        self.telemetry = telemetry
        self.record_failure = record_failure
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-gather")

    def submit(self, block: Block, job: Future) -> Future:
        return self._pool.submit(self._gather_params, block, job)

    def _gather_params(self, block: Block, job) -> None:
        """On the gather thread, in submission order (the same on every rank): wait for the
        block's update (the job, then, on this thread's stream, its device work: the optimizer's
        stream or the write-back's may still be writing this rank's shard), then all-gather the
        updated shards into the full parameter buffer."""
        job.result()
        s0, s1 = block.shard
        try:
            block.order_after_update(dev.current_stream(block.device))
            with self.telemetry.span("offload::param_allgather"):
                shard = block.param_flat[s0:s1].clone()   # the input must not alias the output
                self.comm.all_gather(block.param_flat, shard,
                                     f"param allgather of block {block.index} ({block.name})", group="side")
        except BaseException as exc:
            raise self.record_failure(block, "parameter all-gather", exc) from exc

    def close(self) -> None:
        """Wait for the gathers queued."""
        self._pool.shutdown(wait=True)
