"""The one-rank covering set of the engine's configurations, run on a simulated device
(tests/system/test_sim_device.py) and on CUDA (tests/system/test_cuda.py): the cells, the engine's config
for one, and the plain torch loop (single-tensor or fused AdamW) they are compared with."""
import torch

from _simdevice import to_sim

CELLS = {
    # id: ZeRO stage, optimizer tier, parameter home, micro-steps a window (gas), backward()
    # calls a micro-step, clipping, update ahead, activation offload
    "z0-cpu-gas2-clip": dict(stage=0, opt="cpu", gas=2, clip=0.5),
    "z1-device-2backward-clip": dict(stage=1, opt="none", backwards=2, clip=0.5),
    "z2-cpu-gas2": dict(stage=2, opt="cpu", gas=2),
    "z2-device-2backward": dict(stage=2, opt="none", backwards=2),
    "z3-cpu-clip": dict(stage=3, opt="cpu", clip=0.5),
    "z3-device-gas2": dict(stage=3, opt="none", gas=2),
    "device-opt-cpu-params-clip": dict(opt="none", param="cpu", clip=0.5),
    "nvme-nvme-gas2-clip": dict(opt="nvme", param="nvme", gas=2, clip=0.5),
    "cpu-cpu-ahead": dict(opt="cpu", param="cpu", ahead=True),
    "cpu-cpu-activations-cpu": dict(opt="cpu", param="cpu", act="cpu"),
}
STEPS = 2
LAYERS = 3            # layer 1 frozen: a block of frozen parameters only


def cell_config(c: dict, tmp_path) -> dict:
    """The engine's config for cell ``c`` (NVMe files under ``tmp_path``)."""
    nvme = str(tmp_path)
    cfg = {"optimizer": {"lr": 1e-3, "weight_decay": 0.01},
           "zero_optimization": {"stage": c.get("stage", 0)},
           "gradient_accumulation_steps": c.get("gas", 1),
           "gradient_clipping": c.get("clip", 0.0),
           "offload_optimizer": {"device": c["opt"], "nvme_path": nvme if c["opt"] == "nvme" else None,
                                 "update_ahead": c.get("ahead", False)}}
    if c.get("param", "none") != "none":
        cfg["offload_param"] = {"device": c["param"], "nvme_path": nvme if c["param"] == "nvme" else None}
    if c.get("act", "none") != "none":
        cfg["offload_activations"] = {"device": c["act"], "min_bytes": 1024}
    return cfg


def plain_run(model, data, *, gas=1, backwards=1, clip=0.0, fused=False, on_sim=False):
    """Plain torch: AdamW (single-tensor or fused) on every trainable parameter; ``backwards``
    batches' losses each backward()-ed into one micro-step, ``gas`` micro-steps a window (the
    loss divided by ``gas``), clip_grad_norm_ at the window's end. Parameter snapshots after
    every optimizer step. ``on_sim``: forward and backward on the simulated device (the same
    kernels as the engine's there), AdamW and clipping on host copies of the trainable
    parameters (torch has no fused AdamW for that device type), copied back after each step."""
    if on_sim:
        model, data = to_sim(model), [to_sim(b) for b in data]
    params = [p for p in model.parameters() if p.requires_grad]
    host = [p.detach().to("cpu").requires_grad_() for p in params] if on_sim else params
    opt = torch.optim.AdamW(host, lr=1e-3, weight_decay=0.01, **({"fused": True} if fused else {"foreach": False}))
    snaps = []
    for i in range(0, len(data), backwards):
        for x, y in data[i:i + backwards]:
            loss = model(x, y)
            (loss / gas if gas > 1 else loss).backward()
        if (i // backwards + 1) % gas == 0:
            if on_sim:
                for h, p in zip(host, params):
                    h.grad = p.grad.to("cpu")
            if clip:
                torch.nn.utils.clip_grad_norm_(host, clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if on_sim:
                with torch.no_grad():
                    for h, p in zip(host, params):
                        p.copy_(h)
                        p.grad = None
            snaps.append({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
    return snaps
