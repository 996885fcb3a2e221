"""Parameter offload: bit-exact against the engine without it, the device budget, prefetch,
and the model shapes that trip offload engines (re-used modules, tied weights across
blocks, parameters read outside their module, changing paths, checkpointed activations)."""
import time

import pytest
import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import offload
from offload.optim.rule import UpdateRule
from offload.params.part import ParamState
import _forked
import _resume_worker
from _models import Wide, batches, clone, make_model
from _parity import noise_bound


def cfg(tmp_path, param="none", opt="cpu", **kw):
    c = {"optimizer": {"lr": 1e-3, "weight_decay": 0.01},
         "offload_optimizer": {"device": opt, "nvme_path": str(tmp_path) if opt == "nvme" else None},
         "offload_param": {"device": param, "nvme_path": str(tmp_path) if param == "nvme" else None}}
    c["offload_param"].update(kw.pop("offload_param", {}))
    c.update(kw)
    return c


def train(model, data, config, *, eval_every=0, forward=None):
    eng = offload.initialize(model, config)
    snaps, evals = [], []
    for i, (x, y) in enumerate(data):
        loss = forward(eng, x, y) if forward else eng(x, y)
        eng.backward(loss)
        eng.step()
        snaps.append(eng.full_state_dict())
        if eval_every and (i + 1) % eval_every == 0:
            with torch.no_grad():
                eng.eval()
                evals.append(eng(x).clone())
                eng.train()
    stats = eng.stats()
    eng.close()
    return snaps, evals, stats


def assert_bit_equal(a_snaps, b_snaps):
    assert len(a_snaps) == len(b_snaps)
    for step, (a, b) in enumerate(zip(a_snaps, b_snaps)):
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: {k} differs"


@pytest.mark.parametrize("param", ["cpu", "nvme"])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_bit_exact_against_no_param_offload(param, clip, tmp_path, monkeypatch):
    base = make_model()
    data = batches(10)
    ref, ref_eval, _ = train(clone(base), data, cfg(tmp_path, gradient_clipping=clip), eval_every=5)
    # the offloaded fp32 parameters' new values are written by the update's own pass (an fp32
    # param_copy into the home copy being assembled), never copied from the master after it
    copies, cpu_step = [], UpdateRule.cpu_step

    def spy(self, param, grad, state, group, step, *, param_copy=None, **kw):
        copies.append(param_copy)
        return cpu_step(self, param, grad, state, group, step, param_copy=param_copy, **kw)
    monkeypatch.setattr(UpdateRule, "cpu_step", spy)
    got, got_eval, stats = train(clone(base), data, cfg(tmp_path, param, opt="nvme" if param == "nvme" else "cpu",
                                                         gradient_clipping=clip), eval_every=5)
    assert_bit_equal(ref, got)
    assert copies and all(c is not None and c.dtype == torch.float32 for c in copies)
    # eval forwards use the same fetch path; they agree to rounding only, because torch's
    # MultiheadAttention inference fast path is skipped while the engine's torch-function
    # mode (which catches parameters read outside their module) is active
    assert len(got_eval) == 2
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(ref_eval, got_eval))
    assert stats["prefetch"]["hits"] > stats["prefetch"]["misses"]


def test_resume_with_param_offload_is_bit_exact(tmp_path):
    """Parameters and optimizer state on NVMe: N steps + save + load in a new process + M
    steps equals N + M steps, bit for bit."""
    nv = tmp_path / "nvme"
    nv.mkdir()
    ck = str(tmp_path / "ckpt")

    def run(*args):      # each leg in a process of its own
        _forked.call(_resume_worker.run, "nvme", str(nv), ck, *args, True, timeout_s=300,
                     what="a resume test's leg")
    run(str(tmp_path / "full.pt"), "0", "6", "2")
    run(str(tmp_path / "first.pt"), "0", "4", "0")
    run(str(tmp_path / "resumed.pt"), "4", "6", "1")
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert list(full) == list(resumed)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert not torch.equal(torch.load(tmp_path / "first.pt")["tok.weight"], full["tok.weight"])


def test_device_budget_is_never_exceeded(tmp_path):
    torch.manual_seed(0)
    model = Wide(layers=20)
    block = (128 * 128 + 128) * 4
    total = sum(p.numel() for p in model.parameters()) * 4
    budget = 2 * (block + 4096)      # about two blocks (flat buffers are padded to 4 KiB)
    assert total >= 8 * budget
    eng = offload.initialize(model, cfg(tmp_path, "nvme", opt="nvme",
                                        offload_param={"device_budget_bytes": budget}))
    peak = []
    orig = eng.param_offload._note_peak

    def spy():
        orig()
        peak.append(eng.param_offload.prefetcher.device_bytes())
    eng.param_offload._note_peak = spy
    x = torch.randn(4, 128)
    for _ in range(4):
        eng.backward(eng(x))
        eng.step()
        assert eng.stats()["device_param_bytes_peak"] <= budget
    assert max(peak) <= budget and max(peak) >= block
    s = eng.stats()
    assert s["param_budget_overruns"] == 0
    assert s["prefetch"]["hits"] > 0
    eng.close()


class Branchy(nn.Module):
    """Uses one layer twice per forward, reads a parameter outside its module's forward,
    and takes another path when ``skip`` is set."""

    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, d)
        self.skip = False

    def forward(self, x, y=None):
        h = self.emb(x)
        h = torch.tanh(self.a(h))
        if not self.skip:
            h = torch.tanh(self.b(h))
        h = torch.tanh(self.a(h))                    # a again
        h = h + self.c.bias                          # c's bias read outside c's forward
        logits = F.linear(h, self.emb.weight)        # the embedding read as the head
        out = logits.float().logsumexp(-1).mean()
        return out if y is None else out + 0 * y.sum()


def test_reused_module_outside_reads_and_path_change(tmp_path):
    torch.manual_seed(0)
    base = Branchy()
    data = batches(8, vocab=50)

    def forward(eng, x, y):
        eng.module.skip = 3 <= forward.calls < 5     # the path changes for two steps
        forward.calls += 1
        return eng(x, y)
    forward.calls = 0
    ref, _, _ = train(clone(base), data, cfg(tmp_path), forward=forward)
    forward.calls = 0
    got, _, stats = train(clone(base), data, cfg(tmp_path, "nvme", opt="nvme"), forward=forward)
    assert_bit_equal(ref, got)
    assert stats["prefetch"]["divergences"] >= 1
    assert stats["counters"].get("param_reads_outside_forward", 0) >= 1


class Checkpointed(nn.Module):
    def __init__(self, layers=4, d=32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
                                    for _ in range(layers))

    def forward(self, x, y=None):
        for layer in self.layers:
            x = x + checkpoint(layer, x, use_reentrant=False)
        out = x.pow(2).mean()
        return out if y is None else out + 0 * y.sum()


def test_activation_checkpointing(tmp_path):
    torch.manual_seed(0)
    base = Checkpointed()
    data = [(torch.randn(4, 32), torch.zeros(1)) for _ in range(5)]
    ref, _, _ = train(clone(base), data, cfg(tmp_path))
    got, _, _ = train(clone(base), data, cfg(tmp_path, "cpu"))
    assert_bit_equal(ref, got)


def test_released_parameters_are_placeholders(tmp_path):
    model = make_model()
    eng = offload.initialize(model, cfg(tmp_path, "cpu"))
    x, y = batches(1)[0]
    eng.backward(eng(x, y))
    eng.step()
    eng.synchronize()
    released = [p for p in model.layers[0].parameters() if p.requires_grad]
    # between steps nothing of layer 0 is on the device: a stray use fails loudly
    assert all(p.numel() == 0 for p in released)
    # the frozen layer is offloaded with its block too (no gradient, no optimizer state)
    assert id(model.layers[1].ln1.weight) in eng.param_offload.frozen_io.ids()
    eng.close()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_models_bit_exact(arch, tmp_path):
    transformers = pytest.importorskip("transformers", reason="HF transformers is not installed")
    if arch == "gpt2":
        conf = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=3, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        make = transformers.GPT2LMHeadModel
    else:
        conf = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                        tie_word_embeddings=True)
        make = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    base = make(conf)
    data = batches(4, vocab=97)

    def forward(eng, x, y):
        return eng(input_ids=x, labels=x).loss
    ref, _, _ = train(clone(base), data, cfg(tmp_path), forward=forward)
    got, _, _ = train(clone(base), data, cfg(tmp_path, "nvme"), forward=forward)
    assert_bit_equal(ref, got)


def _wide_run(tmp_path, base, xs, prefetch):
    """The user's loop (no synchronisation) on NVMe homes. Returns, per step, the blocks the
    forward first used with no NVMe read of theirs since the last step() (served from memory),
    the blocks written through, the losses and the final weights."""
    block = (64 * 64 + 64) * 4
    eng = offload.initialize(clone(base), cfg(tmp_path / str(prefetch), "nvme", opt="cpu",
                                              prefetch={"enabled": prefetch},
                                              offload_param={"device_budget_bytes": 2 * (block + 4096)}))
    events = []                                   # ("read", block) / ("use", block), in order
    store, po = eng.resources.store("params"), eng.param_offload
    real_read, real_materialize = store.read, po.materialize

    def read(key, *a, **k):
        events.append(("read", int(key.split(".")[0][1:])))
        return real_read(key, *a, **k)

    def materialize(block):                       # the block on the device, its reads done
        real_materialize(block)
        events.append(("use", block.index))
    store.read, po.materialize = read, materialize
    served, losses = [], []
    for x in xs:
        events.clear()
        loss = eng(x)
        first_use = {}
        for k, (what, i) in enumerate(events):
            if what == "use":
                first_use.setdefault(i, k)
        served.append({i for i, k in first_use.items() if ("read", i) not in events[:k]})
        eng.backward(loss)
        eng.step()
        losses.append(loss.detach())
    kept = [i for i in range(len(eng.blocks)) if eng.param_offload.write_through.keeps_staged(i)]
    got = eng.full_state_dict()
    eng.close()
    return served, kept, torch.stack(losses), got


def test_updated_blocks_stay_staged_for_the_next_forward(tmp_path):
    """NVMe homes: the blocks the next forward uses first (within the device budget plus the
    host lookahead) are written through their staging buffers by the update and stay staged,
    so that forward uses them without reading them from NVMe; the others are written through
    a write buffer, asynchronously, and read back; without prefetch every block is read back
    before its use. Training stays what plain torch AdamW computes (the tolerance of
    tests/engine/test_step.py: twice torch's own fused-vs-single distance)."""
    torch.manual_seed(0)
    base = Wide(layers=8, d=64)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 64, generator=g) for _ in range(6)]
    (tmp_path / "True").mkdir()
    (tmp_path / "False").mkdir()
    on = _wide_run(tmp_path, base, xs, True)
    off = _wide_run(tmp_path, base, xs, False)
    # the device budget (two blocks) and the host lookahead (default: twice the budget, four
    # blocks) cover six blocks of eight
    kept = set(range(6))
    assert on[1] == sorted(kept) and off[1] == []
    for s in range(1, len(xs)):                   # from the first commit on (the order it plans
                                                  # with is the one the first step recorded)
        # block 0, the first the next forward needs, is at times read again when its
        # update finishes after that forward asked for it: five of six at least
        assert len(on[0][s] & kept) >= len(kept) - 1, on[0]
        assert off[0][s] == set(), off[0]
    for _, _, losses, got in (on, off):
        _assert_as_torch_adamw(base, xs, losses, got)


def _assert_as_torch_adamw(base, xs, losses, got):
    """The losses and final weights are plain torch AdamW's (cfg's hyper-parameters) within
    twice torch's own fused-vs-single distance, and training moved the weights."""
    ref, fused = [], []
    for kw, out in (({"foreach": False}, ref), ({"fused": True}, fused)):
        model = clone(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **kw)
        for x in xs:
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.detach())
        out.append(model.state_dict())
    sd_bound = noise_bound(ref[-1], fused[-1])
    loss_bound = noise_bound(torch.stack(ref[:-1]), torch.stack(fused[:-1]))
    assert max((ref[-1][k] - got[k]).abs().max().item() for k in got) <= sd_bound
    assert (torch.stack(ref[:-1]) - losses).abs().max().item() <= loss_bound
    assert max((ref[-1][k] - base.state_dict()[k]).abs().max().item() for k in ref[-1]) > 1e-3


class _DeferredWrite:
    """A parameter write that reaches the disk only ``delay`` seconds after it was submitted
    (a slow disk), and not before ``gate()`` opens (at most ``hold`` seconds after the
    submission): until then NVMe still holds the old bytes, so a read issued too early would
    serve stale parameters."""

    def __init__(self, submit, key, src, delay, pending, gate=lambda: True, hold=0.0):
        self.submit, self.key, self.src, self.pending, self.gate = submit, key, src, pending, gate
        now = time.monotonic()
        self.until, self.hold = now + delay, now + max(delay, hold)
        self.real = None
        pending[key] = pending.get(key, 0) + 1

    def _due(self) -> bool:
        now = time.monotonic()
        return now >= self.until and (self.gate() or now >= self.hold)

    def _go(self):
        if self.real is None:
            self.real = self.submit(self.key, self.src)
            self.real.wait(60)                    # on the disk now: reads may see it
            self.pending[self.key] -= 1

    def done(self):
        if not self._due():
            return False
        self._go()
        return self.real.done()

    def wait(self, timeout=None):
        end = None if timeout is None else time.monotonic() + timeout
        while not self._due():
            if end is not None and time.monotonic() >= end:
                raise TimeoutError(f"write of key {self.key!r} not done after {timeout} s")
            time.sleep(0.002)
        self._go()


@pytest.mark.parametrize("prefetch", [True, False])
def test_write_back_in_flight_is_served_or_read_after_it(prefetch, tmp_path):
    """NVMe homes on a slow disk (each parameter write lands 30 ms after its submission; those
    of the first and the last block of the forward not before the block's next use has
    begun, or 1 s, so a use meets a write in flight however slow the machine): the update
    jobs return with their writes in flight, and the user's loop (no synchronisation) goes on. A block kept staged is served from its held
    buffer while its write goes on; any other is read back only once its write has landed:
    no read of a home is ever issued while a write of it is in flight, and training is plain
    torch AdamW's."""
    torch.manual_seed(0)
    base = Wide(layers=8, d=64)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(4, 64, generator=g) for _ in range(5)]
    block = (64 * 64 + 64) * 4
    eng = offload.initialize(clone(base), cfg(tmp_path, "nvme", opt="cpu", prefetch={"enabled": prefetch},
                                              offload_param={"device_budget_bytes": 2 * (block + 4096)}))
    store = eng.resources.store("params")
    pending, early, served_in_flight, read_after_write = {}, [], [0], [0]
    offloaded = eng.param_offload.offloaded
    gated = {p.key for bp in (offloaded[0], offloaded[-1]) for p in bp.parts}
    used = set()                       # gated keys whose block's use began since their last write
    real_write, real_read = store.write, store.read

    def write(key, src):
        if key in gated:
            used.discard(key)
            return _DeferredWrite(real_write, key, src, 0.03, pending, gate=lambda: key in used, hold=1.0)
        if key.endswith(".param"):
            return _DeferredWrite(real_write, key, src, 0.03, pending)
        return real_write(key, src)

    def read(key, dst):
        if pending.get(key):
            early.append(key)
        return real_read(key, dst)
    store.write, store.read = write, read
    real_materialize = eng.param_offload.materialize

    def materialize(block):
        parts = block.parts
        waits = [p.key for p in parts if p.state is ParamState.WRITING]
        read_after_write[0] += bool(waits)
        used.update(waits)                 # the use waits for these writes: they may land now
        real_materialize(block)
        served_in_flight[0] += any(p.writing for p in parts)   # on the device, its write going on
        used.update(p.key for p in parts)  # a kept block's write lands after its use
    eng.param_offload.materialize = materialize
    losses = []
    for x in xs:
        loss = eng(x)
        eng.backward(loss)
        eng.step()
        losses.append(loss.detach())
    got = eng.full_state_dict()
    assert not eng.param_offload.offloaded[0].writing        # synchronize waited for every write
    eng.close()
    assert early == [], early
    assert read_after_write[0] > 0                         # a use met a write in flight
    if prefetch:
        assert served_in_flight[0] > 0                     # a kept block served while written
    _assert_as_torch_adamw(base, xs, torch.stack(losses), got)


def test_uses_that_need_no_fetch_fetch_nothing(tmp_path):
    """A LoRA Llama with tied embeddings, parameters on NVMe, a device budget of two blocks:
    the embedding the forward's lm_head reads last is read again at once by lm_head's backward,
    so it stays on the device for it (not fetched again); the next forward's first block, which
    no update changes (the frozen embedding), is read while backward ends, before step(); and the
    next module of a block already in use fetches nothing and walks no block list (the
    lookahead is advanced once per use of another block, not per module)."""
    from _hf import tiny_llama, SEQ, VOCAB
    from offload.core.hooks import in_backward
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                              target_modules=["q_proj", "v_proj"]))
    model.base_model.model.config.tie_word_embeddings = True
    model.base_model.model.tie_weights()
    embed = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embed
    budget = 2 * max(embed.numel() * 4, 32 * 1024) + 8192
    eng = offload.initialize(model, cfg(tmp_path, "nvme", opt="nvme", offload_param={"device_budget_bytes": budget}))
    po = eng.param_offload
    emb = next(b for b in po.offloaded if any(s.param is embed for _, s in b.segments))
    assert emb.trainable is None                      # frozen only
    seen, issues, calls = [], [0], [0]
    real_materialize, real_issue = po.materialize, po.prefetcher.issue

    def materialize(block):
        calls[0] += 1
        seen.append((block, block.residency, in_backward()))
        real_materialize(block)

    def issue():
        issues[0] += 1
        real_issue()
    po.materialize, po.prefetcher.issue = materialize, issue
    g = torch.Generator().manual_seed(1)
    xs = torch.randint(0, VOCAB, (3, 2, SEQ), generator=g)
    try:
        for k, x in enumerate(xs):
            seen.clear()
            issues[0] = calls[0] = 0
            eng.backward(eng(input_ids=x, labels=x).loss)
            if k:
                first_backward = next((i, st) for i, st, back in seen if back)
                assert first_backward == (emb, ParamState.ON_DEVICE), first_backward
                # its read for the next forward is on its way already
                assert emb.residency is not ParamState.HOME
                assert calls[0] > 2 * issues[0], (calls[0], issues[0])
            eng.step()
    finally:
        eng.close()
