"""One rank of tests/integrations/test_lightning.py's two-rank tests (gloo), Fabric's and the Trainer's:
plain DDP twice (torch's single-tensor and fused AdamW: the noise bound) and the engine, on
the same seed and this rank's share of the batches. Lightning is imported in the child, not
by the fork server."""
import io
import os


def _as_rank(rank: int, world: int, port: int) -> None:
    """This process as rank ``rank`` of ``world`` started by a launcher (torchrun's variables):
    Lightning starts no processes of its own."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))
    import torch
    torch.set_num_threads(1)


def _saved(out: dict) -> bytes:
    """``out`` saved with torch.save (tensors sent through the pipe would be shared memory the
    child frees)."""
    import torch
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def fabric_rank(rank: int, world: int, port: int, nvme: str) -> bytes:
    """This rank's {"single" | "fused" | "engine": (losses, gradient norms, weights), "world": ranks}
    of a Fabric loop on its half of the batches."""
    _as_rank(rank, world, port)
    import torch
    from _lightning import L, fabric_run, loader, weights
    from offload.lightning import OffloadFabricStrategy

    def fabric(strategy):
        f = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
        f.launch()
        return f

    mine = [b for i, b in enumerate(loader(n=16)) if i % world == rank]
    out = {}
    for name, impl in (("single", "single"), ("fused", "fused")):
        losses, norms, net = fabric_run(fabric("ddp"), impl, data=mine)
        out[name] = (losses, norms, weights(net))
    f = fabric(OffloadFabricStrategy({"zero_optimization": {"stage": 2},
                                      "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}))
    losses, norms, _ = fabric_run(f, data=mine)
    out["engine"] = (losses, norms, f.strategy.engine.full_state_dict())     # a collective: every rank
    out["world"] = f.strategy.engine.comm.world
    f.strategy.engine.close()
    torch.distributed.destroy_process_group()
    return _saved(out)


def trainer_rank(rank: int, world: int, port: int, micro_batches: int) -> bytes:
    """This rank's {"single" | "fused" | "engine": (losses, gradient norms, weights), "world": ranks}
    of ``Trainer.fit`` over ``micro_batches`` x ``world`` batches, which the distributed sampler
    shares among the ranks: plain ``strategy="ddp"`` and ``OffloadStrategy`` with ZeRO-2."""
    _as_rank(rank, world, port)
    import torch
    from _lightning import Lit, loader, trainer, weights
    from offload.lightning import OffloadStrategy

    data = loader(n=micro_batches * world)
    out = {}
    m = Lit()        # first: the strategy starts the process group (plain DDP's runs then reuse it)
    t = trainer(OffloadStrategy({"zero_optimization": {"stage": 2}, "offload_optimizer": {"device": "cpu"}}),
                devices=world)
    t.fit(m, data)
    out["engine"] = (m.losses, m.norms, weights(m))     # handed back after fit
    out["world"] = t.strategy.engine.comm.world      # the group the strategy started
    t.strategy.engine.close()
    for impl in ("single", "fused"):
        m = Lit(impl=impl)
        trainer("ddp", devices=world).fit(m, data)
        out[impl] = (m.losses, m.norms, weights(m))
    torch.distributed.destroy_process_group()
    return _saved(out)
