"""The engine against plain PyTorch on the same seed and data, step by step."""
import os

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import offload
import _forked
import _resume_worker
from _models import batches, clone, make_model
from _parity import check_parity, max_diff, reference_run

TIERS = ["none", "cpu", "nvme"]


def engine_run(model, data, cfg, groups=None, sched=None, engine_out=None):
    eng = offload.initialize(model, cfg, param_groups=groups(model) if groups else None)
    sch = sched(eng.optimizer) if sched else None
    snaps = []
    gas = eng.config.gradient_accumulation_steps
    for i, (x, y) in enumerate(data):
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()                      # every micro-step; commits at the window's boundary
        if (i + 1) % gas == 0:
            if sch:
                sch.step()
            snaps.append(eng.full_state_dict())
    if engine_out is not None:
        engine_out.append(eng)
    else:
        eng.close()
    return snaps


def cfg_for(tier, tmp_path, **kw):
    cfg = {"optimizer": {"type": kw.pop("type", "AdamW"), "lr": kw.pop("lr", 1e-3),
                         "weight_decay": kw.pop("wd", 0.01)},
           "offload_optimizer": {"device": tier}}
    if tier == "nvme":
        cfg["offload_optimizer"]["nvme_path"] = str(tmp_path)
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize("tier", TIERS)
def test_fp32_parity_with_clipping(tier, tmp_path):
    """20 steps, tied embeddings, a frozen layer, gradient clipping (the synchronous path)."""
    base = make_model()
    data = batches(20)
    ref = reference_run(clone(base), data, clip=0.5)
    ref_fused = reference_run(clone(base), data, clip=0.5, fused=True)
    got = engine_run(clone(base), data, cfg_for(tier, tmp_path, gradient_clipping=0.5))
    assert len(got) == 20
    check_parity(ref, ref_fused, got)
    # the weights really moved, so the comparison means something
    assert max_diff(ref[-1], clone(base).state_dict()) > 1e-3


def test_gradient_accumulation_parity(tmp_path):
    base = make_model()
    data = batches(12)
    ref = reference_run(clone(base), data, gas=3, clip=1.0)
    ref_fused = reference_run(clone(base), data, gas=3, clip=1.0, fused=True)
    got = engine_run(clone(base), data, cfg_for("cpu", tmp_path, gradient_accumulation_steps=3,
                                                gradient_clipping=1.0))
    assert len(got) == 4
    check_parity(ref, ref_fused, got)


def test_param_groups_and_lr_scheduler(tmp_path):
    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for n, p in m.named_parameters() if p.requires_grad and p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]

    def sched(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    base = make_model()
    data = batches(8)
    ref = reference_run(clone(base), data, groups=groups, sched=sched, adamw=False)
    ref_fused = reference_run(clone(base), data, groups=groups, sched=sched, adamw=False, fused=True)
    got = engine_run(clone(base), data, cfg_for("cpu", tmp_path, type="Adam"), groups=groups, sched=sched)
    check_parity(ref, ref_fused, got)


def test_frozen_parameters_have_no_state(tmp_path):
    model = make_model()
    eng = offload.initialize(model, cfg_for("cpu", tmp_path))
    frozen = {id(p) for p in model.layers[1].parameters()}
    in_blocks = {id(s.param) for b in eng.blocks for s in b.layout.segments}
    assert frozen and not (frozen & in_blocks)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(b.layout.numel for b in eng.blocks) == trainable
    # tied embedding / head: one parameter, in one block
    assert model.head.weight is model.tok.weight
    assert sum(1 for b in eng.blocks for s in b.layout.segments if s.param is model.tok.weight) == 1
    frozen_before = [p.clone() for p in model.layers[1].parameters()]
    for x, y in batches(3):
        eng.backward(eng(x, y))
        eng.step()
    eng.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(frozen_before, model.layers[1].parameters()))
    eng.close()


def test_fp16_overflow_skips_step_and_lowers_scale(tmp_path):
    model = make_model()
    eng = offload.initialize(model, cfg_for("cpu", tmp_path, precision="fp16",
                                            loss_scaler={"initial_scale": 2.0 ** 10, "growth_interval": 2}))
    data = batches(4)
    x, y = data[0]
    before = eng.full_state_dict()
    eng.backward(eng(x, y) * float("inf"))
    assert eng.step() is False
    assert eng.stats()["loss_scale"] == 2.0 ** 9 and eng.stats()["skipped_steps"] == 1
    assert max_diff(before, eng.full_state_dict()) == 0.0
    for x, y in data[1:]:
        eng.backward(eng(x, y))
        assert eng.step() is True
    assert eng.stats()["loss_scale"] == 2.0 ** 10  # grew after two clean steps
    assert max_diff(before, eng.full_state_dict()) > 1e-4
    eng.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_resume_in_new_process_is_bit_exact(tier, tmp_path):
    nv = tmp_path / "nvme"
    nv.mkdir()
    ck = str(tmp_path / "ckpt")

    def run(*args):      # each leg in a process of its own
        _forked.call(_resume_worker.run, tier, str(nv), ck, *args, timeout_s=300, what="a resume test's leg")
    run(str(tmp_path / "full.pt"), "0", "8", "2")       # 8 steps straight (no load, no save: load=2)
    run(str(tmp_path / "first.pt"), "0", "5", "0")      # 5 steps, save
    run(str(tmp_path / "resumed.pt"), "5", "8", "1")    # new process: load, 3 more steps
    full = torch.load(tmp_path / "full.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert list(full) == list(resumed)
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    assert not torch.equal(torch.load(tmp_path / "first.pt")["tok.weight"], full["tok.weight"])


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    from offload.io import checkpoint
    eng = offload.initialize(make_model(), cfg_for("cpu", tmp_path))
    data = batches(3)
    eng.backward(eng(*data[0]))
    eng.step()
    ck = tmp_path / "ck"
    eng.save_checkpoint(str(ck))
    saved = eng.full_state_dict()
    eng.backward(eng(*data[1]))
    eng.step()
    calls = []
    real = checkpoint._write_block

    def failing(fname, block, *cols):
        calls.append(fname)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(fname, block, *cols)
    monkeypatch.setattr(checkpoint, "_write_block", failing)
    with pytest.raises(OSError):
        eng.save_checkpoint(str(ck))
    monkeypatch.setattr(checkpoint, "_write_block", real)
    assert not list(tmp_path.glob("ck.tmp-*"))
    eng2 = offload.initialize(make_model(seed=5), cfg_for("cpu", tmp_path))
    eng2.load_checkpoint(str(ck))
    loaded = eng2.full_state_dict()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    # a crash between the two renames: only <dir>.prev is left, and it loads
    os.rename(ck, str(ck) + ".prev")
    with pytest.warns(UserWarning, match="interrupted"):
        eng2.load_checkpoint(str(ck))
    eng.close()
    eng2.close()


def test_export_fp32_loads_into_original_model(tmp_path):
    eng = offload.initialize(make_model(), cfg_for("nvme", tmp_path))
    for x, y in batches(3):
        eng.backward(eng(x, y))
        eng.step()
    eng.save_checkpoint(str(tmp_path / "ck"))
    live = eng.full_state_dict()
    eng.close()
    sd = offload.export_fp32(str(tmp_path / "ck"))
    fresh = make_model(seed=9)
    fresh.load_state_dict(sd)
    assert all(torch.equal(fresh.state_dict()[k], live[k]) for k in live)
    assert sd["head.weight"].data_ptr() != 0 and torch.equal(sd["head.weight"], sd["tok.weight"])


def test_close_removes_swap_files(tmp_path):
    eng = offload.initialize(make_model(), cfg_for("nvme", tmp_path))
    eng.backward(eng(*batches(1)[0]))
    eng.step()
    assert any(p.is_file() for p in tmp_path.rglob("*"))
    eng.close()
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    with pytest.raises(RuntimeError, match="closed"):
        eng.step()


def test_load_checkpoint_from_other_model_is_an_error(tmp_path):
    eng = offload.initialize(make_model(), cfg_for("cpu", tmp_path))
    eng.save_checkpoint(str(tmp_path / "ck"))
    other = offload.initialize(make_model(layers=3), cfg_for("cpu", tmp_path))
    with pytest.raises(offload.CheckpointError, match="different model"):
        other.load_checkpoint(str(tmp_path / "ck"))
    eng.close()
    other.close()


def test_stats_and_profiler_ranges(tmp_path):
    eng = offload.initialize(make_model(), cfg_for("nvme", tmp_path, gradient_clipping=1.0))
    from torch.profiler import ProfilerActivity, profile
    # the optimizer stages run on worker threads: profile all threads to see them
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        for x, y in batches(2):
            eng.backward(eng(x, y))
            eng.step()
        eng.synchronize()
    names = {e.name for e in prof.events()}
    for stage in ("forward", "backward", "grad_d2h", "grad_norm", "cpu_adam", "state_read", "state_write"):
        assert f"offload::{stage}" in names, stage
    s = eng.stats()
    assert s["step"] == 2 and s["bytes"]["nvme_write"] > 0 and s["bytes"]["nvme_read"] > 0
    assert s["tier_bytes"]["nvme"] >= sum(b.state.nbytes for b in eng.blocks)
    assert s["seconds"]["cpu_adam"] > 0
    eng.close()


def test_optimizer_step_hooks_run_as_torch_runs_them(tmp_path, ranges_entered):
    """torch.optim's step hooks (global and the engine optimizer's own, pre then post) run
    once per committed update, as around a torch optimizer's step; the step's profiler
    range is entered only while a profiler records."""
    calls = []
    entered = ranges_entered
    model = make_model()
    eng = offload.initialize(model, cfg_for("cpu", tmp_path, gradient_accumulation_steps=2))
    opt = eng.optimizer
    handles = [opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt, a[0] is opt))),
               opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt, a[0] is opt))),
               register_optimizer_step_pre_hook(
                   lambda o, a, k: calls.append(("global pre", o is opt, a[0] is opt))),
               register_optimizer_step_post_hook(
                   lambda o, a, k: calls.append(("global post", o is opt, a[0] is opt)))]
    try:
        for i, (x, y) in enumerate(batches(4)):
            eng.backward(eng(x, y))
            eng.step()
            # a torch optimizer: global pre, own pre, own post, global post, once per update
            assert calls == [("global pre", True, True), ("pre", True, True), ("post", True, True),
                             ("global post", True, True)] * ((i + 1) // 2), i
        assert not [n for n in entered if n.startswith("Optimizer.step")]   # no profiler: no range
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for x, y in batches(2):
                eng.backward(eng(x, y))
                eng.step()
        assert "Optimizer.step#_ParamGroups.step" in {e.name for e in prof.events()}
    finally:
        for h in handles:
            h.remove()
        eng.close()
