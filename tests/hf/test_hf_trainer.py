"""offload.hf.Trainer against plain Hugging Face Trainer (and PEFT) on the same seed and data.

Tolerance: twice the distance between two plain Trainer runs that differ only in torch's own
AdamW implementation (single-tensor vs fused), measured here on the same run, plus 1e-6."""
import json
import math
import os
import warnings

import pytest
import torch

from _hf import args, dataset, snapshot, tiny_llama, train_logs, transformers
from _parity import max_diff, noise_bound
from _profile import AVX2_RATES
import _forked
from _paths import TESTS

from offload.config import ConfigError
from offload.hf import Trainer

peft = pytest.importorskip("peft")

PLACEMENTS = {
    "host": {"offload_optimizer": {"device": "cpu"}},
    "nvme+param-offload": {"offload_optimizer": {"device": "nvme", "nvme_path": None},
                           "offload_param": {"device": "cpu"}},
}


def _placement(name, tmp_path):
    cfg = json.loads(json.dumps(PLACEMENTS[name]))
    if "nvme_path" in cfg["offload_optimizer"]:
        cfg["offload_optimizer"]["nvme_path"] = str(tmp_path)
    return cfg


def lora(model):
    torch.manual_seed(0)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))


def plain_run(make, optim, **kw):
    model = make()
    t = transformers.Trainer(model=model, args=args(optim=optim, **kw), train_dataset=dataset(),
                             eval_dataset=dataset(4, seed=2))
    t.train()
    return train_logs(t), snapshot(model), t.evaluate()["eval_loss"]


def engine_run(make, cfg, **kw):
    model = make()
    t = Trainer(model=model, args=args(**kw), train_dataset=dataset(), eval_dataset=dataset(4, seed=2),
                offload_config=cfg)
    try:
        t.train()
        return train_logs(t), t.engine.full_state_dict(), t.evaluate()["eval_loss"], t
    finally:
        t.close()


def check_same(ref, fused, got):
    """Logged losses, grad norms and learning rates, final weights, eval loss."""
    (rl, rw, re), (fl, fw, fe), (gl, gw, ge) = ref, fused, got
    assert len(gl) == len(rl) == 6
    bound_w = noise_bound(rw, fw)
    assert max_diff(rw, gw) <= bound_w, f"weights differ by {max_diff(rw, gw)} > {bound_w}"
    for r, f, g in zip(rl, fl, gl):
        assert g["learning_rate"] == r["learning_rate"]
        for k in ("loss", "grad_norm"):
            bound = noise_bound(r[k], f[k])
            assert abs(g[k] - r[k]) <= bound, f"{k}: engine {g[k]} vs Trainer {r[k]} (bound {bound})"
    assert abs(ge - re) <= noise_bound(re, fe)


@pytest.fixture(scope="module")
def full_refs():
    return plain_run(tiny_llama, "adamw_torch"), plain_run(tiny_llama, "adamw_torch_fused")


@pytest.fixture(scope="module")
def lora_refs():
    make = lambda: lora(tiny_llama())  # noqa: E731
    return plain_run(make, "adamw_torch"), plain_run(make, "adamw_torch_fused")


@pytest.mark.hf_versions
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_full_finetune_matches_trainer(full_refs, placement, tmp_path):
    ref, fused = full_refs
    # clipping bites (so a loss divided twice for accumulation would show in grad_norm and weights)
    assert max(r["grad_norm"] for r in ref[0]) > 0.5
    logs, weights, ev, _ = engine_run(tiny_llama, _placement(placement, tmp_path))
    check_same(ref, fused, (logs, weights, ev))


def test_lora_matches_trainer_with_peft(lora_refs, tmp_path):
    ref, fused = lora_refs
    logs, weights, ev, _ = engine_run(lambda: lora(tiny_llama()), _placement("nvme+param-offload", tmp_path))
    check_same(ref, fused, (logs, weights, ev))


def test_gradient_checkpointing_honoured(full_refs, tmp_path):
    model = tiny_llama()
    t = Trainer(model=model, args=args(activation_checkpointing=True), train_dataset=dataset(),
                eval_dataset=dataset(4, seed=2), offload_config=_placement("host", tmp_path))
    try:
        t.train()
        assert model.is_activation_checkpointing
        check_same(*full_refs, (train_logs(t), t.engine.full_state_dict(), t.evaluate()["eval_loss"]))
    finally:
        t.close()


@pytest.mark.hf_versions
def test_resume_is_bit_exact_and_checkpoints_rotate(tmp_path):
    cfg = _placement("nvme+param-offload", tmp_path)
    whole = Trainer(model=tiny_llama(), args=args(str(tmp_path / "a")), train_dataset=dataset(), offload_config=cfg)
    whole.train()
    want, want_logs = whole.engine.full_state_dict(), train_logs(whole)
    whole.close()

    out = str(tmp_path / "b")
    first = Trainer(model=tiny_llama(), args=args(out, save_strategy="steps", save_steps=2, save_total_limit=2),
                    train_dataset=dataset(), offload_config=cfg)
    first.train()
    first.close()
    assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-6"]      # checkpoint-2 rotated away
    for name in ("checkpoint-4", "checkpoint-6"):
        folder = os.path.join(out, name)
        assert os.path.isdir(os.path.join(folder, "offload"))             # the engine's checkpoint inside
        assert os.path.isfile(os.path.join(folder, "model.safetensors"))   # HF layout beside it
    resumed = Trainer(model=tiny_llama(seed=5), args=args(out), train_dataset=dataset(), offload_config=cfg)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    got = resumed.engine.full_state_dict()
    resumed.close()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert train_logs(resumed)[-2:] == want_logs[-2:]


def test_resume_from_a_folder_without_engine_state_fails(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    t = Trainer(model=tiny_llama(), args=args(str(tmp_path)), train_dataset=dataset(),
                offload_config=_placement("host", tmp_path))
    with pytest.raises(ValueError, match="has no engine checkpoint"):
        t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_save_model_loads_with_from_pretrained(tmp_path):
    t = Trainer(model=tiny_llama(), args=args(max_steps=2), train_dataset=dataset(),
                offload_config=_placement("nvme+param-offload", tmp_path))
    t.train()
    t.save_model(str(tmp_path / "full"))
    want = t.engine.full_state_dict()
    t.close()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "full"))
    got = loaded.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k].float(), v), k


def test_save_model_writes_a_peft_adapter(tmp_path):
    t = Trainer(model=lora(tiny_llama()), args=args(max_steps=2), train_dataset=dataset(),
                offload_config=_placement("host", tmp_path))
    t.train()
    t.save_model(str(tmp_path / "adapter"))
    want = {k: v for k, v in t.engine.full_state_dict().items() if "lora_" in k}
    t.close()
    assert os.path.isfile(tmp_path / "adapter" / "adapter_config.json")
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "adapter"))
    got = loaded.state_dict()
    assert want and all(torch.equal(got[k], v) for k, v in want.items())
    assert any(v.abs().max() > 0 for k, v in want.items() if "lora_B" in k)   # trained, not the zero init


@pytest.mark.parametrize("flag,precision", [("bf16", "bf16"), ("fp16", "fp16"), (None, "fp32")])
def test_precision_flags_map_to_the_engine(flag, precision, tmp_path):
    kw = {flag: True} if flag else {}
    t = Trainer(model=tiny_llama(), args=args(max_steps=3, **kw), train_dataset=dataset(),
                offload_config=_placement("host", tmp_path))
    assert t.offload_config.precision == precision
    assert t.place_model_on_device is False
    t.train()
    try:
        assert t.engine.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
        assert next(p for p in t.model.parameters()).dtype == t.engine.dtype
        assert all(torch.isfinite(torch.tensor(l["loss"])) for l in train_logs(t))
    finally:
        t.close()


def _precision_notes(make):
    """(what ``make()`` returns, the messages offload.planner.precision told while it ran)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = make()
    return got, [str(w.message) for w in caught if "as asked" in str(w.message) or "none asked for" in str(w.message)]


def test_precision_fits_the_machine_where_bf16_is_slow(matmul_rates, tmp_path):
    """bf16 45x slower than fp32 (an AVX2 CPU's rates): without bf16 / fp16 in the arguments or a
    precision in the config, fp32 and why; bf16 asked for runs, its factor told once."""
    matmul_rates(AVX2_RATES)

    def trainer(**kw):
        return Trainer(model=tiny_llama(), args=args(max_steps=2, **kw), train_dataset=dataset(),
                       offload_config=_placement("host", tmp_path))
    t, notes = _precision_notes(trainer)
    assert t.offload_config.precision == "fp32"
    assert len(notes) == 1 and notes[0].startswith("precision fp32 (none asked for): bf16 computes 45x slower than "
                                                   "fp32 on this device (cpu: matmul fp32 0.9, bf16 0.02 TFLOP/s")
    t, notes = _precision_notes(lambda: trainer(bf16=True))
    assert len(notes) == 1 and notes[0].startswith("precision bf16 as asked, but bf16 computes 45x slower than fp32")
    t.train()
    try:
        assert t.engine.dtype == torch.bfloat16 and all(math.isfinite(l["loss"]) for l in train_logs(t))
    finally:
        t.close()
    assert _precision_notes(lambda: trainer(bf16=True))[1] == []          # once per process


def test_precision_asked_in_the_config_or_fast_says_nothing(matmul_rates, tmp_path):
    matmul_rates(AVX2_RATES)
    t, notes = _precision_notes(lambda: Trainer(model=tiny_llama(), args=args(), train_dataset=dataset(),
                                                offload_config={**_placement("host", tmp_path), "precision": "fp32"}))
    assert t.offload_config.precision == "fp32" and notes == []
    matmul_rates({"fp32": 0.05, "bf16": 0.15, "fp16": 0.05})            # bf16 faster than fp32
    for kw in ({}, {"bf16": True}):
        t, notes = _precision_notes(lambda: Trainer(model=tiny_llama(), args=args(**kw), train_dataset=dataset(),
                                                    offload_config=_placement("host", tmp_path)))
        assert notes == [] and t.offload_config.precision == ("bf16" if kw else "fp32")


def test_config_from_training_arguments_and_deepspeed_auto(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}
    t = Trainer(model=tiny_llama(), args=args(bf16=True), train_dataset=dataset(), offload_config=ds)
    c = t.offload_config
    assert (c.gradient_accumulation_steps, c.gradient_clipping, c.precision, c.optimizer.lr,
            c.optimizer.weight_decay, c.offload_optimizer.device) == (4, 0.5, "bf16", 1e-2, 0.01, "cpu")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2 disagrees with TrainingArguments"):
        Trainer(model=tiny_llama(), args=args(), train_dataset=dataset(),
                offload_config={"gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError, match="'auto' is for DeepSpeed configs"):
        Trainer(model=tiny_llama(), args=args(), train_dataset=dataset(),
                offload_config={"optimizer": {"lr": "auto"}})
    with pytest.raises(ValueError, match="optim='rmsprop' has no update rule in the engine"):
        Trainer(model=tiny_llama(), args=args(optim="rmsprop"), train_dataset=dataset())
    with pytest.raises(ValueError, match="load_best_model_at_end with save_only_model=True.*set save_only_model=False"):
        Trainer(model=tiny_llama(), args=args(load_best_model_at_end=True, save_only_model=True, eval_strategy="steps",
                                              eval_steps=2, save_strategy="steps", save_steps=2,
                                              metric_for_best_model="eval_loss"),
                train_dataset=dataset(), eval_dataset=dataset())


def test_torchrun_two_ranks_match_one_process(tmp_path):
    """Under torchrun (2 ranks, gloo, ZeRO-2) on half batches: the same logged losses and
    weights as plain Trainer in one process on the full batch."""
    import subprocess
    import sys
    here = TESTS
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_forked.free_port()),
           os.path.join(here, "_hf_ddp_worker.py"), str(tmp_path), "2"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(tmp_path / "stage2.pt", weights_only=False)
    assert got["world"] == 2
    refs = []
    for optim in ("adamw_torch", "adamw_torch_fused"):
        model = tiny_llama()
        t = transformers.Trainer(model=model, args=args(optim=optim, per_device_train_batch_size=4,
                                                        gradient_accumulation_steps=2, max_steps=3),
                                 train_dataset=dataset())
        t.train()
        refs.append((train_logs(t), snapshot(model)))
    (rl, rw), (fl, fw) = refs
    assert len(got["logs"]) == len(rl) == 3 and all(r["grad_norm"] > 0.5 for r in rl)   # clipping bites
    bound = noise_bound(rw, fw)
    assert max_diff(rw, got["weights"]) <= bound
    for r, f, g in zip(rl, fl, got["logs"]):
        for k in ("loss", "grad_norm"):
            assert abs(g[k] - r[k]) <= noise_bound(r[k], f[k]), (k, g, r)



def test_fp16_overflow_skips_the_step_and_the_schedule(tmp_path):
    """A loss scale that overflows every step: the engine skips each update, Trainer's
    scheduler does not advance (as with Trainer's own fp16), grad_norm logs inf."""
    before = snapshot(tiny_llama())
    t = Trainer(model=tiny_llama(), args=args(max_steps=3, fp16=True, warmup_steps=0), train_dataset=dataset(),
                offload_config={"offload_optimizer": {"device": "cpu"}, "loss_scaler": {"initial_scale": 2.0 ** 40}})
    try:
        t.train()
        logs = train_logs(t)
        assert t.engine.stats()["skipped_steps"] == 3 and t.lr_scheduler.last_epoch == 0
        assert [l["learning_rate"] for l in logs] == [1e-2] * 3 and all(l["grad_norm"] == float("inf") for l in logs)
        after = t.engine.full_state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before if k in after and "weight" in k)
    finally:
        t.close()


def test_weights_streamed_into_a_meta_model(tmp_path):
    """Trainer(weights=DIR) on a model built on the meta device trains exactly as the same
    weights loaded with from_pretrained."""
    tiny_llama().save_pretrained(tmp_path / "base")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "base")
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    runs = []
    for model, weights in ((meta, str(tmp_path / "base")),
                           (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), None)):
        t = Trainer(model=model, args=args(max_steps=2), train_dataset=dataset(), weights=weights,
                    offload_config={"offload_optimizer": {"device": "cpu"}})
        t.train()
        runs.append((train_logs(t), t.engine.full_state_dict()))
        t.close()
    (la, wa), (lb, wb) = runs
    assert la == lb and all(torch.equal(wa[k], wb[k]) for k in wb)


# ---- update rules through TrainingArguments.optim -------------------------------------------------
def plain_run_cls(make, cls, **opt_kwargs):
    """Plain Trainer with torch's optimizer class given directly (a second implementation of
    the same rule, e.g. foreach, for the tolerance)."""
    model = make()
    a = args()
    t = transformers.Trainer(model=model, args=a, train_dataset=dataset(), eval_dataset=dataset(4, seed=2),
                             optimizer_cls_and_kwargs=(cls, dict(lr=a.learning_rate, **opt_kwargs)))
    t.train()
    return train_logs(t), snapshot(model), t.evaluate()["eval_loss"]


@pytest.mark.parametrize("optim, optim_args, cls, kwargs", [
    ("sgd", "momentum=0.9,nesterov=true", torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    ("adagrad", "lr_decay=0.01", torch.optim.Adagrad, {"lr_decay": 0.01}),
])
def test_optim_selects_the_engines_rule(optim, optim_args, cls, kwargs, tmp_path):
    """optim (and its optim_args) run the same rule as plain Trainer; the tolerance is the
    distance between torch's single-tensor and foreach implementations on the same run."""
    ref = plain_run(tiny_llama, optim, optim_args=optim_args)     # adafactor: tests/hf/test_hf_adafactor.py
    other = plain_run_cls(tiny_llama, cls, foreach=True, **kwargs)
    logs, weights, ev, t = engine_run(tiny_llama, _placement("host", tmp_path), optim=optim, optim_args=optim_args)
    assert t.offload_config.optimizer.type == {"sgd": "SGD", "adagrad": "Adagrad"}[optim]
    check_same(ref, other, (logs, weights, ev))


def test_optim_names_and_the_config_choose_together():
    from offload.hf.config import engine_config
    c = engine_config({"optimizer": {"type": "Lion"}}, args())            # default AdamW name: the config decides
    assert (c.optimizer.type, c.optimizer.betas) == ("Lion", (0.9, 0.999))  # Lion's betas from adam_beta1/2
    c = engine_config(None, args(optim="lion_8bit"))
    assert (c.optimizer.type, c.optimizer.state_dtype) == ("Lion", "int8")
    c = engine_config({"optimizer": {"type": "SGD", "momentum": 0.5}}, args(optim="sgd"))
    assert (c.optimizer.type, c.optimizer.momentum) == ("SGD", 0.5)
    with pytest.raises(ConfigError, match="optimizer.type='Lion' disagrees with TrainingArguments optim='sgd'"):
        engine_config({"optimizer": {"type": "Lion"}}, args(optim="sgd"))
    with pytest.raises(ConfigError, match="state_dtype='bf16' disagrees with TrainingArguments optim='adamw_8bit'"):
        engine_config({"optimizer": {"state_dtype": "bf16"}}, args(optim="adamw_8bit"))
    with pytest.raises(ConfigError, match="momentum=0.5 disagrees with TrainingArguments optim_args momentum"):
        engine_config({"optimizer": {"momentum": 0.5}}, args(optim="sgd", optim_args="momentum=0.9"))
    with pytest.raises(ConfigError, match="optim='galore_adamw' has no update rule in the engine"):
        engine_config(None, args(optim="galore_adamw"))
