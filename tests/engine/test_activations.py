"""Activation offload: training with it equals training without it bit for bit (fp32, bf16;
with and without activation checkpointing; the engine's GPT, HF Llama and GPT-2; with
parameter and optimizer offload), and what moves is exactly what plain torch saves."""
import functools
import re

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload.models.gpt import GPT, GPTConfig
from _models import batches, clone

MIN_BYTES = 512       # small models: most saved tensors move, the smallest stay


def make(arch: str, ckpt: bool):
    torch.manual_seed(0)
    if arch == "gpt":
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32))
        if ckpt:   # the engine's GPT has no switch: checkpoint each block (reentrant flavour)
            for blk in model.blocks:
                blk.forward = functools.partial(checkpoint, blk.forward, use_reentrant=True)
        return model
    transformers = pytest.importorskip("transformers", reason="HF transformers is not installed")
    if arch == "gpt2":
        conf = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(conf)
    else:
        conf = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                        tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(conf)
    if ckpt:       # Hugging Face's switch (non-reentrant torch.utils.checkpoint)
        model.gradient_checkpointing_enable()
    return model


def loss_of(arch, eng, x, y):
    return eng(x, y) if arch == "gpt" else eng(input_ids=x, labels=x).loss


def config(tmp_path, act: str, precision: str):
    tier = "nvme" if act == "nvme" else "cpu"      # nvme activations ride with everything on NVMe
    path = str(tmp_path)
    return {"optimizer": {"lr": 1e-3, "weight_decay": 0.01}, "precision": precision,
            "offload_optimizer": {"device": tier, "nvme_path": path},
            "offload_param": {"device": tier, "nvme_path": path},
            "offload_activations": {"device": act, "nvme_path": path, "min_bytes": MIN_BYTES,
                                    "lookahead_bytes": 64 << 10}}


def train(arch, model, cfg, data):
    model.train()
    eng = offload.initialize(model, cfg)
    snaps = []
    for x, y in data:
        x, y = x.to(eng.device), y.to(eng.device)      # on a GPU machine too (gpu_check.sh)
        eng.backward(loss_of(arch, eng, x, y))
        eng.step()
        snaps.append(eng.full_state_dict())
    stats = eng.stats()
    eng.close()
    return snaps, stats


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["gpt", "llama", "gpt2"])
def test_bit_exact_with_and_without_activation_offload(arch, precision, ckpt, tmp_path):
    base = make(arch, ckpt)
    data = batches(3, vocab=64)
    for act in ("cpu", "nvme"):
        cfg = config(tmp_path, act, precision)
        ref, _ = train(arch, clone(base), {**cfg, "offload_activations": {"device": "none"}}, data)
        got, stats = train(arch, clone(base), cfg, data)
        for step, (a, b) in enumerate(zip(ref, got)):
            for k in a:
                assert torch.equal(a[k], b[k]), f"{act}: step {step}: {k} differs"
        st = stats["activations"]
        assert st["tensors"] > 0 and st["bytes_moved"]["d2h"] == st["saved_bytes"] > 0
        assert st["bytes_moved"]["h2d"] == st["saved_bytes"]     # each back once
        assert st["prefetch"]["hits"] > st["prefetch"]["misses"]


def test_a_forward_that_saves_nothing_that_large_trains_and_moves_nothing(tmp_path):
    """``min_bytes`` above every tensor the forward saves (a small model, the default 1 MiB):
    nothing leaves, nothing is read back, and the steps equal those without offload."""
    base = make("gpt", False)
    data = batches(2, vocab=64)
    cfg = config(tmp_path, "nvme", "fp32")
    cfg["offload_activations"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    ref, _ = train("gpt", clone(base), {**cfg, "offload_activations": {"device": "none"}}, data)
    got, stats = train("gpt", clone(base), cfg, data)
    for a, b in zip(ref, got):
        assert all(torch.equal(a[k], b[k]) for k in a)
    st = stats["activations"]
    assert st["tensors"] == 0 and st["bytes_moved"]["d2h"] == st["bytes_moved"]["h2d"] == 0


def _plain_saved_bytes(model, x, min_bytes, *, arch):
    """What plain torch saves for backward in one forward, as the outermost saved-tensor hooks
    see it: unique tensors of at least ``min_bytes`` that are not parameters or views of one."""
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total, count = set(), 0, 0

    def pack(t):
        nonlocal total, count
        n = t.numel() * t.element_size()
        if n >= min_bytes and t.untyped_storage().data_ptr() not in storages and id(t) not in seen:
            seen.add(id(t))
            total += n
            count += 1
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x) if arch == "gpt" else model(input_ids=x, labels=x).loss
    loss.backward()
    return total, count


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_moves_what_torch_saves_and_only_checkpoint_boundaries(ckpt, tmp_path):
    arch = "llama"
    base = make(arch, ckpt)
    x, _ = batches(1, vocab=64)[0]
    want_bytes, want_count = _plain_saved_bytes(clone(base), x, MIN_BYTES, arch=arch)
    cfg = config(tmp_path, "cpu", "fp32")
    cfg["offload_param"] = {"device": "none"}
    model = clone(base)
    eng = offload.initialize(model, cfg)
    xd = x.to(eng.device)
    eng.backward(loss_of(arch, eng, xd, xd))
    eng.step()
    st = eng.stats()["activations"]
    eng.close()
    assert (st["saved_bytes"], st["tensors"]) == (want_bytes, want_count)
    if ckpt:   # only the 3 layers' boundaries (hidden states; the shared rotary cos/sin once) and the head
        _, plain_count = _plain_saved_bytes(clone(make(arch, False)), x, MIN_BYTES, arch=arch)
        assert st["tensors"] < plain_count / 3


def test_parameters_are_never_copied(tmp_path):
    """A model that saves its parameters and a view of one: nothing of them moves."""
    class SavesParams(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64))

        def forward(self, x, y=None):
            h = x @ self.w            # saves x and w
            h = h * self.w.t()        # saves a view of w (and h)
            return h.pow(2).mean()
    torch.manual_seed(0)
    model = SavesParams()
    cfg = {"offload_optimizer": {"device": "cpu"}, "offload_activations": {"device": "cpu", "min_bytes": 1}}
    eng = offload.initialize(model, cfg)
    x = torch.randn(64, 64, device=eng.device)
    loss = eng(x)
    eng.backward(loss)
    eng.step()
    st = eng.stats()["activations"]
    eng.close()
    # x (saved by matmul), h (saved by mul) and h*w.t() (saved by pow): three activations, no parameter
    assert st["tensors"] == 3 and st["saved_bytes"] == 3 * 64 * 64 * 4


def test_config_flag_and_deepspeed_mapping(tmp_path):
    c = offload.Config.from_flags(["--offload-activations", "nvme", "--nvme-path", str(tmp_path)])
    assert (c.offload_activations.device, c.offload_activations.nvme_path) == ("nvme", str(tmp_path))
    with pytest.warns(UserWarning, match="activation_checkpointing.partition_activations"):
        ds = offload.Config.from_any({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {
            "cpu_checkpointing": True, "partition_activations": True}})
    assert ds.offload_activations.device == "cpu"
    with pytest.raises(offload.config.ConfigError, match="offload_activations.device"):
        offload.Config.from_any({"offload_activations": {"device": "gpu"}})
    with pytest.raises(offload.config.ConfigError, match="offload_activations.nvme_path"):
        offload.Config.from_any({"offload_activations": {"device": "nvme"}})


def test_block_phases_and_one_saved_tensor_chain(tmp_path):
    """The hook owner drives every block FORWARD_DONE after forward and IDLE after backward;
    parameter offload and activation offload share one saved-tensor chain, parameters first."""
    from offload.core.block import BlockPhase
    from _models import make_model
    model = make_model()
    eng = offload.initialize(model, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                                     "offload_activations": {"device": "cpu", "min_bytes": 1}})
    assert eng.hooks.saved.handlers == [eng.param_offload, eng.activations]
    x, y = batches(1)[0]
    loss = eng(x, y)
    assert all(p is BlockPhase.FORWARD_DONE for p in (b.phase for b in eng.blocks))
    eng.backward(loss)
    assert all(p is BlockPhase.IDLE for p in (b.phase for b in eng.blocks))
    eng.step()
    st = eng.stats()
    eng.close()
    assert st["activations"]["tensors"] > 0 and st["prefetch"]["hits"] + st["prefetch"]["misses"] > 0


class _LentCount:
    """An independent count of the host memory the activation pool lends: every range handed
    out (HostBuffer created by the pool named offload-activations) and given back, with the
    peak of the bytes out at once."""

    def __init__(self, monkeypatch):
        from offload.storage import pool as pool_mod
        self.out = self.peak = self.loans = 0
        init, release = pool_mod.HostBuffer.__init__, pool_mod.HostBuffer.release
        mine = lambda buf: buf._pool.name == "offload-activations"   # noqa: E731

        def counted_init(buf, pool, index, data):
            init(buf, pool, index, data)
            if mine(buf):
                self.out += buf.nbytes
                self.loans += 1
                self.peak = max(self.peak, self.out)

        def counted_release(buf):
            if mine(buf):
                self.out -= buf.nbytes
            release(buf)
        monkeypatch.setattr(pool_mod.HostBuffer, "__init__", counted_init)
        monkeypatch.setattr(pool_mod.HostBuffer, "release", counted_release)


def _largest_saved(model, x):
    sizes = [0]

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)
    loss.backward()
    return max(sizes)


@pytest.mark.parametrize("act", ["cpu", "nvme"])
def test_host_copies_draw_on_the_budgeted_pool(act, tmp_path, monkeypatch):
    """The host copies are ranges of the offload-activations pool, whose bytes lent at once
    (counted outside the engine) never exceed offload_activations.host_bytes; with nvme a
    pool far smaller than what one forward saves spills to NVMe as it fills, and training
    still equals training without activation offload bit for bit."""
    base = make("gpt", False)
    data = batches(3, vocab=64)
    cfg = config(tmp_path, act, "fp32")
    page = 4096
    largest = -(-_largest_saved(clone(base), data[0][0]) // page) * page
    # nvme: room for two of the largest tensors (and an odd size: the pool rounds down);
    # cpu: a whole forward's copies must fit
    budget = 2 * largest + 1000 if act == "nvme" else 4 << 20
    cfg["offload_activations"] = {**cfg["offload_activations"], "host_bytes": budget}
    ref, _ = train("gpt", clone(base), {**cfg, "offload_activations": {"device": "none"}}, data)
    lent = _LentCount(monkeypatch)
    model = clone(base)
    eng = offload.initialize(model, cfg)
    assert eng.plan.pool("offload-activations").nbytes == budget // page * page
    got = []
    for x, y in data:
        eng.backward(eng(x, y))
        eng.step()
        got.append(eng.full_state_dict())
    st = eng.stats()
    assert st["tier_bytes"]["host"] == eng.plan.host          # the pool is counted with the others
    eng.close()
    for step, (a, b) in enumerate(zip(ref, got)):
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: {k} differs"
    act_st = st["activations"]
    assert 0 < lent.peak <= budget
    # every host copy took a range of the pool; on the CPU device with nvme, dense tensors are
    # written straight from device memory (a range only for the bytes before their first page)
    direct = act_st["direct_tensors"]
    assert lent.loans >= act_st["tensors"] - direct and act_st["tensors"] > 0
    assert (direct > 0) == (act == "nvme" and eng.device.type == "cpu")
    assert act_st["host_bytes_peak"] <= budget and act_st["host_pool_bytes"] <= budget
    if act == "nvme":                   # the pool binds: one forward saves far more than it holds
        assert act_st["saved_bytes"] / len(data) > 3 * budget
        assert act_st["bytes_moved"]["nvme_write"] >= act_st["saved_bytes"]


def test_host_pool_too_small_is_an_error_naming_the_fix(tmp_path):
    """cpu: a forward whose copies do not fit fails naming host_bytes and the ways out, at
    once (nothing would free a range before its backward); nvme: a tensor larger than the
    whole pool fails naming the size that works. Both leave the engine closable."""
    from offload.engine.activations import ActivationHostBudgetError
    base = make("gpt", False)
    x, y = batches(1, vocab=64)[0]
    largest = _largest_saved(clone(base), x)
    for act, host_bytes, match in (
            ("cpu", 4 * 4096, r"this forward saves .*offload_activations.host_bytes=16384 .*raise "
                              r"offload_activations.host_bytes, set offload_activations.device to nvme"),
            ("nvme", 4096, r"a saved tensor of (\d+) bytes .* does not fit in the host pool "
                           r"\(offload_activations.host_bytes=4096 .*raise offload_activations.host_bytes to at "
                           r"least (\d+)")):
        cfg = config(tmp_path, act, "fp32")
        cfg["offload_activations"] = {**cfg["offload_activations"], "host_bytes": host_bytes}
        eng = offload.initialize(clone(base), cfg)
        with pytest.raises(ActivationHostBudgetError, match=match) as err:
            eng(x, y)
        eng.close()
        if act == "nvme":               # the size named is the tensor's, in pages, and it would fit
            n, need = map(int, re.search(match, str(err.value)).groups())
            assert need == -(-n // 4096) * 4096 > 4096 and n <= largest
    with pytest.raises(offload.config.ConfigError, match="offload_activations.host_bytes"):
        offload.Config.from_any({"offload_activations": {"device": "cpu", "host_bytes": 100}})


def test_direct_writes_handed_back_before_durable(tmp_path):
    """CPU device, nvme: dense tensors are written straight from device memory. A tensor that
    backward needs while its write is still in flight is handed back as it is (no read), the
    write finishes later, and the next steps read the rest from NVMe: training still equals
    training without activation offload bit for bit."""
    base = make("llama", False)
    data = batches(3, vocab=64)
    cfg = config(tmp_path, "nvme", "fp32")
    cfg["offload_param"] = {"device": "none"}
    cfg["offload_activations"] = {**cfg["offload_activations"], "lookahead_bytes": 1 << 30}
    ref, _ = train("llama", clone(base), {**cfg, "offload_activations": {"device": "none"}}, data)
    eng = offload.initialize(clone(base), cfg)
    if eng.device.type != "cpu":
        eng.close()
        pytest.skip("direct writes are the CPU device's path")
    held = {"open": False}

    class Held:                    # a write that does not report done until the gate opens
        def __init__(self, io):
            self.io = io

        def done(self):
            return held["open"] and self.io.done()

        def wait(self, timeout=None):
            self.io.wait(timeout)
    store = eng.activations.store
    write = store.write
    store.write = lambda key, src: Held(write(key, src))
    got = []
    for step, (x, y) in enumerate(data):
        held["open"] = step > 0    # the first forward's writes all look in flight at its backward
        eng.backward(loss_of("llama", eng, x, y))
        eng.step()
        got.append(eng.full_state_dict())
    st = eng.stats()["activations"]
    eng.close()
    for step, (a, b) in enumerate(zip(ref, got)):
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: {k} differs"
    assert st["direct_tensors"] > 0 and st["prefetch"]["before_durable"] >= st["direct_tensors"] / len(data)
    assert st["bytes_moved"]["nvme_read"] < st["bytes_moved"]["nvme_write"]   # handed back, not read
    assert st["bytes_moved"]["h2d"] == st["saved_bytes"]


def test_read_window_reuses_ranges_only_after_their_tensors_die():
    """The read window lends page-aligned ranges as tensors with storages of their own: a
    range comes back only when autograd (here: the test) lets its tensor go, is then lent
    again (its pages reused), and a tensor still alive keeps its bytes through reuse of the
    others, a trim and the window's close."""
    from offload.engine.read_window import ReadWindow
    w = ReadWindow()
    assert w.lend(4096) is None and w.misses == 1            # no window yet: the caller allocates
    w.ensure(3 * 8192)
    a, b = w.lend(8192), w.lend(8192)
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    a.fill_(7)
    b.fill_(9)
    view = b[100:200].view(torch.int32)                      # a view keeps b's storage (and range)
    pa = a.data_ptr()
    del a
    c = w.lend(8192)
    assert c.data_ptr() == pa                                 # a's range again, once a died
    assert w.lend(16384) is None                              # no room: never waits
    del b
    d = w.lend(8192)
    assert d.data_ptr() not in (pa, view.data_ptr() - 100)    # b still lives through its view
    assert torch.equal(view, torch.full((25,), 0x09090909, dtype=torch.int32))
    del c, d
    assert w.trim() > 0 and torch.equal(view, torch.full((25,), 0x09090909, dtype=torch.int32))
    w.ensure(1 << 20)                                         # b's range on loan: keeps its size
    assert w.capacity_bytes == 3 * 8192
    w.close()
    assert torch.equal(view, torch.full((25,), 0x09090909, dtype=torch.int32))   # memory outlives close
    del view


def test_backward_reads_land_in_reused_memory(tmp_path):
    """CPU device, nvme: every read back lands in the read window, which reuses its pages
    within a backward (its peak is below a step's reads) and has every range back once
    the graph is gone."""
    base = make("llama", False)
    data = batches(3, vocab=64)
    cfg = config(tmp_path, "nvme", "fp32")
    cfg["offload_param"] = {"device": "none"}
    eng = offload.initialize(clone(base), cfg)
    if eng.device.type != "cpu":
        eng.close()
        pytest.skip("the read window is the CPU device's path")
    for x, y in data:
        eng.backward(loss_of("llama", eng, x, y))
        eng.step()
    st = eng.stats()["activations"]
    eng.close()
    win, reads = st["read_window"], st["bytes_moved"]["nvme_read"]
    assert win["loans"] > 0 and win["misses"] == 0 and win["in_use_bytes"] == 0
    assert 0 < win["peak_bytes"] < reads / len(data)
