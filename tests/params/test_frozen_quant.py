"""A frozen base stored quantized in its home (offload_param.frozen_dtype int8 / nf4,
offload/params/quantized.py): the codec against offload.quantize on whole tensors, LoRA over
the quantized base against a plain PEFT loop over the same dequantized weights (the tolerance
measured as the other parity tests measure it: torch's single-tensor against fused AdamW),
the error and bytes ``stats()`` reports, the config's checks and the memory plan's bytes."""
import pytest
import torch

import offload
from offload import quantize as qz
from offload.config.errors import ConfigError
from offload.core import blocks as blk
from offload.params import quantized
from _models import batches, clone
from _parity import max_diff, noise_bound, parity_bounds, plain_run
from _lora import MIN_NUMEL, base_key_map, dequantized, dequantized_base, engine_run, lora_llama, qcfg, save_base
from _probes import swap_bytes


# ---- the codec ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,double_quant", [("nf4", False), ("nf4", True), ("int8", False)])
def test_codec_equals_offload_quantize_chunk_by_chunk(fmt, double_quant, monkeypatch):
    """The blob holds exactly offload.quantize's codes of each whole tensor even when it is
    quantized in chunks (the chunk shrunk so every tensor spans several, with a short last
    NF4 block and an odd element count); the raw tensors (a norm, a bias) hold their values
    in the kept dtype, the padding zeros."""
    monkeypatch.setattr(quantized, "_CHUNK", 64 * 256 * 2)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(333, 301), torch.nn.LayerNorm(301), torch.nn.Linear(301, 7, bias=False))
    m.requires_grad_(False)
    [(_, _, parts)] = blk.frozen_parts(m, [""], lambda p: torch.bfloat16)
    [part] = parts
    codec = quantized.QuantizedPart.for_part(part, torch.bfloat16, fmt, double_quant, 1000)
    assert [sc.fmt for sc in codec.segments] == [fmt, "raw", "raw", "raw", fmt]
    blob = codec.fill(torch.full((codec.nbytes,), 0xAB, dtype=torch.uint8))
    out = codec.values(blob)
    assert out.dtype == torch.bfloat16 and out.numel() == part.padded_numel
    for sc in codec.segments:
        got = out[sc.offset:sc.offset + sc.numel]
        want = (dequantized(sc.param.data, fmt, double_quant) if sc.fmt != "raw" else sc.param.data).bfloat16()
        assert torch.equal(got, want.reshape(-1)), sc.name
    assert not out[part.numel:].any()
    torch_out = torch.empty_like(out)                     # the torch path (CUDA's) gives the same bits
    codec.dequantize(blob, torch_out, reference=True)
    assert torch.equal(torch_out, out)
    w = m[0].weight
    if fmt == "nf4":
        t = qz.quantize_nf4(w.data, double_quant=double_quant)
        assert torch.equal(codec._nf4(blob, codec.segments[0]).packed, t.packed)
        assert codec.segments[0].nbytes == t.nbytes == quantized.tensor_bytes(w.shape, fmt, double_quant)
    else:
        assert codec.segments[0].nbytes == qz.quantize_int8_rows(w.data).nbytes == quantized.tensor_bytes(w.shape, fmt)
    deq = dequantized(w.data, fmt, double_quant).float()     # the error of the fp32 dequantized values
    err = (deq - w.data).abs().max().item()
    assert codec.segments[0].max_abs_error == pytest.approx(err, rel=1e-6)


def test_tensor_bytes_are_the_issues_formulas():
    n, rows = 4096 * 11008, 4096
    assert quantized.tensor_bytes((rows, n // rows), "nf4") == n // 2 + 4 * n // 64
    assert quantized.tensor_bytes((rows, n // rows), "nf4", True) == n // 2 + n // 64 + 4 * n // (64 * 256)
    assert quantized.tensor_bytes((rows, n // rows), "int8") == n + 4 * rows


# ---- training over the quantized base ---------------------------------------------------------
@pytest.mark.parametrize("param", ["cpu", "nvme"])
@pytest.mark.parametrize("fmt,double_quant", [("nf4", False), ("nf4", True), ("int8", False)])
def test_lora_over_quantized_base_matches_plain_peft(param, fmt, double_quant, tmp_path, monkeypatch):
    """LoRA over the quantized base trains as a plain PEFT loop over the same dequantized
    weights: losses and adapters within twice torch's own single-tensor-vs-fused AdamW
    distance (plus 1e-6), the frozen weights the engine hands back equal to the dequantized
    reference bit for bit, and ``stats()`` reporting each quantized tensor's error and bytes.
    The CPU device dequantizes into flats released blocks gave back (reused in the run)."""
    made = []
    init = quantized.DequantFlats.__init__
    monkeypatch.setattr(quantized.DequantFlats, "__init__", lambda self, n: (made.append(self), init(self, n))[1])
    base = lora_llama()
    data = batches(5, vocab=97)
    ref_model = dequantized_base(base, fmt, double_quant)
    ref, ref_losses = plain_run(clone(ref_model), data)
    fused, fused_losses = plain_run(clone(ref_model), data, fused=True)
    got, stats, _, losses = engine_run(clone(base), data, qcfg(tmp_path, param, fmt, double_quant))
    trainable = [k for k in ref[0] if "lora_" in k]
    bounds = parity_bounds([{k: s[k] for k in trainable} for s in ref], [{k: s[k] for k in trainable} for s in fused])
    for step, (r, g, bound) in enumerate(zip(ref, got, bounds)):
        d = max_diff({k: r[k] for k in trainable}, {k: g[k] for k in trainable})
        assert d <= bound, f"step {step}: adapters differ from plain PEFT by {d}, bound {bound}"
    for step, (a, b, c) in enumerate(zip(ref_losses, losses, fused_losses)):
        assert abs(a - b) <= noise_bound(a, c), (step, a, b, c)
    for k in ref[-1]:
        if "lora_" not in k:                 # the base as the engine holds it: the dequantized values
            assert torch.equal(got[-1][k].to(ref[-1][k].dtype), ref[-1][k]), k
    assert got[-1].keys() == ref[-1].keys()
    fq = stats["frozen_quant"]
    n_quant = sum(1 for n, p in base.named_parameters()
                  if not p.requires_grad and quantized.quantizes(p.shape, p.dtype, fmt, MIN_NUMEL))
    assert fq["frozen_dtype"] == fmt and fq["tensors"] == n_quant > 0
    assert 0 < fq["quantized_bytes"] < fq["compute_bytes"] / (1.5 if fmt == "int8" else 3)
    for name, t in fq["per_tensor"].items():
        assert t["format"] == fmt and t["max_abs_error"] > 0
        assert 0 < t["rel_rms_error"] < (0.02 if fmt == "int8" else 0.2), (name, t)
    moved = max_diff({k: got[-1][k] for k in trainable}, {k: v for k, v in base.state_dict().items() if k in trainable})
    assert moved > 10 * bounds[-1]            # the adapters really trained: the comparison means something
    assert len(made) == 1 and made[0].reused > 0


def test_checkpoint_streamed_into_a_quantized_nvme_home(tmp_path):
    """weights= a safetensors checkpoint with offload_param nvme: the quantized parts are
    quantized as the loader streams them and written to the swap file (not read in place: the
    file holds bf16), at about a quarter of their bf16 bytes; the training equals the plain
    loop over the dequantized base."""
    base = lora_llama()
    ck = save_base(base, tmp_path / "ck")
    data = batches(4, vocab=97)
    ref_model = dequantized_base(base, "nf4")
    ref, ref_losses = plain_run(clone(ref_model), data)
    fused, _ = plain_run(clone(ref_model), data, fused=True)
    model = clone(base)
    with torch.no_grad():                     # the model's own weights are not what trains
        for p in model.parameters():
            if not p.requires_grad:
                p.zero_()
    eng = offload.initialize(model, qcfg(tmp_path, "nvme", "nf4"), weights=ck, key_map=base_key_map)
    got = []
    for x, y in data:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        got.append(dict(eng.full_state_dict()))
    trainable = [k for k in ref[0] if "lora_" in k]
    bounds = parity_bounds([{k: s[k] for k in trainable} for s in ref], [{k: s[k] for k in trainable} for s in fused])
    for r, g, bound in zip(ref, got, bounds):
        assert max_diff({k: r[k] for k in trainable}, {k: g[k] for k in trainable}) <= bound
    for k in ref[-1]:
        if "lora_" not in k:
            assert torch.equal(got[-1][k].to(ref[-1][k].dtype), ref[-1][k]), k
    assert eng._codecs and not set(eng._codecs) & set(eng._made.homes._in_place)   # quantized parts: in the swap file
    frozen_bf16 = sum(p.numel() * 2 for p in base.parameters() if not p.requires_grad)
    assert swap_bytes(eng) < frozen_bf16 / 2
    eng.close()


def test_model_weights_quantized_without_a_checkpoint(tmp_path):
    """No weights=: the model's own frozen tensors are quantized as they are taken; trainable
    parameters, norms and tensors below the threshold stay in the compute dtype."""
    base = lora_llama(layers=2)
    big = {n for n, p in base.named_parameters() if not p.requires_grad and p.dim() == 2}
    eng = offload.initialize(clone(base), qcfg(tmp_path, "cpu", "nf4", frozen_quant_min_numel=5000))
    fq = eng.stats()["frozen_quant"]
    names = {n.removeprefix("m.") for n in fq["per_tensor"]}
    want = {n.removeprefix("m.") for n in big if dict(base.named_parameters())[n].numel() >= 5000}
    assert names == want and all("lora_" not in n and "norm" not in n for n in names)
    assert fq["home_bytes"] < sum(p.numel() * 2 for p in base.parameters() if not p.requires_grad)
    eng.close()


def test_quantized_home_counts_quantized_bytes(tmp_path):
    """The memory plan sizes the parameter homes by the quantized bytes: the host home
    pool shrinks by about the bytes quantization saves."""
    base = lora_llama(layers=2)
    plain = offload.initialize(clone(base), qcfg(tmp_path, "cpu", "compute"))
    quant = offload.initialize(clone(base), qcfg(tmp_path, "cpu", "nf4"))
    saved = quant.stats()["frozen_quant"]
    p0 = plain.plan.pool("offload-param-home").nbytes
    p1 = quant.plan.pool("offload-param-home").nbytes
    assert p1 < p0 - (saved["compute_bytes"] - saved["home_bytes"]) // 2, (p0, p1, saved)
    plain.close()
    quant.close()


# ---- the config ----------------------------------------------------------------------------
@pytest.mark.parametrize("section,match", [
    ({"device": "cpu", "frozen_dtype": "fp4"}, "frozen_dtype='fp4' is not valid"),
    ({"device": "none", "frozen_dtype": "nf4"}, "set offload_param.device"),
    ({"device": "cpu", "frozen_dtype": "int8", "frozen_double_quant": True}, "to 'nf4'"),
    ({"device": "cpu", "frozen_dtype": "nf4", "frozen_double_quant": "yes"}, "true or false"),
    ({"device": "cpu", "frozen_dtype": "nf4", "frozen_quant_min_numel": -1}, "integer >= 0"),
])
def test_bad_frozen_dtype_settings_are_named(section, match):
    with pytest.raises(ConfigError, match=match):
        offload.Config.from_any({"offload_param": section})


def test_frozen_dtype_flag():
    cfg = offload.Config.from_flags(["--offload-param", "cpu", "--frozen-dtype", "nf4"])
    assert cfg.offload_param.frozen_dtype == "nf4"


# ---- estimate / plan / Trainer / export ------------------------------------------------------------
def wide_lora_llama():
    """A LoRA Llama whose linear weights reach the default threshold (frozen_quant_min_numel)."""
    import peft
    import transformers
    conf = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(conf).to(torch.bfloat16)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize("param", ["cpu", "nvme"])
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_estimate_equals_the_engines_quantized_pools(param, fmt, tmp_path, monkeypatch):
    """The estimate of a LoRA model with frozen_dtype counts the quantized homes as the engine
    allocates them (host pools and swap bytes), fewer than with the base in bf16."""
    import tempfile
    from offload.planner import estimate as est
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = wide_lora_llama()
    spec = est.spec_from_module(model, precision="bf16", frozen_dtype=fmt)
    r = est.placement_bytes(spec, "cpu", param, "bf16", buffer_count=2)
    plain = est.placement_bytes(est.spec_from_module(model, precision="bf16"), "cpu", param, "bf16", buffer_count=2)
    cfg = est.plan_config("cpu", param, "bf16", 2, frozen_dtype=fmt)
    eng = offload.initialize(model, cfg)
    tiers = eng.stats()["tier_bytes"]
    h2d, d2h, _ = est.link_bytes(eng.plan)        # two blocks per link, as they travel (frozen parts quantized)
    link = h2d + d2h
    assert link < 2 * 2 * spec.largest_block * est.BYTES_PER_PARAM["bf16"]
    assert r.pinned - link == tiers["host"] and r.nvme == tiers["nvme"]
    assert eng.stats()["frozen_quant"]["tensors"] > 0
    tier = "pinned" if param == "cpu" else "nvme"
    assert getattr(r, tier) < getattr(plain, tier)
    eng.close()


def test_estimate_cli_knows_frozen_dtype(tmp_path, capsys):
    import json
    from _cli import run
    wide_lora_llama().base_model.model.config.save_pretrained(tmp_path)
    got = {}
    for fmt in ("compute", "nf4"):
        code, out, _ = run(["estimate", "--hf-config", str(tmp_path), "--lora-rank", "4", "--frozen-dtype", fmt,
                            "--json"], capsys)
        assert code == 0
        got[fmt] = {(p["optimizer"], p["param"]): p for p in json.loads(out)["placements"]}
    assert got["nf4"]["cpu", "cpu"]["pinned"] < got["compute"]["cpu", "cpu"]["pinned"]
    assert got["nf4"]["nvme", "nvme"]["nvme"] < got["compute"]["nvme", "nvme"]["nvme"]


def test_choose_places_the_quantized_base_on_the_host_when_it_fits():
    """The planner keeps a quantized base offloaded (never 'none', where nothing would be
    quantized), on the host tier when it fits there (a small model: it does)."""
    from offload.planner.choose import choose
    c = choose(wide_lora_llama(), tokens=64, precision="bf16", frozen_dtype="nf4")
    assert c.param == "cpu", c


def test_trainer_offload_config_takes_frozen_dtype(tmp_path):
    from transformers import TrainingArguments
    from offload.hf.config import engine_config
    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
    cfg = engine_config({"offload_param": {"device": "cpu", "frozen_dtype": "nf4", "frozen_double_quant": True}}, args)
    assert cfg.offload_param.frozen_dtype == "nf4" and cfg.offload_param.frozen_double_quant


def test_merged_export_goes_into_the_dequantized_base(tmp_path):
    """export_hf(peft="merged") of a run over an nf4 base merges the adapter into the base as
    the engine held it (dequantized), and says so."""
    from offload.io.export import merged_base_note
    from safetensors.torch import load_file
    model = wide_lora_llama()
    ck = tmp_path / "base"
    model.base_model.model.save_pretrained(ck)
    ref = clone(model)
    eng = offload.initialize(model, qcfg(tmp_path, "cpu", "nf4", frozen_quant_min_numel=1 << 16),
                             weights=str(ck), key_map=lambda k: "base_model.model." + k)
    x = torch.randint(0, 97, (2, 8))
    eng.backward(eng(input_ids=x, labels=x).loss)
    eng.step()
    eng.save_checkpoint(str(tmp_path / "ck"))
    trained = {k: v.clone() for k, v in eng.full_state_dict().items()}
    eng.close()
    out = offload.export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), peft="merged")
    assert "dequantized nf4 base" in merged_base_note(str(tmp_path / "ck"))
    sd = load_file(f"{out}/model.safetensors")
    with torch.no_grad():
        ref.load_state_dict({k: v for k, v in trained.items() if "lora_" in k}, strict=False)
        for n, p in ref.named_parameters():
            if not p.requires_grad and quantized.quantizes(p.shape, p.dtype, "nf4", 1 << 16):
                p.copy_(quantized.round_trip(p.data, "nf4"))
        want = ref.merge_and_unload().state_dict()
    k = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(sd[k].float(), want[k].float(), atol=1e-2, rtol=0)
    mlp = "model.layers.0.mlp.up_proj.weight"                       # no adapter: the dequantized base itself
    assert torch.equal(sd[mlp], want[mlp])


# ---- checkpoints of a quantized base ------------------------------------------------------------
def _steps(eng, data):
    out = []
    for x, y in data:
        eng.backward(eng(x, y))
        eng.step()
        out.append({k: v.clone() for k, v in eng.full_state_dict().items()})
    return out


@pytest.mark.parametrize("param,fmt,double_quant", [("cpu", "nf4", True), ("nvme", "int8", False)])
def test_resume_reads_the_quantized_base_as_stored(param, fmt, double_quant, tmp_path):
    """A base taken from the model's own weights (no weights=) is kept in the checkpoint as
    its blobs, not its dequantized values: a resumed engine (its model's weights zeroed)
    trains on exactly as the first one did, bit for bit, and nothing is quantized twice;
    export_fp32 and a merged export read the base as the engine held it."""
    from offload.io import checkpoint
    base = lora_llama(layers=2)
    data = batches(4, vocab=97)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg = lambda d: qcfg(tmp_path / d, param, fmt, double_quant)   # noqa: E731
    eng = offload.initialize(clone(base), cfg("a"))
    _steps(eng, data[:2])
    ck = eng.save_checkpoint(str(tmp_path / "ck"))
    held = eng.full_state_dict()
    home_bytes = eng.stats()["frozen_quant"]["home_bytes"]
    want = _steps(eng, data[2:])
    eng.close()

    extra = torch.load(f"{ck}/extra.pt", weights_only=False)
    stored = {k for q in extra["quantized"] for k in q["keys"]}
    assert stored and not stored & set(extra["tensors"])          # the blobs, not the values
    assert sum(q["blob"].numel() for q in extra["quantized"]) == home_bytes   # each part's home as it is
    model = clone(base)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    eng = offload.initialize(model, cfg("b"))
    eng.load_checkpoint(ck)
    got = _steps(eng, data[2:])
    eng.close()
    for w, g in zip(want, got):
        for k in w:
            assert torch.equal(w[k], g[k]), k

    fp32 = checkpoint.export_fp32(ck)
    for k in stored:
        assert torch.equal(fp32[k], held[k].float()), k
    from safetensors.torch import load_file
    out = offload.export_hf(ck, str(tmp_path / "merged"), peft="merged")
    sd = load_file(f"{out}/model.safetensors")
    mlp = "layers.0.mlp.up_proj.weight"                           # no adapter: the base as it trained
    (a,), (b,) = [k for k in sd if k.endswith(mlp)], [k for k in held if k.endswith(mlp)]
    assert torch.equal(sd[a].float(), held[b].float())


def test_resume_into_another_frozen_dtype_quantizes_the_stored_values(tmp_path):
    """A checkpoint of an nf4 base resumed by an engine storing int8: the stored blobs are
    dequantized and the engine quantizes those values its own way (said by the result: the
    base equals int8's round trip of the nf4 values)."""
    base = lora_llama(layers=2)
    eng = offload.initialize(clone(base), qcfg(tmp_path / "a", "cpu", "nf4"))
    ck = eng.save_checkpoint(str(tmp_path / "ck"))
    held = eng.full_state_dict()
    eng.close()
    eng = offload.initialize(clone(base), qcfg(tmp_path / "b", "cpu", "int8"))
    eng.load_checkpoint(ck)
    got = eng.full_state_dict()
    eng.close()
    k = "m.base_model.model.model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(got[k], held[k])
    assert torch.equal(got[k], quantized.round_trip(held[k].to(torch.bfloat16), "int8").float())   # a bf16 base


def test_plan_prices_the_quantized_base():
    """``plan.predict`` with a base stored quantized: the links and the disk carry its
    quantized bytes, and the dequantization of every fetched element is a term of the
    compute device at the measured rate (none without a measured rate)."""
    import dataclasses
    from offload.planner import estimate as est
    from offload.planner import plan
    from offload.planner.predict import quantized_bytes
    from _profile import GPU, profile
    with torch.device("meta"):
        model = wide_lora_llama()
    spec = {fmt: est.spec_from_module(model, "m", "bf16", frozen_dtype=fmt) for fmt in ("compute", "nf4")}
    prof = profile(dequant_params_per_s={"nf4": 1e9})
    qc, qh = quantized_bytes(spec["nf4"], "bf16")
    assert qc > 2 * qh > 0
    for param, link in (("cpu", "h2d"), ("nvme", "nvme")):
        p = {fmt: plan.predict(spec[fmt], "cpu", param, prof, GPU, "bf16", device_budget_bytes=1 << 40)
             for fmt in spec}
        assert "dequant" not in p["compute"].terms
        assert p["nf4"].terms["dequant"] == pytest.approx(qc / 2 / 1e9)   # the budget holds it all: once
        assert p["nf4"].groups["device"] == pytest.approx(p["compute"].groups["device"] + p["nf4"].terms["dequant"])
        if param == "nvme":
            assert p["compute"].io["param_read"] - p["nf4"].io["param_read"] == qc - qh
        else:
            assert p["compute"].terms["h2d"] - p["nf4"].terms["h2d"] == pytest.approx(2 * (qc - qh) / 20e9)
    unmeasured = plan.predict(spec["nf4"], "cpu", "cpu", dataclasses.replace(prof, dequant_params_per_s={}),
                              GPU, "bf16")
    assert "dequant" not in unmeasured.terms


def test_writing_one_frozen_tensor_leaves_the_others_as_stored(tmp_path):
    """Replacing one tensor of a quantized part quantizes that tensor alone: the other
    tensors' stored bytes stay as they were (never dequantized and quantized again), and the
    new tensor reads back as its own round trip."""
    eng = offload.initialize(lora_llama(layers=1), qcfg(tmp_path, "cpu", "nf4", double_quant=True))
    po = eng.param_offload
    part = next(p for _, p in po.frozen_io.parts()
                if p.codec is not None and sum(sc.fmt == "nf4" for sc in p.codec.segments) >= 2)
    a, b = [sc for sc in part.codec.segments if sc.fmt == "nf4"][:2]
    before = part.read_home(raw=True)
    new = torch.randn(a.shape, dtype=torch.bfloat16)
    po.frozen_io.write({id(a.param): new})
    after = part.read_home(raw=True)
    for off, n in b.pieces.values():
        assert torch.equal(after[off:off + n], before[off:off + n])
    assert not torch.equal(after[a.pieces["packed"][0]:][:a.pieces["packed"][1]],
                           before[a.pieces["packed"][0]:][:a.pieces["packed"][1]])
    got = po.frozen_io.read({id(a.param)})[id(a.param)]
    assert torch.equal(got, quantized.round_trip(new, "nf4", double_quant=True))
    eng.close()
