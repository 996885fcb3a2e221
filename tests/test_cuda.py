"""The engine on a CUDA device: streams, pinned buffers, D2H gradients, H2D parameters.
Skipped without CUDA (see conftest.py); benchmarks/gpu_check.sh runs them on a GPU machine."""
import pytest
import torch

import offload
from _models import batches, clone, make_model
from test_engine import check_parity, max_diff, reference_run

pytestmark = pytest.mark.cuda


def on_cuda(data):
    return [(x.cuda(), y.cuda()) for x, y in data]


def run_engine(model, data, cfg):
    eng = offload.initialize(model, cfg)
    assert eng.device.type == "cuda"
    snaps = []
    for x, y in data:
        eng.backward(eng(x, y))
        eng.step()
        snaps.append({k: v.cpu() for k, v in eng.full_state_dict().items()})
    stats = eng.stats()
    eng.close()
    return snaps, stats


def cfg(tier, tmp_path, **kw):
    c = {"optimizer": {"lr": 1e-3, "weight_decay": 0.01}, "gradient_clipping": kw.pop("clip", 0.5),
         "offload_optimizer": {"device": tier, "nvme_path": str(tmp_path) if tier == "nvme" else None}}
    c.update(kw)
    return c


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_cuda_fp32_parity(tier, clip, tmp_path):
    base = make_model()
    data = on_cuda(batches(12))
    ref = [{k: v.cpu() for k, v in s.items()} for s in reference_run(clone(base).cuda(), data, clip=clip)]
    ref_fused = [{k: v.cpu() for k, v in s.items()}
                 for s in reference_run(clone(base).cuda(), data, clip=clip, fused=True)]
    got, _ = run_engine(clone(base), data, cfg(tier, tmp_path, clip=clip))
    check_parity(ref, ref_fused, got)


@pytest.mark.parametrize("param", ["none", "nvme"])
def test_cuda_update_ahead_parity(param, tmp_path):
    """offload_optimizer.update_ahead on CUDA: each block's update computed on the host during
    the device's backward (parameters staged in pinned memory, copied in at step()), against
    torch on the device, with no synchronisation between steps."""
    base = make_model()
    data = on_cuda(batches(8))
    ref = reference_run(clone(base).cuda(), data, clip=0.0)
    ref_fused = reference_run(clone(base).cuda(), data, clip=0.0, fused=True)
    eng = offload.initialize(clone(base), cfg("cpu", tmp_path, clip=0.0, offload_optimizer={"device": "cpu", "update_ahead": True},
                                              offload_param={"device": param, "nvme_path": str(tmp_path) if param == "nvme" else None}))
    for x, y in data:
        eng.backward(eng(x, y))
        eng.step()
    got = {k: v.cpu() for k, v in eng.full_state_dict().items()}
    assert eng.telemetry.counters["updates_ahead"] == len(data) * len(eng.blocks)
    eng.close()
    check_parity([{k: v.cpu() for k, v in ref[-1].items()}], [{k: v.cpu() for k, v in ref_fused[-1].items()}], [got])


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_cuda_param_offload_bit_exact(param, tmp_path):
    base = make_model()
    data = on_cuda(batches(8))
    ref, _ = run_engine(clone(base), data, cfg("cpu", tmp_path))
    got, stats = run_engine(clone(base), data, cfg("cpu", tmp_path, offload_param={
        "device": param, "nvme_path": str(tmp_path) if param == "nvme" else None}))
    for a, b in zip(ref, got):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert stats["prefetch"]["hits"] > 0


def test_cuda_bf16_trains(tmp_path):
    base = make_model()
    data = on_cuda(batches(30, seed=3)[:1] * 30)      # one batch, repeated: the loss must fall
    eng = offload.initialize(clone(base), cfg("cpu", tmp_path, precision="bf16"))
    losses = []
    for x, y in data:
        loss = eng(x, y)
        losses.append(loss.item())
        eng.backward(loss)
        eng.step()
    eng.close()
    assert losses[-1] < 0.8 * losses[0]


def test_cuda_device_memory_within_budget(tmp_path):
    from test_param_offload import Wide
    torch.manual_seed(0)
    model = Wide(layers=20)
    block = (128 * 128 + 128) * 4
    budget = 2 * (block + 4096)
    eng = offload.initialize(model, cfg("cpu", tmp_path, clip=0.0, offload_param={
        "device": "cpu", "device_budget_bytes": budget}))
    x = torch.randn(4, 128, device="cuda")
    for _ in range(3):
        eng.backward(eng(x))
        eng.step()
    s = eng.stats()
    assert s["device_param_bytes_peak"] <= budget and s["param_budget_overruns"] == 0
    eng.close()


def test_cuda_resume_matches(tmp_path):
    base = make_model()
    data = on_cuda(batches(6))
    full, _ = run_engine(clone(base), data, cfg("nvme", tmp_path))
    eng = offload.initialize(clone(base), cfg("nvme", tmp_path))
    for x, y in data[:3]:
        eng.backward(eng(x, y))
        eng.step()
    eng.save_checkpoint(str(tmp_path / "ck"))
    eng.close()
    eng = offload.initialize(make_model(seed=7), cfg("nvme", tmp_path))
    eng.load_checkpoint(str(tmp_path / "ck"))
    for x, y in data[3:]:
        eng.backward(eng(x, y))
        eng.step()
    got = {k: v.cpu() for k, v in eng.full_state_dict().items()}
    eng.close()
    assert max_diff(full[-1], got) == 0.0


def test_cuda_device_adam_never_synchronises(tmp_path):
    """Optimizer state on the device (tier none): forward, backward and step queue the update
    behind the block's backward without a single synchronising CUDA call (sync debug mode
    raises on any, in the optimizer's worker threads too; their errors surface in the next
    forward, which waits for every block's update). The result still matches torch."""
    base = make_model()
    data = on_cuda(batches(6))
    ref = [{k: v.cpu() for k, v in s.items()} for s in reference_run(clone(base).cuda(), data)]
    ref_fused = [{k: v.cpu() for k, v in s.items()} for s in reference_run(clone(base).cuda(), data, fused=True)]
    eng = offload.initialize(clone(base), cfg("none", tmp_path, clip=0.0))
    eng.backward(eng(*data[0]))         # the first step records orders and allocates: not timed here
    eng.step()
    got = [{k: v.cpu() for k, v in eng.full_state_dict().items()}]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in data[1:]:
            eng.backward(eng(x, y))
            eng.step()
        eng(*data[0])                   # waits for every block's update (host: the jobs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got.append({k: v.cpu() for k, v in eng.full_state_dict().items()})
    eng.close()
    check_parity([ref[0], ref[-1]], [ref_fused[0], ref_fused[-1]], got)
