"""The planner's overlap model, profile round-trip, ranking, and a small measured check."""
import json

import pytest
import torch

from offload.planner import estimate as est
from offload.planner import measure, predict, rank, validate
from _profile import GPU, profile


SPEC = est.ModelSpec(params=1_000_000_000, largest_layer=50_000_000, largest_block=100_000_000, n_blocks=10)


def test_no_offload_is_compute_plus_device_adam():
    p = predict.predict(SPEC, "none", "none", profile(), GPU, "bf16")
    assert p.groups == {"device": pytest.approx(3.0 + 1e9 / 50e9)}
    assert p.step_s == pytest.approx(3.02)


def test_committed_step_overlaps_the_next_forward():
    p = predict.predict(SPEC, "cpu", "none", profile(), GPU, "bf16")
    # cpu adam 1.0 s, d2h 2 GB / 20 GB/s = 0.1 s, h2d 0.1 s, device 3.0 s (forward 1, backward 2)
    assert p.terms["adam"] == pytest.approx(1.0)
    assert p.terms["d2h"] == pytest.approx(0.1) and p.terms["h2d"] == pytest.approx(0.1)
    assert p.bottleneck == "device" and p.mode == "global"
    assert p.step_s == pytest.approx(2.0 + 1.0 + 1.0 / 10)


def test_nvme_terms_and_bottleneck():
    p = predict.predict(SPEC, "nvme", "nvme", profile(), GPU, "bf16")
    # state 12 B/param, bf16 params 2 B read by the forward and again by the backward but for
    # the device budget's worth still on the device at the turn (default: two largest blocks,
    # 0.4 GB), and the gradients (bf16, 2 B) parked on NVMe until step() commits them (they
    # wait for the commit whether or not anything clips)
    read = 12e9 + (2e9 + 1.6e9) + 2e9
    write = 12e9 + 2e9 + 2e9
    assert p.terms["nvme"] == pytest.approx(read / 4e9 + write / 2e9)
    # the bytes and requests behind the term (bench_scale compares them with the engine's stats)
    assert p.io == pytest.approx({"nvme_read": read, "nvme_write": write, "param_read": 3.6e9, "reads": 38,
                                  "writes": 30})
    # one request per block and direction: 10 blocks x (1 state + 1 parked gradient), 10 + 8
    # parameter reads (forward, backward but two); writes 10 x (state, param, gradient)
    lat = predict.predict(SPEC, "nvme", "nvme", profile(nvme_read_latency_s=0.01, nvme_write_latency_s=0.02), GPU, "bf16")
    assert lat.terms["nvme"] == pytest.approx(p.terms["nvme"] + 38 * 0.01 + 30 * 0.02)
    # LoRA: the frozen base is fetched as before; state, gradients and write-back are the adapters'
    lora = predict.predict(SPEC, "nvme", "nvme", profile(), GPU, "bf16", trainable=10_000_000)
    assert lora.terms["nvme"] == pytest.approx((12e7 + 3.6e9 + 2e7) / 4e9 + (12e7 + 2e7 + 2e7) / 2e9)
    assert lora.terms["adam"] == pytest.approx(0.01)
    # a full-duplex disk hides the shorter direction (reads, 4 s) under the longer (8 s)
    duplex = predict.predict(SPEC, "nvme", "nvme", profile(nvme_duplex=1.0), GPU, "bf16")
    assert duplex.terms["nvme"] == pytest.approx(write / 2e9)
    assert p.bottleneck == "nvme"
    assert p.step_s > predict.predict(SPEC, "cpu", "none", profile(), GPU, "bf16").step_s


def test_update_hides_behind_the_next_forward_only():
    plain = predict.predict(SPEC, "cpu", "none", profile(adam_params_per_s=0.25e9), GPU, "bf16")
    glob = predict.predict(SPEC, "cpu", "none", profile(adam_params_per_s=0.25e9), GPU, "bf16", clipping=True)
    # adam 4 s behind the 1 s forward only (step() commits after backward), clipping or not
    assert glob.mode == plain.mode == "global"
    assert glob.step_s == plain.step_s == pytest.approx(2.0 + 4.0 + 1.0 / 10)


def test_update_ahead_hides_behind_backward_and_the_next_forward():
    ahead = predict.predict(SPEC, "cpu", "none", profile(adam_params_per_s=0.25e9), GPU, "bf16", update_ahead=True)
    # adam 4 s from the first block's gradients on: behind the 2 s backward and the 1 s forward
    assert ahead.mode == "ahead"
    assert ahead.step_s == pytest.approx(4.0 + 3.0 / 10)
    nvme = predict.predict(SPEC, "nvme", "none", profile(adam_params_per_s=0.25e9), GPU, "bf16", update_ahead=True)
    assert nvme.mode == "global"          # the optimizer on nvme does not take it
    with pytest.raises(est.EstimateError, match="update_ahead.*gradient_clipping"):
        predict.predict(SPEC, "cpu", "none", profile(), GPU, "bf16", clipping=True, update_ahead=True)


def test_serial_adds_everything():
    p = predict.predict(SPEC, "cpu", "none", profile(), GPU, "bf16", overlap_step=False)
    assert p.mode == "serial" and p.step_s == pytest.approx(3.0 + 1.0 + 0.1 + 0.1)


def test_cpu_only_compute_shares_the_cores():
    cpu = measure.Compute(1.0, 2.0, True, shares_cpu=True)
    p = predict.predict(SPEC, "cpu", "none", profile(device="cpu"), cpu, "fp32")
    assert set(p.groups) == {"cpu"}
    assert p.step_s == pytest.approx(3.0 + p.terms["adam"] + p.terms["d2h"] + p.terms["h2d"])


def test_accumulation_repeats_compute_not_the_optimizer():
    one = predict.predict(SPEC, "cpu", "none", profile(), GPU, "bf16", gradient_accumulation_steps=1)
    four = predict.predict(SPEC, "cpu", "none", profile(), GPU, "bf16", gradient_accumulation_steps=4)
    assert four.terms["forward"] == 4 * one.terms["forward"] and four.terms["adam"] == one.terms["adam"]
    assert four.terms["d2h"] > one.terms["d2h"]   # fp32 grads, every micro-step


def test_rank_fits_first_and_says_when_no_offload_is_needed(tmp_path):
    small = est.ModelSpec(params=10_000_000, largest_layer=1_000_000, largest_block=2_000_000, n_blocks=6)
    roomy = est.Machine(80 << 30, "test", 64 << 30, 1 << 40, str(tmp_path))
    ranked = rank.rank(small, profile(), GPU, roomy, "bf16")
    assert len(ranked) == 9
    assert (ranked[0].memory.optimizer, ranked[0].memory.param) == ("none", "none")
    assert rank.fits_without_offload(ranked) is not None
    tiny_device = est.Machine(24 << 20, "test", 64 << 30, 1 << 40, str(tmp_path))
    ranked = rank.rank(small, profile(), GPU, tiny_device, "bf16")
    assert rank.fits_without_offload(ranked) is None
    assert ranked[0].fits and ranked[0].memory.param != "none"
    assert all(not r.fits for r in ranked if r.memory.param == "none")


def test_profile_round_trip(tmp_path):
    p = profile()
    path = p.save(str(tmp_path / "p.json"))
    assert measure.Profile.load(path) == p
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "cpu"}))
    with pytest.raises(ValueError, match="lacks"):
        measure.Profile.load(str(bad))
    with pytest.raises(FileNotFoundError, match="--save-profile"):
        measure.Profile.load(str(tmp_path / "missing.json"))


def test_fit_latency_and_bandwidth():
    bw, lat = measure._fit((1 << 20, 9 << 20), [0.002 + (1 << 20) / 1e9, 0.002 + (9 << 20) / 1e9])
    assert bw == pytest.approx(1.0) and lat == pytest.approx(0.002)
    bw, lat = measure._fit((1 << 20, 9 << 20), [0.01, 0.005])       # inconsistent (noise)
    assert lat == 0.0 and bw == pytest.approx((9 << 20) / 0.005 / 1e9)


def test_flops_compute():
    c = predict.flops_compute(SPEC, 1000, profile())
    assert c.total_s == pytest.approx(6 * 1e9 * 1000 / 100e12)
    assert c.backward_s == pytest.approx(2 * c.forward_s) and not c.measured


def test_measurements_are_positive(tmp_path):
    rate, backend = measure.measure_cpu_adam(1 << 16)
    assert rate > 0 and backend.startswith("rule AdamW")    # the engine's own update rule is timed
    h2d, d2h, memcpy = measure.measure_links(torch.device("cpu"), 1 << 20)
    assert h2d == d2h == memcpy > 0
    io = measure.measure_nvme(str(tmp_path), (1 << 20, 2 << 20), 8 << 20)
    assert io.read_gbps > 0 and io.write_gbps > 0 and io.read_latency_s >= 0 and io.write_latency_s >= 0
    assert 0.0 <= io.duplex <= 1.0 and io.backend
    (r, _), (w, _) = measure._measure_file_io(str(tmp_path), 4 << 20, (1 << 20, 2 << 20))
    assert r > 0 and w > 0
    assert measure.measure_matmul(torch.device("cpu"), n=128) > 0

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.lin(x).sum()
    c = measure.measure_compute(Loss(), lambda: (torch.randn(4, 8),), torch.device("cpu"), iters=2)
    assert c.measured and c.shares_cpu and c.forward_s > 0 and c.backward_s > 0


def test_check_runs_the_engine(tmp_path):
    """A tiny measured run per placement: the machinery, not the accuracy (that is `offload plan
    --check` on a quiet machine)."""
    from offload.models.gpt import GPT, GPTConfig
    cfg = GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)
    spec = est.spec_from_module(GPT(cfg))
    x = torch.randint(0, 256, (2, 16))
    case = validate.CheckCase("tiny", lambda: GPT(cfg), lambda: (x, x), spec)
    logs = []
    res = validate.check([case], profile(device="cpu"), [("cpu", "none")], str(tmp_path), rounds=1, log=logs.append)
    assert len(res) == 1 and res[0].measured_s > 0 and res[0].predicted_s > 0
    assert any("predicted" in line for line in logs)


def test_cpu_only_device_optimizer_is_the_cpu_kernel():
    """On a CPU device the engine's tier-none optimizer runs on its CPU workers, beside the
    (here simulated, GIL-free) compute: a CPU group, not device work."""
    p = predict.predict(SPEC, "none", "none", profile(device="cpu", device_adam_params_per_s=1e9), GPU, "fp32")
    assert p.groups == {"device": pytest.approx(3.0), "cpu": pytest.approx(1.0)}
    assert p.step_s == pytest.approx(3.0 + 1.0 / 10)
