"""One rank of a multi-rank test: main(argv) in a child forked by tests/_forked.py (started by
tests/distributed/test_zero.py), or

    python _zero_worker.py RANK WORLD PORT OUTDIR SPEC.json

Runs every job of the spec in one process group (imports and the rendezvous cost seconds;
the jobs are cheap) and writes OUTDIR/rank{RANK}.pt: job name -> the consolidated fp32 state
after each step and the engine's stats. An error is written to OUTDIR/rank{RANK}.err and the
process exits 1. The spec's "backend" is gloo (default) or nccl (one GPU per rank, batches on
it); "fake_nccl" makes a gloo world look NCCL-only to the engine (see fake_nccl_only).
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


def fake_nccl_only() -> list:
    """Make the default group (and every group made without ``backend="gloo"``) behave like
    NCCL's on a CPU-only machine: ``dist.get_backend`` answers "nccl" for it, and a collective
    over it that carries CPU tensors (or pickled objects) raises NCCL's error. Groups created
    with ``backend="gloo"`` work as usual. Returns the list of those gloo groups."""
    gloo = []
    real_new_group, real_get_backend = dist.new_group, dist.get_backend

    def is_gloo(group):
        return any(group is g for g in gloo)

    def new_group(*args, **kw):
        g = real_new_group(*args, **kw)
        if kw.get("backend") == "gloo":
            gloo.append(g)
        return g

    def get_backend(group=None):
        return real_get_backend(group) if is_gloo(group) else "nccl"

    def guard(name, fn, objects):
        def wrapped(*args, group=None, **kw):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if not is_gloo(group) and (objects or any(t.device.type == "cpu" for t in tensors)):
                raise RuntimeError(f"{name}: No backend type associated with device type cpu (fake NCCL group)")
            return fn(*args, group=group, **kw)
        return wrapped

    dist.new_group, dist.get_backend = new_group, get_backend
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter_single",
                 "broadcast", "barrier", "all_gather_object", "broadcast_object_list"):
        fn = getattr(dist, name, None)
        if fn is not None:
            setattr(dist, name, guard(name, fn, objects=name.endswith(("_object", "_object_list")) or name == "barrier"))
    return gloo


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
    if eng.device.type == "cuda":
        data = [(x.to(eng.device), y.to(eng.device)) for x, y in data]
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
        sd = {k: v.cpu() for k, v in eng.full_state_dict().items()}
        if rank == 0:
            snaps.append(sd)
        if job.get("save_at") == step + 1:
            eng.save_checkpoint(job["save"])
    out = {"snaps": snaps, "stats": stats[-1], "stats_all": stats,
           "groups": {"backend": eng.comm.backend, "host_backend": eng.comm.host_backend,
                      "host_is_separate": eng.comm.host_main is not eng.comm.main}}
    made = [g for g in (eng.comm.main, eng.comm.side, eng.comm.host_main, eng.comm.host_side) if g is not None]
    eng.close()
    out["groups"]["left_after_close"] = sum(_group_alive(g) for g in made)
    return out


def _group_alive(group) -> bool:
    try:
        dist.get_rank(group)
        return True
    except ValueError:   # "not registered": destroyed
        return False


def main(argv):
    rank, world, port, outdir, spec = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    with open(spec) as f:
        spec = json.load(f)
    jobs, backend = spec["jobs"], spec.get("backend", "gloo")
    results = {}
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            # gloo jobs test the CPU paths: on a GPU machine the engine would compute on CUDA
            # and hand gloo CUDA tensors for collectives it does not support there (read by
            # CUDA at its first use in this process)
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if spec.get("fake_nccl"):
            fake_nccl_only()
        dist.init_process_group(backend, rank=rank, world_size=world)
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
    main(sys.argv[1:])
