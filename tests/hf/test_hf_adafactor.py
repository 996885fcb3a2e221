"""transformers' own Adafactor (``transformers.optimization.Adafactor``: relative step,
parameter scaling, warm-up init, update clipping, first moment) as the engine's
``TransformersAdafactor`` rule, against transformers' class on the same seed and data.

The rule runs transformers' operations in their order on fp32, so the comparisons are
bitwise: the engine directly (a checkpoint and resume in the middle of training, the
optimizer state on cpu and nvme, clipping through the engine), and ``offload.hf.Trainer``
given the optimizer (``optimizers=``, ``lr=None`` with ``AdafactorSchedule``) or
``optim="adafactor"`` against plain ``transformers.Trainer``."""
import pytest
import torch

import offload
from _hf import args, dataset, snapshot, tiny_llama, train_logs, transformers
from _models import RuleNet, make_model, rule_batches

from offload.hf import Trainer

Adafactor = transformers.optimization.Adafactor
VOCAB, D, STEPS, SAVE_AT, CLIP = 64, 32, 5, 2, 0.5
NET = dict(net=RuleNet, vocab=VOCAB, d=D)


def plain(kw, clip):
    model = make_model(**NET)
    opt = Adafactor(model.parameters(), **kw)
    for x, y in rule_batches(STEPS, VOCAB):
        opt.zero_grad()
        model(x, y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine(kw, clip, tier, tmp_path):
    """STEPS steps, with a checkpoint after SAVE_AT loaded into a new engine that goes on."""
    cfg = {"offload_optimizer": {"device": tier}, "gradient_clipping": CLIP if clip else 0.0,
           "optimizer": {"type": "TransformersAdafactor", "beta1": kw.get("beta1")}}
    if tier == "nvme":
        cfg["offload_optimizer"]["nvme_path"] = str(tmp_path)
    data = rule_batches(STEPS, VOCAB)

    def start():
        model = make_model(**NET)
        return offload.initialize(model, cfg, param_groups=Adafactor(model.parameters(), **kw))

    eng = start()
    try:
        for x, y in data[:SAVE_AT]:
            eng.backward(eng(x, y))
            assert eng.step()
        eng.save_checkpoint(str(tmp_path / "ckpt"))
    finally:
        eng.close()
    eng = start()
    try:
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        for x, y in data[SAVE_AT:]:
            eng.backward(eng(x, y))
            assert eng.step()
        return eng.full_state_dict()
    finally:
        eng.close()


# lr=None with scale_parameter (the defaults) runs in tests/integrations/test_hf_accelerate.py, lr given with
# relative_step and scale_parameter off in test_trainer_optim_adafactor below
@pytest.mark.parametrize("kw, clip, tier", [
    ({"warmup_init": True}, True, "nvme"),
    ({"beta1": 0.9, "weight_decay": 0.01, "clip_threshold": 0.5}, True, "cpu"),
], ids=["warmup-clip", "beta1-decay"])
def test_engine_equals_transformers_adafactor(kw, clip, tier, tmp_path):
    want = plain(kw, clip)
    got = engine(kw, clip, tier, tmp_path)
    moved = max((want[k] - make_model(**NET).state_dict()[k]).abs().max().item() for k in want)
    assert moved > 1e-6                     # it trained (warmup_init steps are 1e-6 * step)
    assert all(torch.equal(got[k], want[k]) for k in want), \
        max((got[k] - want[k]).abs().max().item() for k in want)


def test_factored_rows_and_lr_none_in_the_config():
    """A 2-D weight keeps its row and column statistics under transformers' names; lr=None
    without relative_step is refused naming the fix."""
    from offload.config import Config, ConfigError
    eng = offload.initialize(make_model(**NET), {"optimizer": {"type": "TransformersAdafactor"}})
    try:
        rows = [dict(t.rows) for t in eng.blocks[1].state.layout.tensors]
        assert {"exp_avg_sq_row": D, "exp_avg_sq_col": D} in rows and {"exp_avg_sq": D} in rows
    finally:
        eng.close()
    with pytest.raises(ConfigError, match="lr=None needs relative_step=True"):
        Config.from_dict({"optimizer": {"type": "TransformersAdafactor", "relative_step": False}})


# ---- through offload.hf.Trainer ------------------------------------------------------------------
def _trainer_args(out, optim="adamw_torch"):
    return args(str(out), max_grad_norm=1.0, optim=optim, warmup_steps=0, learning_rate=1e-2, max_steps=3,
                gradient_accumulation_steps=2)


def _same(plain_t, plain_model, t):
    assert [l["loss"] for l in train_logs(t)] == [l["loss"] for l in train_logs(plain_t)]
    want, got = snapshot(plain_model), t.engine.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_trainer_given_adafactor_with_relative_step(tmp_path):
    """``optimizers=(Adafactor(lr=None), AdafactorSchedule)``, transformers' documented way."""
    from transformers.optimization import AdafactorSchedule

    def opts(m):
        o = Adafactor(m.parameters(), lr=None, relative_step=True, scale_parameter=True, warmup_init=True)
        return o, AdafactorSchedule(o)

    ref_model = tiny_llama()
    ref = transformers.Trainer(model=ref_model, args=_trainer_args(tmp_path / "a"), train_dataset=dataset(),
                               optimizers=opts(ref_model))
    ref.train()
    model = tiny_llama()
    t = Trainer(model=model, args=_trainer_args(tmp_path / "b"), train_dataset=dataset(), optimizers=opts(model),
                offload_config={"offload_optimizer": {"device": "cpu"}})
    try:
        t.train()
        assert t.offload_config.optimizer.type == "TransformersAdafactor" and t.offload_config.optimizer.lr is None
        _same(ref, ref_model, t)
    finally:
        t.close()


def test_trainer_optim_adafactor(tmp_path):
    """``optim="adafactor"``: transformers' class with scale_parameter and relative_step off."""
    ref_model = tiny_llama()
    ref = transformers.Trainer(model=ref_model, args=_trainer_args(tmp_path / "a", "adafactor"),
                               train_dataset=dataset())
    ref.train()
    model = tiny_llama()
    t = Trainer(model=model, args=_trainer_args(tmp_path / "b", "adafactor"), train_dataset=dataset(),
                offload_config={"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}})
    try:
        t.train()
        o = t.offload_config.optimizer
        assert (o.type, o.relative_step, o.scale_parameter, o.lr) == ("TransformersAdafactor", False, False, 1e-2)
        _same(ref, ref_model, t)
    finally:
        t.close()
