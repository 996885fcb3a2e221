"""Pretrained checkpoints in and out: initialize(weights=...) against the original tensors,
export_hf against from_pretrained / PeftModel.from_pretrained, PEFT's adapter init, the
model's own init on the meta device, frozen-base references in checkpoints, and each error."""
import json
import os
import sys

import pytest
import torch
from torch import nn

import offload
from offload.io.safetensors import WeightFiles, WeightsError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from _paths import ROOT as REPO  # noqa: E402
OPT = {"optimizer": {"type": "AdamW", "lr": 1e-2}}


def tiny_config(tied=False, layers=3):
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=tied)


def lora_config():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama saved by save_pretrained in many shards (and one tied variant)."""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for tied in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_config(tied))
        d = root / f"llama_tied{int(tied)}"
        model.save_pretrained(d, max_shard_size="20KB")
        (d / "tokenizer_config.json").write_text("{}")
        out[tied] = (str(d), model)
    return out


def meta_llama(tied=False):
    with torch.device("meta"):
        return LlamaForCausalLM(tiny_config(tied))


def batch(seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (2, 12), generator=g)


def train(engine, steps=2, **kw):
    x = batch()
    for _ in range(steps):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()


# ---- loading ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["dir", "index", "single", "torch", "bf16"])
def test_loads_every_tensor_equal(pretrained, tmp_path, layout):
    d, ref = pretrained[False]
    shards = [f for f in os.listdir(d) if f.endswith(".safetensors")]
    assert len(shards) > 3                          # save_pretrained really sharded it
    path = {"dir": d, "index": os.path.join(d, "model.safetensors.index.json")}.get(layout)
    expect = ref.state_dict()
    if layout == "single":
        ref.save_pretrained(tmp_path)               # one model.safetensors
        path = str(tmp_path / "model.safetensors")
    elif layout == "torch":
        path = str(tmp_path / "weights.pt")
        torch.save(ref.state_dict(), path)
    elif layout == "bf16":                          # a bf16 checkpoint into fp32 masters + bf16 compute
        from safetensors.torch import save_file
        expect = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
        path = str(tmp_path / "model.safetensors")
        save_file({k: v.contiguous() for k, v in expect.items()}, path)
        expect = {k: v.float() for k, v in expect.items()}
    model = meta_llama()
    model.eval()                                    # the mode the user left it in stays
    engine = offload.initialize(model, {**OPT, "precision": "bf16" if layout == "bf16" else "fp32"}, weights=path)
    assert not model.training
    got = engine.full_state_dict()
    assert set(got) == set(expect)
    for k, v in expect.items():
        assert torch.equal(got[k], v), k
    if layout == "bf16":                            # the compute copy is the checkpoint's bf16 values
        w = model.model.layers[0].mlp.up_proj.weight
        assert w.dtype == torch.bfloat16
        assert torch.equal(w.float(), expect["model.layers.0.mlp.up_proj.weight"])
    for n, b in ref.named_buffers():                # non-persistent rotary buffers recomputed
        mine = dict(model.named_buffers())[n]       # (the engine keeps buffers in the compute dtype)
        assert torch.equal(mine, b.to(mine.dtype)), n
    x = batch()
    with torch.no_grad():
        assert engine(input_ids=x).logits.shape == (2, 12, 96)
    engine.close()


def test_tied_lm_head_comes_through_the_tie(pretrained):
    d, ref = pretrained[True]
    assert "lm_head.weight" not in WeightFiles(d).keys()
    model = meta_llama(tied=True)
    engine = offload.initialize(model, OPT, weights=d)
    got = engine.full_state_dict()
    assert torch.equal(got["lm_head.weight"], ref.model.embed_tokens.weight)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    engine.close()


def test_key_map_and_prefix(pretrained, tmp_path):
    d, ref = pretrained[False]
    from safetensors.torch import save_file
    save_file({"transformer." + k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "m.safetensors"))
    model = meta_llama()
    engine = offload.initialize(model, OPT, weights=str(tmp_path / "m.safetensors"),
                                key_map=lambda k: k[len("transformer."):])
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
    engine.close()


def test_meta_without_weights_gets_the_models_own_init():
    cfg = tiny_config()
    cfg.initializer_range = 0.5                     # far from what reset_parameters() would give
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine = offload.initialize(model, OPT)
    sd = engine.full_state_dict()
    w = sd["model.layers.0.mlp.up_proj.weight"]     # HF _init_weights: N(0, initializer_range)
    bound = 1 / w.shape[1] ** 0.5                   # nn.Linear.reset_parameters: U(-bound, bound)
    assert w.abs().max() > 3 * bound and abs(w.std().item() - 0.5) < 0.1
    assert torch.equal(sd["model.norm.weight"], torch.ones(32))
    ref = LlamaForCausalLM(cfg)
    for n, b in ref.named_buffers():
        assert torch.equal(dict(model.named_buffers())[n], b), n
    engine.close()

    from offload.models.gpt import GPT, GPTConfig   # offload's GPT: its scaled residual init
    with torch.device("meta"):
        gpt = GPT(GPTConfig(n_layer=8, n_embd=64, n_head=2, block_size=16))
    engine = offload.initialize(gpt, OPT)
    sd = engine.full_state_dict()
    small, plain = sd["blocks.0.mlp.2.weight"].std().item(), sd["blocks.0.mlp.0.weight"].std().item()
    assert abs(plain - 0.02) < 0.002 and abs(small - 0.02 / 4) < 0.0005
    engine.close()


# ---- PEFT -----------------------------------------------------------------------------------
def test_peft_lora_base_from_safetensors_adapters_get_peft_init(pretrained):
    d, ref = pretrained[False]
    with torch.device("meta"):
        pm = get_peft_model(LlamaForCausalLM(tiny_config()), lora_config())
    torch.manual_seed(11)
    engine = offload.initialize(pm, OPT, weights=d)
    got = engine.full_state_dict()
    # the reference: PEFT's own reset_lora_parameters, in module order, from the same seed
    expect = get_peft_model(LlamaForCausalLM(tiny_config()), lora_config())
    torch.manual_seed(11)
    from peft.tuners.lora import LoraLayer
    for m in expect.modules():
        if isinstance(m, LoraLayer):
            m.reset_lora_parameters("default", True)
    esd = expect.state_dict()
    lora_keys = [k for k in got if ".lora_" in k]
    assert len(lora_keys) == 12
    for k in lora_keys:
        assert torch.equal(got[k], esd[k]), k
        if ".lora_B." in k:
            assert not got[k].any()
    base = ref.state_dict()
    for k, v in got.items():
        if ".lora_" not in k:
            ck = k.replace("base_model.model.", "", 1).replace(".base_layer.", ".")
            assert torch.equal(v, base[ck]), k
    engine.close()


def test_peft_adapter_and_merged_export(pretrained, tmp_path):
    d, ref = pretrained[False]
    with torch.device("meta"):
        pm = get_peft_model(LlamaForCausalLM(tiny_config()), lora_config())
    engine = offload.initialize(pm, {**OPT, "offload_optimizer": {"device": "cpu"}}, weights=d)
    train(engine, steps=3)
    engine.save_checkpoint(str(tmp_path / "ck"))
    sd = engine.full_state_dict()
    assert any(v.abs().sum() > 0 for k, v in sd.items() if ".lora_B." in k)   # it trained

    # the frozen base is referenced, not copied
    meta = json.loads((tmp_path / "ck" / "meta.json").read_text())
    extra = torch.load(tmp_path / "ck" / "extra.pt", weights_only=False)["tensors"]
    base_keys = [k for k, loc in meta["keys"].items() if loc.get("base")]
    assert len(base_keys) == len([k for k in sd if ".lora_" not in k]) and not set(base_keys) & set(extra)
    assert set(meta["base"]["files"]) <= {os.path.join(d, f) for f in os.listdir(d)}
    assert meta["hf"]["peft"]["default"]["r"] == 4 and meta["hf"]["config"]["hidden_size"] == 32

    out = offload.export_hf(tmp_path / "ck", tmp_path / "adapter")
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer_config.json"} <= set(os.listdir(out))
    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(d), out)
    lsd = loaded.state_dict()
    assert set(lsd) == set(sd)
    for k, v in sd.items():
        assert torch.equal(lsd[k], v), k

    out = offload.export_hf(tmp_path / "ck", tmp_path / "merged", peft="merged", max_shard_bytes=30000)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    expect = loaded.merge_and_unload().state_dict()
    assert set(merged) == set(expect)
    for k, v in expect.items():
        assert torch.equal(merged[k], v), k
    engine.close()


def test_frozen_base_reference_verified_on_load(pretrained, tmp_path):
    import shutil
    d0, _ = pretrained[False]
    d = tmp_path / "base"
    shutil.copytree(d0, d)
    with torch.device("meta"):
        pm = get_peft_model(LlamaForCausalLM(tiny_config()), lora_config())
    engine = offload.initialize(pm, OPT, weights=str(d))
    train(engine, steps=2)
    engine.save_checkpoint(str(tmp_path / "ck"))
    sd = engine.full_state_dict()
    engine.close()

    fresh = get_peft_model(LlamaForCausalLM(tiny_config()), lora_config())   # a different random base
    e2 = offload.initialize(fresh, OPT)
    e2.load_checkpoint(str(tmp_path / "ck"))
    got = e2.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    e2.close()
    assert all(torch.equal(offload.export_fp32(str(tmp_path / "ck"))[k], v) for k, v in sd.items())

    meta = json.loads((tmp_path / "ck" / "meta.json").read_text())
    ref = meta["base"]["tensors"]["base_model.model.model.layers.1.mlp.up_proj.weight"]
    ext = WeightFiles(str(d)).extent(ref["key"])
    with open(ext.file, "r+b") as f:                # one changed byte in a referenced tensor
        f.seek(ext.offset + 5)
        b = f.read(1)
        f.seek(ext.offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    e3 = offload.initialize(get_peft_model(LlamaForCausalLM(tiny_config()), lora_config()), OPT)
    with pytest.raises(WeightsError, match=r"model.layers.1.mlp.up_proj.weight' fails its crc32c? check"):
        e3.load_checkpoint(str(tmp_path / "ck"))
    with open(ext.file, "ab") as f:
        f.write(b"x")
    with pytest.raises(WeightsError, match=r"which now holds .* replaced since the checkpoint was saved"):
        e3.load_checkpoint(str(tmp_path / "ck"))
    e3.close()


# ---- export of a fully trained model ------------------------------------------------------------
@pytest.mark.parametrize("offload_param", ["none", "nvme"])
def test_export_hf_loads_with_from_pretrained(pretrained, tmp_path, offload_param, capsys):
    d, _ = pretrained[True]
    cfg = {**OPT, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    if offload_param != "none":
        cfg["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    engine = offload.initialize(meta_llama(tied=True), cfg, weights=d)
    train(engine, steps=2)
    engine.save_checkpoint(str(tmp_path / "ck"))
    sd = engine.full_state_dict()
    engine.close()
    from offload import cli
    assert cli.main(["export", str(tmp_path / "ck"), str(tmp_path / "hf"), "--format", "hf",
                     "--max-shard-size", "40000"]) == 0
    assert "wrote" in capsys.readouterr().out
    files = os.listdir(tmp_path / "hf")
    assert len([f for f in files if f.endswith(".safetensors")]) > 1 and "model.safetensors.index.json" in files
    assert {"config.json", "tokenizer_config.json", "generation_config.json"} <= set(files)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    assert set(loaded) == set(sd)
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k
    # dtype= converts, the default keeps the training dtype (fp32 masters)
    offload.export_hf(tmp_path / "ck", tmp_path / "hf16", dtype=torch.bfloat16)
    f16 = WeightFiles(str(tmp_path / "hf16"))
    assert {f16.dtype(k) for k in f16.keys()} == {torch.bfloat16}
    assert {WeightFiles(str(tmp_path / "hf")).dtype(k) for k in loaded if k != "lm_head.weight"} == {torch.float32}


# ---- errors ------------------------------------------------------------------------------------
def _write(path, sd):
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return str(path)


def test_missing_key_is_named(pretrained, tmp_path):
    _, ref = pretrained[False]
    sd = dict(ref.state_dict())
    del sd["model.layers.1.self_attn.k_proj.weight"]
    p = _write(tmp_path / "m.safetensors", sd)
    with pytest.raises(WeightsError, match=r"missing key in .*m\.safetensors: model\.layers\.1\.self_attn\.k_proj"
                                           r"\.weight: .*key_map.*init_fn"):
        offload.initialize(meta_llama(), OPT, weights=p)


def test_unexpected_key_is_named(pretrained, tmp_path):
    _, ref = pretrained[False]
    sd = dict(ref.state_dict(), **{"model.layers.9.mlp.up_proj.weight": torch.zeros(2)})
    p = _write(tmp_path / "m.safetensors", sd)
    with pytest.raises(WeightsError, match=r"unexpected key in .*: model\.layers\.9\.mlp\.up_proj\.weight: the model "
                                           r"has no such parameter"):
        offload.initialize(meta_llama(), OPT, weights=p)


def test_shape_mismatch_is_named(pretrained, tmp_path):
    _, ref = pretrained[False]
    sd = dict(ref.state_dict())
    sd["model.norm.weight"] = torch.ones(31)
    p = _write(tmp_path / "m.safetensors", sd)
    with pytest.raises(WeightsError, match=r"shape mismatch .*model\.norm\.weight: the checkpoint has shape \[31\], "
                                           r"the model's model\.norm\.weight has \[32\]"):
        offload.initialize(meta_llama(), OPT, weights=p)


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(4))    # no reset_parameters, no model _init_weights

    def forward(self, x):
        return x * self.gain


def test_uncovered_parameter_is_named(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())
    with pytest.raises(WeightsError, match=r"no initialisation covers '1\.gain': .*pass init_fn"):
        offload.initialize(model, OPT)
    p = _write(tmp_path / "m.safetensors", {"0.weight": torch.ones(4, 4), "0.bias": torch.zeros(4)})
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())
    with pytest.raises(WeightsError, match=r"no initialisation covers '1\.gain'"):   # init_fn that misses it
        offload.initialize(model, OPT, weights=p, init_fn=lambda m: None)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _Scale())

    def init_fn(m):
        if isinstance(m, _Scale):
            nn.init.constant_(m.gain, 2.0)
    engine = offload.initialize(model, OPT, weights=p, init_fn=init_fn)
    sd = engine.full_state_dict()
    assert torch.equal(sd["1.gain"], torch.full((4,), 2.0)) and torch.equal(sd["0.weight"], torch.ones(4, 4))
    engine.close()


def test_bad_paths_are_named(tmp_path):
    with pytest.raises(WeightsError, match="does not exist"):
        offload.initialize(meta_llama(), OPT, weights=str(tmp_path / "nope"))
    with pytest.raises(WeightsError, match="holds no model.safetensors"):
        offload.initialize(meta_llama(), OPT, weights=str(tmp_path))
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(WeightsError, match="not a safetensors file"):
        offload.initialize(meta_llama(), OPT, weights=str(tmp_path / "bad.safetensors"))


# ---- host memory -------------------------------------------------------------------------------
@pytest.mark.parametrize("heap_hole_mib", [0, 512])
def test_loading_rss_does_not_grow_with_the_checkpoint(tmp_path, heap_hole_mib):
    """A deep model's checkpoint (four times the shallow one's layers) loads to NVMe with the
    same peak RSS rise: host memory holds a few blocks, never the model (a fresh process).
    Also when the heap already holds a large free hole, as building the model under
    accelerate's ``init_empty_weights`` leaves one: the load's transient copies are served
    from it and stayed resident block after block (before each block's trim, the deep load
    rose by 1.1x ``extra`` more than the shallow one)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import bench_load
    finally:
        sys.path.pop(0)
    shallow, deep = bench_load.rss_rise(512, [2, 8], 1376, 1024, str(tmp_path), heap_hole_mib=heap_hole_mib)
    extra = deep["checkpoint_bytes"] - shallow["checkpoint_bytes"]     # 6 layers of bf16: ~38 MB
    assert deep["bytes_read"] == deep["checkpoint_bytes"]
    # holding the deep model's extra checkpoint bytes would add at least 1.0x ``extra`` (its
    # fp32 masters 2.0x); what remains is heap fragmentation from sub-4-MiB tensors (a few MB)
    assert deep["rise"] - shallow["rise"] < 0.5 * extra, (shallow, deep)
