"""The ranks of one ``offload finetune`` job.

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) every rank trains, the engine sharing
the work across them, and what is done once for the job is rank 0's: printing, the planner's
placement, merging the adapter, writing the files beside the weights (tokenizer, summary). The
other ranks wait for it at a barrier that carries rank 0's outcome, bounded by ``WAIT_S``: an
error on rank 0 fails every rank with its message instead of leaving them waiting (and two ranks
never write, or delete, the same file). One process is the job of one rank.
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Callable, Optional

from offload.core.errors import OffloadError

WAIT_S = 1800.0      # the longest a rank waits for rank 0's share (transformers' ddp_timeout default)


class JobError(RuntimeError, OffloadError):
    """Rank 0 failed at work done for the whole job; raised on the other ranks with its message."""


class Job:
    """``rank`` / ``world`` of this process; ``comm`` its own process groups (None for one rank)."""

    def __init__(self, rank: int = 0, world: int = 1, comm=None, started: bool = False):
        self.rank, self.world, self.comm = rank, world, comm
        self._started = started        # the default process group is this job's to tear down

    @classmethod
    def start(cls, use_cpu: bool) -> "Job":
        """The job of this process: under torchrun, the default process group is initialized here
        as transformers' TrainingArguments would (accelerate's PartialState: gloo on CPU), so the
        job's groups exist before the model; otherwise a job of one rank."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls()
        import torch.distributed as dist
        from accelerate import PartialState
        from offload.dist.comm import Comm
        started = not dist.is_initialized()
        if use_cpu:
            PartialState(cpu=True)
        else:
            PartialState(timeout=datetime.timedelta(seconds=WAIT_S))
        comm = Comm(timeout_s=WAIT_S)
        return cls(comm.rank, comm.world, comm, started)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def say(self, *args, **kwargs) -> None:
        """print, on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs)

    def main_only(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0 alone; every rank returns its result (a picklable value) once rank 0
        is done. An exception on rank 0 is raised there and, as JobError naming ``what``, on the
        others."""
        result: Any = None
        error: Optional[BaseException] = None
        if self.is_main:
            try:
                result = fn()
            except Exception as exc:   # noqa: BLE001 - re-raised below, after the others are told
                error = exc
        if self.comm is not None:
            sent = (result, None if error is None else f"{type(error).__name__}: {error}") if self.is_main else None
            result, message = self.comm.gather_objects(sent, f"waiting for rank 0 {what}")[0]
            if message is not None and error is None:
                raise JobError(f"rank 0 failed {what}: {message}")
        if error is not None:
            raise error
        return result

    def any(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` is set on any rank (a decision every rank must take alike)."""
        if self.comm is None:
            return flag
        import torch
        t = torch.tensor([1.0 if flag else 0.0])
        self.comm.all_reduce(t, what, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def close(self) -> None:
        """Destroy the job's groups, and the default one where this job initialized it (torch
        asks it of every process before exit: gloo's threads left at exit can abort a rank)."""
        if self.comm is None:
            return
        import torch.distributed as dist
        self.comm.close()
        self.comm = None
        if self._started and dist.is_initialized():
            dist.destroy_process_group()
