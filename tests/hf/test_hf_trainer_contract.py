"""offload.hf.Trainer where transformers' own Trainer tests look: a model handed from one
Trainer to the next, a Trainer dropped, the model after train(), the best model loaded at the
end with checkpoint rotation and early stopping, the user's optimizer and scheduler, the
checkpoint layout, buffers on resume and a mistyped resume path; each against plain
transformers.Trainer on the same seed and data.

Tolerance: twice the distance between two plain Trainer runs that differ only in torch's
implementation of the same update (AdamW single-tensor vs fused; SGD / Adagrad / Adafactor
single-tensor vs foreach), measured here on the same case, plus 1e-6."""
import functools
import gc
import json
import os
import tempfile
import types
import weakref

import pytest
import torch
from torch import nn

from _hf import args, dataset, snapshot, tiny_llama, train_logs, transformers
from _parity import max_diff, noise_bound

from offload.config import ConfigError
from offload import EngineInUseError
from offload.hf import Trainer

PLACEMENTS = {
    "host": {"offload_optimizer": {"device": "cpu"}},
    "param-cpu": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "param-nvme": {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}},
}
EVAL = dataset(4, seed=2)


def placement(name, tmp_path):
    cfg = json.loads(json.dumps(PLACEMENTS[name]))
    for key, sec in cfg.items():
        if sec["device"] == "nvme":
            os.makedirs(tmp_path / key, exist_ok=True)
            sec["nvme_path"] = str(tmp_path / key)
    return cfg


def hook_count(model) -> int:
    """Forward hooks on the model's modules and gradient hooks on its parameters."""
    return (sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
            + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()))


def model_weights(model) -> dict:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


# ---- plain Trainer's runs, once per session ----------------------------------------------------
@functools.lru_cache(maxsize=None)
def plain_two_trainers(optim):
    """One model trained by a Trainer, then handed to a second Trainer on other data."""
    model = tiny_llama()
    for seed in (1, 3):
        t = transformers.Trainer(model=model, args=args(optim=optim, max_steps=3), train_dataset=dataset(seed=seed))
        t.train()
    return train_logs(t), snapshot(model), t.evaluate(EVAL)["eval_loss"]


@functools.lru_cache(maxsize=None)
def plain_run(optim):
    model = tiny_llama()
    t = transformers.Trainer(model=model, args=args(optim=optim, max_steps=3), train_dataset=dataset())
    t.train()
    return train_logs(t), snapshot(model), t.evaluate(EVAL)["eval_loss"]


# ---- a second Trainer on the same model ---------------------------------------------------------
@pytest.mark.parametrize("where", ["host", "param-nvme"])
def test_second_trainer_takes_the_model_over(where, tmp_path):
    """The first engine is closed (its hooks off the model, its buffers released) with the
    model holding its trained weights; the second trains on from them, as two plain Trainers
    on one model do; the first Trainer, used again, takes the model back."""
    ref, fused = plain_two_trainers("adamw_torch"), plain_two_trainers("adamw_torch_fused")
    cfg = placement(where, tmp_path)
    model = tiny_llama()
    first = Trainer(model=model, args=args(max_steps=3), train_dataset=dataset(seed=1), offload_config=cfg)
    first.train()
    engine, hooks = first.engine, hook_count(model)
    second = Trainer(model=model, args=args(max_steps=3), train_dataset=dataset(seed=3), offload_config=cfg)
    second.train()
    assert engine.closed and second.engine is not engine and hook_count(model) == hooks
    with pytest.raises(RuntimeError, match="this engine is closed"):
        engine.stats()
    got = model_weights(model)
    assert max_diff(ref[1], got) <= noise_bound(ref[1], fused[1])
    for r, f, g in zip(ref[0], fused[0], train_logs(second)):
        assert abs(g["loss"] - r["loss"]) <= noise_bound(r["loss"], f["loss"])
    ev = second.evaluate(EVAL)["eval_loss"]
    assert abs(ev - ref[2]) <= noise_bound(ref[2], fused[2])
    assert first.evaluate(EVAL)["eval_loss"] == ev and second.engine.closed     # the latest engine holds it
    first.close()


def test_a_model_too_large_to_hand_back(tmp_path, monkeypatch):
    """Where the offloaded parameters do not fit in host memory: train() says so once and the
    model keeps placeholders; the weights leave through save_model; a second engine is refused
    with the fix."""
    import psutil
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=0))
    model = tiny_llama()
    t = Trainer(model=model, args=args(max_steps=2), train_dataset=dataset(),
                offload_config=placement("param-cpu", tmp_path))
    with pytest.warns(UserWarning, match="do not fit in host memory.*trainer.save_model"):
        t.train()
    assert model.lm_head.weight.numel() == 0
    t.save_model(str(tmp_path / "out"))
    want = t.engine.full_state_dict()
    with pytest.raises(EngineInUseError, match=r"save_model\(dir\).*close it.*weights=dir"):
        Trainer(model=model, args=args(max_steps=2), train_dataset=dataset(),
                offload_config=placement("param-cpu", tmp_path)).train()
    t.close(), monkeypatch.undo()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).state_dict()
    assert all(torch.equal(loaded[k].float(), v) for k, v in want.items())


# ---- a dropped Trainer ---------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["host", "param-cpu"])
def test_dropped_trainer_releases_its_engine(where, tmp_path):
    model = tiny_llama()
    t = Trainer(model=model, args=args(max_steps=2), train_dataset=dataset(), offload_config=placement(where, tmp_path))
    t.train()
    trained = t.engine.full_state_dict()
    engine = weakref.ref(t.engine)
    del t
    gc.collect()
    assert engine() is None and hook_count(model) == 0         # nothing of it is left on the model
    got = model_weights(model)
    assert all(torch.equal(got[k], v) for k, v in trained.items())
    plain = tiny_llama()
    plain.load_state_dict(trained)
    x = EVAL[0]["input_ids"][None]
    assert torch.equal(model(x, labels=x).loss, plain(x, labels=x).loss)


# ---- the model after train() ----------------------------------------------------------------------
@pytest.mark.parametrize("where", ["param-cpu", "param-nvme"])      # (host: the tests above)
def test_model_holds_its_trained_weights_after_train(where, tmp_path):
    ref, fused = plain_run("adamw_torch"), plain_run("adamw_torch_fused")
    model = tiny_llama()
    t = Trainer(model=model, args=args(max_steps=3), train_dataset=dataset(), offload_config=placement(where, tmp_path))
    t.train()
    got = model_weights(model)                                   # state_dict, no close() needed
    assert max_diff(ref[1], got) <= noise_bound(ref[1], fused[1])
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, got["model.layers.1.mlp.down_proj.weight"])
    model.save_pretrained(tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in got.items())
    ev = t.evaluate(EVAL)["eval_loss"]                            # the engine uses the model again...
    assert abs(ev - ref[2]) <= noise_bound(ref[2], fused[2])
    after = model_weights(model)                                  # ... and hands it back
    assert all(torch.equal(after[k], v) for k, v in got.items())
    t.close()
    assert all(torch.equal(model_weights(model)[k], v) for k, v in got.items())


# ---- load_best_model_at_end, checkpoint rotation, early stopping --------------------------------
def best_args(out, optim="adamw_torch", **kw):
    """An evaluation and a checkpoint at every step; the best is the lowest eval loss, the
    first step's (on held-out random tokens it rises as the model fits its training rows), so
    the best model is not the last; early stopping after three evaluations without a better one."""
    return args(out, optim=optim, max_steps=8, warmup_steps=0, eval_strategy="steps", eval_steps=1,
                save_strategy="steps", save_steps=1, save_total_limit=3, load_best_model_at_end=True,
                metric_for_best_model="eval_loss", **kw)


def early_stopping():
    return transformers.EarlyStoppingCallback(early_stopping_patience=3)


@functools.lru_cache(maxsize=None)
def plain_best(optim):
    out = tempfile.mkdtemp(prefix="hf-best-")
    model = tiny_llama()
    t = transformers.Trainer(model=model, args=best_args(out, optim), train_dataset=dataset(), eval_dataset=EVAL,
                             callbacks=[early_stopping()])
    t.train()
    with open(os.path.join(t.state.best_model_checkpoint, "trainer_state.json")) as f:
        saved = json.load(f)
    return (out, t.state.global_step, os.path.basename(t.state.best_model_checkpoint), snapshot(model),
            [e["eval_loss"] for e in t.state.log_history if "eval_loss" in e], saved["stateful_callbacks"])


def test_load_best_model_at_end_with_rotation_and_early_stopping(tmp_path):
    """Stops where plain Trainer stops, keeps the checkpoints it keeps (the best one
    included), lays each out as save_pretrained does, and ends with the best checkpoint's
    weights in the model and its master copy and optimizer state in the engine."""
    out, steps, best, ref_w, ref_evals, ref_callbacks = plain_best("adamw_torch")
    fused_w = plain_best("adamw_torch_fused")[3]
    model = tiny_llama()
    t = Trainer(model=model, args=best_args(str(tmp_path / "run")), train_dataset=dataset(), eval_dataset=EVAL,
                callbacks=[early_stopping()], offload_config=placement("param-cpu", tmp_path))
    t.train()
    assert t.state.global_step == steps < 8 and best == "checkpoint-1"
    assert os.path.basename(t.state.best_model_checkpoint) == best
    assert sorted(os.listdir(tmp_path / "run")) == sorted(os.listdir(out))          # rotated alike
    evals = [e["eval_loss"] for e in t.state.log_history if "eval_loss" in e]
    assert len(evals) == len(ref_evals) and max(abs(a - b) for a, b in zip(evals, ref_evals)) < 1e-4
    with open(os.path.join(t.state.best_model_checkpoint, "trainer_state.json")) as f:
        assert json.load(f)["stateful_callbacks"] == ref_callbacks
    got = model_weights(model)
    assert max_diff(ref_w, got) <= noise_bound(ref_w, fused_w)
    # the layout of a checkpoint: save_pretrained's files, the engine's state in place of optimizer.pt
    folder, ref_folder = t.state.best_model_checkpoint, os.path.join(out, best)
    assert set(os.listdir(folder)) - {"offload"} == set(os.listdir(ref_folder)) - {"optimizer.pt"}
    from safetensors import safe_open
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as a, \
            safe_open(os.path.join(ref_folder, "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), got[k]) for k in a.keys())
    # the engine holds the best checkpoint's state, consistently: saved again, byte for byte the same
    assert t.engine.global_step == int(best.split("-")[1])
    t.engine.save_checkpoint(str(tmp_path / "again"))
    blocks = [f for f in os.listdir(tmp_path / "again") if f.startswith("block_")]
    assert blocks and all(open(tmp_path / "again" / f, "rb").read() == open(os.path.join(folder, "offload", f), "rb").read()
                          for f in blocks)
    t.close()


def test_early_stopping_state_resumes_from_the_engines_checkpoint(tmp_path):
    """A run resumed from a checkpoint written before early stopping struck restores the
    callback's state and stops at the same step, its last checkpoint and evaluation the same
    as the whole run's."""
    cfg = placement("host", tmp_path)
    whole = Trainer(model=tiny_llama(), args=best_args(str(tmp_path / "a")), train_dataset=dataset(),
                    eval_dataset=EVAL, callbacks=[early_stopping()], offload_config=cfg)
    whole.train()
    steps = whole.state.global_step
    whole.close()
    resume_at = os.path.join(tmp_path / "a", f"checkpoint-{steps - 1}")
    with open(os.path.join(resume_at, "trainer_state.json")) as f:
        assert json.load(f)["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"][
            "early_stopping_patience_counter"] == 2
    resumed = Trainer(model=tiny_llama(seed=5), args=best_args(str(tmp_path / "b"),
                                                               restore_callback_states_from_checkpoint=True),
                      train_dataset=dataset(),
                      eval_dataset=EVAL, callbacks=[early_stopping()], offload_config=cfg)
    resumed.train(resume_from_checkpoint=resume_at)
    resumed.close()
    assert resumed.state.global_step == steps

    def last(t):
        return [e["eval_loss"] for e in t.state.log_history if "eval_loss" in e][-1]
    assert last(resumed) == last(whole)
    name = f"checkpoint-{steps}/model.safetensors"
    assert open(tmp_path / "a" / name, "rb").read() == open(tmp_path / "b" / name, "rb").read()


# ---- the user's optimizer and scheduler ----------------------------------------------------------
def sgd_groups(model, foreach=False):
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    rest = [p for n, p in model.named_parameters() if "norm" in n]
    return torch.optim.SGD([{"params": decay, "weight_decay": 0.01}, {"params": rest, "lr": 0.02}],
                           lr=0.05, momentum=0.9, nesterov=True, foreach=foreach)


def _lambda(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


CASES = {
    # optimizers=(optimizer, scheduler): two groups with their own lr / weight decay
    "sgd-groups+lambda": dict(optimizers=lambda m, fe: (sgd_groups(m, fe), None), scheduler=_lambda),
    "adagrad+steplr": dict(optimizers=lambda m, fe: (torch.optim.Adagrad(m.parameters(), lr=0.05, lr_decay=0.01,
                                                                          foreach=fe), None),
                           scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)),
    # optimizer_cls_and_kwargs: Trainer's groups (weight decay off for norms), the class's rule
    "adamw-cls": dict(cls=lambda fe: (torch.optim.AdamW, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6,
                                                           "foreach": fe})),
    "adafactor-cls": dict(cls=lambda fe: (torch.optim.Adafactor, {"lr": 0.01, "foreach": fe})),
    # ReduceLROnPlateau, stepped by Trainer with the metric after each evaluation: the held-out
    # loss rises (see best_args), so it halves the learning rate at every evaluation after the first
    "sgd+plateau": dict(optimizers=lambda m, fe: (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                                                  foreach=fe), None),
                        scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
                        args=dict(eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_loss")),
}


def run_with_optimizer(trainer_cls, case, foreach, **kw):
    c = CASES[case]
    model = tiny_llama()
    extra = {}
    if "optimizers" in c:
        opt, _ = c["optimizers"](model, foreach)
        extra["optimizers"] = (opt, c["scheduler"](opt))
    else:
        extra["optimizer_cls_and_kwargs"] = c["cls"](foreach)
    t = trainer_cls(model=model, args=args(max_steps=4, **c.get("args", {})), train_dataset=dataset(),
                    eval_dataset=EVAL, **extra, **kw)
    t.train()
    return t, train_logs(t), model_weights(model)


@functools.lru_cache(maxsize=None)
def plain_with_optimizer(case, foreach):
    _, logs, weights = run_with_optimizer(transformers.Trainer, case, foreach)
    return logs, weights


@pytest.mark.parametrize("case", list(CASES))
def test_users_optimizer_and_scheduler_drive_the_engine(case, tmp_path):
    (rl, rw), (fl, fw) = plain_with_optimizer(case, False), plain_with_optimizer(case, True)
    t, logs, got = run_with_optimizer(Trainer, case, None, offload_config=placement("host", tmp_path))
    try:
        cls = type(t._user_optimizer) if t._user_optimizer is not None else t.optimizer_cls_and_kwargs[0]
        assert t.offload_config.optimizer.type == cls.__name__
        assert t.optimizer is t.engine.optimizer and len(logs) == len(rl) == 4
        lrs = [l["learning_rate"] for l in logs]
        assert lrs == [l["learning_rate"] for l in rl]            # the user's scheduler, as plain
        if "optimizers" in CASES[case]:
            assert lrs[-1] < lrs[0]                               # ... and it moves the learning rate
        assert max_diff(rw, got) <= noise_bound(rw, fw)
        for r, f, g in zip(rl, fl, logs):
            assert abs(g["loss"] - r["loss"]) <= noise_bound(r["loss"], f["loss"])
    finally:
        t.close()


@pytest.mark.parametrize("make,msg", [
    (lambda m: torch.optim.RMSprop(m.parameters()), r"no rule for torch\.optim\..*RMSprop: give one of "
                                                     r"torch\.optim\.AdamW \(AdamW\).*torch\.optim\.SGD \(SGD\)"),
    (lambda m: torch.optim.NAdam(m.parameters()), r"no rule for torch\.optim\..*NAdam: give one of .*"
                                                   r"transformers\.optimization\.Adafactor \(TransformersAdafactor\)"),
    (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), r"amsgrad=True: the engine's AdamW rule has no "
                                                                r"such option"),
])
def test_an_optimizer_without_the_engines_rule_is_refused(make, msg):
    model = tiny_llama()
    with pytest.raises(ConfigError, match=msg):
        Trainer(model=model, args=args(), train_dataset=dataset(), optimizers=(make(model), None))
    with pytest.raises(ConfigError, match="no rule for torch.optim.*RMSprop"):
        Trainer(model=model, args=args(), train_dataset=dataset(),
                optimizer_cls_and_kwargs=(torch.optim.RMSprop, {"lr": 1e-3}))


# ---- resume: buffers through the model's own load_state_dict, a mistyped path -----------------
class Seen(nn.Module):
    """A buffer that grows with every forward (one entry per micro-batch) and that the module
    resizes when it loads one, as torch's observers do."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(0))

    def _load_from_state_dict(self, state_dict, prefix, *rest):
        key = prefix + "seen"
        if key in state_dict:
            self.seen = state_dict.pop(key).clone()
        super()._load_from_state_dict(state_dict, prefix, *rest)


def with_seen(seed=0):
    model = tiny_llama(seed)
    model.seen = Seen()
    model.register_forward_pre_hook(
        lambda m, a, kw: setattr(m.seen, "seen", torch.cat([m.seen.seen, kw["input_ids"].float().mean().view(1)])),
        with_kwargs=True)
    return model


def test_resume_restores_buffers_through_the_models_load_state_dict(tmp_path):
    cfg = placement("param-cpu", tmp_path)
    plain = with_seen()
    transformers.Trainer(model=plain, args=args(max_steps=4), train_dataset=dataset()).train()
    kw = dict(args=args(str(tmp_path / "run"), max_steps=4, save_strategy="steps", save_steps=2),
              train_dataset=dataset(), offload_config=cfg)
    whole = with_seen()
    t = Trainer(model=whole, **kw)
    t.train()
    want = t.engine.full_state_dict()
    t.close()
    assert torch.equal(whole.seen.seen, plain.seen.seen) and whole.seen.seen.numel() == 16
    resumed = with_seen(seed=5)
    t = Trainer(model=resumed, **kw)
    t.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))   # its buffer: 8 entries
    got = t.engine.full_state_dict()
    t.close()
    assert torch.equal(resumed.seen.seen, plain.seen.seen)
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("resume", ["missing", True])
def test_a_mistyped_resume_path_gets_trainers_message(resume, tmp_path):
    path = str(tmp_path / "checkpoint-9") if resume == "missing" else True
    messages = []
    for cls, kw in ((transformers.Trainer, {}), (Trainer, {"offload_config": placement("host", tmp_path)})):
        t = cls(model=tiny_llama(), args=args(str(tmp_path / "out")), train_dataset=dataset(), **kw)
        with pytest.raises(ValueError) as err:
            t.train(resume_from_checkpoint=path)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and ("Can't find a valid checkpoint" in messages[0]
                                           or "No valid checkpoint found" in messages[0])
