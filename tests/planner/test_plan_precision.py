"""The precision that fits the machine (offload.planner.precision): the per-dtype matmul rate
measured for real, and the choice made from a rate table (a machine where bf16 is 45x slower
than fp32, as on an AVX2-only CPU, and one where it is faster): told once, used by the plan."""
import json
import math
import warnings

import pytest
import torch

from offload.planner import measure, precision, predict
from offload.planner import estimate as est
from _cli import run
from _profile import AVX2_RATES

FAST_BF16 = {"fp32": 0.05, "bf16": 0.15, "fp16": 0.001}     # AVX-512 BF16, no native fp16


def test_rates_are_measured_for_real_once_per_process():
    precision._measured.cache_clear()
    threads = torch.get_num_threads()
    r = precision.rates(torch.device("cpu"))
    assert set(r) == {"fp32", "bf16", "fp16"}
    assert all(0 < v < math.inf for v in r.values()), r
    assert torch.get_num_threads() == threads            # the probe's one thread is given back
    hits = precision._measured.cache_info().hits
    assert precision.rates(torch.device("cpu")) == r
    assert precision._measured.cache_info().hits == hits + 3
    assert precision.slowdown("fp32") == 1.0
    assert precision.slowdown("bf16", torch.device("cpu")) == pytest.approx(r["fp32"] / r["bf16"])


def test_not_asked_fp32_where_bf16_is_slow_with_the_factor(matmul_rates):
    matmul_rates(AVX2_RATES)
    c = precision.decide(None)
    assert (c.precision, c.asked, c.warning) == ("fp32", False, False)
    assert "precision fp32 (none asked for): bf16 computes 45x slower than fp32" in c.message
    assert "fp32 0.9, bf16 0.02 TFLOP/s" in c.message
    c = precision.decide(None, default="bf16")          # offload train's default on CUDA
    assert c.precision == "fp32" and "bf16 computes 45x slower" in c.message


def test_asked_slow_precision_runs_with_a_warning(matmul_rates):
    matmul_rates(AVX2_RATES)
    c = precision.decide("bf16")
    assert (c.precision, c.asked, c.warning) == ("bf16", True, True)
    assert "precision bf16 as asked, but bf16 computes 45x slower than fp32" in c.message
    c = precision.decide("fp16")
    assert c.precision == "fp16" and "fp16 computes 30x slower" in c.message
    assert precision.decide("fp32").message is None


def test_the_default_stands_where_bf16_is_not_slow(matmul_rates):
    matmul_rates(FAST_BF16)
    assert precision.decide(None) == precision.PrecisionChoice("fp32", False, None)
    assert precision.decide(None, default="bf16") == precision.PrecisionChoice("bf16", False, None)
    assert precision.decide("bf16").message is None
    assert "fp16 computes 50x slower" in precision.decide("fp16").message     # fp16 is slow here


def test_the_threshold_is_2x(matmul_rates):
    matmul_rates({"fp32": 1.0, "bf16": 0.5, "fp16": 1.0})
    assert precision.SLOW == 2.0
    assert precision.decide(None, default="bf16").precision == "bf16"        # exactly 2x: not slow
    matmul_rates({"fp32": 1.0, "bf16": 0.49, "fp16": 1.0})
    c = precision.decide(None, default="bf16")
    assert c.precision == "fp32" and "bf16 computes 2.0x slower" in c.message
    matmul_rates({"fp32": 1.0, "bf16": 0.0, "fp16": 1.0})                    # no bf16 matmul at all
    assert "bf16 does not compute" in precision.decide("bf16").message


def test_a_table_is_used_instead_of_measuring(monkeypatch):
    def no_measuring(*a, **kw):
        raise AssertionError("measured")
    monkeypatch.setattr(precision, "matmul_tflops", no_measuring)
    c = precision.decide(None, table=AVX2_RATES, where="saved")
    assert c.precision == "fp32" and "(saved: matmul fp32 0.9" in c.message
    assert precision.decide("bf16", table={}).message is None                  # no rates: nothing known
    with pytest.raises(ValueError, match="use fp32, bf16 or fp16"):
        precision.decide("bf17")


def test_told_once_per_process_and_precision(matmul_rates):
    matmul_rates(AVX2_RATES)
    said = []
    precision.announce(precision.decide(None), say=said.append)
    precision.announce(precision.decide(None), say=said.append)
    assert len(said) == 1 and "45x" in said[0]
    with pytest.warns(UserWarning, match="precision bf16 as asked, but bf16 computes 45x slower"):
        precision.announce(precision.decide("bf16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precision.announce(precision.decide("bf16"))                           # not again
        precision.announce(precision.decide("fp32"))                           # fp32 was told above


def _profile(**kw):
    base = dict(device="cpu", cpu_threads=2, adam_params_per_s=1e9, adam_backend="t",
                device_adam_params_per_s=1e9, h2d_gbps=8, d2h_gbps=8, host_memcpy_gbps=8, nvme_read_gbps=2,
                nvme_write_gbps=1, nvme_read_latency_s=0, nvme_write_latency_s=0, nvme_duplex=0.5, io_backend="t",
                nvme_path="/tmp", matmul_tflops=0.05)
    base.update(kw)
    return measure.Profile(**base)


def test_plan_predicts_each_precision_at_its_own_rate(tmp_path):
    spec = est.ModelSpec(params=100_000_000, largest_layer=10_000_000, largest_block=10_000_000, n_blocks=10)
    prof = _profile(matmul_tflops_by_dtype=AVX2_RATES)
    fp32, bf16 = (predict.flops_compute(spec, 1024, prof, p).total_s for p in ("fp32", "bf16"))
    assert fp32 == pytest.approx(6 * 1e8 * 1024 / 0.05e12)
    assert bf16 == pytest.approx(45 * fp32)
    old = measure.Profile.load(_profile().save(str(tmp_path / "old.json")))     # saved without the table
    assert old.matmul_tflops_by_dtype == {} and old.tflops("bf16") == old.matmul_tflops
    assert measure.Profile.load(prof.save(str(tmp_path / "new.json"))) == prof


def _compute_ms(out: str) -> float:
    line = next(ln for ln in out.splitlines() if ln.startswith("compute (forward+backward)"))
    return float(line.split()[2])


def test_plan_cli_chooses_and_warns_from_the_profile(capsys, tmp_path, matmul_rates):
    prof = _profile(nvme_path=str(tmp_path), matmul_tflops_by_dtype=AVX2_RATES).save(str(tmp_path / "p.json"))
    argv = ["plan", "--profile", prof, "--params", "1e8", "--largest-layer", "1e7", "--nvme-path", str(tmp_path),
            "--baseline-bytes", "300MiB"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "precision fp32 (none asked for): bf16 computes 45x slower than fp32 on this device (cpu: " in out
    assert "precision fp32, optimizer AdamW" in out
    code, out_bf16, err = run(argv + ["--precision", "bf16"], capsys)
    assert code == 0, err
    assert "precision bf16 as asked, but bf16 computes 45x slower than fp32" in out_bf16
    assert "precision bf16, optimizer AdamW" in out_bf16
    assert _compute_ms(out_bf16) == pytest.approx(45 * _compute_ms(out), rel=1e-3)
    assert "matmul 0.05 fp32, 0.00111 bf16, 0.00167 fp16 TFLOP/s" in out


def test_plan_measures_the_gpt_in_fp32_and_scales_a_slow_precision(capsys, tmp_path, monkeypatch):
    measured = []
    real = measure.measure_compute

    def spy(model, make_batch, device, dtype=torch.float32, iters=5):
        measured.append(dtype)
        return real(model, make_batch, device, dtype, iters=1)
    monkeypatch.setattr(measure, "measure_compute", spy)
    prof = _profile(nvme_path=str(tmp_path), matmul_tflops_by_dtype=AVX2_RATES).save(str(tmp_path / "p.json"))
    argv = ["plan", "--profile", prof, "--nvme-path", str(tmp_path), "--n-layer", "1", "--n-embd", "32",
            "--seq-len", "16", "--batch-size", "2", "--baseline-bytes", "300MiB", "--precision"]
    code, out, err = run(argv + ["bf16"], capsys)
    assert code == 0, err
    assert measured == [torch.float32] and "in fp32, times bf16's measured matmul slowdown" in out
    prof = _profile(nvme_path=str(tmp_path), matmul_tflops_by_dtype=FAST_BF16).save(str(tmp_path / "p.json"))
    code, out, err = run(argv + ["bf16"], capsys)
    assert code == 0, err
    assert measured[-1] == torch.bfloat16 and "slowdown" not in out


def test_train_falls_back_to_fp32_where_its_bf16_default_is_slow(matmul_rates, capsys):
    from offload.cli.train import _precision
    from offload.config import Config
    matmul_rates(AVX2_RATES)
    assert _precision(Config(precision="bf16"), asked=False).precision == "fp32"      # the CUDA default
    assert "bf16 computes 45x slower" in capsys.readouterr().out
    assert _precision(Config(precision="bf16"), asked=True).precision == "bf16"
    assert "as asked" in capsys.readouterr().out
