"""The engine's step with the compute device of another device type than the host tiers
(tests/_simdevice.py), against plain torch / PEFT on the CPU on the same seed.

Why: on a CPU device host and device tensors are the same kind, so a device gradient added
into a host buffer, or a stream call on a block whose parameters live on the host, passes
every CPU test and fails on the first GPU. Here device tensors are of another type (their
bytes still on the CPU, so the arithmetic is the CPU's): a host tensor meeting a device
tensor raises as on CUDA, and every path written for CUDA streams and events runs.

The cells: a covering set of accumulation (micro-steps, and two backward() calls a step),
clipping, ZeRO stages 0-3 on one rank, every optimizer and parameter placement, the update
computed ahead, LoRA on a frozen base, the quantized base and activation offload. fp32 cells
are compared after every optimizer step with the bound of the CPU suite: twice the distance
between torch's single-tensor and fused AdamW on the same run, plus 1e-6.
"""
import pytest
import torch

import offload
from _models import batches, clone, make_model
from _simdevice import SIM, SimTensor, sim_device, to_sim
from test_engine import max_diff, parity_bounds

pytestmark = pytest.mark.filterwarnings("ignore:saved activations leave a CPU device",
                                        "ignore:Converting a tensor with requires_grad")

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


@pytest.fixture
def sim(monkeypatch):
    """The simulated accelerator for this test (undone at its end)."""
    stop = sim_device(monkeypatch)
    yield SIM
    stop()


def _config(c: dict, tmp_path) -> dict:
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


def sim_run(model, data, cfg, *, backwards=1):
    """The engine with the model and batches on the simulated device; snapshots (host
    tensors) after every commit, and the engine's stats."""
    eng = offload.initialize(to_sim(model), cfg)
    assert eng.device == SIM
    snaps, losses = [], []
    try:
        for i in range(0, len(data), backwards):
            for x, y in data[i:i + backwards]:
                loss = eng(*to_sim((x, y)))
                assert isinstance(loss, SimTensor)
                losses.append(loss.item())
                eng.backward(loss)
            if eng.step():
                snaps.append(eng.full_state_dict())
        stats = eng.stats()
    finally:
        eng.close()
    for snap in snaps:
        assert not any(isinstance(v, SimTensor) for v in snap.values())
    return snaps, stats, losses


def check_against(ref, fused, got, keys=None):
    assert len(got) == len(ref) > 0
    pick = (lambda s: {k: s[k] for k in keys}) if keys else (lambda s: s)
    for step, (r, g, bound) in enumerate(zip(ref, got, parity_bounds([pick(s) for s in ref],
                                                                    [pick(s) for s in fused]))):
        assert list(r) == list(g)
        d = max_diff(pick(r), pick(g))
        assert d <= bound, f"step {step}: the engine differs from torch by {d}, bound {bound}"


@pytest.mark.parametrize("cell", list(CELLS), ids=list(CELLS))
def test_step_on_a_separate_device_matches_torch(cell, sim, tmp_path):
    c = CELLS[cell]
    gas, backwards = c.get("gas", 1), c.get("backwards", 1)
    base = make_model(layers=LAYERS)
    data = batches(STEPS * gas * backwards)
    kw = dict(gas=gas, backwards=backwards, clip=c.get("clip", 0.0))
    ref = plain_run(clone(base), data, **kw)
    fused = plain_run(clone(base), data, fused=True, **kw)
    got, stats, _ = sim_run(clone(base), data, _config(c, tmp_path), backwards=backwards)
    check_against(ref, fused, got)
    if c.get("act", "none") != "none":
        assert stats["activations"]["bytes_moved"]["d2h"] > 0
    if c.get("ahead"):
        assert stats["counters"].get("updates_ahead", 0) > 0


def test_close_gives_every_parameter_back_on_the_compute_device(sim, tmp_path):
    """After close(), offloaded parameters (trained and frozen-only blocks alike) are back
    where they were at initialize: a model trained on the device stays usable there."""
    model = to_sim(make_model(layers=LAYERS))
    eng = offload.initialize(model, _config({"opt": "cpu", "param": "cpu"}, tmp_path))
    x, y = to_sim(batches(1)[0])
    try:
        eng.backward(eng(x, y))
        eng.step()
    finally:
        eng.close(restore=True)
    assert all(isinstance(p, SimTensor) for p in model.parameters())
    model(x, y)


@pytest.mark.parametrize("param", ["cpu", "nvme"], ids=["lora-cpu", "lora-nf4-nvme"])
def test_lora_and_quantized_base_on_a_separate_device_match_peft(param, sim, tmp_path):
    """LoRA over a frozen base offloaded to ``param``, quantized (nf4) on nvme: the adapters
    follow plain PEFT over the same (dequantized) base, run on the simulated device too (its
    bf16 matmuls round otherwise than the host's fused CPU kernels)."""
    pytest.importorskip("peft")
    from test_frozen_offload import cfg as lora_cfg, lora_llama
    from test_frozen_quant import dequantized_base, qcfg
    base = lora_llama()
    data = batches(STEPS, vocab=97)
    quant = param == "nvme"
    ref_model = dequantized_base(base, "nf4") if quant else base
    ref = plain_run(clone(ref_model), data, on_sim=True)
    fused = plain_run(clone(ref_model), data, fused=True, on_sim=True)
    got, stats, _ = sim_run(clone(base), data, qcfg(tmp_path, param, "nf4") if quant else lora_cfg(tmp_path, param))
    trainable = [k for k in ref[0] if "lora_" in k]
    check_against(ref, fused, got, keys=trainable)
    if quant:
        assert stats["frozen_quant"]["tensors"] > 0
