"""Parameter counts from HF configs and modules, bytes per tier per placement, fit checks."""
import json

import pytest
import torch
from torch import nn

from offload.planner import estimate as est
from offload.models.gpt import GPT, GPTConfig


def write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return str(p)


GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000}


def test_gpt2_count_matches_published_and_module(tmp_path):
    spec = est.spec_from_hf_config(write(tmp_path, GPT2))
    assert spec.params == 124_439_808           # GPT-2 small, tied head
    assert spec.largest_layer == 50257 * 768    # the embedding
    # an independent count: the package's GPT built in GPT-2 small's shape, on the meta device
    assert est.spec_from_callable("offload.models.gpt:gpt2_small").params == spec.params


def test_llama_counts_match_published(tmp_path):
    assert est.spec_from_hf_config(write(tmp_path, LLAMA2_7B)).params == 6_738_415_616
    assert est.spec_from_hf_config(write(tmp_path, MISTRAL_7B)).params == 7_241_732_096   # GQA


class _TinyLlama(nn.Module):
    """The Llama layout in plain torch, to check the config arithmetic against a module."""

    def __init__(self, d, inter, layers, heads, kv, vocab, tied):
        super().__init__()
        hd = d // heads
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            m = nn.Module()
            m.q, m.k, m.v = nn.Linear(d, heads * hd, bias=False), nn.Linear(d, kv * hd, bias=False), nn.Linear(d, kv * hd, bias=False)
            m.o = nn.Linear(heads * hd, d, bias=False)
            m.gate, m.up, m.down = nn.Linear(d, inter, bias=False), nn.Linear(d, inter, bias=False), nn.Linear(inter, d, bias=False)
            m.n1, m.n2 = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
            self.layers.append(m)
        self.norm = nn.Parameter(torch.ones(d))
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight


@pytest.mark.parametrize("tied", [False, True])
def test_llama_count_matches_a_module(tmp_path, tied):
    c = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": tied}
    with torch.device("meta"):
        m = _TinyLlama(64, 172, 3, 4, 2, 100, tied)
    assert est.spec_from_hf_config(write(tmp_path, c)).params == est.spec_from_module(m).params


def test_hf_config_directory_and_text_config(tmp_path):
    write(tmp_path, {"model_type": "llava", "text_config": LLAMA2_7B})
    assert est.spec_from_hf_config(str(tmp_path)).params == 6_738_415_616


def test_hf_config_errors(tmp_path):
    with pytest.raises(est.EstimateError, match="does not exist"):
        est.spec_from_hf_config(str(tmp_path / "none.json"))
    with pytest.raises(est.EstimateError, match="give --params"):
        est.spec_from_hf_config(write(tmp_path, {"model_type": "mystery"}))


def test_spec_from_module_uses_engine_blocks():
    cfg = GPTConfig(n_layer=3, n_embd=64, n_head=4)
    with torch.device("meta"):
        spec = est.spec_from_module(GPT(cfg))
    assert spec.params == cfg.num_params()
    per_block = sum(p.numel() for p in GPT(cfg).blocks[0].parameters())
    assert spec.largest_block == max(per_block, cfg.vocab_size * cfg.n_embd)
    assert spec.n_blocks >= cfg.n_layer


def test_spec_from_callable_errors():
    for bad, msg in [("nocolon", "module:callable"), ("no_such_mod_xyz:f", "cannot import"),
                     ("offload.models.gpt:nope", "no callable"), ("offload.models.gpt:GPTConfig", "not an nn.Module")]:
        with pytest.raises(est.EstimateError, match=msg):
            est.spec_from_callable(bad)


def test_spec_from_counts():
    s = est.spec_from_counts(7e9, 2e8)
    assert (s.params, s.largest_layer, s.exact) == (7_000_000_000, 200_000_000, True)
    assert not est.spec_from_counts(7e9).exact
    for bad in [(0, None), (1e6, 2e6), (1e6, -1)]:
        with pytest.raises(est.EstimateError):
            est.spec_from_counts(*bad)


# ---- bytes per placement ---------------------------------------------------------------------------
SPEC = est.ModelSpec(params=1_000_000, largest_layer=50_000, largest_block=100_000, n_blocks=10)


def test_formulas_by_hand():
    P, B = 1_000_000, 100_000
    r = est.placement_bytes(SPEC, "none", "none", "bf16")
    assert (r.device, r.pinned, r.host, r.nvme) == (2 * P + 2 * P + 12 * P, 0, 0, 0)
    r = est.placement_bytes(SPEC, "none", "none", "fp32")
    assert r.device == 4 * P + 4 * P + 8 * P          # fp32: the parameter is the master
    r = est.placement_bytes(SPEC, "cpu", "none", "bf16")
    assert r.device == 2 * P + 4 * B and r.nvme == 0
    r = est.placement_bytes(SPEC, "cpu", "cpu", "bf16")
    assert r.device == 8 * B
    r = est.placement_bytes(SPEC, "nvme", "nvme", "bf16", buffer_count=2)
    assert r.device == 8 * B and r.nvme >= 14 * P


@pytest.mark.parametrize("opt,param,clip,gas,precision,ahead", [
    ("cpu", "none", 0.0, 1, "fp32", False), ("cpu", "cpu", 1.0, 2, "fp32", False), ("nvme", "none", 0.0, 1, "bf16", False),
    ("nvme", "nvme", 1.0, 1, "fp32", False), ("nvme", "nvme", 0.0, 4, "bf16", False), ("nvme", "nvme", 1.0, 4, "fp16", False),
    ("cpu", "nvme", 0.0, 2, "bf16", True), ("cpu", "none", 0.0, 1, "fp32", True)])
def test_estimate_equals_the_engines_pools(opt, param, clip, gas, precision, ahead, tmp_path, monkeypatch):
    """The estimate's host and NVMe bytes are the engine's own: a real engine on a small
    model allocates exactly the pools and swap space the estimate of that model lists
    (update_ahead's second state and staged parameters included, for every block)."""
    import tempfile
    from _models import make_model
    import offload
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = make_model(layers=3, frozen_layer=None)
    if precision != "fp32":
        model = model.to(torch.bfloat16 if precision == "bf16" else torch.float16)
    spec = est.spec_from_module(model)
    r = est.placement_bytes(spec, opt, param, precision, buffer_count=2, gradient_clipping=clip,
                            gradient_accumulation_steps=gas, update_ahead=ahead)
    cfg = est.plan_config(opt, param, precision, 2, clip, gas, update_ahead=ahead)
    eng = offload.initialize(model, cfg)
    tiers = eng.stats()["tier_bytes"]
    link = 2 * 2 * spec.largest_block * est.BYTES_PER_PARAM[precision]
    assert r.pinned - link == tiers["host"] and r.nvme == tiers["nvme"]
    if ahead:                          # the second state and the staged parameters, on top
        plain = est.placement_bytes(spec, opt, param, precision, buffer_count=2, gradient_clipping=clip,
                                    gradient_accumulation_steps=gas)
        page = lambda n: -(-n // 4096) * 4096   # noqa: E731 - pool slots are whole pages
        ahead_blocks = [b for b in eng.blocks if b.trains]              # every trained block has its slot
        assert all(b.update.ahead is not None for b in ahead_blocks)
        staged = 0 if (param, precision) == ("none", "fp32") else sum(
            page(b.update.ahead.out.numel() * b.update.ahead.out.element_size()) for b in ahead_blocks)
        assert r.pinned - plain.pinned == sum(page(b.state.nbytes) for b in ahead_blocks) + staged > 0
    eng.close()


@pytest.mark.parametrize("act,host_bytes", [("cpu", 3 << 20), ("nvme", None)])
def test_estimate_counts_the_activation_pool(act, host_bytes, tmp_path, monkeypatch):
    """Offloaded activations draw on a host pool of their own: the estimate lists it with the
    others, and a real engine allocates exactly what the estimate says."""
    import tempfile
    from _models import make_model
    import offload
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = make_model(layers=3, frozen_layer=None)
    spec = est.spec_from_module(model)
    kw = {"activations": act, "activation_host_bytes": host_bytes}
    r = est.placement_bytes(spec, "cpu", "none", "fp32", buffer_count=2, **kw)
    without = est.placement_bytes(spec, "cpu", "none", "fp32", buffer_count=2)
    pool = host_bytes if act == "cpu" else 2 * (256 << 20)       # nvme: twice the default lookahead
    assert r.pinned - without.pinned == pool
    eng = offload.initialize(model, est.plan_config("cpu", "none", "fp32", 2, **kw))
    link = 2 * 2 * spec.largest_block * est.BYTES_PER_PARAM["fp32"]
    assert r.pinned - link == eng.stats()["tier_bytes"]["host"]
    eng.close()


def test_offload_moves_bytes_off_the_device():
    rows = {(r.optimizer, r.param): r for r in est.estimate(SPEC, "bf16")}
    assert len(rows) == 9
    assert rows["cpu", "none"].device < rows["none", "none"].device
    assert rows["cpu", "cpu"].device < rows["cpu", "none"].device
    assert rows["nvme", "nvme"].host_total < rows["cpu", "cpu"].host_total
    for (o, p), r in rows.items():
        assert (r.nvme > 0) == ("nvme" in (o, p))


def test_world_size_shards_per_rank_state():
    one = est.placement_bytes(SPEC, "none", "none", "bf16", world_size=1)
    four = est.placement_bytes(SPEC, "none", "none", "bf16", world_size=4)
    assert four.device == 4 * SPEC.params + 12 * SPEC.params // 4 < one.device
    # host and nvme are per node: all ranks together need the same state
    a = est.placement_bytes(SPEC, "nvme", "none", "bf16", world_size=1, buffer_count=1)
    b = est.placement_bytes(SPEC, "nvme", "none", "bf16", world_size=4, buffer_count=1)
    pad = 12 * 4 * 1024 * SPEC.n_blocks           # each block padded to world_size * 1024 elements
    # one rank parks its bf16 gradients on NVMe (2 bytes/param); ZeRO-2 ranks keep their shards in RAM
    assert b.nvme <= a.nvme <= b.nvme + 2 * SPEC.params + pad
    # each rank stages two blocks per link direction of its own; the pools hold shards
    link = 2 * 2 * 2 * SPEC.largest_block
    assert b.pinned - 4 * link <= a.pinned - link + 2 * SPEC.params + pad   # (their gradients, in RAM)


def test_deepspeed_reference_formulas():
    ref = est.deepspeed_reference(SPEC, world_size=1)
    P, LL = SPEC.params, SPEC.largest_layer
    assert ref["zero2 optimizer=cpu"] == {"device": 2 * P, "host": int(16 * P * 1.5)}
    assert ref["zero3 optimizer=cpu param=cpu"] == {"device": 4 * LL, "host": int(18 * P * 1.5)}
    assert ref["zero3 optimizer=none param=none"]["device"] == 4 * LL + 18 * P


def test_bad_arguments():
    with pytest.raises(est.EstimateError, match="precision"):
        est.placement_bytes(SPEC, "cpu", "none", "fp8")
    with pytest.raises(est.EstimateError, match="world-size"):
        est.placement_bytes(SPEC, "cpu", "none", "bf16", world_size=0)


def test_fit_against_a_machine(tmp_path):
    m = est.Machine(device_bytes=10 << 30, device_name="test", host_available=64 << 30,
                    nvme_free=1 << 40, nvme_path=str(tmp_path))
    big = est.spec_from_counts(7e9, 2e8)
    rows = {(r.optimizer, r.param): r for r in est.estimate(big, "bf16")}
    assert not est.fits(rows["none", "none"], m)                 # 112 GB of model states
    assert est.check_fit(rows["none", "none"], m)["device"] is False
    assert est.fits(rows["nvme", "nvme"], m)
    unknown = est.Machine(None, "cpu", 64 << 30, 1 << 40, str(tmp_path))
    assert est.check_fit(rows["none", "none"], unknown)["device"] is None


def test_this_machine(tmp_path):
    m = est.this_machine(str(tmp_path), device_memory=24 << 30)
    assert m.device_bytes == 24 << 30 and m.host_available > 0 and m.nvme_free > 0
    with pytest.raises(est.EstimateError):
        est.this_machine(str(tmp_path / "missing"))
