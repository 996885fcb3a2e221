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

import offload
from _models import batches, clone, make_model
from _simdevice import SIM, SimTensor, sim_device, to_sim
from _cells import CELLS, LAYERS, STEPS, cell_config, plain_run
from _parity import check_parity

pytestmark = pytest.mark.filterwarnings("ignore:saved activations leave a CPU device",
                                        "ignore:Converting a tensor with requires_grad")

@pytest.fixture
def sim(monkeypatch):
    """The simulated accelerator for this test (undone at its end)."""
    stop = sim_device(monkeypatch)
    yield SIM
    stop()


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


@pytest.mark.parametrize("cell", list(CELLS), ids=list(CELLS))
def test_step_on_a_separate_device_matches_torch(cell, sim, tmp_path):
    c = CELLS[cell]
    gas, backwards = c.get("gas", 1), c.get("backwards", 1)
    base = make_model(layers=LAYERS)
    data = batches(STEPS * gas * backwards)
    kw = dict(gas=gas, backwards=backwards, clip=c.get("clip", 0.0))
    ref = plain_run(clone(base), data, **kw)
    fused = plain_run(clone(base), data, fused=True, **kw)
    got, stats, _ = sim_run(clone(base), data, cell_config(c, tmp_path), backwards=backwards)
    check_parity(ref, fused, got)
    if c.get("act", "none") != "none":
        assert stats["activations"]["bytes_moved"]["d2h"] > 0
    if c.get("ahead"):
        assert stats["counters"].get("updates_ahead", 0) > 0


def test_close_gives_every_parameter_back_on_the_compute_device(sim, tmp_path):
    """After close(), offloaded parameters (trained and frozen-only blocks alike) are back
    where they were at initialize: a model trained on the device stays usable there."""
    model = to_sim(make_model(layers=LAYERS))
    eng = offload.initialize(model, cell_config({"opt": "cpu", "param": "cpu"}, tmp_path))
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
    from _lora import dequantized_base, lora_cfg, lora_llama, qcfg
    base = lora_llama()
    data = batches(STEPS, vocab=97)
    quant = param == "nvme"
    ref_model = dequantized_base(base, "nf4") if quant else base
    ref = plain_run(clone(ref_model), data, on_sim=True)
    fused = plain_run(clone(ref_model), data, fused=True, on_sim=True)
    got, stats, _ = sim_run(clone(base), data, qcfg(tmp_path, param, "nf4") if quant else lora_cfg(tmp_path, param))
    trainable = [k for k in ref[0] if "lora_" in k]
    check_parity(ref, fused, got, keys=trainable)
    if quant:
        assert stats["frozen_quant"]["tensors"] > 0
