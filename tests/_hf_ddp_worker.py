"""One rank of tests/hf/test_hf_trainer.py's torchrun test: offload.hf.Trainer with ZeRO across
ranks (gloo), as Trainer runs under torchrun with DeepSpeed. argv: OUT STAGE."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _hf import args, dataset, tiny_llama, train_logs  # noqa: E402

from offload.hf import Trainer  # noqa: E402


def main(out: str, stage: int) -> None:
    t = Trainer(model=tiny_llama(), args=args(os.path.join(out, "trainer"), per_device_train_batch_size=2,
                                              gradient_accumulation_steps=2, max_steps=3, ddp_backend="gloo"),
                train_dataset=dataset(), offload_config={"zero_optimization": {"stage": stage},
                                                         "offload_optimizer": {"device": "cpu"}})
    t.train()
    weights = t.engine.full_state_dict()          # a collective: every rank
    if t.args.process_index == 0:
        torch.save({"logs": train_logs(t), "weights": weights, "world": t.engine.comm.world},
                   os.path.join(out, f"stage{stage}.pt"))
    t.close()
    # as torch asks of every script that initialized a process group: without it, gloo's
    # threads are torn down at interpreter exit while the other rank may still be in its last
    # collectives (a rank aborted with "terminate called without an active exception" once)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
