"""bf16 and fp16 training against plain-PyTorch references doing the same mixed-precision
arithmetic: the model in the low-precision dtype (the compute copy), an fp32 master per
parameter updated by AdamW from the low-precision gradients taken to fp32, the compute copy
rounded from the master after each step; for fp16 the same dynamic loss scaling (overflow:
skip and halve; growth after ``growth_interval`` clean steps), gradients unscaled by
multiplying with 1 / scale. The loop does not synchronise between steps. Tolerances: twice
the distance between torch's single-tensor and fused AdamW running the same reference.
"""
import pytest
import torch

import offload
from _models import batches, clone, make_model
from _parity import max_diff, noise_bound
from _probes import ahead_blocks

LR, WD = 1e-3, 0.01


def reference(base, data, dtype, *, fused, scaler=None):
    """Returns (losses, [committed?], masters by state_dict key at the end, scales)."""
    model = clone(base).to(dtype)
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in clone(base).parameters() if p.requires_grad]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, **({"fused": True} if fused else {"foreach": False}))
    scale, clean = (scaler["initial_scale"], 0) if scaler else (1.0, 0)
    losses, committed, scales = [], [], []
    for x, y in data:
        loss = model(x, y)
        losses.append(loss.detach().float())
        (loss * scale if scaler else loss).backward()
        grads = [p.grad.float() for p in params]
        for p in params:
            p.grad = None
        scales.append(scale)
        if scaler and not all(torch.isfinite(g).all() for g in grads):
            scale = max(scale * 0.5, 1.0)                 # skipped: nothing changes but the scale
            clean = 0
            committed.append(False)
            continue
        for m, g in zip(masters, grads):
            m.grad = g * (1.0 / scale) if scaler else g
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)                                # the compute copy, rounded from the master
        committed.append(True)
        if scaler:
            clean += 1
            if clean % scaler["growth_interval"] == 0:
                scale *= 2.0
    return torch.stack(losses), committed, {names[id(p)]: m for p, m in zip(params, masters)}, scales


def engine_run(base, data, precision, tmp_path, scaler=None, ahead=False):
    cfg = {"optimizer": {"type": "AdamW", "lr": LR, "weight_decay": WD}, "precision": precision,
           "offload_optimizer": {"device": "cpu", "update_ahead": ahead}}
    if scaler:
        cfg["loss_scaler"] = dict(scaler)
    eng = offload.initialize(clone(base), cfg)
    losses, committed, scales = [], [], []
    for x, y in data:
        loss = eng(x, y)
        eng.backward(loss)
        scales.append(eng.scaler.scale)
        committed.append(eng.step())
        losses.append(loss.detach().float())
    sd = eng.full_state_dict()
    assert eng.telemetry.counters["updates_ahead"] == (len(data) * ahead_blocks(eng) if ahead else 0)
    eng.close()
    return torch.stack(losses), committed, sd, scales


def check(base, data, dtype, precision, tmp_path, scaler=None, ahead=False):
    ref_l, ref_c, ref_m, ref_s = reference(base, data, dtype, fused=False, scaler=scaler)
    fus_l, _, fus_m, _ = reference(base, data, dtype, fused=True, scaler=scaler)
    got_l, got_c, got_sd, got_s = engine_run(base, data, precision, tmp_path, scaler, ahead)
    assert got_c == ref_c and got_s == ref_s
    loss_bound = noise_bound(ref_l, fus_l)
    assert (got_l - ref_l).abs().max().item() <= loss_bound
    master_bound = noise_bound(ref_m, fus_m)
    d = max_diff(ref_m, {k: got_sd[k] for k in ref_m})
    assert d <= master_bound, f"fp32 masters differ from the reference by {d} (bound {master_bound})"
    assert max_diff(ref_m, {k: v.float() for k, v in base.state_dict().items() if k in ref_m}) > 1e-3
    return ref_c


@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "update_ahead"])
def test_bf16_matches_mixed_precision_reference(ahead, tmp_path):
    """bf16 parameters, fp32 masters; with update_ahead the new bf16 parameters are staged
    during backward and copied in by step()."""
    base = make_model()
    check(base, batches(8), torch.bfloat16, "bf16", tmp_path, ahead=ahead)


def test_fp16_matches_dynamic_loss_scaling_reference(tmp_path):
    """The initial scale overflows the fp16 gradients: the first two steps are skipped with
    the scale halved each time; after every two clean steps it grows and overflows again."""
    base = make_model()
    scaler = {"initial_scale": 2.0 ** 17, "growth_interval": 2}
    committed = check(base, batches(14), torch.float16, "fp16", tmp_path, scaler=scaler)
    assert committed[:3] == [False, False, True] and committed.count(False) >= 4 and sum(committed) >= 6
