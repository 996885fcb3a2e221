"""One rank of tests/test_lightning.py's two-rank Fabric test (gloo): plain DDP twice (torch's
single-tensor and fused AdamW: the noise bound) and the engine, on the same seed and this
rank's half of the batches. Lightning is imported in the child, not by the fork server."""
import io
import os


def fabric_rank(rank: int, world: int, port: int, nvme: str) -> bytes:
    """This rank's {"single" | "fused" | "engine": (losses, gradient norms, weights), "world": ranks}, saved
    with torch.save (tensors sent through the pipe would be shared memory the child frees)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                      WORLD_SIZE=str(world))
    import torch
    torch.set_num_threads(1)
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
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()
