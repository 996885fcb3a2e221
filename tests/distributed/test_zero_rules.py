"""Update rules other than fp32 AdamW across ranks (gloo on the CPU, the ranks as in
tests/distributed/test_zero.py): Adafactor at 2 ranks against plain torch on the full batch, and int8
optimizer state re-sharded on load (2 ranks -> 1 and 1 -> 2).

Adafactor: at stage 0 every rank holds whole tensors, so 2 ranks on half batches equal
``torch.optim.Adafactor`` on the full batch. At stage 1 a tensor ZeRO splits across ranks
keeps unfactored state for each rank's piece, its relative step and update clipping from
that piece (README, offload/optim/adafactor.py): the reference is torch's Adafactor with each
such piece as its own 1-D tensor (torch keeps 1-D tensors unfactored), whole tensors as they
are. Tolerance: the reduction-order bound of tests/distributed/test_zero.py, or twice the distance between
torch's single-tensor and foreach Adafactor on the same run where that is larger.

int8 state: the bound is measured on the same run: twice the distance between a straight
int8 run at 1 rank and at 2 ranks (reduction order, carried through the 8-bit state), plus
the reduction-order bound.
"""
import os

import pytest
import torch

import offload
from _models import batches, make_model
from _parity import max_diff
from offload.core import sharding
from offload.core import blocks as blk
from _zero import CLIP, EPS, STEPS, TOL, spawn

LR_AF = 1e-2
INT8 = {"optimizer": {"type": "AdamW", "lr": 1e-3, "weight_decay": 0.01, "eps": EPS, "state_dtype": "int8"}}
ADAFACTOR = {"optimizer": {"type": "Adafactor", "lr": LR_AF, "weight_decay": 0.01}}


def int8_cfg(stage):
    return {**INT8, "gradient_clipping": CLIP, "offload_optimizer": {"device": "cpu"},
            "zero_optimization": {"stage": stage}}


def straight_one_rank(steps, save_at=None, save=None):
    eng = offload.initialize(make_model(), int8_cfg(0))
    snaps = []
    try:
        for i, (x, y) in enumerate(batches(steps)):
            eng.backward(eng(x, y))
            eng.step()
            snaps.append({k: v.clone() for k, v in eng.full_state_dict().items()})
            if save_at == i + 1:
                eng.save_checkpoint(save)
    finally:
        eng.close()
    return snaps


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("zero_rules"))
    ck1 = os.path.join(out, "ck_int8_world1")
    one = straight_one_rank(STEPS, save_at=2, save=ck1)
    jobs = [{"name": f"adafactor_s{s}", "stage": s, "tier": "cpu", "steps": STEPS, "extra": dict(ADAFACTOR)}
            for s in (0, 1)]
    jobs += [{"name": "int8_s2", "stage": 2, "tier": "cpu", "steps": STEPS, "eps": EPS, "extra": dict(INT8),
              "save_at": 2, "save": os.path.join(out, "ck_int8_world2")},
             {"name": "int8_from1", "stage": 1, "tier": "cpu", "steps": STEPS - 2, "start": 2, "eps": EPS,
              "extra": dict(INT8), "load": ck1}]
    rcs, errs, res = spawn(jobs, 2, out)
    assert rcs == [0, 0] and not errs, errs
    return {"out": out, "res": res[0], "one_rank_int8": one}


def _pieces(model, world):
    """(param, None) for each trainable tensor a rank holds whole, (param, (a, b)) for each
    rank's piece of one ZeRO splits: the engine's blocks (its layout code) and shard ranges."""
    group_of = {id(p): 0 for p in model.parameters() if p.requires_grad}
    out = []
    for lay in blk.build_layouts(model, None, group_of, world_size=world, param_align=1):
        ranges = [sharding.shard_range(lay.numel, world, r) for r in range(world)]
        for sg in lay.segments:
            cuts = [c for c in (sharding.clip_range(sg.offset, sg.offset + sg.numel, s0, s1) for s0, s1 in ranges) if c]
            if len(cuts) == 1:
                out.append((sg.param, None))
            else:
                out += [(sg.param, (a - sg.offset, b - sg.offset)) for a, b in cuts]
    return out


def adafactor_reference(world_pieces, foreach):
    """Plain torch on the full batch: clip_grad_norm_, then torch.optim.Adafactor over the
    whole tensors and (world_pieces) each split tensor's pieces as 1-D tensors of their own."""
    m = make_model()
    params = [p for p in m.parameters() if p.requires_grad]
    units = _pieces(m, 2) if world_pieces else [(p, None) for p in params]
    leaves = [p if cut is None else p.detach().reshape(-1)[cut[0]:cut[1]].clone() for p, cut in units]
    opt = torch.optim.Adafactor(leaves, lr=LR_AF, weight_decay=0.01, foreach=foreach)
    snaps = []
    for x, y in batches(STEPS):
        m(x, y).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        for (p, cut), leaf in zip(units, leaves):
            if cut is not None:
                leaf.grad = p.grad.reshape(-1)[cut[0]:cut[1]].clone()
        opt.step()
        with torch.no_grad():
            for (p, cut), leaf in zip(units, leaves):
                if cut is not None:
                    p.view(-1)[cut[0]:cut[1]] = leaf
        m.zero_grad()
        opt.zero_grad()
        snaps.append({k: v.detach().clone() for k, v in m.state_dict().items()})
    return snaps


@pytest.mark.parametrize("stage", [0, 1])
def test_adafactor_two_ranks_match_torch_on_the_full_batch(ranks, stage):
    split = stage >= 1
    if split:      # the case the reference's pieces are for: some tensor really is split
        assert any(cut is not None for _, cut in _pieces(make_model(), 2))
    ref, other = adafactor_reference(split, False), adafactor_reference(split, True)
    bound = max(TOL, 2 * max(max_diff(a, b) for a, b in zip(ref, other)))
    got = ranks["res"][f"adafactor_s{stage}"]["snaps"]
    assert len(got) == STEPS
    for step, (r, g) in enumerate(zip(ref, got)):
        d = max_diff(r, g)
        assert d <= bound, f"step {step}: 2 ranks differ from torch's Adafactor by {d} > {bound}"
    assert max_diff(ref[-1], make_model().state_dict()) > 1e-3


def test_int8_state_resharded_two_ranks_to_one_and_one_to_two(ranks):
    one, two = ranks["one_rank_int8"], ranks["res"]["int8_s2"]["snaps"]
    bound = 2 * max(max_diff(a, b) for a, b in zip(one, two)) + TOL
    # 2 -> 1: the 2-rank stage 2 checkpoint (int8 state in 2 shards) continued by one process
    eng = offload.initialize(make_model(seed=7), int8_cfg(1))
    try:
        eng.load_checkpoint(os.path.join(ranks["out"], "ck_int8_world2"))
        for x, y in batches(STEPS)[2:]:
            eng.backward(eng(x, y))
            eng.step()
        resumed = {k: v.clone() for k, v in eng.full_state_dict().items()}
    finally:
        eng.close()
    d = max_diff(two[-1], resumed)
    assert d <= bound, f"2 -> 1 differs from the 2-rank run by {d} > {bound}"
    # 1 -> 2: the 1-rank checkpoint continued by 2 ranks (stage 1)
    got = ranks["res"]["int8_from1"]["snaps"]
    assert len(got) == STEPS - 2
    d = max_diff(one[-1], got[-1])
    assert d <= bound, f"1 -> 2 differs from the 1-rank run by {d} > {bound}"
    assert max_diff(one[-1], one[1]) > 10 * bound        # the last step moved the weights well beyond the bound
