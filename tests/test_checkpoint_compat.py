"""Checkpoints written by earlier versions still load: tests/fixtures/ckpt_v2 was written by
main at 26a9b0f (format version 2; tests/fixtures/make_ckpt_v2.py) after 3 AdamW steps of a
small TinyGPT. Loaded into a fresh engine it must hold what plain torch AdamW holds after the
same 3 steps, and the 4th step must match torch's 4th step."""
import os

import torch

import offload
from _models import batches, clone, make_model

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "ckpt_v2")
MODEL = dict(vocab=32, d=16, layers=2, heads=2, ctx=8, frozen_layer=1)
CFG = {"optimizer": {"type": "AdamW", "lr": 1e-2, "weight_decay": 0.01}, "offload_optimizer": {"device": "cpu"}}


def _torch_run(model, data, fused):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, **({"fused": True} if fused else {"foreach": False}))
    snaps = []
    for x, y in data:
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        snaps.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return snaps


def _diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_v2_checkpoint_loads_and_continues(tmp_path):
    base = make_model(seed=0, **MODEL)
    data = batches(4, batch=2, ctx=8, vocab=32, seed=1)
    ref = _torch_run(clone(base), data, fused=False)
    ref_fused = _torch_run(clone(base), data, fused=True)
    bound = [2 * _diff(a, b) + 1e-6 for a, b in zip(ref, ref_fused)]
    eng = offload.initialize(clone(base), CFG)
    try:
        eng.load_checkpoint(FIXTURE)
        assert _diff(eng.full_state_dict(), ref[2]) <= bound[2]
        x, y = data[3]
        eng.backward(eng(x, y))
        eng.step()
        assert _diff(eng.full_state_dict(), ref[3]) <= bound[3]
        assert _diff(ref[3], base.state_dict()) > 1e-3
    finally:
        eng.close()
