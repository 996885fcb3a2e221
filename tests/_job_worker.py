"""One rank of tests/hf/test_hf_finetune.py's job test: offload.hf.job.Job across 2 gloo ranks
started from torchrun's environment variables."""
import contextlib
import io
import os


def rank_main(rank: int, world: int, port: int) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from offload.hf.job import Job, JobError
    job = Job.start(use_cpu=True)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            job.say(f"printed by rank {rank}")
            shared = job.main_only("choosing", lambda: {"chosen by": rank})
            try:
                job.main_only("merging the adapter", lambda: 1 / 0)
                failed = None
            except (JobError, ZeroDivisionError) as exc:
                failed = f"{type(exc).__name__}: {exc}"
    finally:
        job.close()
    return {"rank": job.rank, "world": job.world, "printed": out.getvalue(), "shared": shared, "failed": failed}
