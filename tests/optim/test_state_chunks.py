"""Optimizer state in chunks (offload_optimizer.state_chunk_bytes smaller than a block's state),
against plain PyTorch, in the real loop.

A block shard whose state on NVMe is larger than the chunk size is read, stepped and written in
element ranges (optim/state.py); the swap pool's slots hold a chunk. The model here has two
blocks far above the chunk size (tok, head: 4 to 5 chunks, a chunk boundary inside the
embedding weight) and two below it (the layers: one chunk). Tolerances as in
test_engine_rules.py: fp32 state against torch's single-tensor AdamW / SGD, the bound twice
torch's own distance to its fused kernel on the same data plus 1e-6; int8 state against a
plain-torch loop applying the rule per parameter with int8 rows between steps (quant.py's
codes, scale blocks from each tensor's first element), the bound a hundredth of what int8
changes against fp32 state. The loop is the user's: forward, backward, step, nothing
synchronised between steps."""
import json

import pytest
import torch

import offload
from _models import RuleNet, make_model, resume_and_train, rule_batches
from _parity import max_diff, noise_bound
from offload.engine import memory_plan as mp
from offload.optim import get_rule
from offload.optim.rule import load_row, store_row

VOCAB, D, STEPS, CHUNK = 512, 64, 4, 100_000
NET = dict(net=RuleNet, vocab=VOCAB, d=D)
HP = {"AdamW": dict(lr=1e-2, weight_decay=0.01), "SGD": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
      "Lion": dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)}


def batches(n, seed=1):
    return rule_batches(n, VOCAB, seed)


def cfg(rule, tmp_path, state_dtype="fp32", **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    c = {"optimizer": dict(HP[rule], type=rule, state_dtype=state_dtype),
         "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2,
                               "state_chunk_bytes": CHUNK}}
    c.update(kw)
    return c


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_run(config, data=None, check=None):
    eng = offload.initialize(make_model(**NET), config)
    gas = eng.config.gradient_accumulation_steps
    try:
        if check is not None:
            check(eng)
        for i, (x, y) in enumerate(data or batches(STEPS)):
            eng.backward(eng(x, y))
            assert eng.step() is ((i + 1) % gas == 0)     # the last micro-step commits
        return eng.full_state_dict()
    finally:
        eng.close()


def chunked_as_planned(eng):
    """tok and head are in chunks, the layers are not; the swap pool's slots are the largest
    chunk (below the largest block's state), as the memory plan says; the swap file has a key
    per chunk."""
    counts = [len(b.state.chunks) for b in eng.blocks]
    assert counts[0] >= 2 and counts[3] >= 2 and counts[1:3] == [1, 1], counts
    largest_chunk = max(c.nbytes for b in eng.blocks for c in b.state.chunks)
    assert largest_chunk <= CHUNK < max(b.state.nbytes for b in eng.blocks)
    swap = eng.plan.pool("offload-swap")
    assert set(swap.slots) == {largest_chunk} and eng.resources.pool("offload-swap").capacity_bytes == swap.nbytes
    assert {c.key for c in eng.blocks[0].state.chunks} == {f"b0.state.c{k}" for k in range(counts[0])}
    assert set(eng.resources.store("optimizer").keys()) >= {c.key for b in eng.blocks for c in b.state.chunks}
    tok = eng.blocks[0].state.chunks
    assert tok[0].a == 0 and tok[-1].b == eng.blocks[0].state.numel and all(c.a % 4096 == 0 for c in tok)


def torch_run(rule, fused):
    model = make_model(**NET)
    params = list(model.parameters())
    opt = getattr(torch.optim, rule)(params, **HP[rule], **({"fused": True} if fused else {"foreach": False}))
    for x, y in batches(STEPS):
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return snapshot(model)


def dtype_loop(rule_name, state_dtype):
    """The rule per parameter in plain torch with ``state_dtype`` rows between steps."""
    rule, model = get_rule(rule_name), make_model(**NET)
    group = dict(rule.defaults, **HP[rule_name])
    params = list(model.parameters())
    states = []
    for p in params:
        st = {}
        for r in rule.rows(group):
            store_row(st, r, torch.zeros(p.numel()), state_dtype)
        states.append(st)
    for s, (x, y) in enumerate(batches(STEPS)):
        model(x, y).backward()
        with torch.no_grad():
            for p, st in zip(params, states):
                flat = p.detach().reshape(-1).clone()
                wide = {r.name: load_row(st, r).clone() for r in rule.rows(group)}
                rule.reference(flat, p.grad.reshape(-1), wide, group, s + 1)
                for r in rule.rows(group):
                    store_row(st, r, wide[r.name], state_dtype)
                p.copy_(flat.view(p.shape))
                p.grad = None
    return snapshot(model)


@pytest.mark.parametrize("rule", ["AdamW", "SGD"])
def test_fp32_state_in_chunks_matches_torch(rule, tmp_path):
    got = engine_run(cfg(rule, tmp_path), check=chunked_as_planned)
    single, fused = torch_run(rule, False), torch_run(rule, True)
    bound = noise_bound(single, fused)
    d = max_diff(got, single)
    assert d <= bound, f"{rule} in chunks: weights differ from torch by {d} (bound {bound})"
    assert max_diff(single, make_model(**NET).state_dict()) > 1e-3


@pytest.mark.parametrize("rule", ["AdamW", "Lion"])
def test_int8_state_in_chunks_matches_same_rule_in_torch(rule, tmp_path):
    got = engine_run(cfg(rule, tmp_path, state_dtype="int8"), check=chunked_as_planned)
    want, fp32 = dtype_loop(rule, "int8"), dtype_loop(rule, "fp32")
    cost = max_diff(want, fp32)
    assert cost > 0
    d = max_diff(got, want)
    assert d <= cost / 100, f"{rule} int8 in chunks: {d} from the plain-torch loop (its cost {cost})"


def bf16_reference(data, fused, gas):
    """Plain torch in bf16 with fp32 master weights: torch's AdamW on fp32 copies of the
    parameters, each micro-step's loss divided by ``gas`` (the engine's convention, DeepSpeed's)
    and the bf16 model's gradients summed in fp32 over the ``gas`` micro-steps, clipped to 1.0,
    the result rounded to bf16. Returns the masters by state_dict key."""
    model = make_model(**NET).to(torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().clone() for p in make_model(**NET).parameters()]     # from the fp32 values
    opt = torch.optim.AdamW(master, **HP["AdamW"], **({"fused": True} if fused else {"foreach": False}))
    for s in range(len(data) // gas):
        grads = [torch.zeros_like(m) for m in master]
        for x, y in data[gas * s:gas * s + gas]:
            (model(x, y) / gas).backward()
            for g, p in zip(grads, params):
                g += p.grad.float()
                p.grad = None
        for m, g in zip(master, grads):
            m.grad = g
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
    return {k: m.detach().clone() for k, m in zip(model.state_dict(), master)}


def check_bf16(got, data, gas):
    single, fused = bf16_reference(data, False, gas), bf16_reference(data, True, gas)
    bound = noise_bound(single, fused)
    d = max_diff(got, single)
    assert d <= bound, f"bf16: fp32 masters differ from torch by {d} (bound {bound})"
    assert max_diff(single, make_model(**NET).state_dict()) > 1e-3


def bf16_config(tmp_path, **kw):
    (tmp_path / "p").mkdir(parents=True, exist_ok=True)
    return cfg("AdamW", tmp_path / "o", precision="bf16", gradient_clipping=1.0,
               offload_param={"device": "nvme", "nvme_path": str(tmp_path / "p")}, **kw)


@pytest.mark.parametrize("gas", [1, 2])
def test_bf16_offloaded_params_with_clipping_and_accumulation(tmp_path, gas):
    """The bench_scale placement: bf16 compute, parameters on NVMe (the new bf16 copy written
    per chunk into the write-back buffer), clipping, state in chunks; accumulation 2 (the
    gradients summed in fp32) and 1 (they stay bf16 on the host; the clipping norm is still
    fp32's). Against plain torch in bf16 with fp32 master weights (``bf16_reference``), the
    fp32 masters (full_state_dict) compared, the bound twice the distance between torch's
    single-tensor and fused AdamW there plus 1e-6."""
    data = batches(2 * STEPS)
    got = engine_run(bf16_config(tmp_path, gradient_accumulation_steps=gas), data=data, check=chunked_as_planned)
    check_bf16(got, data, gas)


def test_write_back_target_is_decided_once_per_update(tmp_path, monkeypatch):
    """Where an update's new parameters go (a write buffer, or a staging buffer written
    through and kept staged) is decided once: the kernel fills that buffer, and the commit
    writes the same one home, even when the answer to "keep it staged?" changes in between
    (here it alternates on every question; a second question at the commit once wrote a
    fresh, unfilled staging buffer home instead)."""
    from offload.params.write_through import WriteThrough
    asked = {}

    def keeps_staged(self, i):
        asked[i] = asked.get(i, 0) + 1
        return asked[i] % 2 == 0
    monkeypatch.setattr(WriteThrough, "keeps_staged", keeps_staged)
    data = batches(2 * STEPS)
    got = engine_run(bf16_config(tmp_path, gradient_accumulation_steps=2), data=data)
    check_bf16(got, data, 2)
    assert set(asked) == {0, 1, 2, 3} and all(n == STEPS for n in asked.values()), asked   # once per update


def test_checkpoint_of_chunked_state_resumes_bit_exact(tmp_path):
    """A checkpoint holds a chunked block's state in the whole layout (the file a whole-block
    engine writes); it resumes bit-exactly into chunks and into whole blocks alike."""
    data = batches(5)
    full = engine_run(cfg("AdamW", tmp_path / "a", state_dtype="int8"), data=data)
    eng = offload.initialize(make_model(**NET), cfg("AdamW", tmp_path / "b", state_dtype="int8"))
    for x, y in data[:3]:
        eng.backward(eng(x, y))
        eng.step()
    eng.save_checkpoint(str(tmp_path / "ck"))
    eng.close()
    meta = json.load(open(tmp_path / "ck" / "meta.json"))
    assert meta["blocks"][0]["shards"][0]["layout"]["numel"] == 32768
    for chunk in (CHUNK, None):
        c = cfg("AdamW", tmp_path / f"c{chunk}", state_dtype="int8")
        c["offload_optimizer"]["state_chunk_bytes"] = chunk
        eng = offload.initialize(make_model(**NET), c)
        assert (len(eng.blocks[0].state.chunks) > 1) == (chunk is not None)
        resumed = resume_and_train(eng, tmp_path / "ck", data[3:])
        for k in full:
            assert torch.equal(full[k], resumed[k]), (chunk, k)


def test_plan_and_estimate_count_the_chunk():
    """The memory plan sizes the swap slots by the largest chunk; ``state_chunks`` splits only
    NVMe states above the chunk size, at multiples of 4096 elements, never a per-tensor rule's;
    a chunk size below one aligned chunk is an error naming the key and the smallest size."""
    from offload.config import Config
    base = {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 2}}
    blocks = [mp.BlockSize("emb", 65_536_000), mp.BlockSize("layer", 50_597_888)]
    whole = mp.plan(blocks, Config.from_dict(dict(base, offload_optimizer=dict(base["offload_optimizer"],
                                                                                 state_chunk_bytes=None))))
    assert whole.pool("offload-swap").slots == (65_536_000 * 12,) * 2
    chunked = mp.plan(blocks, Config.from_dict(base))              # the default, 256 MiB
    slot = chunked.pool("offload-swap").slots[0]
    assert slot <= 256 << 20 and slot == max(c for b in chunked.blocks for c in b.chunk_bytes)
    assert chunked.nvme["optimizer"] >= whole.nvme["optimizer"] - 4096 * 3 * len(chunked.blocks[0].chunk_bytes)
    for b in chunked.blocks:
        assert b.state_chunks[0][0] == 0 and b.state_chunks[-1][1] == b.shard[1] - b.shard[0]
        assert all(a % mp.CHUNK_ALIGN == 0 for a, _ in b.state_chunks)
    # offload estimate counts the engine's plan: the 2B model's swap slots at the chunk, not the embedding
    from offload.planner import estimate as est
    spec = est.spec_from_counts(2.15e9, largest_layer=65_536_000, n_blocks=33)
    row = est.placement_bytes(spec, "nvme", "nvme", buffer_count=2)
    cfg = est.plan_config("nvme", "nvme", buffer_count=2)
    host = mp.plan(est.spec_blocks(spec), cfg).host
    assert row.pinned == host + 2 * (2 * spec.largest_block * 2)     # plus the link staging (two bf16 windows)
    assert mp.plan(est.spec_blocks(spec), cfg).pool("offload-swap").slots[0] <= 256 << 20
    ada = Config.from_dict(dict(base, optimizer={"type": "Adafactor"}))
    assert mp.state_chunks(ada, 65_536_000) == ((0, 65_536_000),)
    tiny = Config.from_dict(dict(base, offload_optimizer=dict(base["offload_optimizer"], state_chunk_bytes=4096)))
    with pytest.raises(ValueError, match=r"offload_optimizer.state_chunk_bytes=4096 .* at least \d+ bytes"):
        mp.state_chunks(tiny, 1 << 20)
