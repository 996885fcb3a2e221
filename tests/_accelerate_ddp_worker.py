"""One rank of tests/integrations/test_hf_accelerate.py's torchrun test: the same loop (tests/_accelerate.py)
under plain Accelerate (DDP over gloo; single-tensor and fused AdamW) and under
offload.accelerate.Accelerator (ZeRO-2 across the ranks), each rank on its shard of the
data. argv: OUT."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accelerate  # noqa: E402
from _accelerate import GAS, run  # noqa: E402

from offload.accelerate import Accelerator  # noqa: E402


def main(out: str) -> None:
    from accelerate.utils import GradientAccumulationPlugin

    def plain(each):
        plugin = GradientAccumulationPlugin(num_steps=GAS, sync_each_batch=each)
        return lambda: accelerate.Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    single = run(plain(True), opt_kwargs={"foreach": False}, n=16)
    fused = run(plain(False), opt_kwargs={"fused": True}, n=16)
    cfg = {"zero_optimization": {"stage": 2}, "offload_optimizer": {"device": "cpu"}}
    engine_acc = []

    def make():
        acc = Accelerator(cpu=True, gradient_accumulation_steps=GAS, offload_config=cfg)
        engine_acc.append(acc)
        return acc
    engine = run(make, n=16)
    if torch.distributed.get_rank() == 0:
        stage = engine_acc[-1].engine.config.zero_optimization.stage      # (a closed engine keeps its config)
        torch.save({"single": single, "fused": fused, "engine": engine, "world": torch.distributed.get_world_size(),
                    "stage": stage},
                   os.path.join(out, "result.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
