"""Every update rule in the engine (optimizer.type, optimizer.state_dtype), against plain PyTorch.

The loop is the real one: forward, backward, step, nothing synchronised between steps (the
next forward trails the optimizer block by block). Parameters stay on the device (here the
CPU), the optimizer state on the cpu and nvme tiers.

* fp32 state: each rule against its torch.optim class run single-tensor (foreach=False); the
  bound is twice torch's own distance between that run and its fused one (foreach for
  Adafactor, which has no fused kernel) on the same data, plus 1e-6. Lion (no torch class)
  against its plain-torch reference in offload/optim/lion.py, the bound from the distance
  between that single-tensor reference and its foreach form (Lion.device_step).
* bf16 and int8 state: against a plain-torch loop applying the same rule with the same state
  dtype, per parameter (the engine starts every parameter on a 256-element scale block, so
  its int8 blocks are each tensor's own, as here), the rows stored as bf16 / as quant.py's
  codes and scales between steps, the rule's reference update in fp32 in between. The bound
  is a hundredth of the distance between that loop and the same loop with fp32 state: a
  broken update (state not written back, a wrong scale, rows swapped) moves by far more.
* checkpoints: a non-Adam rule and int8 state resume bit-exactly; another rule or state
  dtype is refused naming both.
"""
import pytest
import torch

import offload
from _models import RuleNet, make_model, resume_and_train, rule_batches
from _parity import max_diff, noise_bound
from offload.config import ConfigError
from offload.optim import get_rule, quant
from offload.optim.rule import load_row, store_row

VOCAB, D, STEPS = 64, 32, 4
NET = dict(net=RuleNet, vocab=VOCAB, d=D)
HP = {
    "AdamW": dict(lr=1e-2, weight_decay=0.01),
    "Adam": dict(lr=1e-2, weight_decay=0.01),
    "Lion": dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1),
    "SGD": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adagrad": dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.01),
    "Adafactor": dict(lr=1e-2, weight_decay=0.01),
}


def batches(n, seed=1):
    return rule_batches(n, VOCAB, seed)


def cfg(rule, tier, tmp_path, state_dtype="fp32", **kw):
    c = {"optimizer": dict(HP[rule], type=rule, state_dtype=state_dtype), "offload_optimizer": {"device": tier}}
    if tier == "nvme":
        tmp_path.mkdir(parents=True, exist_ok=True)
        c["offload_optimizer"]["nvme_path"] = str(tmp_path)
    c.update(kw)
    return c


def engine_run(config, steps=STEPS, data=None):
    model = make_model(**NET)
    eng = offload.initialize(model, config)
    try:
        for x, y in data or batches(steps):
            eng.backward(eng(x, y))
            assert eng.step() is True
        return eng.full_state_dict(), eng
    finally:
        eng.close()


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- plain-torch references --------------------------------------------------------------------------
def torch_run(rule, kind, steps=STEPS):
    """Plain torch: the rule's torch.optim class, single-tensor ("single") or its other kernel
    ("other": fused; foreach for Adafactor); Lion: the reference / its foreach form."""
    model = make_model(**NET)
    params = [p for p in model.parameters() if p.requires_grad]
    hp = HP[rule]
    if rule == "Lion":
        lion, states = get_rule("Lion"), [{"exp_avg": torch.zeros(p.numel())} for p in params]
        group = dict(lion.defaults, **hp)
    else:
        other = {"foreach": True} if rule == "Adafactor" else {"fused": True}
        opt = getattr(torch.optim, rule)(params, **hp, **(other if kind == "other" else {"foreach": False}))
    for s, (x, y) in enumerate(batches(steps)):
        model(x, y).backward()
        with torch.no_grad():
            if rule != "Lion":
                opt.step()
            elif kind == "single":
                for p, st in zip(params, states):
                    lion.reference(p, p.grad, st, group, s + 1)
            else:
                lion.device_step(params, [p.grad for p in params], states, group, [s + 1] * len(params))
        for p in params:
            p.grad = None
    return snapshot(model)


def block_params(model):
    """The model's trainable parameters grouped and ordered as the engine's blocks."""
    return [list(model.tok.parameters())] + [list(m.parameters()) for m in model.layers] + \
        [list(model.head.parameters())]


def dtype_loop(rule_name, state_dtype, steps=STEPS):
    """A plain-torch loop applying ``rule_name`` with ``state_dtype`` rows per parameter (int8:
    each tensor quantized on its own, scale blocks from its first element, as 8-bit Adam
    does), the rule's reference update in fp32 between loading and storing the rows."""
    rule, model = get_rule(rule_name), make_model(**NET)
    group = dict(rule.defaults, **HP[rule_name])
    params = [p for ps in block_params(model) for p in ps]
    rows = rule.rows(group)
    states = []
    for p in params:
        st = {}
        for r in rows:
            store_row(st, r, torch.full((p.numel(),), float(group[r.init]) if r.init else 0.0), state_dtype)
        states.append(st)
    for s, (x, y) in enumerate(batches(steps)):
        model(x, y).backward()
        with torch.no_grad():
            for p, st in zip(params, states):
                flat = p.detach().reshape(-1).clone()
                wide = {r.name: load_row(st, r).clone() for r in rows}
                rule.reference(flat, p.grad.reshape(-1), wide, group, s + 1)
                for r in rows:
                    store_row(st, r, wide[r.name], state_dtype)
                p.copy_(flat.view(p.shape))
                p.grad = None
    return snapshot(model)


# ---- fp32 state: every rule, cpu and nvme ---------------------------------------------------------------
@pytest.mark.parametrize("rule,tier", [(r, t) for r in HP for t in ("cpu", "nvme")] +
                         [(r, "none") for r in ("Lion", "SGD", "Adagrad")])   # none: rule.device_step on CUDA
def test_rule_matches_torch(rule, tier, tmp_path):
    if rule == "Adafactor" and not hasattr(torch.optim, "Adafactor"):
        pytest.skip("this torch has no torch.optim.Adafactor")
    got, eng = engine_run(cfg(rule, tier, tmp_path))
    single, other = torch_run(rule, "single"), torch_run(rule, "other")
    bound = noise_bound(single, other)
    d = max_diff(got, single)
    assert d <= bound, f"{rule} on {tier}: weights differ from torch by {d} (bound {bound})"
    assert max_diff(single, make_model(**NET).state_dict()) > 1e-3          # the weights moved
    assert eng.rule.name == rule


def test_adafactor_factors_whole_matrices(tmp_path):
    """Adafactor's state per whole 2-D tensor is its row / column statistics: a Linear weight
    of 32 x 32 keeps 64 values, not 1024; 1-D tensors keep their unfactored variance."""
    config = cfg("Adafactor", "cpu", tmp_path)
    eng = offload.initialize(make_model(**NET), config)
    try:
        assert [b.name for b in eng.blocks] == ["tok", "layers.0", "layers.1", "head"]
        lay = eng.blocks[1].state.layout             # layers.0: LayerNorm weight, bias, Linear weight, bias
        rows = [(t.shape, dict(t.rows)) for t in lay.tensors]
        assert rows == [((D,), {"variance": D}), ((D,), {"variance": D}),
                        ((D, D), {"row_var": D, "col_var": D}), ((D,), {"variance": D})]
        plan_bytes = eng.plan.blocks[1].state_bytes
        assert plan_bytes == lay.nbytes < 4 * 2 * eng.layouts[1].padded_numel   # below unfactored
    finally:
        eng.close()


def test_adafactor_split_tensor_keeps_unfactored_piece():
    """A shard that holds only part of a matrix (ZeRO) keeps the unfactored variance of its
    piece; whole matrices in the shard keep row / column statistics."""
    from offload.optim.state import StateLayout
    rule = get_rule("Adafactor")
    hp = dict(rule.defaults)
    # shard [0, 1024) of a flat holding a 16 x 16 matrix at 0 and a 40 x 30 matrix at 256 (split)
    lay = StateLayout.for_shard(rule, [hp], 1024, "fp32", [(0, 256, (16, 16), 0), (256, 1200, (40, 30), 0)])
    assert [(t.start, t.numel, t.shape, dict(t.rows)) for t in lay.tensors] == [
        (0, 256, (16, 16), {"row_var": 16, "col_var": 16}), (256, 768, None, {"variance": 768})]
    again = StateLayout.from_description(lay.describe())
    assert again.describe() == lay.describe() and again.nbytes == lay.nbytes
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    master, rows = lay.views(buf)
    assert lay.tensor_state(rows, 1)["variance"].numel() == 768 and master.numel() == 1024


# ---- bf16 / int8 state against the same rule in plain torch ----------------------------------------------
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("rule,state_dtype", [("AdamW", "int8"), ("AdamW", "bf16"), ("Lion", "int8"),
                                              ("SGD", "int8"), ("Adagrad", "int8"), ("Adagrad", "bf16")])
def test_low_precision_state_matches_same_rule_in_torch(rule, state_dtype, tier, tmp_path):
    got, eng = engine_run(cfg(rule, tier, tmp_path, state_dtype=state_dtype))
    want = dtype_loop(rule, state_dtype)
    fp32 = dtype_loop(rule, "fp32")
    cost = max_diff(want, fp32)                   # what the state dtype changes
    assert cost > 0
    d = max_diff(got, want)
    assert d <= cost / 100, f"{rule} {state_dtype} on {tier}: {d} from the plain-torch loop (its cost {cost})"
    assert max_diff(want, make_model(**NET).state_dict()) > 1e-3


def test_int8_state_is_stored_compressed(tmp_path):
    """The state buffer on the tiers is the layout's bytes: int8 AdamW keeps one byte per
    element and row plus a scale per 256 (master 4 + 2 x (1 + 4/256) against 12 per parameter;
    the tiny blocks here are dominated by the 4 KiB alignment of each region)."""
    sizes = {}
    for sd in ("fp32", "int8"):
        eng = offload.initialize(make_model(**NET), cfg("AdamW", "nvme", tmp_path / sd, state_dtype=sd))
        try:
            sizes[sd] = sum(b.state.nbytes for b in eng.blocks)
            assert eng.stats()["tier_bytes"]["nvme"] >= sizes[sd]
            regions = eng.blocks[0].state.layout.regions
            int8 = sd == "int8"
            assert [r.name for r in regions] == \
                ["master", "exp_avg", "exp_avg_sq"] + (["exp_avg_absmax", "exp_avg_sq_absmax"] if int8 else [])
            n = eng.blocks[0].state.numel
            scales = 4 * quant.nblocks(n)
            assert [r.nbytes for r in regions] == ([4 * n, n, n, scales, scales] if int8 else [4 * n] * 3)
        finally:
            eng.close()
    assert sizes["int8"] < sizes["fp32"]


# ---- checkpoints -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule,state_dtype,tier", [("Adagrad", "fp32", "nvme"), ("AdamW", "int8", "nvme"),
                                                   ("Adafactor", "fp32", "cpu"), ("SGD", "bf16", "cpu")])
def test_checkpoint_resume_bit_exact(rule, state_dtype, tier, tmp_path):
    data = batches(5)
    full, _ = engine_run(cfg(rule, tier, tmp_path / "a", state_dtype=state_dtype), data=data)
    model = make_model(**NET)
    eng = offload.initialize(model, cfg(rule, tier, tmp_path / "b", state_dtype=state_dtype))
    for x, y in data[:3]:
        eng.backward(eng(x, y))
        eng.step()
    eng.save_checkpoint(str(tmp_path / "ck"))
    eng.close()
    eng = offload.initialize(make_model(**NET), cfg(rule, tier, tmp_path / "c", state_dtype=state_dtype))
    resumed = resume_and_train(eng, tmp_path / "ck", data[3:])
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    import json
    meta = json.load(open(tmp_path / "ck" / "meta.json"))
    assert meta["version"] == 3 and meta["optimizer"]["rule"] == rule
    assert meta["optimizer"]["state_dtype"] == state_dtype
    assert meta["blocks"][0]["shards"][0]["layout"]["state_dtype"] == state_dtype
    if rule == "Adafactor":
        assert "tensors" in meta["blocks"][1]["shards"][0]["layout"]
    exported = offload.export_fp32(str(tmp_path / "ck"))
    assert set(exported) == set(full)


def test_checkpoint_of_another_rule_or_state_dtype_is_refused(tmp_path):
    eng = offload.initialize(make_model(**NET), cfg("Lion", "cpu", tmp_path, state_dtype="int8"))
    x, y = batches(1)[0]
    eng.backward(eng(x, y))
    eng.step()
    eng.save_checkpoint(str(tmp_path / "ck"))
    eng.close()
    for rule, sd in (("AdamW", "int8"), ("Lion", "fp32")):
        eng = offload.initialize(make_model(**NET), cfg(rule, "cpu", tmp_path, state_dtype=sd))
        try:
            with pytest.raises(offload.io.checkpoint.CheckpointError) as e:
                eng.load_checkpoint(str(tmp_path / "ck"))
            msg = str(e.value)
            assert "Lion" in msg and "int8" in msg and rule in msg and sd in msg and "optimizer.type" in msg
        finally:
            eng.close()


# ---- configuration ----------------------------------------------------------------------------------------
def test_int8_state_on_the_device_is_refused():
    with pytest.raises(ConfigError, match="int8.*offload_optimizer.device"):
        offload.initialize(make_model(**NET), {"optimizer": {"state_dtype": "int8"}, "offload_optimizer": {"device": "none"}})


def test_param_groups_carry_the_rules_hyperparameters(tmp_path):
    model = make_model(**NET)
    groups = [{"params": list(model.tok.parameters()), "momentum": 0.5},
              {"params": [p for n, p in model.named_parameters() if not n.startswith("tok")], "lr": 0.05}]
    eng = offload.initialize(model, cfg("SGD", "cpu", tmp_path), param_groups=groups)
    try:
        assert eng.optimizer.param_groups[0]["momentum"] == 0.5 and eng.optimizer.param_groups[1]["lr"] == 0.05
        assert eng.optimizer.param_groups[1]["nesterov"] is True
    finally:
        eng.close()
    with pytest.raises(ConfigError, match=r"param_groups\[0\].*betas.*SGD"):
        offload.initialize(make_model(**NET), cfg("SGD", "cpu", tmp_path),
                           param_groups=[{"params": list(make_model(**NET).parameters()), "betas": (0.9, 0.9)}])
    m = make_model(**NET)
    with pytest.raises(ConfigError, match=r"param_groups\[0\]\.momentum"):
        offload.initialize(m, cfg("SGD", "cpu", tmp_path), param_groups=[{"params": list(m.parameters()),
                                                                         "momentum": -1.0}])


@pytest.mark.parametrize("ds_type,params,want", [
    ("Lion", {"betas": [0.9, 0.99]}, "Lion"), ("FusedLion", {}, "Lion"), ("CPUAdagrad", {"eps": 1e-10}, "Adagrad"),
    ("SGD", {"momentum": 0.9, "nesterov": True}, "SGD"), ("Adafactor", {"eps": [None, 1e-3]}, "Adafactor"),
])
def test_deepspeed_optimizer_types(ds_type, params, want):
    from offload.config import Config
    c = Config.from_any({"train_batch_size": 8, "optimizer": {"type": ds_type, "params": dict(params, lr=1e-3)}})
    assert c.optimizer.type == want and c.optimizer.lr == 1e-3
    for k, v in params.items():
        assert getattr(c.optimizer, k) == (tuple(v) if isinstance(v, list) else v)


def test_deepspeed_unsupported_optimizer_type_is_refused():
    from offload.config import Config
    with pytest.raises(ConfigError, match="'OneBitAdam'.*not supported.*Lion"):
        Config.from_any({"train_batch_size": 8, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}})
