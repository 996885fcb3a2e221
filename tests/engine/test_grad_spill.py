"""Host memory bounded by configuration: with the optimizer state on NVMe, gradients that
wait (for the global norm, or across micro-steps) are parked on NVMe, the clip still equals
plain torch, and the host pools do not grow with the number of layers."""
import pytest
import torch

import offload
from offload.placement import Placement
from _models import batches, clone, make_model
from _parity import check_parity, reference_run


def nvme_cfg(tmp_path, **kw):
    c = {"optimizer": {"lr": 1e-3, "weight_decay": 0.01},
         "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2}}
    c["offload_optimizer"].update(kw.pop("opt", {}))
    c.update(kw)
    return c


def run(model, data, config):
    eng = offload.initialize(model, config)
    gas = eng.config.gradient_accumulation_steps
    snaps = []
    for i, (x, y) in enumerate(data):
        eng.backward(eng(x, y))
        eng.step()                      # every micro-step; the window commits every gas-th
        if (i + 1) % gas == 0:
            snaps.append(eng.full_state_dict())
    stats, plan = eng.stats(), eng.plan
    eng.close()
    return snaps, stats, plan


@pytest.mark.parametrize("clip,gas", [(0.0, 1), (0.5, 1), (1.0, 3)])
def test_parked_gradients_match_torch(clip, gas, tmp_path):
    base = make_model(layers=4)
    data = batches(2 * gas)
    ref = reference_run(clone(base), data, gas=gas, clip=clip)
    ref_fused = reference_run(clone(base), data, gas=gas, clip=clip, fused=True)
    got, stats, plan = run(clone(base), data, nvme_cfg(tmp_path, gradient_accumulation_steps=gas,
                                                       gradient_clipping=clip))
    check_parity(ref, ref_fused, got)
    assert plan.grad_home is Placement.NVME
    assert plan.pool("offload-host") is None                  # no whole-model gradient buffer
    n_grads = plan.pool("offload-grads").slots
    assert len(n_grads) < len(plan.blocks)
    # the parked sums went to the disk and came back: beyond the optimizer state's traffic
    state = sum(b.state_bytes for b in plan.blocks)
    assert stats["bytes"]["nvme_write"] > 3 * state * 1.0


def test_grad_host_budget_keeps_gradients_in_ram_when_they_fit(tmp_path):
    base = make_model()
    data = batches(4)
    cfg = nvme_cfg(tmp_path, gradient_accumulation_steps=2, gradient_clipping=1.0, opt={"grad_host_bytes": 1 << 30})
    ref = reference_run(clone(base), data, gas=2, clip=1.0)
    ref_fused = reference_run(clone(base), data, gas=2, clip=1.0, fused=True)
    got, _, plan = run(clone(base), data, cfg)
    assert plan.grad_home is Placement.HOST
    check_parity(ref, ref_fused, got)


def test_grad_host_budget_needs_nvme(tmp_path):
    cfg = {"offload_optimizer": {"device": "cpu", "grad_host_bytes": 4096}, "gradient_clipping": 1.0}
    with pytest.raises(ValueError, match="set offload_optimizer.device to nvme"):
        offload.initialize(make_model(), cfg)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_host_pools_do_not_grow_with_depth(precision, tmp_path):
    """For every combination of clipping and accumulation: the host pools of an 8-layer and
    a 16-layer model of one width are the same bytes (all on NVMe; pools are sized by the
    configuration, clamped only for models with fewer blocks than buffers), and both train."""
    for clip, gas in ((0.0, 1), (1.0, 1), (1.0, 2)):
        host = []
        for layers in (8, 16):
            model = make_model(layers=layers, frozen_layer=None)
            if precision != "fp32":
                model = model.to(torch.bfloat16 if precision == "bf16" else torch.float16)
            cfg = nvme_cfg(tmp_path, precision=precision, gradient_clipping=clip, gradient_accumulation_steps=gas,
                           offload_param={"device": "nvme", "nvme_path": str(tmp_path)})
            eng = offload.initialize(model, cfg)
            for x, y in batches(gas):
                eng.backward(eng(x, y))
                eng.step()
            eng.synchronize()
            host.append(eng.stats()["tier_bytes"]["host"])
            assert host[-1] == eng.plan.host
            eng.close()
        assert host[0] == host[1], (precision, clip, gas, host)
