"""Every bad config fails with one line that names the key and the fix; good ones round-trip."""
import json
import os
import subprocess
import warnings

import pytest

from offload.config import Config, ConfigError, from_flags, parse_bytes


def err(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        Config.from_any(cfg)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def path_err(cfg) -> str:
    """Paths are checked at initialize (Config.check_paths), not while the Config is built."""
    built = Config.from_any(cfg)
    with pytest.raises(ConfigError) as e:
        built.check_paths()
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def flag_err(argv) -> str:
    with pytest.raises(ConfigError) as e:
        from_flags(argv)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ---- a genuinely read-only directory ----------------------------------------------------------
@pytest.fixture(scope="module")
def readonly_dir(tmp_path_factory):
    """A read-only bind mount (root ignores mode bits, so chmod would not do); where mount is not
    permitted, /sys, which refuses new files even to root."""
    src = tmp_path_factory.mktemp("ro-src")
    dst = tmp_path_factory.mktemp("ro-dst")
    mounted = False
    try:
        subprocess.run(["mount", "--bind", str(src), str(dst)], check=True, capture_output=True)
        mounted = True
        subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], check=True, capture_output=True)
        yield str(dst)
    except (OSError, subprocess.CalledProcessError):
        yield "/sys"
    finally:
        if mounted:
            subprocess.run(["umount", str(dst)], capture_output=True)


def test_readonly_dir_is_really_readonly(readonly_dir):
    with pytest.raises(OSError):
        open(os.path.join(readonly_dir, "probe"), "w").close()


# ---- unknown and misspelled keys ------------------------------------------------------------------
@pytest.mark.parametrize("cfg, names, nearest", [
    ({"offload_optimzer": {"device": "cpu"}}, "'offload_optimzer'", "'offload_optimizer'"),
    ({"offload_optimizer": {"devce": "cpu"}}, "'offload_optimizer.devce'", "'offload_optimizer.device'"),
    ({"optimizer": {"lrr": 1e-3}}, "'optimizer.lrr'", "'optimizer.lr'"),
    ({"aio": {"queue_dept": 8}}, "'aio.queue_dept'", "'aio.queue_depth'"),
    ({"precison": "bf16"}, "'precison'", "'precision'"),
    ({"gradient_acumulation_steps": 2}, "'gradient_acumulation_steps'", "'gradient_accumulation_steps'"),
])
def test_unknown_key_names_nearest(cfg, names, nearest):
    msg = err(cfg)
    assert names in msg and f"did you mean {nearest}" in msg


def test_unknown_key_without_near_match_lists_valid_keys():
    msg = err({"zzz": 1})
    assert "'zzz'" in msg and "valid keys:" in msg and "offload_optimizer" in msg


@pytest.mark.parametrize("cfg, names, nearest", [
    ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae", "'zero_optimization.stage'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_optimizer.pin_memroy", "'zero_optimization.offload_optimizer.pin_memory'"),
    ({"train_batch_size": 8, "gradient_clippin": 1.0}, "gradient_clippin", "'gradient_clipping'"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 100}}, "fp16.loss_scale_windw", "'fp16.loss_scale_window'"),
])
def test_deepspeed_misspelled_key_fails(cfg, names, nearest):
    msg = err(cfg)
    assert names in msg and f"did you mean {nearest}" in msg


def test_deepspeed_ignored_keys_named_in_one_warning(tmp_path):
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "gradient_clipping": 1.0, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                    "weight_decay": 0.1}},
          "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path),
                                                      "pin_memory": True, "buffer_count": 5,
                                                      "fast_init": False}},
          "aio": {"block_size": 1048576, "queue_depth": 16, "thread_count": 2, "single_submit": False}}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = Config.from_any(ds)
    assert len(w) == 1
    text = str(w[0].message)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization.contiguous_gradients",
                "zero_optimization.overlap_comm", "zero_optimization.offload_optimizer.fast_init",
                "aio.single_submit"):
        assert key in text
    assert cfg.precision == "bf16" and cfg.gradient_accumulation_steps == 2 and cfg.gradient_clipping == 1.0
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.betas == (0.9, 0.95) and cfg.optimizer.weight_decay == 0.1
    assert cfg.offload_optimizer.device == "nvme" and cfg.offload_optimizer.buffer_count == 5
    assert cfg.zero_optimization.stage == 2 and cfg.aio.queue_depth == 16 and cfg.aio.thread_count == 2


def test_deepspeed_fp16_loss_scaler_translated():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = Config.from_any({"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 200,
                                        "min_loss_scale": 2, "hysteresis": 2}})
    assert cfg.precision == "fp16"
    assert cfg.loss_scaler.initial_scale == 4096.0 and cfg.loss_scaler.growth_interval == 200
    assert cfg.loss_scaler.min_scale == 2


# ---- invalid values ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, key, fix", [
    ({"offload_param": {"device_budget_bytes": -1}}, "offload_param.device_budget_bytes", "> 0"),
    ({"aio": {"block_size": -4096}}, "aio.block_size", "> 0"),
    ({"aio": {"block_size": 1000}}, "aio.block_size", "multiple of 4096"),
    ({"aio": {"queue_depth": 0}}, "aio.queue_depth", "> 0"),
    ({"offload_optimizer": {"buffer_count": 0}}, "offload_optimizer.buffer_count", "> 0"),
    ({"prefetch": {"host_lookahead_bytes": -5}}, "prefetch.host_lookahead_bytes", ">= 0"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps", ">= 1"),
    ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps", "integer"),
    ({"gradient_clipping": -1.0}, "gradient_clipping", ">= 0"),
    ({"optimizer": {"lr": -1e-3}}, "optimizer.lr", ">= 0"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr", "number"),
    ({"optimizer": {"eps": 0}}, "optimizer.eps", "> 0"),
    ({"optimizer": {"betas": 0.9}}, "optimizer.betas", "two numbers"),
    ({"optimizer": {"betas": [0.9, 1.5]}}, "optimizer.betas", "[0, 1)"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type", "'Lion'"),
    ({"optimizer": {"momentum": 0.9}}, "optimizer.momentum", "optimizer.type SGD"),
    ({"optimizer": {"type": "SGD", "nesterov": True}}, "optimizer.nesterov", "momentum > 0"),
    ({"optimizer": {"state_dtype": "fp8"}}, "optimizer.state_dtype", "'int8'"),
    ({"optimizer": {"type": "Adafactor", "eps": 1e-3}}, "optimizer.eps", "pair"),
    ({"optimizer": {"type": "Adagrad", "lr_decay": -1.0}}, "optimizer.lr_decay", ">= 0"),
    ({"precision": "fp8"}, "precision", "'bf16'"),
    ({"offload_optimizer": {"device": "disk"}}, "offload_optimizer.device", "'nvme'"),
    ({"offload_param": {"device": "gpu"}}, "offload_param.device", "'cpu'"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "3"),
    ({"aio": {"backend": "uring"}}, "aio.backend", "'native'"),
    ({"loss_scaler": {"growth_factor": 0.5}}, "growth_factor", "> 1"),
    ({"optimizer_workers": 0}, "optimizer_workers", "> 0"),
    ({"offload_optimizer": "nvme"}, "offload_optimizer", "mapping"),
    ({"offload_optimizer": {"update_ahead": "yes"}}, "offload_optimizer.update_ahead", "true or false"),
    ({"offload_optimizer": {"device": "none", "update_ahead": True}}, "offload_optimizer.device='none'",
     "set update_ahead to false"),
    ({"offload_optimizer": {"update_ahead": True}, "gradient_clipping": 1.0}, "gradient_clipping=1.0",
     "global norm"),
    ({"offload_optimizer": {"update_ahead": True}, "precision": "fp16"}, "precision='fp16'", "overflow"),
])
def test_invalid_value_names_key_and_fix(cfg, key, fix):
    msg = err(cfg)
    assert key in msg and fix in msg, msg


@pytest.mark.parametrize("tier", ["offload_optimizer", "offload_param"])
def test_nvme_without_path(tier):
    msg = err({tier: {"device": "nvme"}})
    assert f"{tier}.nvme_path is required" in msg and "set it to a directory" in msg


@pytest.mark.parametrize("tier", ["offload_optimizer", "offload_param"])
def test_nvme_path_missing(tier, tmp_path):
    msg = path_err({tier: {"device": "nvme", "nvme_path": str(tmp_path / "nope")}})
    assert f"{tier}.nvme_path" in msg and "does not exist" in msg and "create it" in msg


def test_nvme_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    msg = path_err({"offload_optimizer": {"device": "nvme", "nvme_path": str(f)}})
    assert "not a directory" in msg


@pytest.mark.parametrize("tier", ["offload_optimizer", "offload_param"])
def test_nvme_path_not_writable(tier, readonly_dir):
    msg = path_err({tier: {"device": "nvme", "nvme_path": readonly_dir}})
    assert f"{tier}.nvme_path" in msg and "not writable" in msg and "choose a writable directory" in msg


def test_path_is_checked_only_for_nvme(tmp_path):
    cfg = Config.from_any({"offload_optimizer": {"device": "cpu", "nvme_path": str(tmp_path / "nope")}})
    assert cfg.offload_optimizer.device == "cpu"
    cfg.check_paths()


def test_config_construction_does_no_io(tmp_path, monkeypatch):
    """Building a Config (dict, flags, DeepSpeed) touches no file: a missing directory is
    accepted here and refused by check_paths / initialize, with the same message."""
    import builtins
    import tempfile
    d = tmp_path / "swap"
    d.mkdir()
    before = os.stat(d).st_mtime_ns

    root = str(tmp_path)

    def guard(real):
        def call(*a, **k):
            where = a[0] if a else k.get("dir") or k.get("path")
            if root in os.fspath(where if where is not None else ""):
                raise AssertionError(f"Config construction did I/O under the nvme_path: {real.__name__}{a}")
            return real(*a, **k)
        return call
    for mod, name in ((os, "open"), (os, "stat"), (os, "lstat"), (os, "listdir"), (os, "mkdir"),
                      (os, "access"), (builtins, "open"), (tempfile, "NamedTemporaryFile"), (tempfile, "mkstemp")):
        monkeypatch.setattr(mod, name, guard(getattr(mod, name)))
    cfgs = [Config.from_any({t: {"device": "nvme", "nvme_path": str(d)}}) for t in ("offload_optimizer", "offload_param")]
    missing = Config.from_any({"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nope")}})
    flags = from_flags(["--offload-optimizer", "nvme", "--nvme-path", str(tmp_path / "nope")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = Config.from_any({"zero_optimization": {"stage": 1, "offload_param": {"device": "nvme",
                                                                                  "nvme_path": str(d)}}})
    monkeypatch.undo()
    assert os.listdir(d) == [] and os.stat(d).st_mtime_ns == before
    for c in cfgs + [ds]:
        c.check_paths()
    for c in (missing, flags):
        with pytest.raises(ConfigError, match="does not exist"):
            c.check_paths()


def test_initialize_checks_paths(tmp_path):
    import torch
    import offload
    cfg = Config.from_any({"offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="offload_param.nvme_path=.* does not exist"):
        offload.initialize(torch.nn.Linear(4, 4), cfg)


# ---- non-finite and out-of-range hyper-parameters ------------------------------------------------
@pytest.mark.parametrize("key, value", [
    ("optimizer.lr", float("nan")), ("optimizer.lr", float("inf")), ("optimizer.eps", float("nan")),
    ("optimizer.eps", float("inf")), ("optimizer.weight_decay", float("nan")),
    ("optimizer.weight_decay", float("-inf")), ("optimizer.betas", [float("nan"), 0.999]),
    ("optimizer.betas", [0.9, float("inf")]), ("gradient_clipping", float("nan")),
    ("gradient_clipping", float("inf")), ("loss_scaler.initial_scale", float("inf")),
    ("loss_scaler.initial_scale", float("nan")), ("loss_scaler.growth_factor", float("inf")),
    ("loss_scaler.backoff_factor", float("nan")), ("loss_scaler.min_scale", float("nan")),
])
def test_non_finite_value_names_key(key, value):
    d = {}
    *path, leaf = key.split(".")
    sec = d
    for p in path:
        sec = sec.setdefault(p, {})
    sec[leaf] = value
    msg = err(d)
    assert f"{key}=" in msg and "finite" in msg, msg
    # the same through the command line's --set
    assert f"{key}=" in flag_err(["--set", f"{key}={json.dumps(value)}"])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_timeout(value):
    from offload.config import ZeroConfig
    with pytest.raises(ConfigError, match="zero_optimization.timeout_s=.* must be a finite number"):
        ZeroConfig(timeout_s=value)


def test_loss_scaler_min_above_initial():
    msg = err({"loss_scaler": {"initial_scale": 8.0, "min_scale": 16.0}})
    assert "loss_scaler.min_scale" in msg and "initial_scale" in msg


@pytest.mark.parametrize("group, key", [({"lr": float("nan")}, "lr"), ({"lr": -1.0}, "lr"),
                                        ({"betas": (0.9, float("inf"))}, "betas"), ({"eps": 0.0}, "eps"),
                                        ({"weight_decay": float("nan")}, "weight_decay")])
def test_param_group_hparams_checked_at_initialize(group, key):
    import torch
    import offload
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    groups = [{"params": list(m[0].parameters())}, dict(group, params=list(m[1].parameters()))]
    with pytest.raises(ConfigError) as e:
        offload.initialize(m, {"offload_optimizer": {"device": "cpu"}}, param_groups=groups)
    assert f"param_groups[1].{key}=" in str(e.value), str(e.value)


def test_json_file_errors(tmp_path):
    assert "does not exist" in err(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not valid JSON" in err(str(bad))


def test_not_a_config():
    assert "must be a dict" in err(42)


# ---- good configs ---------------------------------------------------------------------------------
def test_round_trip_stays_native(tmp_path):
    cfg = Config.from_any({"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                           "zero_optimization": {"stage": 0}, "precision": "bf16"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # a native dict must not be taken for DeepSpeed
        again = Config.from_dict(cfg.to_dict())
    assert again == cfg


def test_json_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"optimizer": {"lr": 5e-4}, "gradient_accumulation_steps": 4}))
    cfg = Config.from_any(str(p))
    assert cfg.optimizer.lr == 5e-4 and cfg.gradient_accumulation_steps == 4


# ---- flags ----------------------------------------------------------------------------------------
def test_flags_to_config(tmp_path):
    cfg = Config.from_flags(["--offload-optimizer", "nvme", "--offload-param", "nvme", "--nvme-path", str(tmp_path),
                             "--lr", "3e-4", "--betas", "0.9,0.95", "--precision", "bf16",
                             "--gradient-accumulation-steps", "2", "--device-budget", "1GiB",
                             "--aio-block-size", "2MiB", "--no-pin-memory", "--no-overlap-step",
                             "--set", "prefetch.host_lookahead_bytes=1000000", "--set", "blocks=[\"a\", \"b\"]"])
    assert cfg.offload_optimizer.device == cfg.offload_param.device == "nvme"
    assert cfg.offload_optimizer.nvme_path == cfg.offload_param.nvme_path == str(tmp_path)
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.betas == (0.9, 0.95) and cfg.precision == "bf16"
    assert cfg.gradient_accumulation_steps == 2 and cfg.offload_param.device_budget_bytes == 1 << 30
    assert cfg.aio.block_size == 2 << 20 and not cfg.offload_optimizer.pin_memory and not cfg.overlap_step
    assert cfg.prefetch.host_lookahead_bytes == 1000000 and cfg.blocks == ("a", "b")


def test_flags_override_config_file(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme"}},
                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}))
    # the file alone would fail (nvme without a path); the flag completes it
    cfg = Config.from_flags(["--config", str(p), "--nvme-path", str(tmp_path), "--lr", "2e-4"])
    assert cfg.offload_optimizer.device == "nvme" and cfg.offload_optimizer.nvme_path == str(tmp_path)
    assert cfg.optimizer.lr == 2e-4


@pytest.mark.parametrize("argv, expect", [
    (["--offload-optimzer", "nvme"], "unknown flag --offload-optimzer: did you mean --offload-optimizer?"),
    (["--set", "optimizer.lrr=1"], "did you mean 'optimizer.lr'"),
    (["--set", "lr"], "must be KEY=VALUE"),
    (["--device-budget=-1GiB"], "--device-budget='-1GiB' must be >= 0"),
    (["--device-budget", "12XB"], "is not a size"),
    (["--lr", "abc"], "--lr='abc' must be a number"),
    (["--buffer-count", "2.5"], "--buffer-count='2.5' must be an integer"),
    (["--betas", "0.9"], "optimizer.betas"),
    (["--offload-optimizer", "nvme"], "offload_optimizer.nvme_path is required"),
    (["--offload-param", "disk"], "offload_param.device='disk' is not valid"),
    (["--config", "/nonexistent/c.json"], "--config '/nonexistent/c.json' does not exist"),
])
def test_bad_flags(argv, expect):
    assert expect in flag_err(argv)


def test_flag_nvme_path_not_writable(readonly_dir):
    with pytest.raises(ConfigError) as e:
        from_flags(["--offload-optimizer", "nvme", "--nvme-path", readonly_dir]).check_paths()
    msg = str(e.value)
    assert "offload_optimizer.nvme_path" in msg and "not writable" in msg


@pytest.mark.parametrize("text, n", [("4096", 4096), (4096, 4096), ("7e9", 7_000_000_000), ("1.5GB", 1_500_000_000),
                                     ("24GiB", 24 << 30), ("512MiB", 512 << 20), ("2k", 2000), ("0", 0)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["-1", "abc", "1.5XB", ""])
def test_parse_bytes_bad(text):
    with pytest.raises(ConfigError):
        parse_bytes(text)


# ---- DeepSpeed optimizer fidelity --------------------------------------------------------------------
@pytest.mark.parametrize("ds_type, params, expect", [
    ("Adam", {}, "AdamW"),                              # DeepSpeed's default adam_w_mode=True
    ("Adam", {"adam_w_mode": True}, "AdamW"),
    ("Adam", {"adam_w_mode": False}, "Adam"),           # L2 added to the gradient
    ("AdamW", {}, "AdamW"),
    ("AdamW", {"adam_w_mode": False}, "AdamW"),          # AdamW is decoupled whatever it says
])
def test_deepspeed_adam_follows_adam_w_mode(ds_type, params, expect):
    ds = {"train_batch_size": 8, "optimizer": {"type": ds_type, "params": dict(params, lr=1e-4, weight_decay=0.1)}}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = Config.from_any(ds)
    assert all("optimizer" not in str(x.message) for x in w)   # honoured keys are not named as ignored
    assert cfg.optimizer.type == expect and cfg.optimizer.weight_decay == 0.1 and cfg.optimizer.lr == 1e-4


@pytest.mark.parametrize("key, value", [("amsgrad", True), ("bias_correction", False)])
def test_deepspeed_adam_options_that_change_the_math_fail(key, value):
    msg = err({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-4, key: value}}})
    assert f"optimizer.params.{key}" in msg and "not supported" in msg


def test_deepspeed_adam_implementation_choices_named_in_warning():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        Config.from_any({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"torch_adam": True,
                                                                                          "fused": True}}})
    assert len(w) == 1 and "optimizer.params.torch_adam" in str(w[0].message) \
        and "optimizer.params.fused" in str(w[0].message)
