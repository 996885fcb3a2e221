"""`offload estimate` / `offload plan` for fine-tuning: LoRA and trainable-parameter flags, the
placements the engine refuses, and the peak host RSS terms, checked against PEFT's own
parameter counts, the engine's own pools and autograd's own saved tensors."""
import json

import pytest
import torch

from offload.planner import estimate as est
from offload.planner import rss
from _cli import error_line, run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
         "max_position_embeddings": 64, "tie_word_embeddings": False}
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    (d / "config.json").write_text(json.dumps(LLAMA))
    return str(d)


def peft_model():
    """The same model as PEFT builds it for real (on the CPU, not on the meta device)."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in LLAMA.items()
                                                                     if k not in ("architectures", "model_type")}))
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))


def test_lora_rank_counts_peft_trainable_parameters(hf_dir, capsys):
    code, out, err = run(["estimate", "--hf-config", hf_dir, "--lora-rank", "4", "--lora-targets", ",".join(TARGETS),
                          "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    real = peft_model()
    assert d["model"]["trainable"] == sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert d["model"]["params"] == sum(p.numel() for p in real.parameters())
    # the frozen base has no optimizer state and no gradient: optimizer state (12 bytes) and
    # parked bf16 gradients (2) on NVMe follow the adapters only, each block page-rounded
    code, out, _ = run(["estimate", "--hf-config", hf_dir, "--json"], capsys)
    base = json.loads(out)
    assert base["model"]["params"] == d["model"]["params"] - d["model"]["trainable"]     # the base, frozen
    full = {(r["optimizer"], r["param"]): r for r in base["placements"]}
    lora = {(r["optimizer"], r["param"]): r for r in d["placements"]}
    pages = 2 * 4096 * (LLAMA["num_hidden_layers"] + 3)
    assert 14 * d["model"]["trainable"] <= lora["nvme", "none"]["nvme"] <= 14 * d["model"]["trainable"] + pages
    assert 14 * base["model"]["params"] <= full["nvme", "none"]["nvme"] <= 14 * base["model"]["params"] + pages


def test_frozen_in_place_leaves_the_base_out_of_the_swap_file(hf_dir, capsys):
    base = ["estimate", "--hf-config", hf_dir, "--lora-rank", "4", "--json"]
    copied = {(r["optimizer"], r["param"]): r["nvme"] for r in json.loads(run(base, capsys)[1])["placements"]}
    in_place = {(r["optimizer"], r["param"]): r["nvme"]
                for r in json.loads(run(base + ["--frozen-in-place"], capsys)[1])["placements"]}
    frozen = peft_model()
    frozen_bytes = sum(p.numel() * 2 for p in frozen.parameters() if not p.requires_grad)   # bf16
    gap = copied["nvme", "nvme"] - in_place["nvme", "nvme"]
    assert frozen_bytes <= gap <= frozen_bytes + 4096 * 2 * (LLAMA["num_hidden_layers"] + 3)


def test_trainable_params_flag(capsys):
    code, out, err = run(["estimate", "--params", "1e9", "--largest-layer", "5e7", "--trainable-params", "1e7",
                          "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["model"]["trainable"] == 10_000_000
    rows = {(r["optimizer"], r["param"]): r for r in d["placements"]}
    full = {(r["optimizer"], r["param"]): r for r in json.loads(run(
        ["estimate", "--params", "1e9", "--largest-layer", "5e7", "--json"], capsys)[1])["placements"]}
    # cpu optimizer state: 12 bytes per trained parameter, in the host pool
    assert full["cpu", "nvme"]["pinned"] - rows["cpu", "nvme"]["pinned"] >= 12 * (1e9 - 1e7)


@pytest.mark.parametrize("argv, expect", [
    (["--params", "1e9", "--lora-rank", "8"], "--lora-rank needs the model's modules"),
    (["--params", "1e9", "--trainable-params", "2e9"], "--trainable-params=2000000000.0 must be > 0 and <="),
    (["--params", "1e9", "--trainable-params", "1e6", "--lora-rank", "4"], "not both"),
    (["--params", "1e9", "--frozen-in-place"], "--frozen-in-place counts frozen parameters"),
])
def test_finetune_flag_errors(argv, expect, capsys):
    assert expect in error_line(["estimate"] + argv, capsys)


def test_lora_targets_not_in_the_model(hf_dir, capsys):
    line = error_line(["estimate", "--hf-config", hf_dir, "--lora-rank", "4", "--lora-targets", "c_attn"], capsys)
    assert "--lora-targets c_attn" in line and "q_proj" in line and "down_proj" in line
    assert "--lora-rank=0 must be >= 1" in error_line(["estimate", "--hf-config", hf_dir, "--lora-rank", "0"], capsys)


def test_int8_state_on_the_device_is_marked_refused_with_the_engines_reason(tmp_path, capsys):
    import offload
    from offload.config import ConfigError
    with pytest.raises(ConfigError) as exc:
        offload.initialize(torch.nn.Linear(4, 4), {"optimizer": {"state_dtype": "int8"},
                                                    "offload_optimizer": {"device": "none"},
                                                    "offload_param": {"device": "none"}})
    code, out, err = run(["estimate", "--params", "1e8", "--state-dtype", "int8", "--nvme-path", str(tmp_path)], capsys)
    assert code == 0, err
    rows = [ln.split() for ln in out.splitlines() if ln.strip().split(" ")[0] in est.TIERS]
    assert len(rows) == 9
    for r in rows:
        assert ("refused by the engine" in " ".join(r)) == (r[0] == "none"), r
    assert str(exc.value) in out
    d = json.loads(run(["estimate", "--params", "1e8", "--state-dtype", "int8", "--json"], capsys)[1])
    assert all((p["refused"] == str(exc.value)) == (p["optimizer"] == "none") for p in d["placements"])
    # a rule / state dtype no placement runs is an error line, as initialize's
    assert "Adafactor keeps its factored second moment in fp32" in error_line(
        ["estimate", "--params", "1e8", "--optimizer", "Adafactor", "--state-dtype", "bf16"], capsys)


def test_rss_pools_are_the_engines_and_activations_are_autogrades(hf_dir, tmp_path, capsys):
    """The RSS terms against what the engine allocates (its pools, by name) and what autograd
    saves in a real CPU forward of the same model."""
    import offload
    budget = 1 << 20
    code, out, err = run(["estimate", "--hf-config", hf_dir, "--lora-rank", "4", "--lora-targets", ",".join(TARGETS),
                          "--placement", "nvme/nvme", "--precision", "fp32", "--buffer-count", "2",
                          "--device-budget-bytes", str(budget), "--host-lookahead-bytes", str(budget),
                          "--baseline-bytes", "100MiB", "--batch-size", "2", "--seq-len", "16", "--json"], capsys)
    assert code == 0, err
    terms = json.loads(out)["peak_rss"]["terms"]
    assert terms["baseline"] == 100 << 20
    model = peft_model()
    x = torch.randint(0, LLAMA["vocab_size"], (2, 16))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=x, labels=x).loss
    assert terms["activations"] == sum(saved.values())
    cfg = {"precision": "fp32", "optimizer": {"lr": 1e-3},
           "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2},
           "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "device_budget_bytes": budget},
           "prefetch": {"host_lookahead_bytes": budget}}
    engine = offload.initialize(model, cfg)
    try:
        pools = engine.stats()["host_pools"]
    finally:
        engine.close()
    assert {k[5:]: v for k, v in terms.items() if k.startswith("pool ")} == \
        {k: v["capacity_bytes"] for k, v in pools.items()}
    assert sum(terms.values()) == json.loads(out)["peak_rss"]["total_bytes"]


def test_baseline_is_a_fresh_interpreters_rss():
    import psutil
    n = rss.measure_baseline(("torch",))
    assert 50 << 20 < n < psutil.Process().memory_info().rss + (200 << 20)
    with pytest.raises(RuntimeError, match="no_such_module"):
        rss.measure_baseline(("no_such_module",))


def test_plan_with_lora_prints_the_rss_of_a_placement(hf_dir, tmp_path, capsys):
    from offload.planner.measure import Profile
    prof = Profile(device="cpu", cpu_threads=2, adam_params_per_s=1e9, adam_backend="t", device_adam_params_per_s=1e9,
                   h2d_gbps=8, d2h_gbps=8, host_memcpy_gbps=8, nvme_read_gbps=2, nvme_write_gbps=1,
                   nvme_read_latency_s=0, nvme_write_latency_s=0, nvme_duplex=0.5, io_backend="t",
                   nvme_path=str(tmp_path), matmul_tflops=0.05).save(str(tmp_path / "profile.json"))
    argv = ["plan", "--profile", prof, "--hf-config", hf_dir, "--lora-rank", "4", "--nvme-path", str(tmp_path),
            "--placement", "nvme/nvme", "--baseline-bytes", "100MiB", "--batch-size", "2", "--seq-len", "16",
            "--precision", "bf16"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    trainable = sum(p.numel() for p in peft.get_peft_model(
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in LLAMA.items()
                                                                  if k not in ("architectures", "model_type")})),
        peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])).parameters() if p.requires_grad)
    assert f"{est.human_count(trainable)} trainable" in out
    assert "peak host RSS of the training process at optimizer=nvme param=nvme" in out
    rows = {ln.split()[0] + (" " + ln.split()[1] if ln.split()[0] == "pool" else ""): ln for ln in out.splitlines()
            if ln.startswith("  ") and "GiB" in ln}
    assert {"baseline", "pool offload-param-stage", "pool offload-swap", "activations",
            "predicted"} <= set(rows), rows
    assert "0.098 GiB" in rows["baseline"]          # 100 MiB
