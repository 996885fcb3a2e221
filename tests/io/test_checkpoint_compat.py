"""Checkpoints written by earlier versions still load: tests/fixtures/ckpt_v2 was written by
main at 26a9b0f (format version 2; tests/fixtures/make_ckpt_v2.py) after 3 AdamW steps of a
small TinyGPT. Loaded into a fresh engine it must hold exactly what the fixture's files hold
(read here without the engine), and the 4th step must match plain torch AdamW's step from that
state: the same weights, moments and step count.

The state is not compared with torch's own first three steps: they ran on the machine that
wrote the fixture, and Adam turns the last-bit differences between two machines' matmuls in
near-zero gradients into differences of the order of the learning rate, which no noise
measured here bounds."""
import json
import math
import os

import numpy as np
import torch

import offload
from _models import batches, clone, make_model
from _parity import max_diff, noise_bound
from _paths import FIXTURES

FIXTURE = os.path.join(FIXTURES, "ckpt_v2")
MODEL = dict(vocab=32, d=16, layers=2, heads=2, ctx=8, frozen_layer=1)
CFG = {"optimizer": {"type": "AdamW", "lr": 1e-2, "weight_decay": 0.01}, "offload_optimizer": {"device": "cpu"}}


def _fixture():
    """The fixture's contents from its files: ({key: stored value}, {trained key: (exp_avg,
    exp_avg_sq)}). Format 2 keeps each block's rows [master | exp_avg | exp_avg_sq] in fp32,
    one shard per block at world size 1; frozen tensors are in extra.pt."""
    with open(os.path.join(FIXTURE, "meta.json")) as f:
        meta = json.load(f)
    assert meta["version"] == 2 and meta["global_step"] == 3
    rows = {}
    for b in meta["blocks"]:
        (shard,) = b["shards"]
        raw = np.fromfile(os.path.join(FIXTURE, shard["file"]), dtype=np.float32)
        assert raw.size == 3 * b["numel"]
        rows[b["index"]] = torch.from_numpy(raw.reshape(3, b["numel"]).copy())
    extra = torch.load(os.path.join(FIXTURE, "extra.pt"), weights_only=False)["tensors"]
    values, moments = {}, {}
    for key, where in meta["keys"].items():
        if where.get("extra"):
            values[key] = extra[key]
            continue
        n, off = math.prod(where["shape"]), where["offset"]
        master, exp_avg, exp_avg_sq = (r.view(where["shape"]) for r in rows[where["block"]][:, off:off + n])
        values[key], moments[key] = master, (exp_avg, exp_avg_sq)
    return values, moments


def _torch_step(base, values, moments, batch, fused):
    """Plain torch AdamW's 4th step from the fixture's state."""
    model = clone(base)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in named], lr=1e-2, weight_decay=0.01,
                            **({"fused": True} if fused else {"foreach": False}))
    for name, p in named:
        exp_avg, exp_avg_sq = moments[name]
        opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    x, y = batch
    model(x, y).backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_v2_checkpoint_loads_and_continues():
    values, moments = _fixture()
    base = make_model(seed=0, **MODEL)
    data = batches(4, batch=2, ctx=8, vocab=32, seed=1)
    eng = offload.initialize(clone(base), CFG)
    try:
        eng.load_checkpoint(FIXTURE)
        loaded = eng.full_state_dict()
        for key, value in values.items():
            assert torch.equal(loaded[key], value), key
        assert max_diff(values, base.state_dict()) > 1e-3       # three steps from the initial weights
        ref, ref_fused = (_torch_step(base, values, moments, data[3], fused) for fused in (False, True))
        bound = noise_bound(ref, ref_fused)
        x, y = data[3]
        eng.backward(eng(x, y))
        eng.step()
        after = eng.full_state_dict()
        assert max_diff(after, ref) <= bound
        assert max_diff(values, after) > 1e-3                    # the 4th step moved them
    finally:
        eng.close()
