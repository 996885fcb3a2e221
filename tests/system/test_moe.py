"""Mixture-of-experts models (issue 44): fused 3-D expert tensors quantized per expert
(params/quantized.py), transformers' own MoE families trained by the engine against a plain
torch / PEFT loop over the same quantized-then-dequantized base (a covering array of
fine-tune mode x base format x parameter tier x gradient checkpointing, the router's
auxiliary loss on), the router trainable or frozen, and the estimate of the real models'
configs (tests/fixtures/hf_configs/)."""
import pytest
import torch
from torch import nn

import offload
from offload import quantize as qz
from offload.core import blocks as blk
from offload.params import quantized
from _models import batches, clone
import _paths
from _parity import max_diff, parity_bounds, plain_run

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()

MIN_NUMEL = 256           # the test models' tensors are small: quantize every 2-D / 3-D one of them
VOCAB = 97


# ---- the codec: per expert ------------------------------------------------------------------
class _Experts(nn.Module):
    def __init__(self, experts, rows, cols):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, rows, cols))
        self.norm = nn.Parameter(torch.randn(cols))
        self.down_proj = nn.Parameter(torch.randn(experts, cols, rows))


def _codec(fmt, double_quant, experts=5, rows=9, cols=13):
    torch.manual_seed(0)
    m = _Experts(experts, rows, cols).to(torch.bfloat16).requires_grad_(False)
    [(_, _, [part])] = blk.frozen_parts(m, [""], lambda p: torch.bfloat16)
    codec = quantized.QuantizedPart.for_part(part, torch.bfloat16, fmt, double_quant, MIN_NUMEL // 4)
    return m, part, codec


@pytest.mark.parametrize("fmt,double_quant", [("nf4", False), ("nf4", True), ("int8", False)])
def test_experts_quantized_per_expert_and_dequantized_alone(fmt, double_quant, monkeypatch):
    """A 3-D tensor [E, R, C] is quantized per expert (an odd R * C, not a multiple of the
    NF4 block: blocks restart at each expert), in chunks smaller than an expert: the part's
    values equal ``round_trip`` of each whole tensor; expert e dequantizes alone (native and
    torch paths) to the same bits after every byte of its neighbours' codes and scales is
    overwritten; nf4 / int8 experts equal the expert quantized as its own tensor; the bytes
    are ``tensor_bytes``'."""
    monkeypatch.setattr(quantized, "_CHUNK", 64)
    m, part, codec = _codec(fmt, double_quant)
    assert [sc.fmt for sc in codec.segments] == [fmt, "raw", fmt]
    blob = codec.fill(torch.full((codec.nbytes,), 0xAB, dtype=torch.uint8))
    out = codec.values(blob)
    for sc in codec.segments:
        if sc.fmt != "raw":
            assert sc.experts == 5 and sc.nbytes == quantized.tensor_bytes(sc.shape, fmt, double_quant)
            want = quantized.round_trip(sc.param.data, fmt, double_quant)
            assert torch.equal(out[sc.offset:sc.offset + sc.numel].view(sc.shape), want), sc.name
            err = (want.float() - sc.param.data.float()).abs().max().item()    # of the bf16 values
            ulp = sc.param.data.float().abs().max().item() / 256             # bf16 rounding of the values
            assert sc.max_abs_error == pytest.approx(err, abs=ulp)
    ref = torch.empty_like(out)
    codec.dequantize(blob, ref, reference=True)
    assert torch.equal(ref, out)
    name, e = "down_proj", 3
    sc = next(s for s in codec.segments if s.name == name)
    whole = out[sc.offset:sc.offset + sc.numel].view(sc.shape)
    alone = codec.dequantize_expert(blob, name, e)
    assert torch.equal(alone, whole[e])
    if not double_quant:                       # each expert is its own tensor's quantization
        assert torch.equal(alone, quantized.round_trip(sc.param.data[e], fmt))
    keep = torch.zeros(codec.nbytes, dtype=torch.bool)     # expert e's bytes of every piece
    per = sc.numel // sc.experts
    for piece, (off, nbytes) in sc.pieces.items():
        if piece == "absmax_scale":
            w = 4 * quantized.q8.nblocks(qz.nblocks_of(per))
        else:
            w = nbytes // sc.experts
        keep[off + e * w:off + (e + 1) * w] = True
    scrambled = torch.where(keep, blob, torch.randint(0, 256, blob.shape, dtype=torch.uint8))
    assert torch.equal(codec.dequantize_expert(scrambled, name, e), alone)
    assert torch.equal(codec.dequantize_expert(scrambled, name, e, reference=True), alone)
    with pytest.raises(IndexError, match="it has 5"):
        codec.dequantize_expert(blob, name, 5)


def test_experts_of_whole_blocks_have_the_whole_flats_codes():
    """Experts of a multiple of 64 elements: per-expert NF4 (no double quant) is the whole
    flat's quantization, and one expert with double quant is ``quantize_nf4``'s."""
    torch.manual_seed(1)
    x = torch.randn(4, 16, 24, dtype=torch.bfloat16)
    per = qz.quantize_nf4_experts(x)
    whole = qz.quantize_nf4(x)
    assert torch.equal(torch.cat([t.packed for t in per]), whole.packed)
    assert torch.equal(torch.cat([t.absmax for t in per]), whole.absmax)
    [one] = qz.quantize_nf4_experts(x[:1], double_quant=True)
    ref = qz.quantize_nf4(x[0], double_quant=True)
    assert torch.equal(one.absmax_q, ref.absmax_q) and torch.equal(one.absmax_scale, ref.absmax_scale)
    assert one.absmax_offset == ref.absmax_offset


# ---- transformers' MoE families, trained ------------------------------------------------------
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=32, output_router_logits=True)
FAMILIES = {        # transformers' own classes at small sizes: fused experts [E, 2 x inter, hidden] and [E, ...]
    "qwen3_moe": ("Qwen3Moe", dict(intermediate_size=64, moe_intermediate_size=16, head_dim=16, num_experts=4,
                                   num_experts_per_tok=2)),
    "mixtral": ("Mixtral", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("GptOss", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                               sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                               rope_scaling=None)),
    "deepseek_v3": ("DeepseekV3", dict(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                                       num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                       topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                       qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=2)),
    "olmoe": ("Olmoe", dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2, eos_token_id=None,
                            pad_token_id=None)),
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]     # PEFT target_parameters: the fused experts


class MoELM(nn.Module):
    """A transformers MoE causal LM with the (x, y) -> loss interface of the reference loop:
    the loss with the router's load-balancing auxiliary term (``output_router_logits``)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, y=None):
        return self.m(input_ids=x, labels=x).loss


def moe_model(family, mode, checkpointing=False, router=None, seed=0):
    """``family``'s small model: ``mode`` full (fp32, everything trains), lora_attn (bf16 base,
    LoRA on q/v), lora_experts (bf16 base, LoRA on the fused experts through PEFT's
    ``target_parameters``); ``router`` trainable: the router's weight trains beside the
    adapters, frozen: it is part of the base; None: as the mode leaves it (full: trains,
    LoRA: frozen)."""
    prefix, kw = FAMILIES[family]
    conf = getattr(transformers, prefix + "Config")(**{**_COMMON, **kw})
    torch.manual_seed(seed)
    base = getattr(transformers, prefix + "ForCausalLM")(conf)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.train()
    if mode == "full":
        if router == "frozen":
            for n, p in base.named_parameters():
                if _is_router(n):
                    p.requires_grad_(False)
        return MoELM(base)
    if router == "frozen":                     # a trainable router trains in fp32 (its base too)
        base = base.to(torch.bfloat16)
    targets = dict(target_modules=["q_proj", "v_proj"] if family != "deepseek_v3" else ["q_b_proj", "kv_b_proj"])
    if mode == "lora_experts":
        targets = dict(target_modules=[], target_parameters=EXPERTS)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:                  # B is zero at init: make step one move A too
                p.normal_(0, 0.02)
    if router == "trainable":
        for n, p in model.named_parameters():
            if _is_router(n):
                p.requires_grad_(True)
    return MoELM(model)


def _is_router(name):
    return name.endswith(("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias"))


def dequantized(model, fmt, double_quant=False):
    """A copy of ``model`` whose frozen 2-D / 3-D tensors the engine quantizes hold their
    round trip (per expert for 3-D): what the engine's forward sees."""
    model = clone(model)
    if fmt in quantized.FORMATS:
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad and quantized.quantizes(p.shape, p.dtype, fmt, MIN_NUMEL):
                    p.copy_(quantized.round_trip(p.data, fmt, double_quant))
    return model


def engine_run(model, data, config):
    eng = offload.initialize(model, config)
    snaps, losses = [], []
    try:
        for x, y in data:
            loss = eng(x, y)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
            snaps.append(dict(eng.full_state_dict()))
        return snaps, losses, eng.stats()
    finally:
        eng.close()


def qcfg(tmp_path, param, fmt, double_quant=False):
    nvme = str(tmp_path) if param == "nvme" else None
    return {"optimizer": {"lr": 1e-3, "weight_decay": 0.01},
            "offload_optimizer": {"device": "nvme" if param == "nvme" else "cpu", "nvme_path": nvme},
            "offload_param": {"device": param, "nvme_path": nvme, "frozen_dtype": fmt,
                              "frozen_double_quant": double_quant, "frozen_quant_min_numel": MIN_NUMEL}}


# A covering array over (family) x (full, LoRA on attention, LoRA on experts) x (compute, nf4,
# int8 base) x (parameters cpu, nvme) x (checkpointing off, on): every pair of mode, base,
# tier and checkpointing that exists (a full fine-tune has no frozen base to quantize), every
# family; one nf4 cell double-quantized.
CELLS = [
    ("qwen3_moe", "lora_experts", "nf4", "cpu", True),
    ("mixtral", "lora_attn", "int8", "nvme", False),
    ("gpt_oss", "lora_experts", "int8", "nvme", False),
    ("deepseek_v3", "lora_attn", "nf4", "cpu", False),
    ("olmoe", "full", "compute", "cpu", True),
    ("qwen3_moe", "full", "compute", "nvme", False),
    ("mixtral", "lora_experts", "nf4+dq", "nvme", True),
    ("olmoe", "lora_attn", "int8", "cpu", True),
]


def check_trains_as_plain(base, fmt, param, tmp_path, steps=3):
    """The engine trains ``base`` as a plain loop over the same (quantized, then dequantized)
    base: losses (with the router's auxiliary loss) and the trained parameters within twice
    torch's own single-tensor-vs-fused AdamW distance (plus 1e-6) at every step, the frozen
    parameters handed back equal to the reference bit for bit, the trained ones really
    moved, and every frozen fused expert tensor quantized (``stats()["frozen_quant"]``)."""
    fmt, _, dq = fmt.partition("+")
    data = batches(steps, batch=2, ctx=8, vocab=VOCAB)
    ref_model = dequantized(base, fmt, bool(dq))
    ref, ref_losses = plain_run(clone(ref_model), data)
    fused, fused_losses = plain_run(clone(ref_model), data, fused=True)
    got, losses, stats = engine_run(clone(base), data, qcfg(tmp_path, param, fmt, bool(dq)))
    trainable = [k for k, v in ref_model.state_dict(keep_vars=True).items() if v.requires_grad]
    assert trainable
    pick = lambda snaps: [{k: s[k] for k in trainable} for s in snaps]     # noqa: E731
    bounds = parity_bounds(pick(ref), pick(fused))
    for step, (r, g, bound) in enumerate(zip(pick(ref), pick(got), bounds)):
        d = max_diff(r, g)
        assert d <= bound, f"step {step}: trained parameters differ from plain by {d}, bound {bound}"
    for step, (a, b, c) in enumerate(zip(ref_losses, losses, fused_losses)):
        assert abs(a - b) <= 2 * abs(a - c) + 1e-6, (step, a, b, c)
    assert got[-1].keys() == ref[-1].keys()
    for k in ref[-1]:
        if k not in trainable:
            assert torch.equal(got[-1][k].to(ref[-1][k].dtype), ref[-1][k]), k
    moved = max_diff({k: got[-1][k] for k in trainable}, {k: base.state_dict()[k] for k in trainable})
    assert moved > 10 * bounds[-1]
    if fmt != "compute":
        fq = stats["frozen_quant"]
        experts = {n.removeprefix("m.") for n, p in base.named_parameters() if p.dim() == 3 and not p.requires_grad}
        assert experts and experts <= {n.removeprefix("m.") for n in fq["per_tensor"]}, fq["per_tensor"].keys()
    return ref, got


@pytest.mark.parametrize("family,mode,fmt,param,checkpointing", CELLS, ids=["-".join(map(str, c)) for c in CELLS])
def test_moe_family_trains_as_plain(family, mode, fmt, param, checkpointing, tmp_path):
    """One cell of the covering array: ``check_trains_as_plain``."""
    check_trains_as_plain(moe_model(family, mode, checkpointing), fmt, param, tmp_path)


@pytest.mark.parametrize("mode,router,fmt", [("full", "frozen", "compute"), ("lora_experts", "trainable", "nf4")])
def test_router_trainable_or_frozen(mode, router, fmt, tmp_path):
    """The router as the user chooses: frozen in a full fine-tune (it stays as it was, the
    rest trains as plain), trainable beside LoRA on the experts over an nf4 base (it trains
    as plain); the loss carries the load-balancing auxiliary term in both."""
    base = moe_model("qwen3_moe", mode, router=router)
    x = batches(1, batch=2, ctx=8, vocab=VOCAB)[0][0]
    inner = base.m
    with_aux = inner(input_ids=x, labels=x).loss
    without = inner(input_ids=x, labels=x, output_router_logits=False).loss
    assert with_aux.item() != without.item()
    ref, got = check_trains_as_plain(base, fmt, "cpu", tmp_path)
    routers = [k for k in ref[-1] if _is_router(k)]
    assert routers
    for k in routers:
        changed = not torch.equal(got[-1][k].float(), base.state_dict()[k].float())
        assert changed == (router == "trainable"), k


# ---- the estimate of the real models -------------------------------------------------------------
FIXTURES = __import__("pathlib").Path(_paths.FIXTURES) / "hf_configs"
GiB = 1 << 30


@__import__("functools").lru_cache(maxsize=None)
def _moe_spec(name):
    from offload.planner import estimate as est
    model = est.apply_lora(est.hf_model_on_meta(str(FIXTURES / name)), 16, ["attention"], name)
    return est.spec_from_module(model, name, "bf16", frozen_dtype="nf4")


def moe_estimate(name, **kw):
    """``offload estimate --hf-config <name> --lora-rank 16 --precision bf16 --frozen-dtype nf4``
    (the default targets: the attention's linear layers), as the CLI computes it."""
    from offload.planner import estimate as est
    spec = _moe_spec(name)
    return spec, {(r.optimizer, r.param): r for r in est.estimate(spec, "bf16", **kw)}


@pytest.mark.parametrize("name,host_gib,active", [("qwen3-30b-a3b", 18, (3.2e9, 3.5e9)),
                                                  ("gpt-oss-120b", 68, (5.0e9, 6.0e9))])
def test_estimate_of_a_quantized_moe_base(name, host_gib, active):
    """The issue's claims: LoRA r=16 over an nf4 base, bf16, parameters and optimizer on cpu:
    Qwen3-30B-A3B within 18 GiB of host memory, GPT-OSS-120B within 68 GiB (the fused experts
    quantized: about 0.57 bytes per parameter); compute priced on the active parameters (the
    top-k experts: 3.3B and 5.1B published, plus the embeddings here)."""
    spec, rows = moe_estimate(name)
    cc = rows["cpu", "cpu"]
    assert cc.refused is None and cc.host_total <= host_gib * GiB, cc
    assert 0.55 * spec.params < cc.host_total < 0.62 * spec.params       # nf4 homes of every frozen tensor
    assert active[0] < spec.computed < active[1] and spec.params > 5 * spec.computed


def test_estimate_device_window_follows_the_budget():
    """With parameters offloaded the device holds the parameter budget (two blocks by
    default, ``--device-budget-bytes`` when given) plus one quantized block being dequantized
    and the adapters' gradient window; a budget below the largest block is refused."""
    spec, rows = moe_estimate("gpt-oss-120b")
    one_block = 2 * spec.largest_block + (1 << 20)
    _, small = moe_estimate("gpt-oss-120b", device_budget_bytes=one_block)
    _, too_small = moe_estimate("gpt-oss-120b", device_budget_bytes=one_block // 2)
    d2, d1 = rows["cpu", "cpu"].device, small["cpu", "cpu"].device
    assert d2 - d1 == pytest.approx(2 * 2 * spec.largest_block - one_block, rel=0.01)
    assert small["cpu", "cpu"].refused is None and d1 <= 8 * GiB
    assert "DeviceBudgetError" in too_small["cpu", "cpu"].refused


# ---- the user's side: offload finetune on a MoE checkpoint directory ---------------------------------
def test_finetune_lora_on_the_experts_of_a_moe_directory(tmp_path, capsys):
    """`offload finetune DIR --lora ...,targets=experts` on a Qwen3-MoE directory written by
    save_pretrained (transformers 5 writes its experts one by one): the experts get adapters
    (PEFT target_parameters), train over an nf4 base (every fused expert tensor quantized),
    and --merged-out writes the base with the adapter merged into the dequantized experts, in
    the checkpoint's own layout (the base directory's tensor names), the experts moved."""
    import json
    import shutil
    from safetensors import safe_open
    from offload import cli
    assert cli.main(["new-model", str(tmp_path / "tok"), "--hidden", "32", "--layers", "1", "--heads", "2",
                     "--max-positions", "64"]) == 0
    _, kw = FAMILIES["qwen3_moe"]
    conf = transformers.Qwen3MoeConfig(**{**_COMMON, **kw, "vocab_size": 259, "max_position_embeddings": 64,
                                          "output_router_logits": False})
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(conf).save_pretrained(tmp_path / "moe")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok" / f, tmp_path / "moe" / f)
    (tmp_path / "text.txt").write_text(open(__file__).read()[:12000])
    (tmp_path / "nf4.json").write_text(json.dumps({"offload_optimizer": {"device": "cpu"},
                                                  "offload_param": {"device": "cpu", "frozen_dtype": "nf4",
                                                                    "frozen_quant_min_numel": MIN_NUMEL}}))
    out, merged = tmp_path / "out", tmp_path / "merged"
    code = cli.main([str(a) for a in ["finetune", tmp_path / "moe", "--data", tmp_path / "text.txt", "--out", out,
                                      "--steps", 3, "--batch-size", 2, "--seq-len", 32, "--lr", "2e-2",
                                      "--warmup", 0, "--lora", "r=4,alpha=8,targets=experts", "--merged-out", merged,
                                      "--config", tmp_path / "nf4.json", "--log-every", 0]])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "on experts" in text and "merged into the dequantized nf4 base" in text, text
    summary = json.load(open(out / "finetune_summary.json"))
    fq = summary["stats"]["frozen_quant"]["per_tensor"]
    assert sum(k.endswith(("gate_up_proj", "down_proj")) and ".experts." in k for k in fq) == 4, fq.keys()
    adapter = json.load(open(out / "adapter_config.json"))
    assert set(adapter["target_parameters"]) == {"experts.gate_up_proj", "experts.down_proj"}

    def keys(d):
        with safe_open(str(d / "model.safetensors"), "pt") as h:
            return {k: h.get_tensor(k) for k in h.keys()}
    base, got = keys(tmp_path / "moe"), keys(merged)
    assert set(got) == set(base) and "model.layers.0.mlp.experts.0.gate_proj.weight" in got
    for k in base:                      # the base as the engine held it: nf4 round trips (per expert)
        q = quantized.quantizes(base[k].shape, torch.float32, "nf4", MIN_NUMEL)
        held = quantized.round_trip(base[k].float(), "nf4") if q else base[k].float()
        if ".experts." in k:            # the adapter merged into the dequantized expert: moved from it
            assert not torch.equal(got[k].float(), held), k
            assert (got[k].float() - held).abs().max() < 0.5, k
        else:                           # no adapter: the base as it trained
            assert torch.equal(got[k].float(), held), k


def test_checkpoint_of_quantized_experts_resumes_as_stored_and_exports(tmp_path):
    """A LoRA-on-experts run over an nf4 base: the checkpoint keeps the fused experts as their
    per-expert blobs (not values), a resumed engine (its model's weights zeroed) trains on bit
    for bit, ``export_hf`` writes the adapter, and a merged export, which cannot merge
    parameter adapters, says so instead of dropping them."""
    from offload.io.safetensors import WeightsError
    base = moe_model("mixtral", "lora_experts")
    data = batches(3, batch=2, ctx=8, vocab=VOCAB)
    cfg = lambda d: qcfg(tmp_path / d, "cpu", "nf4")       # noqa: E731
    eng = offload.initialize(clone(base), cfg("a"))
    eng.backward(eng(*data[0]))
    eng.step()
    ck = eng.save_checkpoint(str(tmp_path / "ck"))
    want = []
    for x, y in data[1:]:
        eng.backward(eng(x, y))
        eng.step()
        want.append({k: v.clone() for k, v in eng.full_state_dict().items()})
    eng.close()
    extra = torch.load(f"{ck}/extra.pt", weights_only=False)
    stored = {k for q in extra["quantized"] for k in q["keys"]}
    assert any(k.endswith("experts.base_layer.base_layer.gate_up_proj") for k in stored), stored
    model = clone(base)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    eng = offload.initialize(model, cfg("b"))
    eng.load_checkpoint(ck)
    for (x, y), w in zip(data[1:], want):
        eng.backward(eng(x, y))
        eng.step()
        got = eng.full_state_dict()
        assert all(torch.equal(w[k], got[k]) for k in w)
    eng.close()
    out = offload.export_hf(ck, str(tmp_path / "adapter"), peft="adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists(), out
    with pytest.raises(WeightsError, match="target_parameters"):
        offload.export_hf(ck, str(tmp_path / "merged"), peft="merged")


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3"])   # dense first layers, shared
def test_config_counts_price_compute_on_the_active_parameters(name):
    """``--hf-config`` without ``--lora-rank`` (counted from config.json, no transformers):
    the parameters and active parameters within 3% of the model transformers builds on the
    meta device (MoE fields: routed / shared experts, dense first layers, top-k), and the
    planner's compute is 6 x active x tokens at the measured rate."""
    from offload.planner import estimate as est
    from offload.planner import plan
    from _profile import profile
    counted = est.spec_from_hf_config(str(FIXTURES / name))
    built = _moe_spec(name)
    assert counted.params == pytest.approx(built.params - built.trained, rel=0.03)     # less the adapters
    assert counted.computed == pytest.approx(built.computed, rel=0.03)
    c = plan.flops_compute(counted, 1000, profile(), "fp32")
    assert c.forward_s + c.backward_s == pytest.approx(6 * counted.computed * 1000 / 100e12)


def test_lora_target_keywords():
    """``attention`` / ``experts`` resolve to what the model calls them: the attention's
    linear layers (a leaf name shared with a non-attention module as its full path), a module
    list's experts as modules, fused 3-D experts as PEFT target_parameters; a name that
    matches nothing is named with the model's names."""
    from offload.config import lora_targets as lt

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = nn.ModuleDict(dict(q_a_proj=nn.Linear(4, 4), o_proj=nn.Linear(4, 4)))
            self.mlp = nn.ModuleDict(dict(o_proj=nn.Linear(4, 4), experts=nn.ModuleList(
                nn.ModuleDict(dict(w1=nn.Linear(4, 8), w2=nn.Linear(8, 4))) for _ in range(3))))
            self.fused = nn.Module()
            self.fused.experts = _Experts(3, 8, 4)

    m = nn.ModuleList([Layer(), Layer()])
    got = lt.resolve(m, ["attention"])
    assert got == {"target_modules": ["q_a_proj", "0.self_attn.o_proj", "1.self_attn.o_proj"],
                   "target_parameters": []}
    got = lt.resolve(m, ["experts"])
    assert got == {"target_modules": ["w1", "w2"], "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}
    assert lt.resolve(m, ["experts.down_proj", "w1"])["target_parameters"] == ["experts.down_proj"]
    with pytest.raises(lt.LoraTargetError, match="'q_proj' is not a module.*q_a_proj.*experts.gate_up_proj"):
        lt.resolve(m, ["q_proj"])
