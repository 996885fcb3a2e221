"""offload.accelerate.Accelerator against plain ``accelerate.Accelerator`` on the same seed,
data and loop (tests/_accelerate.py: accumulation, clip_grad_norm_, an LR scheduler, and
save_state / load_state in the middle of training into a fresh Accelerator, model and
optimizer), fp32, full fine-tuning and LoRA, over a covering set of placements.

Tolerance: twice the distance between two plain runs that differ only in torch's AdamW
implementation (single-tensor vs fused), measured here on the same loop, plus 1e-6; the
learning rates logged are equal."""
import functools
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("peft")
accelerate = pytest.importorskip("accelerate")

from _accelerate import CLIP, fresh_state, make_model, run  # noqa: E402
from _parity import max_diff, noise_bound  # noqa: E402
from _paths import TESTS  # noqa: E402
import _forked  # noqa: E402

from offload.accelerate import Accelerator  # noqa: E402
from offload.config import ConfigError  # noqa: E402

SAVE_AT = 6          # micro-batches before save_state: 3 of the 4 windows (GAS 2) committed


def plain():
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)


def on_engine(cfg):
    return lambda: Accelerator(cpu=True, gradient_accumulation_steps=2, offload_config=cfg)


def placement(opt, params, tmp_path):
    cfg = {"offload_optimizer": {"device": opt}, "offload_param": {"device": params}}
    for sec in cfg.values():
        if sec["device"] == "nvme":
            sec["nvme_path"] = str(tmp_path)
    return cfg


@functools.lru_cache(maxsize=None)
def refs(kind):
    """Plain Accelerate's loop with single-tensor and with fused AdamW (once per kind)."""
    return run(plain, kind, {"foreach": False}), run(plain, kind, {"fused": True})


def check_same(ref, fused, got, kind="full"):
    (rl, rw), (fl, fw), (gl, gw) = ref, fused, got
    assert len(gl["loss"]) == len(rl["loss"]) and len(gl["norm"]) == len(rl["norm"]) >= 2
    assert max(rl["norm"]) > CLIP[kind]                # clipping bites
    assert gl["lr"] == rl["lr"] and rl["lr"][-1] < rl["lr"][0]   # the scheduler drove the engine
    for k in ("loss", "norm"):
        for r, f, g in zip(rl[k], fl[k], gl[k]):
            assert abs(g - r) <= noise_bound(r, f), (k, g, r, f)
    bound = noise_bound(rw, fw)
    assert max_diff(rw, gw) <= bound, f"weights differ by {max_diff(rw, gw)} > {bound}"


@pytest.mark.parametrize("kind, opt, params", [
    pytest.param("full", "cpu", "none", marks=pytest.mark.hf_versions),
    ("full", "nvme", "nvme"), ("lora", "nvme", "none"), ("lora", "cpu", "nvme"),
])
def test_loop_matches_plain_accelerate_with_resume(kind, opt, params, tmp_path):
    got = run(on_engine(placement(opt, params, tmp_path)), kind, save_at=SAVE_AT,
              ckpt=str(tmp_path / "state"))
    assert os.path.isdir(tmp_path / "state" / "offload")          # the engine's checkpoint inside
    check_same(*refs(kind), got, kind)


def test_transformers_adafactor_with_relative_step(tmp_path):
    """transformers' Adafactor with ``lr=None`` prepared as the loop's optimizer: bitwise equal
    to plain Accelerate (the rule runs transformers' operations in order), resumed mid-window.
    Its proxy schedule reads transformers' own state, which the engine does not fill: the
    learning rates are not compared."""
    from transformers.optimization import Adafactor, AdafactorSchedule

    def make_opt(params):
        opt = Adafactor(params, lr=None, relative_step=True, scale_parameter=True, warmup_init=False)
        return opt, AdafactorSchedule(opt)
    (rl, rw) = run(plain, make_opt=make_opt)
    (gl, gw) = run(on_engine(placement("nvme", "none", tmp_path)), make_opt=make_opt, save_at=SAVE_AT,
                   ckpt=str(tmp_path / "state"))
    assert (gl["loss"], gl["norm"]) == (rl["loss"], rl["norm"]) and max(rl["norm"]) > CLIP["full"]
    assert all(torch.equal(gw[k], rw[k]) for k in rw)


# ---- what the engine cannot honour fails at prepare ---------------------------------------------
def _acc():
    fresh_state()
    return Accelerator(cpu=True)


def test_another_optimizer_class_is_refused():
    model = make_model("full")
    with pytest.raises(ConfigError, match=r"no rule for torch\.optim\..*RMSprop: give one of"):
        _acc().prepare(model, torch.optim.RMSprop(model.parameters()))


def test_a_second_model_is_refused():
    acc, a, b = _acc(), make_model("full"), make_model("full")
    with pytest.raises(ConfigError, match="a second model to prepare"):
        acc.prepare(a, torch.optim.AdamW(a.parameters()), b)
    a, opt = acc.prepare(a, torch.optim.AdamW(a.parameters()))
    try:
        assert acc.prepare(a, opt) == (a, opt)            # prepared again: passed through
        with pytest.raises(ConfigError, match="a second model to prepare"):
            acc.prepare(b, torch.optim.AdamW(b.parameters()))
    finally:
        acc.close()


def test_model_and_optimizer_come_together():
    model = make_model("full")
    with pytest.raises(ConfigError, match=r"built on the model and its optimizer together"):
        _acc().prepare(model)
    with pytest.raises(ConfigError, match=r"built on the model and its optimizer together"):
        _acc().prepare(torch.optim.AdamW(model.parameters()))
    other = make_model("full")
    with pytest.raises(ConfigError, match=r"param_groups\[0\] holds a parameter that is not the prepared model's"):
        _acc().prepare(model, torch.optim.AdamW(other.parameters()))


def test_config_disagreeing_with_the_loop_is_refused():
    model = make_model("full")
    fresh_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2, offload_config={"gradient_accumulation_steps": 4})
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=4 disagrees with Accelerator "
                                          "gradient_accumulation_steps"):
        acc.prepare(model, torch.optim.AdamW(model.parameters()))
    fresh_state()
    acc = Accelerator(cpu=True, offload_config={"optimizer": {"lr": 0.5}})
    with pytest.raises(ConfigError, match=r"optimizer.lr=0.5 disagrees with the prepared optimizer's lr"):
        acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    from offload.accelerate.config import engine_config
    fresh_state()
    acc = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=3)
    c = engine_config({"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, acc,
                      torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert (c.precision, c.gradient_accumulation_steps, c.optimizer.type, c.optimizer.momentum,
            c.offload_optimizer.device) == ("bf16", 3, "SGD", 0.9, "nvme")
    fresh_state()
    acc = Accelerator(cpu=True, mixed_precision="bf16", offload_config={"precision": "fp16"})
    with pytest.raises(ConfigError, match=r"precision='fp16' disagrees with Accelerator mixed_precision \('bf16'\)"):
        acc.prepare(model, torch.optim.AdamW(model.parameters()))


def test_clip_outside_the_boundary_is_refused():
    fresh_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_model("full")
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    try:
        batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}
        with acc.accumulate(model):
            acc.backward(model(**batch).loss)
            assert not acc.sync_gradients
            with pytest.raises(RuntimeError, match="clip_grad_norm_ outside an accumulation boundary"):
                acc.clip_grad_norm_(model.parameters(), 1.0)
    finally:
        acc.close()


# ---- two ranks under torchrun against plain DDP ------------------------------------------------
def test_torchrun_two_ranks_match_plain_ddp(tmp_path):
    """2 gloo ranks, ZeRO-2: the engine's loop against plain Accelerate's DDP in the same
    ranks. ZeRO-2 reduces every micro-batch's gradients (as DDP with ``sync_each_batch``), DDP
    by default the window's local sum once: the reference is DDP with sync_each_batch and
    single-tensor AdamW, the bound the distance to DDP's default with fused AdamW (torch's
    own noise in both choices)."""
    here = TESTS
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_forked.free_port()),
           os.path.join(here, "_accelerate_ddp_worker.py"), str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    assert (got["world"], got["stage"]) == (2, 2)
    check_same(got["single"], got["fused"], got["engine"])

