"""The engine on a CUDA device: streams, pinned buffers, D2H gradients, H2D parameters; the
covering set of the CPU suite's one-rank configurations (tests/_cells.py, which
tests/system/test_sim_device.py runs on a simulated device; LoRA, the nf4 base) against plain torch / PEFT on the GPU; mixed precision with accumulation
on every stage; stream-ordering tests built to expose races; two ranks on NCCL where two GPUs
exist. Skipped without CUDA (see conftest.py); benchmarks/gpu_check.sh runs them on a GPU
machine."""
import pytest
import torch

import offload
from _models import Wide, batches, clone, make_model
from _parity import check_parity, max_diff, reference_run

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
    assert eng.telemetry.counters["updates_ahead"] == len(data) * sum(b.trains for b in eng.blocks)
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


# ---- every configuration of the CPU suite's covering sets, on one GPU ------------------------
# The cells of tests/_cells.py (accumulation, two backward() calls a step, clipping,
# ZeRO 0-3 on one rank, every optimizer and parameter placement, update ahead, activation
# offload), with the model on the GPU at initialize, against plain torch on the GPU.
from _cells import CELLS, LAYERS, STEPS, cell_config, plain_run as _plain_run   # noqa: E402


def cuda_plain_run(model, data, **kw):
    """_cells' plain torch loop with model and batches on the GPU (fused AdamW
    runs there)."""
    snaps = _plain_run(model.cuda(), on_cuda(data), **kw)
    return [{k: v.cpu() for k, v in s.items()} for s in snaps]


def cuda_engine_run(model, data, cfg, *, backwards=1):
    """The engine on the GPU, the model there at initialize; snapshots after every commit.
    After close() every parameter is back on the GPU (frozen-only blocks included)."""
    model = model.cuda()
    eng = offload.initialize(model, cfg)
    assert eng.device.type == "cuda"
    snaps = []
    try:
        for i in range(0, len(data), backwards):
            for x, y in on_cuda(data[i:i + backwards]):
                eng.backward(eng(x, y))
            if eng.step():
                snaps.append({k: v.cpu() for k, v in eng.full_state_dict().items()})
        stats = eng.stats()
    finally:
        eng.close(restore=True)
    assert all(p.is_cuda for p in model.parameters())
    return snaps, stats


@pytest.mark.parametrize("cell", list(CELLS), ids=list(CELLS))
def test_cuda_cells_match_torch_on_the_gpu(cell, tmp_path):
    c = CELLS[cell]
    gas, backwards = c.get("gas", 1), c.get("backwards", 1)
    base = make_model(layers=LAYERS)
    data = batches(STEPS * gas * backwards)
    kw = dict(gas=gas, backwards=backwards, clip=c.get("clip", 0.0))
    ref = cuda_plain_run(clone(base), data, **kw)
    fused = cuda_plain_run(clone(base), data, fused=True, **kw)
    got, stats = cuda_engine_run(clone(base), data, cell_config(c, tmp_path), backwards=backwards)
    check_parity(ref, fused, got)
    if c.get("act", "none") != "none":
        assert stats["activations"]["bytes_moved"]["d2h"] > 0


# tests/_matrix.py's covering array (tests/system/test_matrix.py's cells: placements x LoRA / partly frozen x checkpointing x
# activation offload x fp32 / bf16 x accumulation, a 3-layer Llama) on the GPU
try:
    import _matrix
    MATRIX = _matrix.CELLS
except BaseException:          # noqa: BLE001 - peft / transformers missing: pytest's skip is a BaseException
    _matrix, MATRIX = None, []


@pytest.mark.parametrize("cell", MATRIX, ids=_matrix.cell_id if _matrix else None)
def test_cuda_matrix_cell_matches_plain_torch_on_the_gpu(cell, tmp_path):
    _matrix.check_cell(cell, tmp_path, device="cuda")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_cuda_mixed_precision_with_accumulation_trains(precision, stage, tmp_path):
    """bf16 / fp16 (loss scaling) with accumulation on every stage of one rank: one batch
    repeated, the loss must fall (the accumulated landings of findings 1 and 4 run here)."""
    data = batches(1, seed=3) * 40
    cfg = cell_config({"stage": stage, "opt": "cpu", "gas": 2, "clip": 0.5}, tmp_path)
    cfg["precision"] = precision
    model = make_model(layers=LAYERS).cuda()
    eng = offload.initialize(model, cfg)
    losses = []
    try:
        for x, y in on_cuda(data):
            loss = eng(x, y)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
    finally:
        eng.close()
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("param", ["cpu", "nvme"], ids=["lora-cpu", "lora-nf4-nvme"])
def test_cuda_lora_and_quantized_base_match_peft(param, tmp_path):
    """LoRA over a frozen base offloaded to the host, and over an nf4 base on NVMe, against
    plain PEFT on the GPU over the same (dequantized) base."""
    pytest.importorskip("peft")
    from _lora import dequantized_base, lora_cfg, lora_llama, qcfg
    base = lora_llama()
    data = batches(STEPS, vocab=97)
    quant = param == "nvme"
    ref_model = dequantized_base(base, "nf4") if quant else base
    ref = cuda_plain_run(clone(ref_model), data)
    fused = cuda_plain_run(clone(ref_model), data, fused=True)
    got, stats = cuda_engine_run(clone(base), data, qcfg(tmp_path, param, "nf4") if quant else lora_cfg(tmp_path, param))
    check_parity(ref, fused, got, keys=[k for k in ref[0] if "lora_" in k])
    if quant:
        assert stats["frozen_quant"]["tensors"] > 0


# ---- stream ordering, built to expose races ----------------------------------------------------
# Each test makes one side of a cross-stream hand-off slow with torch.cuda._sleep (a kernel
# that spins for N cycles) on the stream that produces the data, with quick compute on the
# other: a consumer that does not wait on the right event reads stale or half-written bytes,
# and the run leaves torch's bounds. Clipping off (its .item() synchronizes and would hide it).
SLEEP = 50_000_000          # cycles: tens of milliseconds on current GPUs, far longer than a small step


def _race_cell(tmp_path, **c):
    base = make_model(layers=LAYERS)
    gas, backwards = c.get("gas", 1), c.get("backwards", 1)
    data = batches(3 * gas * backwards)
    kw = dict(gas=gas, backwards=backwards)
    ref = cuda_plain_run(clone(base), data, **kw)
    fused = cuda_plain_run(clone(base), data, fused=True, **kw)
    got, _ = cuda_engine_run(clone(base), data, cell_config(c, tmp_path), backwards=backwards)
    check_parity(ref, fused, got)


def _slow_optimizer_stream(monkeypatch):
    """The optimizer pipeline's streams sleep SLEEP cycles after each wait, before the job's
    kernels: a consumer that does not wait on the job's event reads the old parameters."""
    from offload.optim import pipeline
    real = pipeline.dev.wait_event

    def slow_wait(stream, event):
        real(stream, event)
        if stream is not None and stream != torch.cuda.current_stream():
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP)
    monkeypatch.setattr(pipeline.dev, "wait_event", slow_wait)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_cuda_slow_optimizer_stream_is_waited_for(stage, monkeypatch, tmp_path):
    """The device optimizer's stream sleeps before each job's kernels: the next forward (and
    the ZeRO-1/2 gather) must wait on update_event, with parameters resident or offloaded."""
    _slow_optimizer_stream(monkeypatch)
    _race_cell(tmp_path, stage=stage, opt="none", gas=2)


def test_cuda_slow_optimizer_stream_with_offloaded_params(monkeypatch, tmp_path):
    _slow_optimizer_stream(monkeypatch)
    _race_cell(tmp_path, opt="none", param="cpu")


@pytest.mark.parametrize("opt", ["none", "cpu"])
def test_cuda_slow_gradient_copies_are_waited_for(opt, monkeypatch, tmp_path):
    """Each gradient's D2H copy starts after a long sleep on the D2H stream (a long copy):
    the optimizer (host or device) must wait for the landing events, the second landing of a
    window must add to the first one's bytes."""
    from offload import device as dev
    real = dev.copy_to_host_async

    def slow_copy(dst, src, stream):
        if stream is not None and src.is_cuda:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP // 10)
        return real(dst, src, stream)
    monkeypatch.setattr(dev, "copy_to_host_async", slow_copy)
    _race_cell(tmp_path, opt=opt, gas=2)


def test_cuda_slow_gradient_finish_is_waited_for(monkeypatch, tmp_path):
    """ZeRO-2 on one GPU with the optimizer on the device: the compute stream sleeps before
    each collective's finishing kernels (the shard added into the accumulation buffer); the
    optimizer's stream must start after them (compute_done recorded after the collectives)."""
    from offload.dist import grad_sync
    real = grad_sync._Pending.wait

    def slow(self):
        if not self.done:
            torch.cuda._sleep(SLEEP)
        real(self)
    monkeypatch.setattr(grad_sync._Pending, "wait", slow)
    _race_cell(tmp_path, stage=2, opt="none", gas=2)


# ---- two ranks, where two GPUs exist ----------------------------------------------------------
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
                    reason="needs 2 CUDA devices and NCCL")
@pytest.mark.parametrize("stage,tier", [(0, "none"), (1, "none"), (2, "none"), (2, "cpu"), (3, "none")])
def test_cuda_two_ranks_nccl_without_clipping(stage, tier, tmp_path):
    """Two ranks on NCCL, one GPU each, no clipping (nothing synchronizes the streams for the
    engine): half batches on each rank match plain torch on the full batch."""
    from _zero import EPS, LR, TOL, WD, spawn
    jobs = [{"name": "j", "stage": stage, "tier": tier, "steps": 3, "eps": EPS, "clip": 0.0}]
    rcs, errs, res = spawn(jobs, 2, str(tmp_path), backend="nccl")
    assert rcs == [0, 0] and not errs, errs
    m = make_model()
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, eps=EPS, foreach=False)
    ref = []
    for x, y in batches(3, batch=4):
        m(x, y).backward()
        opt.step()
        opt.zero_grad()
        ref.append({k: v.detach().clone() for k, v in m.state_dict().items()})
    for step, (r, g) in enumerate(zip(ref, res[0]["j"]["snaps"])):
        assert max_diff(r, g) <= TOL, (step, max_diff(r, g))
