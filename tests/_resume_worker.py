"""One leg of a resume test (tests/engine/test_engine.py, tests/params/test_param_offload.py), in a process of
its own (tests/_forked.py): train steps [start, stop) of the shared batches, optionally after
loading a checkpoint and optionally saving one, and save the consolidated state to ``out``."""
import torch

import offload
from _models import batches, make_model


def run(tier, nvme, ckpt, out, start, stop, load, param_nvme=False):
    """load: "1" loads ``ckpt`` first, "0" saves it at the end, "2" neither."""
    cfg = {"optimizer": {"lr": 1e-3, "weight_decay": 0.01}, "gradient_clipping": 0.5,
           "offload_optimizer": {"device": tier, "nvme_path": nvme if tier == "nvme" else None}}
    if param_nvme:
        cfg["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    eng = offload.initialize(make_model(), cfg)
    if load == "1":
        eng.load_checkpoint(ckpt)
    for x, y in batches(int(stop))[int(start):]:
        eng.backward(eng(x, y))
        eng.step()
    if load == "0":
        eng.save_checkpoint(ckpt)
    torch.save(eng.full_state_dict(), out)
    eng.close()
