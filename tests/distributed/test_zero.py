"""ZeRO stages 1-3 across ranks (gloo on the CPU): 2 ranks on half batches against one
process on the full batch, per-rank resident bytes, sharded checkpoints (same world size
bit-exact, 2 -> 1 and 1 -> 2 re-sharded), diverging ranks, and 4 ranks.

The ranks are processes of their own (tests/_zero_worker.py, forked by tests/_forked.py)
running many jobs in one process group, since each rendezvous costs time. Tolerance: the
attention key bias has a mathematically zero gradient, so its computed gradient is round-off
noise, which Adam with eps=1e-8 turns into lr-sized steps that differ with any change of
summation order. The tests use eps=1e-6, where a change of reduction order stays below 1e-5
and a wrong update (a missed average, a rank's shard not stepped) is off by > 1e-4.
"""
import json
import os
import time

import pytest
import torch

import offload
from _models import batches, make_model
from _parity import max_diff
from _zero import CLIP, EPS, LR, STEPS, TOL, WD, spawn
from offload.core import sharding

GAS_STEPS = 2      # optimizer steps of the accumulation jobs (two micro-steps each)


def reference(steps, batch=4, gas=1):
    """One process, plain PyTorch, the full batch: AdamW and clip_grad_norm_, loss / gas
    accumulated over ``gas`` micro-batches per step."""
    m = make_model()
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, eps=EPS, foreach=False)
    snaps = []
    for i, (x, y) in enumerate(batches(steps * gas, batch=batch)):
        (m(x, y) / gas if gas > 1 else m(x, y)).backward()
        if (i + 1) % gas:
            continue
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        snaps.append({k: v.detach().clone() for k, v in m.state_dict().items()})
    return snaps


def engine_cfg(stage=0, tier="cpu", nvme=None):
    cfg = {"optimizer": {"type": "AdamW", "lr": LR, "weight_decay": WD, "eps": EPS}, "gradient_clipping": CLIP,
           "offload_optimizer": {"device": tier}, "zero_optimization": {"stage": stage}}
    if tier == "nvme":
        cfg["offload_optimizer"]["nvme_path"] = nvme
    return cfg


STAGE_TIERS = [(s, t, p) for s in (1, 2, 3) for t in ("none", "cpu", "nvme") for p in (None,)] + \
    [(3, "cpu", "nvme"), (3, "none", "cpu")]


def name(stage, tier, param):
    return f"s{stage}_{tier}" + (f"_p{param}" if param else "")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every stage/tier combination, checkpoints and resumes, in one 2-rank process group."""
    out = str(tmp_path_factory.mktemp("zero2"))
    ck1 = os.path.join(out, "ck_world1")
    # a 1-rank checkpoint after 2 steps, for 1 -> 2
    nv = os.path.join(out, "nv1")
    os.makedirs(nv)
    eng = offload.initialize(make_model(), engine_cfg(0, "cpu"))
    for x, y in batches(2):
        eng.backward(eng(x, y))
        eng.step()
    eng.save_checkpoint(ck1)
    eng.close()
    jobs = []
    for s, t, p in STAGE_TIERS:
        job = {"name": name(s, t, p), "stage": s, "tier": t, "steps": STEPS, "eps": EPS}
        if p:
            job["param"] = p
        if (s, t, p) in ((2, "cpu", None), (3, "nvme", None)):
            job["save_at"], job["save"] = 2, os.path.join(out, f"ck_s{s}")
        jobs.append(job)
    jobs += [{"name": "resume_s2", "stage": 2, "tier": "nvme", "steps": STEPS - 2, "start": 2, "eps": EPS,
              "load": os.path.join(out, "ck_s2")},
             {"name": "resume_s3", "stage": 3, "tier": "cpu", "steps": STEPS - 2, "start": 2, "eps": EPS,
              "load": os.path.join(out, "ck_s3")},
             {"name": "from_world1", "stage": 1, "tier": "cpu", "steps": STEPS - 2, "start": 2, "eps": EPS,
              "load": ck1}]
    jobs += [{"name": f"gas_s{s}", "stage": s, "tier": "cpu", "steps": 2 * GAS_STEPS, "eps": EPS,
              "extra": {"gradient_accumulation_steps": 2}} for s in (0, 2)]
    jobs += [{"name": f"twice_s{s}", "stage": s, "tier": "cpu", "steps": STEPS, "eps": EPS, "backwards": 2}
             for s in (0, 1, 2, 3)]
    jobs += [{"name": f"fp16_s{s}", "stage": s, "tier": "cpu", "steps": 2, "eps": EPS, "diverge": "inf",
              "extra": {"precision": "fp16", "loss_scaler": {"initial_scale": 1024.0}}} for s in (0, 2)]
    t0 = time.time()
    rcs, errs, res = spawn(jobs, 2, out)
    assert rcs == [0, 0] and not errs, errs
    return {"out": out, "res": res, "seconds": time.time() - t0}


@pytest.fixture(scope="module")
def ref():
    return reference(STEPS)


@pytest.mark.parametrize("stage,tier,param", STAGE_TIERS)
def test_two_ranks_on_half_batches_match_one_on_full_batch(two_ranks, ref, stage, tier, param):
    got = two_ranks["res"][0][name(stage, tier, param)]["snaps"]
    assert len(got) == STEPS
    for step, (r, g) in enumerate(zip(ref, got)):
        assert list(r) == list(g)
        d = max_diff(r, g)
        assert d <= TOL, f"step {step}: 2 ranks differ from 1 by {d}"
    assert max_diff(ref[-1], make_model().state_dict()) > 1e-3   # the weights really moved
    for rank in (0, 1):    # close() destroyed the groups the engine made, as torch asks before exit
        assert two_ranks["res"][rank][name(stage, tier, param)]["groups"]["left_after_close"] == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_backwards_per_step_across_ranks(two_ranks, ref, stage):
    """Each rank's half batch in two backward() calls (each loss / 2) before one step(): the
    gradients of both sum into one micro-step before they are reduced, as one backward of
    the full batch would give."""
    got = two_ranks["res"][0][f"twice_s{stage}"]["snaps"]
    assert len(got) == STEPS
    for step, (r, g) in enumerate(zip(ref, got)):
        d = max_diff(r, g)
        assert d <= TOL, f"step {step}: differs from one process on the full batch by {d}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_per_rank_resident_bytes_are_one_over_world_size(two_ranks, stage, tmp_path):
    """stats()['partitioned_bytes'] of each rank against one rank's figure: optimizer state
    (stage >= 1), gradients (>= 2) and parameters (3) are halved, plus padding."""
    eng = offload.initialize(make_model(), engine_cfg(stage, "cpu"))
    one = eng.stats()["partitioned_bytes"]
    nblocks = sum(b.trains for b in eng.blocks)
    numels = [b.layout.numel for b in eng.blocks if b.trains]
    eng.close()
    kinds = {"optimizer_state": 1, "gradients": 2, "parameters": 3}
    for rank in (0, 1):
        st = two_ranks["res"][rank][name(stage, "cpu", None)]["stats"]
        assert st["world_size"] == 2 and st["rank"] == rank
        got = st["partitioned_bytes"]
        for kind, from_stage in kinds.items():
            per_elem = one[kind] // sum(sharding.padded_numel(n, 1) for n in numels)
            if stage < from_stage:     # not partitioned: the full flat, padded for 2 shards
                assert got[kind] == sum(sharding.padded_numel(n, 2) for n in numels) * per_elem, kind
                continue
            expect = sum(sharding.shard_numel(n, 2) for n in numels) * per_elem
            assert got[kind] == expect, kind
            # 1/world_size of the single-rank figure, plus at most one alignment unit per block
            assert abs(got[kind] - one[kind] / 2) <= nblocks * sharding.ALIGN_ELEMS * per_elem, kind


def test_resume_at_same_world_size_is_bit_exact(two_ranks):
    res = two_ranks["res"][0]
    for straight, resumed in (("s2_cpu", "resume_s2"), ("s3_nvme", "resume_s3")):
        a, b = res[straight]["snaps"][2:], res[resumed]["snaps"]
        assert len(b) == STEPS - 2
        for x, y in zip(a, b):
            assert all(torch.equal(x[k], y[k]) for k in x), resumed


def test_resume_two_ranks_to_one_and_one_to_two(two_ranks, ref):
    # 1 -> 2: a 1-rank checkpoint continued by 2 ranks (stage 1)
    for r, g in zip(ref[2:], two_ranks["res"][0]["from_world1"]["snaps"]):
        assert max_diff(r, g) <= TOL
    # 2 -> 1: the 2-rank stage 2 checkpoint continued by one process
    ck = os.path.join(two_ranks["out"], "ck_s2")
    meta = json.load(open(os.path.join(ck, "meta.json")))
    assert meta["world_size"] == 2
    assert any(len(b["shards"]) == 2 for b in meta["blocks"])
    eng = offload.initialize(make_model(seed=7), engine_cfg(1, "cpu"))
    eng.load_checkpoint(ck)
    for x, y in batches(STEPS)[2:]:
        eng.backward(eng(x, y))
        eng.step()
    assert max_diff(ref[-1], eng.full_state_dict()) <= TOL
    eng.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_gradient_accumulation_across_ranks(two_ranks, stage):
    ref = reference(GAS_STEPS, gas=2)
    got = two_ranks["res"][0][f"gas_s{stage}"]["snaps"][1::2]     # after each boundary micro-step
    assert len(got) == GAS_STEPS
    for r, g in zip(ref, got):
        assert max_diff(r, g) <= TOL


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_overflow_on_one_rank_skips_on_all(two_ranks, stage):
    """An inf on the last rank only: every rank skips the step and lowers the scale alike."""
    init = make_model().state_dict()
    for rank in (0, 1):
        first, second = two_ranks["res"][rank][f"fp16_s{stage}"]["stats_all"]
        assert first["skipped_steps"] == 1 and first["loss_scale"] == 512.0 and first["step"] == 0
        assert second["skipped_steps"] == 1 and second["step"] == 1
    s0 = two_ranks["res"][0][f"fp16_s{stage}"]["snaps"]
    assert torch.equal(s0[0]["tok.weight"], init["tok.weight"])         # rank 0's finite step skipped
    assert not torch.equal(s0[1]["tok.weight"], init["tok.weight"])     # the next one applied


def test_export_fp32_consolidates_shards(two_ranks):
    ck = os.path.join(two_ranks["out"], "ck_s2")
    sd = offload.export_fp32(ck)
    want = two_ranks["res"][0]["s2_cpu"]["snaps"][1]
    assert list(sd) == list(want) and all(torch.equal(sd[k], want[k]) for k in sd)
    model = make_model(seed=3)
    model.load_state_dict(sd)


def test_diverging_ranks_fail_clearly(tmp_path):
    """Another model or config: both ranks fail at initialize, naming the difference. A rank
    that takes another module order: every rank fails at the step's check."""
    jobs = [{"name": "config", "stage": 2, "tier": "cpu", "steps": 1, "diverge": "config", "expect_error": True,
             "timeout_s": 10},
            {"name": "model", "stage": 1, "tier": "cpu", "steps": 1, "diverge": "model", "expect_error": True,
             "timeout_s": 10},
            {"name": "order", "stage": 2, "tier": "cpu", "steps": 3, "diverge": "order", "expect_error": True,
             "timeout_s": 10}]
    t0 = time.time()
    rcs, errs, res = spawn(jobs, 2, str(tmp_path), timeout=90)
    assert rcs == [0, 0], errs
    for rank in (0, 1):
        e = res[rank]
        assert "CommError" in e["config"]["error"] and "gradient_clipping" in e["config"]["error"]
        assert "CommError" in e["model"]["error"] and "blocks" in e["model"]["error"]
        assert "CommError" in e["order"]["error"] and "block order" in e["order"]["error"]
        assert "step 2" in e["order"]["error"]
    assert time.time() - t0 < 60


def test_dead_rank_fails_within_timeout(tmp_path):
    """A rank that dies mid-step: the survivor raises within the timeout, naming the collective."""
    jobs = [{"name": "die", "stage": 3, "tier": "cpu", "steps": 3, "diverge": "die", "expect_error": True,
             "timeout_s": 10}]
    t0 = time.time()
    rcs, errs, res = spawn(jobs, 2, str(tmp_path), timeout=90)
    assert rcs[1] == 3 and rcs[0] == 0
    err = res[0]["die"]["error"]
    assert "CommError" in err and "rank 0/2" in err and "collective" in err and "step" in err, err
    assert time.time() - t0 < 60


def test_four_ranks_stage2(tmp_path):
    jobs = [{"name": "s2", "stage": 2, "tier": "cpu", "steps": STEPS, "eps": EPS}]
    rcs, errs, res = spawn(jobs, 4, str(tmp_path))
    assert rcs == [0] * 4 and not errs, errs
    for r, g in zip(reference(STEPS), res[0]["s2"]["snaps"]):
        assert max_diff(r, g) <= TOL
    st = res[3]["s2"]["stats"]
    assert st["world_size"] == 4 and st["comm_bytes"]["reduce_scatter"] > 0


NCCL_JOBS = [{"name": f"s{s}_{t}", "stage": s, "tier": t, "steps": STEPS, "eps": EPS} for s, t in
             ((1, "cpu"), (2, "nvme"), (3, "cpu"))]


def check_nccl_jobs(out, res, ref, backend):
    for job in NCCL_JOBS:
        for rank in (0, 1):
            groups = res[rank][job["name"]]["groups"]
            assert groups == {"backend": backend, "host_backend": "gloo", "host_is_separate": True,
                              "left_after_close": 0}, groups   # close() destroyed the engine's groups
        got = res[0][job["name"]]["snaps"]
        assert len(got) == STEPS
        for step, (r, g) in enumerate(zip(ref, got)):
            d = max_diff(r, g)
            assert d <= TOL, f"{job['name']} step {step}: 2 ranks differ from 1 by {d}"


def test_nccl_only_default_group_uses_a_gloo_group_for_host_tensors(tmp_path, ref):
    """A default group that rejects CPU tensors, as NCCL's does (faked on the CPU): the engine
    makes gloo groups beside it and runs every host collective (gradient buffers, the norm,
    barriers and object exchanges of a checkpoint save) there."""
    jobs = [dict(j) for j in NCCL_JOBS]
    jobs[0].update(save_at=2, save=str(tmp_path / "ck"))
    rcs, errs, res = spawn(jobs, 2, str(tmp_path), fake_nccl=True)
    assert rcs == [0, 0] and not errs, errs
    check_nccl_jobs(str(tmp_path), res, ref, "nccl")
    assert json.load(open(tmp_path / "ck" / "meta.json"))["world_size"] == 2


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
                         and torch.distributed.is_nccl_available()), reason="needs 2 CUDA devices and NCCL")
def test_two_ranks_with_nccl(tmp_path, ref):
    """torchrun's usual setting: an NCCL default group, one GPU per rank."""
    rcs, errs, res = spawn(NCCL_JOBS, 2, str(tmp_path), backend="nccl")
    assert rcs == [0, 0] and not errs, errs
    check_nccl_jobs(str(tmp_path), res, ref, "nccl")
