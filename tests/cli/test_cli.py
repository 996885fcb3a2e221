"""The `offload` command: train (tiny), estimate, plan, bench, export, and its error lines."""
import csv
import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest
import torch

from offload import cli
from offload.models.gpt import GPT, GPTConfig
from offload.cli.progress import Progress
from _cli import error_line, run

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "2",
        "--sample", "0", "--log-every", "0"]


# ---- train ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny run with the default tiers (NVMe for state and, when supported, parameters)."""
    out = tmp_path_factory.mktemp("run")
    trace = out / "trace.json"
    buf = io.StringIO()
    old = sys.stdout
    sys.stdout = buf
    try:
        code = cli.main(["train", "--steps", "40", "--lr", "3e-3", "--out", str(out), "--trace", str(trace)] + TINY)
    finally:
        sys.stdout = old
    return code, buf.getvalue(), out, trace


def test_train_writes_outputs(trained):
    code, text, out, trace = trained
    assert code == 0, text
    for name in ("loss.csv", "summary.json", "config.json", "checkpoint"):
        assert (out / name).exists(), name
    rows = list(csv.DictReader(open(out / "loss.csv")))
    assert len(rows) == 40 and rows[0]["step"] == "1"
    events = json.load(open(trace))["traceEvents"]
    assert any(e["name"] == "offload::forward" for e in events)
    assert "optimizer state -> nvme" in text


def test_train_loss_falls(trained):
    _, text, out, _ = trained
    s = json.load(open(out / "summary.json"))
    assert s["loss_last"] < s["loss_first"] - 0.5, s
    assert s["val_loss_end"] < s["val_loss_start"]
    assert "loss " in text and " -> " in text


def test_train_summary_from_stats(trained):
    _, text, out, _ = trained
    assert "summary after 40 optimizer steps" in text
    assert "time per stage" in text and "moved per link" in text and "bytes per tier" in text
    stats = json.load(open(out / "summary.json"))["stats"]
    assert stats["tier_bytes"]["nvme"] > 0


def test_progress_lines_when_not_a_tty(trained):
    _, text, _, _ = trained
    bars = [ln for ln in text.splitlines() if "/40 [" in ln]      # tqdm lines, one per refresh
    assert len(bars) >= 2 and "\r" not in text and "tok/s" in bars[-1] and "40/40" in bars[-1]


def test_export_pt_matches_checkpoint(trained, tmp_path, capsys):
    _, _, out, _ = trained
    dst = tmp_path / "w.pt"
    code, text, err = run(["export", str(out / "checkpoint"), str(dst)], capsys)
    assert code == 0, err
    sd = torch.load(dst)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    model.load_state_dict(sd)          # every model key, fp32
    assert all(v.dtype == torch.float32 for v in sd.values())


def test_export_safetensors(trained, tmp_path, capsys):
    _, _, out, _ = trained
    dst = tmp_path / "w.safetensors"
    if importlib.util.find_spec("safetensors") is None:
        assert "pip install safetensors" in error_line(["export", str(out / "checkpoint"), str(dst)], capsys)
        return
    code, _, err = run(["export", str(out / "checkpoint"), str(dst)], capsys)
    assert code == 0, err
    from safetensors.torch import load_file
    assert set(load_file(str(dst))) == set(GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16)).state_dict())


def test_export_errors(tmp_path, capsys):
    assert "does not exist" in error_line(["export", str(tmp_path / "nope"), str(tmp_path / "w.pt")], capsys)


def test_train_cpu_tier_without_nvme(tmp_path, capsys):
    code, out, err = run(["train", "--steps", "2", "--out", str(tmp_path), "--offload-optimizer", "cpu",
                          "--offload-param", "none", "--no-checkpoint"] + TINY, capsys)
    assert code == 0, err
    assert "optimizer state -> cpu" in out and not (tmp_path / "checkpoint").exists()


def test_train_from_deepspeed_config_file(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 2, "zero_optimization": {"stage": 0, "offload_optimizer":
                                                                           {"device": "cpu"}},
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    code, out, err = run(["train", "--config", str(ds), "--steps", "2", "--out", str(tmp_path / "o"),
                          "--no-checkpoint"] + TINY, capsys)
    assert code == 0, err
    assert "offload: warning: DeepSpeed config keys not used by offload: train_batch_size" in err


# ---- one-line errors, exit 2, nothing allocated --------------------------------------------------
@pytest.fixture
def no_model(monkeypatch):
    """Config errors must come before any model memory: building one fails the test."""
    def boom(*a, **k):
        raise AssertionError("a model was built before the config was validated")
    monkeypatch.setattr("offload.models.gpt.GPT.__init__", boom)


@pytest.mark.parametrize("argv, expect", [
    (["--offload-optimzer", "nvme"], "unknown flag --offload-optimzer: did you mean --offload-optimizer?"),
    (["--offload-optimizer", "disk"], "offload_optimizer.device='disk' is not valid"),
    (["--nvme-path", "/nonexistent/dir"], "offload_optimizer.nvme_path='/nonexistent/dir' does not exist"),
    (["--device-budget=-5"], "--device-budget='-5' must be >= 0"),
    (["--set", "aio.block_size=1000"], "aio.block_size=1000 must be a multiple of 4096"),
    (["--set", "optimiser.lr=1"], "did you mean 'optimizer'"),
    (["--precision", "fp8"], "precision='fp8' is not valid"),
    (["--gradient-accumulation-steps", "0"], "gradient_accumulation_steps=0 must be an integer >= 1"),
])
def test_train_bad_config_one_line(argv, expect, capsys, tmp_path, no_model):
    assert expect in error_line(["train", "--out", str(tmp_path)] + argv, capsys)


def test_train_bad_config_file(tmp_path, capsys, no_model):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"offload_optimizer": {"device": "nvme", "nvme_pth": "/tmp"}}))
    line = error_line(["train", "--config", str(p)], capsys)
    assert "'offload_optimizer.nvme_pth'" in line and "did you mean 'offload_optimizer.nvme_path'" in line


def test_train_not_writable_nvme_path(capsys, no_model):
    line = error_line(["train", "--nvme-path", "/sys"], capsys)
    assert "nvme_path='/sys' is not writable" in line and "choose a writable directory" in line


def test_error_through_the_console_entry(tmp_path):
    """The real process: status 2, one line on stderr, no traceback."""
    r = subprocess.run([sys.executable, "-m", "offload.cli", "train", "--offload-param", "nvme",
                        "--nvme-path", str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("offload: error: "), r.stderr
    assert "does not exist" in r.stderr


def test_usage_errors(capsys):
    assert "did you mean --params?" in error_line(["estimate", "--parms", "7e9"], capsys)
    assert "invalid choice" in error_line(["frobnicate"], capsys)
    assert "no model" in error_line(["estimate"], capsys)
    assert "--largest-layer needs --params" in error_line(["estimate", "--largest-layer", "5"], capsys)


# ---- estimate / plan / bench ------------------------------------------------------------------------
def test_estimate_table(capsys, tmp_path):
    code, out, err = run(["estimate", "--params", "7e9", "--largest-layer", "2e8", "--device-memory", "24GiB",
                          "--nvme-path", str(tmp_path), "--deepspeed"], capsys)
    assert code == 0, err
    rows = [ln for ln in out.splitlines() if ln.strip().split(" ")[0] in ("none", "cpu", "nvme")]
    assert len(rows) == 9
    assert "no (device" in rows[0]                  # 7B of model states do not fit 24 GiB
    assert "DeepSpeed's estimators" in out and "zero3 optimizer=cpu param=cpu" in out


def test_estimate_hf_config_and_model_json(capsys, tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"n_embd": 768, "n_layer": 12, "vocab_size": 50257, "n_positions": 1024}))
    code, out, _ = run(["estimate", "--hf-config", str(p), "--json", "--world-size", "2"], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["model"]["params"] == 124_439_808 and len(d["placements"]) == 9
    code, out, _ = run(["estimate", "--model", "offload.models.gpt:gpt2_small", "--json"], capsys)
    assert json.loads(out)["model"]["params"] == 124_439_808


def _fake_profile(tmp_path):
    from offload.planner.measure import Profile
    return Profile(device="cpu", cpu_threads=2, adam_params_per_s=1e9, adam_backend="t",
                   device_adam_params_per_s=5e8, h2d_gbps=8, d2h_gbps=8, host_memcpy_gbps=8,
                   nvme_read_gbps=2, nvme_write_gbps=1, nvme_read_latency_s=0, nvme_write_latency_s=0,
                   nvme_duplex=0.5, io_backend="t", nvme_path=str(tmp_path),
                   matmul_tflops=0.05).save(str(tmp_path / "profile.json"))


def test_plan_from_saved_profile(capsys, tmp_path):
    prof = _fake_profile(tmp_path)
    code, out, err = run(["plan", "--profile", prof, "--params", "1e8", "--largest-layer", "1e7",
                          "--device-memory", "80GiB", "--nvme-path", str(tmp_path)], capsys)
    assert code == 0, err
    assert "fits on the device without offload" in out and "only slows it down" in out
    code, out, err = run(["plan", "--profile", prof, "--params", "7e9", "--largest-layer", "2e8",
                          "--device-memory", "24GiB", "--nvme-path", str(tmp_path)], capsys)
    assert code == 0, err
    assert "best placement that fits" in out or "no placement fits" in out
    # update_ahead: the optimizer-on-cpu placements counted and timed with it
    code, ahead, err = run(["plan", "--profile", prof, "--params", "7e9", "--largest-layer", "2e8",
                            "--device-memory", "24GiB", "--nvme-path", str(tmp_path), "--update-ahead"], capsys)
    assert code == 0, err
    assert "optimizer AdamW with fp32 state, update_ahead" in ahead and ahead != out


def test_plan_bad_profile(capsys, tmp_path):
    assert "--save-profile" in error_line(["plan", "--profile", str(tmp_path / "none.json"), "--params", "1e6"], capsys)


def test_bench_missing_and_present(capsys):
    line = error_line(["bench", "nosuchbench"], capsys)
    assert "bench_nosuchbench.py is not there" in line and "available:" in line
    have = os.path.join(cli.REPO_ROOT, "benchmarks", "bench_step.py")
    if os.path.isfile(have):
        assert cli.main(["bench", "step", "--help"]) == 0


def test_progress_tty_redraws_in_place():
    s = io.StringIO()
    bar = Progress(3, stream=s, tty=True, refresh=1e9)
    for i in range(1, 4):
        bar.update(i, loss=1.0, tok_s=10.0, tiers={"device": 1 << 20, "nvme": 0})
    bar.close()
    text = s.getvalue()
    assert "\n" not in text.rstrip("\n") and text.endswith("\n")     # redrawn in place, one line
    assert "3/3" in text and "loss 1.000" in text and "device 1MiB" in text and "nvme" not in text


def test_progress_log_file_gets_whole_lines():
    s = io.StringIO()
    bar = Progress(3, stream=s, tty=False, interval=1e9)
    for i in range(1, 4):
        bar.update(i, loss=2.0, tok_s=5.0)
    bar.close()
    lines = s.getvalue().splitlines()
    assert "\r" not in s.getvalue() and lines and lines[-1].startswith("100%") and "loss 2.000" in lines[-1]
