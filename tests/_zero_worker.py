"""One rank of a multi-rank test (started by tests/test_zero.py as a subprocess).

    python _zero_worker.py RANK WORLD PORT OUTDIR SPEC.json

Runs every job of the spec in one gloo process group (imports and the rendezvous cost
seconds; the jobs are cheap) and writes OUTDIR/rank{RANK}.pt: job name -> the consolidated
fp32 state after each step and the engine's stats. An error is written to
OUTDIR/rank{RANK}.err and the process exits 1.
"""
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import batches, make_model  # noqa: E402

import offload  # noqa: E402


def config(job, nvme_dir):
    tier = job.get("tier", "cpu")
    cfg = {"optimizer": {"type": "AdamW", "lr": 1e-3, "weight_decay": 0.01, "eps": job.get("eps", 1e-8)},
           "offload_optimizer": {"device": tier}, "gradient_clipping": job.get("clip", 0.5),
           "zero_optimization": {"stage": job["stage"], "timeout_s": job.get("timeout_s", 20)}}
    if tier == "nvme":
        cfg["offload_optimizer"]["nvme_path"] = nvme_dir
    if job.get("param"):
        cfg["offload_param"] = {"device": job["param"]}
        if job["param"] == "nvme":
            cfg["offload_param"]["nvme_path"] = nvme_dir
    cfg.update(job.get("extra", {}))
    return cfg


def run_job(job, rank, world, outdir):
    """Train ``job``; with ``expect_error`` an exception is the result (the engine is closed)."""
    held = []
    try:
        return train(job, rank, world, outdir, held)
    except Exception as exc:
        if not job.get("expect_error"):
            raise
        for eng in held:
            try:
                eng.close()
            except Exception:
                pass
        return {"error": f"{type(exc).__name__}: {exc}"}


def train(job, rank, world, outdir, held):
    nvme_dir = os.path.join(outdir, f"nvme_{job['name']}_r{rank}")
    os.makedirs(nvme_dir, exist_ok=True)
    model_kw = dict(job.get("model_kw", {}))
    if job.get("diverge") == "model" and rank == world - 1:
        model_kw["layers"] = 5
    if job.get("diverge") == "config" and rank == world - 1:
        job = dict(job, clip=1.0)
    model = make_model(**model_kw)
    eng = offload.initialize(model, config(job, nvme_dir))
    held.append(eng)
    if job.get("load"):
        eng.load_checkpoint(job["load"])
    data = batches(job.get("start", 0) + job["steps"], batch=job.get("batch", 4))[job.get("start", 0):]
    snaps, stats = [], []
    for step, (x, y) in enumerate(data):
        lo, hi = rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world
        if job.get("diverge") == "order" and rank == world - 1 and step == 1:
            model.layers = torch.nn.ModuleList(list(model.layers)[::-1])    # another module order
        if job.get("diverge") == "die" and rank == world - 1 and step == 1:
            os._exit(3)
        if job.get("backwards") == 2:      # the rank's half in two backward() calls, one step()
            mid = (lo + hi) // 2
            for a, b in ((lo, mid), (mid, hi)):
                eng.backward(eng(x[a:b], y[a:b]) / 2)
        else:
            loss = eng(x[lo:hi], y[lo:hi])
            if job.get("diverge") == "inf" and rank == world - 1 and step == 0:
                loss = loss * float("inf")      # an fp16 overflow on one rank only
            eng.backward(loss)
        eng.step()
        stats.append(eng.stats())
        sd = eng.full_state_dict()
        if rank == 0:
            snaps.append(sd)
        if job.get("save_at") == step + 1:
            eng.save_checkpoint(job["save"])
    out = {"snaps": snaps, "stats": stats[-1], "stats_all": stats}
    eng.close()
    return out


def main():
    rank, world, port, outdir, spec = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    with open(spec) as f:
        jobs = json.load(f)["jobs"]
    results = {}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        for job in jobs:
            results[job["name"]] = run_job(job, rank, world, outdir)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        os._exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
