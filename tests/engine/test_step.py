"""step() as the commit point and close(), against plain PyTorch, on every placement.

The loop is the real one: nothing synchronises between steps (no full_state_dict() or
synchronize() inside the loop), so the next forward runs while the optimizer still writes the
last update, block by block. The model reads parameters where their owning module's hooks do
not run first (a child's bias before the child runs, the head's weight through F.linear in
the root's forward): those reads must wait for the update too.

Every placement: offload_optimizer none / cpu / nvme x offload_param none / cpu / nvme, with
and without clipping. Tolerances: twice the distance between torch's own single-tensor and
fused AdamW on the same run (measured here), plus 1e-6.
"""
import ctypes
import gc
import threading
import weakref

import psutil
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.params.part import ParamPart
from _models import make_model
from _parity import max_diff, noise_bound
from _probes import ahead_blocks

VOCAB, D, LR, WD = 64, 32, 1e-3, 0.01
PLACEMENTS = [(o, p) for o in ("none", "cpu", "nvme") for p in ("none", "cpu", "nvme")]
CASES = [pytest.param(o, p, c, False, id=f"opt-{o}-param-{p}-clip{c}") for o, p in PLACEMENTS for c in (0.0, 0.5)] + [
    # offload_optimizer.update_ahead: each block's update computed during backward, committed by step()
    pytest.param("cpu", p, 0.0, True, id=f"opt-cpu-param-{p}-ahead") for p in ("none", "cpu", "nvme")]


class OutsideReads(nn.Module):
    """Blocks: tok, layers.0-2, head. The root reads the last layer's bias before the layers
    run and the head's weight and bias through F.linear (the head module never runs)."""

    def __init__(self, layers=3):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D)) for _ in range(layers))
        self.head = nn.Linear(D, VOCAB)
        self.register_buffer("gain", torch.tensor(0.5))

    def forward(self, idx, targets):
        x = self.tok(idx) + self.layers[-1][1].bias
        for layer in self.layers:
            x = x + self.gain * torch.tanh(layer(x))
        logits = F.linear(x, self.head.weight, self.head.bias)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, 4, 9), generator=g)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in x]


def cfg(opt, prm, clip, tmp_path, ahead=False, **kw):
    c = {"optimizer": {"type": "AdamW", "lr": LR, "weight_decay": WD}, "gradient_clipping": clip,
         "offload_optimizer": {"device": opt, "update_ahead": ahead}, "offload_param": {"device": prm}}
    for section, tier, sub in (("offload_optimizer", opt, "opt"), ("offload_param", prm, "param")):
        if tier == "nvme":
            (tmp_path / sub).mkdir(parents=True, exist_ok=True)
            c[section]["nvme_path"] = str(tmp_path / sub)
    c.update(kw)
    return c


def torch_run(steps, clip, *, fused=False, backwards=1):
    """Plain PyTorch: ``backwards`` batches' gradients summed per step, clip, AdamW.
    Returns (loss of each forward, final state_dict)."""
    model = make_model(net=OutsideReads)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, **({"fused": True} if fused else {"foreach": False}))
    losses, data = [], batches(steps * backwards)
    for s in range(steps):
        for x, y in data[s * backwards:(s + 1) * backwards]:
            loss = model(x, y)
            loss.backward()
            losses.append(loss.detach())
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.stack(losses), {k: v.detach().clone() for k, v in model.state_dict().items()}


def check(got_losses, got_sd, clip, steps, backwards=1):
    ref_l, ref_sd = torch_run(steps, clip, backwards=backwards)
    fus_l, fus_sd = torch_run(steps, clip, fused=True, backwards=backwards)
    loss_bound = noise_bound(ref_l, fus_l)
    d = (got_losses - ref_l).abs().max().item()
    assert d <= loss_bound, f"losses differ from torch by {d} (bound {loss_bound}): {got_losses} vs {ref_l}"
    sd_bound = noise_bound(ref_sd, fus_sd)
    d = max_diff(ref_sd, got_sd)
    assert d <= sd_bound, f"weights differ from torch by {d} (bound {sd_bound})"
    assert max_diff(ref_sd, make_model(net=OutsideReads).state_dict()) > 1e-3       # the weights really moved


def check_windows(windows, got_losses, got_sd, *, clip=0.0, loss_div=1, before_step=None):
    """Against plain PyTorch, single-tensor and fused AdamW (their distance the tolerance):
    per window (a list of batches) the batches' gradients summed (each loss / ``loss_div``),
    clipped, ``before_step(s, optimizer)``, one step."""
    runs = []
    for fused in (False, True):
        model = make_model(net=OutsideReads)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, **({"fused": True} if fused else {"foreach": False}))
        ref_losses = []
        for s, window in enumerate(windows):
            for x, y in window:
                loss = model(x, y)
                (loss / loss_div).backward()
                ref_losses.append(loss.detach())
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            if before_step is not None:
                before_step(s, opt)
            opt.step()
            opt.zero_grad()
        runs.append((torch.stack(ref_losses), model.state_dict()))
    (ref_l, ref_sd), (fus_l, fus_sd) = runs
    assert (torch.stack(got_losses) - ref_l).abs().max().item() <= noise_bound(ref_l, fus_l)
    assert max_diff(ref_sd, got_sd) <= noise_bound(ref_sd, fus_sd)


def train(eng, data, backwards=1):
    """The user's loop: forward, backward (``backwards`` batches), step; no synchronisation."""
    losses = []
    for s in range(len(data) // backwards):
        for x, y in data[s * backwards:(s + 1) * backwards]:
            loss = eng(x, y)
            eng.backward(loss)
            losses.append(loss.detach())
        assert eng.step() is True
    return losses


@pytest.mark.parametrize("opt,prm,clip,ahead", CASES)
def test_unsynchronised_parity_and_close(opt, prm, clip, ahead, tmp_path):
    """Five steps with the next forward trailing the optimizer; then close(): the model keeps
    the trained values and buffers and runs alone; every engine entry point refuses."""
    model = make_model(net=OutsideReads)
    eng = offload.initialize(model, cfg(opt, prm, clip, tmp_path, ahead))
    losses = train(eng, batches(5))
    final = eng.full_state_dict()
    check(torch.stack(losses), final, clip, 5)
    # with update_ahead every update computed ahead was committed (ahead_blocks: which)
    assert eng.telemetry.counters["updates_ahead"] == (5 * ahead_blocks(eng) if ahead else 0)
    if ahead and prm == "nvme":   # the homes took the staged parameters as they were, no copy
        assert eng.telemetry.counters["ahead_params_adopted"] == eng.telemetry.counters["updates_ahead"]

    eng.close()
    sd = model.state_dict()
    assert list(sd) == list(final)
    for k, v in sd.items():
        assert v.shape == final[k].shape and torch.equal(v.float().cpu(), final[k]), k
    x, y = batches(1, seed=7)[0]
    plain = make_model(net=OutsideReads)
    plain.load_state_dict(final)
    assert torch.equal(model(x, y), plain(x, y))      # the closed engine's model runs alone

    closed = "this engine is closed"
    for call in (lambda: eng(x, y), lambda: eng.backward(plain(x, y)), eng.step, eng.zero_grad,
                 eng.synchronize, eng.full_state_dict, eng.stats, eng.train, eng.eval, eng.parameters,
                 eng.grad_norm, eng.swap_dirs, lambda: eng.save_checkpoint(str(tmp_path / "ck")),
                 lambda: eng.load_checkpoint(str(tmp_path / "ck"))):
        with pytest.raises(RuntimeError, match=closed):
            call()
    eng.close()                                       # a second close is a no-op


@pytest.mark.parametrize("opt,prm,clip,ahead", CASES)
def test_interrupted_window_changes_nothing(opt, prm, clip, ahead, tmp_path):
    """A backward without its step() (the loop stopped) leaves weights, optimizer state and
    counters at the previous step, also in a checkpoint saved then; zero_grad() (the
    engine's or its optimizer's) discards its gradients and training goes on as if it never happened."""
    data = batches(4)
    stray = batches(1, seed=9)[0]
    eng = offload.initialize(make_model(net=OutsideReads), cfg(opt, prm, clip, tmp_path, ahead))
    losses = train(eng, data[:2])
    before = eng.full_state_dict()
    eng.backward(eng(*stray))                         # interrupted: no step()
    assert (eng.global_step, eng.micro_step) == (2, 2)
    after = eng.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    eng.save_checkpoint(str(tmp_path / "ck"))
    # the engine's zero_grad(), or the one of its torch optimizer (what a scheduler-driven
    # loop or Trainer calls): the same discard
    (eng.optimizer if clip else eng).zero_grad()
    losses += train(eng, data[2:])
    check(torch.stack(losses), eng.full_state_dict(), clip, 4)
    eng.close()

    resumed = offload.initialize(make_model(net=OutsideReads), cfg(opt, prm, clip, tmp_path / "again", ahead))
    resumed.load_checkpoint(str(tmp_path / "ck"))
    assert (resumed.global_step, resumed.micro_step) == (2, 2)
    rest = train(resumed, data[2:])
    check(torch.stack(losses[:2] + rest), resumed.full_state_dict(), clip, 4)
    resumed.close()


@pytest.mark.parametrize("opt,prm,clip,ahead", CASES)
def test_two_backwards_one_step(opt, prm, clip, ahead, tmp_path):
    """Two backward() calls then one step(): one update on the summed gradients, as torch."""
    eng = offload.initialize(make_model(net=OutsideReads), cfg(opt, prm, clip, tmp_path, ahead))
    losses = train(eng, batches(6), backwards=2)
    assert (eng.global_step, eng.micro_step) == (3, 3)
    check(torch.stack(losses), eng.full_state_dict(), clip, 3, backwards=2)
    eng.close()


@pytest.mark.parametrize("opt,prm,backwards", [("cpu", "none", 1), ("cpu", "nvme", 2), ("none", "cpu", 1)])
def test_landed_gradients_train_as_torch(opt, prm, backwards, tmp_path):
    """Gradients land directly in each block's buffer (the first backward of a window
    overwrites, a second adds to it): the weights follow torch's, with one or two
    backwards a step, on every tier a landing reaches."""
    eng = offload.initialize(make_model(net=OutsideReads), cfg(opt, prm, 0.0, tmp_path))
    losses = train(eng, batches(6), backwards=backwards)
    check(torch.stack(losses), eng.full_state_dict(), 0.0, 6 // backwards, backwards=backwards)
    eng.close()


@pytest.mark.parametrize("clip,ahead", [(0.5, False), (0.0, True)], ids=["clip", "ahead"])
def test_accumulation_window_commits_at_its_last_step(clip, ahead, tmp_path):
    """gradient_accumulation_steps=2, two backward() calls in each micro-step: the update
    comes at every second step(), on the window's summed gradients (each loss / 2); the
    loop that skips step() inside the window is warned about. With update_ahead, only the
    window's last backward computes updates ahead (the one before it in the same micro-step
    is dropped when the next one adds to its gradients)."""
    eng = offload.initialize(make_model(net=OutsideReads), cfg("cpu", "none", clip, tmp_path, ahead, gradient_accumulation_steps=2))
    data, losses = batches(8), []
    with pytest.warns(UserWarning, match="call step\\(\\) after every backward"):
        for s in range(4):
            for x, y in data[2 * s:2 * s + 2]:
                loss = eng(x, y)
                eng.backward(loss)
                losses.append(loss.detach())
            assert eng.step() is (s % 2 == 1)
    assert (eng.global_step, eng.micro_step) == (2, 4)
    got = eng.full_state_dict()
    assert eng.telemetry.counters["updates_ahead"] == (2 * ahead_blocks(eng) if ahead else 0)
    eng.close()
    # torch: four batches' gradients, each loss / 2, then one step; twice
    check_windows([data[:4], data[4:]], losses, got, clip=clip, loss_div=2)


def test_update_ahead_waits_on_its_worker_for_the_homes_write_back(tmp_path, monkeypatch):
    """update_ahead with parameters on NVMe: each home takes its block's staged parameters as
    its new copy and gives the buffer back once written. A write-back never settled before
    the next backward (no poll settles one here) is waited for by the update's job, on its
    worker, not by backward; every update is still computed ahead, and the weights follow
    torch's."""
    monkeypatch.setattr(ParamPart, "poll_write", lambda self: not self.writing)
    waits, finish = [], ParamPart.finish_write

    def finish_write(self, timeout=None):
        if self.writing:
            waits.append(threading.current_thread() is threading.main_thread())
        return finish(self, timeout)
    monkeypatch.setattr(ParamPart, "finish_write", finish_write)
    eng = offload.initialize(make_model(net=OutsideReads), cfg("cpu", "nvme", 0.0, tmp_path, True))
    losses = train(eng, batches(5))
    final = eng.full_state_dict()
    check(torch.stack(losses), final, 0.0, 5)
    counters = eng.telemetry.counters
    assert counters["updates_ahead"] == 5 * ahead_blocks(eng) == counters["ahead_params_adopted"]
    assert False in waits, "no update's job waited for its home's write-back"
    eng.close()


def test_update_ahead_takes_a_learning_rate_set_before_step(tmp_path):
    """update_ahead: a learning rate set between backward() and step() (a loop that schedules
    it there) is the one applied: the update computed ahead with the old one is dropped and
    step() computes it again; a step whose rate did not change commits what was computed
    ahead."""
    def lr_at(s):
        return LR * (s + 1) if s % 2 else None     # set before steps 1 and 3

    eng = offload.initialize(make_model(net=OutsideReads), cfg("cpu", "nvme", 0.0, tmp_path, True))
    data, losses = batches(4), []
    for s, (x, y) in enumerate(data):
        loss = eng(x, y)
        eng.backward(loss)
        losses.append(loss.detach())
        if lr_at(s):
            for g in eng.optimizer.param_groups:
                g["lr"] = lr_at(s)
        assert eng.step() is True
    got = eng.full_state_dict()
    assert eng.telemetry.counters["updates_ahead"] == 2 * ahead_blocks(eng)   # steps 0 and 2
    eng.close()

    def set_lr(s, opt):
        if lr_at(s):
            for g in opt.param_groups:
                g["lr"] = lr_at(s)
    check_windows([[b] for b in data], losses, got, before_step=set_lr)


@pytest.mark.parametrize("prm", ["cpu", "nvme"])
def test_close_without_restore_releases_offloaded_parameters(prm, tmp_path):
    """close(restore=False): offloaded parameters stay released (empty placeholders), as a
    model larger than host memory keeps them; buffers stay."""
    model = make_model(net=OutsideReads)
    eng = offload.initialize(model, cfg("cpu", prm, 0.0, tmp_path))
    train(eng, batches(2))
    eng.close(restore=False)
    assert all(p.numel() == 0 for p in model.parameters())
    assert model.gain.item() == 0.5


@pytest.mark.parametrize("opt,prm", [("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_close_hands_the_host_memory_back_at_once(opt, prm, tmp_path):
    """close() gives the engine's host memory back at once, not whenever Python's cyclic
    collector next runs (off here): engines built and closed one after another (a sweep,
    Trainer's model_init) do not pile up. Counted with the process's RSS, not the engine's
    own accounting, with the C heap's free pages handed back first (malloc_trim: glibc keeps
    freed tensors' pages, which is not the engine holding them); the model keeps its trained
    parameters."""
    proc = psutil.Process()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", lambda pad: None)

    def rss():
        trim(0)
        return proc.memory_info().rss
    x = torch.randn(8, 1024)

    def run(model, where):
        eng = offload.initialize(model, cfg(opt, prm, 0.0, where))
        for _ in range(2):
            eng.backward(eng(x).square().mean())
            eng.step()
        return eng
    run(nn.Sequential(nn.Linear(1024, 1024)), tmp_path / "warm").close()   # the process's one-time costs
    gc.collect()
    gc.disable()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])     # 32 MiB of fp32
        base = rss()
        eng = run(model, tmp_path)
        sums = {k: v.double().sum() for k, v in eng.full_state_dict().items()}
        taken = rss() - base
        eng.close()
        left = rss() - base
        assert taken > (48 << 20), f"the engine took only {taken >> 20} MiB: nothing to measure"
        assert left < taken // 4, f"{left >> 20} of the {taken >> 20} MiB the engine took are still resident"
        assert {k: v.double().sum() for k, v in model.state_dict().items()} == sums
        assert eng.global_step == 2
        gone = weakref.ref(model)
        del model, eng                  # the user lets go of both: the model's memory goes too
        assert gone() is None, "the closed engine's parts still hold the model"
    finally:
        gc.enable()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU device's zero-copy paths")
def test_cpu_device_steps_parameters_and_gradients_in_place(tmp_path):
    """On a CPU device (fp32, state on the host) the parameters are the fp32 master the
    update writes: the same results as torch with one and two backward() calls per step;
    close() gives the parameters memory of their own, with their trained values."""
    model = make_model(net=OutsideReads)
    eng = offload.initialize(model, cfg("cpu", "none", 0.5, tmp_path))
    for b in eng.blocks:
        master = b.state.views(b.state.acquire())[0]
        for s in b.layout.segments:
            assert s.param.data_ptr() == master[s.offset:].data_ptr(), s.name
    # the parameters are the host pool's bytes: the tiers count them once, under host
    assert eng.stats()["tier_bytes"]["device"] == 0
    losses = train(eng, batches(6), backwards=2)
    check(torch.stack(losses), eng.full_state_dict(), 0.5, 3, backwards=2)
    final = eng.full_state_dict()
    states = {b.state.views(b.state.acquire())[0].untyped_storage().data_ptr() for b in eng.blocks}
    eng.close()
    assert not {p.untyped_storage().data_ptr() for p in model.parameters()} & states
    assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items() if k in final)


@pytest.mark.parametrize("where", ["first block's submit", "last block's submit"])
def test_ctrl_c_during_the_commit_waits_for_the_whole_step(tmp_path, monkeypatch, where):
    """step() commits whole or not at all. A Ctrl-C that arrives once the commit has begun
    submitting updates cuts nothing short: every block gets its update, global_step counts
    it, and the KeyboardInterrupt comes from step() after; nothing is left pending with it
    for the next forward to re-raise, and training goes on."""
    import os
    import signal
    eng = offload.initialize(make_model(net=OutsideReads), cfg("cpu", "none", 0.0, tmp_path))
    target = eng.blocks[0] if where == "first block's submit" else eng.blocks[-1]
    seen = []

    def interrupt(block):
        if block is target and not seen:
            seen.append(block.index)
            os.kill(os.getpid(), signal.SIGINT)
    real_submit = eng.control._submit
    monkeypatch.setattr(eng.control, "_submit", lambda b, c: (interrupt(b), real_submit(b, c))[1])
    idx, tgt = batches(1)[0]
    eng.backward(eng(idx, tgt))
    # Python's own handler, whatever the runner set (a job started in the background of a
    # shell has SIGINT ignored, and then a Ctrl-C is rightly ignored here too)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            eng.step()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [target.index]
    assert eng.global_step == 1
    eng.synchronize()
    assert [b.update.step for b in eng.blocks] == [1] * len(eng.blocks)   # every update, once
    assert all(b.update.future is None or b.update.future.exception() is None for b in eng.blocks)
    eng.zero_grad()
    for idx, tgt in batches(3, seed=2):      # the next calls work: nothing re-raises the interrupt
        eng.backward(eng(idx, tgt))
        assert eng.step() is True
    assert eng.global_step == 4
    eng.close()


def _heap_in_use():
    """Bytes glibc's malloc has handed out and not taken back (every arena, mmapped chunks
    included), or None where unknown (not glibc, glibc < 2.33)."""
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [], Info
    info = fn()
    return info.uordblks + info.hblkhd


@pytest.mark.skipif(torch.cuda.is_available() or _heap_in_use() is None,
                    reason="a CPU device's gradients in glibc's heap")
def test_cpu_device_gradients_do_not_outlive_backward(tmp_path):
    """On a CPU device each gradient is copied into the engine's gradient buffer (host pool,
    allocated once) as it lands and autograd's tensor is freed at once: after backward() the
    heap holds nothing of the step (no fresh allocation per parameter kept until the update,
    which made glibc grow and trim the heap every step), and the next backward reuses that
    memory. Against torch, whose .grad tensors stay allocated until zero_grad().
    On one torch thread: torch's own OpenMP workers allocate buffers of their own, which are
    the threads', not the step's gradients."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(8, 256)
        grad_bytes = 4 * 256 * 256
        ref = model()
        before = _heap_in_use()
        ref(x).square().mean().backward()
        assert _heap_in_use() - before >= 4 * grad_bytes     # torch: every .grad still allocated
        eng = offload.initialize(model(), {"optimizer": {"lr": 1e-3}, "offload_optimizer": {"device": "cpu"}})
        for _ in range(3):
            before = _heap_in_use()
            eng.backward(eng(x).square().mean())
            assert _heap_in_use() - before < grad_bytes
            eng.step()
        eng.close()
    finally:
        torch.set_num_threads(threads)
