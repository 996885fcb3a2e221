"""Update rules (offload/optim/rule.py) against torch.optim, on the native kernels and on the
torch fallback; every SIMD variant against the scalar reference; int8 blockwise state.

Tolerances: each parity test runs torch's single-tensor (foreach=False) optimizer and its
fused one (foreach for Adafactor, which has no fused kernel) on the same data and requires
ours to be within their distance of the single-tensor result, with a floor of one ulp of
the largest parameter (where torch's two kernels agree bit for bit).
"""
from __future__ import annotations

import copy

import pytest
import torch

from offload import _native
from offload.optim import (CPUAdafactor, CPUAdagrad, CPUAdamW, CPULion, CPURuleAdam, CPUSGD, get_rule, quant)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
STEPS = 12


@pytest.fixture(autouse=True, scope="module")
def _torch_single_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(params=["native", "torch"])
def backend(request, monkeypatch):
    monkeypatch.setenv("OFFLOAD_NATIVE", "on" if request.param == "native" else "off")
    if request.param == "native":
        try:
            _native.lib()
        except ImportError as exc:
            pytest.skip(str(exc))
    return request.param


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _grads(shapes, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


def _run(make_opt, p0, grads, snapshot_state=False):
    params = [p.clone().requires_grad_(True) for p in p0]
    opt = make_opt(params)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params], opt


def _ulp(ts):
    return max(torch.finfo(F32).eps * t.abs().max().item() for t in ts)


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


SHAPES = [(7,), (33, 17), (1023,), (4, 5, 6)]

# (our optimizer, torch class, hyper-parameters, the kwargs of torch's "other" kernel)
CASES = [
    ("AdamW", CPUAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01), {"fused": True}),
    ("Adam", CPURuleAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01), {"fused": True}),
    ("SGD", CPUSGD, torch.optim.SGD, dict(lr=1e-2), {"fused": True}),
    ("SGD-momentum", CPUSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01),
     {"fused": True}),
    ("SGD-nesterov", CPUSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
     {"fused": True}),
    ("Adagrad", CPUAdagrad, torch.optim.Adagrad, dict(lr=1e-1), {"fused": True}),
    ("Adagrad-all", CPUAdagrad, torch.optim.Adagrad,
     dict(lr=1e-1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1, eps=1e-6), {"fused": True}),
    ("Adafactor", CPUAdafactor, getattr(torch.optim, "Adafactor", None), dict(lr=1e-2, weight_decay=0.01),
     {"foreach": True}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parity_with_torch(case, backend):
    name, ours, theirs, hp, other = case
    if theirs is None:
        pytest.skip("this torch has no torch.optim.Adafactor (torch >= 2.5)")
    p0, grads = _params(SHAPES), _grads(SHAPES, STEPS)
    single, topt = _run(lambda ps: theirs(ps, foreach=False, **hp), p0, grads)
    fused, _ = _run(lambda ps: theirs(ps, **other, **hp), p0, grads)
    got, oopt = _run(lambda ps: ours(ps, **hp), p0, grads)
    bound = max(_max_diff(single, fused), _ulp(single))
    assert _max_diff(got, single) <= bound, (name, _max_diff(got, single), bound)
    assert _max_diff(single, p0) > 1e-3  # the parameters moved
    # state_dict: the torch layout, both ways; continuing gives the same next step
    sd_t, sd_o = topt.state_dict(), oopt.state_dict()
    for (kt, st), (ko, so) in zip(sorted(sd_t["state"].items()), sorted(sd_o["state"].items())):
        assert set(st) <= set(so) | {"momentum_buffer"}, (set(st), set(so))
        for key, value in st.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert so[key].shape == value.shape and so[key].dtype == value.dtype, key
    g_next = _grads(SHAPES, 1, seed=7)[0]
    ps_t = [p.clone().requires_grad_(True) for p in single]
    ps_o = [p.clone().requires_grad_(True) for p in single]
    t2, o2 = theirs(ps_t, foreach=False, **hp), ours(ps_o, **hp)
    t2.load_state_dict(copy.deepcopy(sd_t))  # torch shares "step" tensors with the source
    o2.load_state_dict(copy.deepcopy(sd_t))  # torch's state into ours
    for ps in (ps_t, ps_o):
        for p, g in zip(ps, g_next):
            p.grad = g.clone()
    t2.step()
    o2.step()
    assert _max_diff(ps_o, ps_t) <= max(bound, _ulp(ps_t))


def lion_published(params, grads_per_step, lr, betas, wd):
    """Lion, Algorithm 2 of Chen et al. 2023, in plain torch (the authors' PyTorch order)."""
    ms = [torch.zeros_like(p) for p in params]
    for gs in grads_per_step:
        for p, g, m in zip(params, gs, ms):
            p.mul_(1 - lr * wd)
            c = m.mul(betas[0]).add(g, alpha=1 - betas[0])
            p.add_(torch.sign(c), alpha=-lr)
            m.mul_(betas[1]).add_(g, alpha=1 - betas[1])
    return params, ms


def test_lion_matches_published_algorithm(backend):
    p0, grads = _params(SHAPES), _grads(SHAPES, STEPS)
    hp = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    want, ms = lion_published([p.clone() for p in p0], grads, hp["lr"], hp["betas"], hp["weight_decay"])
    got, opt = _run(lambda ps: CPULion(ps, **hp), p0, grads)
    assert _max_diff(got, want) <= _ulp(want)
    assert _max_diff(want, p0) > 1e-3
    got_m = [opt.state[p]["exp_avg"] for p in opt.param_groups[0]["params"]]
    assert _max_diff(got_m, ms) <= _ulp(ms)


# ---- every SIMD variant equals the scalar reference ------------------------------------------
KERNEL_RULES = [("AdamW", dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)),
                ("Adam", dict(lr=1e-2, betas=(0.3, 0.99), eps=1e-8, weight_decay=0.01)),
                ("Lion", dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
                ("SGD", dict(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True)),
                ("SGD", dict(lr=1e-2, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)),
                ("Adagrad", dict(lr=1e-1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1,
                                 eps=1e-10))]


def _view(n, dtype, offset):
    """A flat tensor of n elements starting `offset` elements into its storage (unaligned)."""
    return torch.zeros(n + offset, dtype=dtype)[offset:]


def _kernel_run(rule, group, n, g_dtype, state_dtype, copy_dtype, offset, steps=3):
    gen = torch.Generator().manual_seed(3)
    p = _view(n, F32, offset)
    p.copy_(torch.randn(n, generator=gen))
    state = rule.init_state(p, group, state_dtype)
    if state_dtype != "int8":  # unaligned state rows too
        for k, t in list(state.items()):
            v = _view(n, t.dtype, offset)
            v.copy_(t)
            state[k] = v
    copy_t = None if copy_dtype is None else _view(n, copy_dtype, offset)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen)
        g[::5] *= 1e-37  # denormal moments
        g = g.to(g_dtype)
        gv = _view(n, g_dtype, offset)
        gv.copy_(g)
        rule.cpu_step(p, gv, state, group, step, param_copy=copy_t, grad_scale=0.5)
    return [p.clone()] + [t.clone() for t in state.values()] + ([] if copy_t is None else [copy_t.clone()])


@pytest.mark.parametrize("name,group", KERNEL_RULES, ids=[f"{r}{i}" for i, (r, _) in enumerate(KERNEL_RULES)])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_isa_variants_equal_scalar(name, group, state_dtype, monkeypatch):
    monkeypatch.setenv("OFFLOAD_NATIVE", "on")
    try:
        L = _native.lib()
    except ImportError as exc:
        pytest.skip(str(exc))
    rule = get_rule(name)
    isas = [n for c, n in sorted(_native.ISA_NAMES.items()) if c <= L.offload_kernel_best_isa()]
    combos = [(F32, None, 0, 1), (BF16, BF16, 1, 15), (F16, F16, 1, 257), (BF16, None, 3, 1023), (F32, BF16, 1, 5000),
              (F16, BF16, 0, 70001), (BF16, F32, 1, 5000), (F32, F32, 0, 33)]
    try:
        for g_dtype, c_dtype, offset, n in combos:
            results = []
            for isa in isas:
                _native.kernel_set_isa(L, isa)
                results.append(_kernel_run(rule, group, n, g_dtype, state_dtype, c_dtype, offset))
            for isa, r in zip(isas[1:], results[1:]):
                for a, b in zip(r, results[0]):
                    assert torch.equal(a, b), (isa, name, state_dtype, g_dtype, c_dtype, n)
            if c_dtype == F32:   # an fp32 copy is the new param itself, in every variant
                for isa, r in zip(isas, results):
                    assert torch.equal(r[-1].view(torch.int32), r[0].view(torch.int32)), (isa, name, state_dtype, n)
    finally:
        _native.kernel_set_isa(L, None)


def _kernel_run_alternating(rule, group, n, g_dtype, state_dtype, copy_dtype, offset=0, row_offset=0, steps=3):
    """``_kernel_run`` stepping from one buffer into a second and back (``cpu_step(src=...)``,
    optim/ahead.py), the params ``offset`` and the rows ``row_offset`` elements into their
    storage; each step leaves its source as it was."""
    gen = torch.Generator().manual_seed(3)
    p = _view(n, F32, offset)
    p.copy_(torch.randn(n, generator=gen))
    bufs = []
    for k in range(2):
        state = rule.init_state(p, group, state_dtype)
        if state_dtype != "int8":
            for name, t in list(state.items()):
                v = _view(n, t.dtype, row_offset)
                v.copy_(t)
                state[name] = v
        bufs.append((p if k == 0 else _view(n, F32, offset).fill_(float("nan")), state))
    copy_t = None if copy_dtype is None else _view(n, copy_dtype, offset)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen)
        g[::5] *= 1e-37
        (sp, ss), (dp, ds) = bufs[(step - 1) % 2], bufs[step % 2]
        before = [sp.clone()] + [t.clone() for t in ss.values()]
        rule.cpu_step(dp, g.to(g_dtype), ds, group, step, param_copy=copy_t, grad_scale=0.5, src=(sp, ss))
        for a, b in zip([sp] + list(ss.values()), before):
            assert torch.equal(a, b), "the source of an out-of-place step changed"
    p, state = bufs[steps % 2]
    return [p.clone()] + [t.clone() for t in state.values()] + ([] if copy_t is None else [copy_t.clone()])


@pytest.mark.parametrize("name,group", KERNEL_RULES, ids=[f"{r}{i}" for i, (r, _) in enumerate(KERNEL_RULES)])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_step_into_a_second_buffer_equals_the_step_in_place(name, group, state_dtype, backend):
    """update_ahead's step reads the committed state and writes a second buffer: the same bits
    as the step in place, every rule, state dtype and (native) instruction set. Natively in
    one pass, its stores streamed where param, rows and copy align together (sizes from
    4096 elements; the same offset everywhere, with a head, or rows offset otherwise: plain
    stores); int8 state and the torch fallback copy the source over first."""
    rule = get_rule(name)
    L = _native.lib() if backend == "native" else None
    isas = [None] if L is None else [n for c, n in sorted(_native.ISA_NAMES.items()) if c <= L.offload_kernel_best_isa()]
    cases = ((F32, None, 1023, 0, 0), (BF16, BF16, 5000, 0, 0), (F32, F32, 33, 0, 0), (F32, F32, 70001, 3, 3),
             (F16, BF16, 9000, 3, 3), (BF16, F32, 9000, 1, 0))
    try:
        for isa in isas:
            if L is not None:
                _native.kernel_set_isa(L, isa)
            for g_dtype, c_dtype, n, off, row_off in cases:
                want = _kernel_run(rule, group, n, g_dtype, state_dtype, c_dtype, off)
                got = _kernel_run_alternating(rule, group, n, g_dtype, state_dtype, c_dtype, off,
                                              off if state_dtype == "int8" else row_off)
                for a, b in zip(got, want):
                    assert torch.equal(a, b), (isa, name, state_dtype, g_dtype, c_dtype, n, off, row_off)
    finally:
        if L is not None:
            _native.kernel_set_isa(L, None)


@pytest.mark.parametrize("name,group", KERNEL_RULES[2:4], ids=["Lion", "SGD"])
def test_native_equals_torch_fallback_every_state_dtype(name, group, monkeypatch):
    """Lion and SGD use only operations torch's CPU kernels perform identically (fused
    multiply-adds, sign), so the native kernel and the torch fallback agree bit for bit, the
    int8 quantization included."""
    rule = get_rule(name)
    for state_dtype in ("fp32", "bf16", "int8"):
        out = {}
        for mode in ("on", "off"):
            monkeypatch.setenv("OFFLOAD_NATIVE", mode)
            out[mode] = _kernel_run(rule, group, 1000, F32, state_dtype, BF16, 0)
        for a, b in zip(out["on"], out["off"]):
            assert torch.equal(a, b), (name, state_dtype)


# ---- int8 blockwise state ----------------------------------------------------------------------
def test_dynamic_map_is_bitsandbytes():
    """bitsandbytes' create_dynamic_map: 256 sorted values, 0 and 1 included, decades 1e-6..1."""
    for signed in (True, False):
        code = quant.dynamic_map(signed)
        assert code.shape == (256,) and bool((code[1:] >= code[:-1]).all())
        assert code.max().item() == 1.0 and (code == 0).sum().item() == 1
        assert abs(code[code > 0].min().item() - (5.5e-7 if signed else 3.25e-7)) < 1e-12
    assert quant.dynamic_map(True).min().item() == pytest.approx(-0.99296875, abs=1e-7)
    assert quant.dynamic_map(False).min().item() == 0.0


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_picks_nearest_code(signed):
    gen = torch.Generator().manual_seed(0)
    n = 3 * quant.BLOCK + 17
    x = torch.randn(n, generator=gen) * torch.logspace(-6, 0, n)
    if not signed:
        x = x.abs()
    x[quant.BLOCK:2 * quant.BLOCK] = 0  # an all-zero block
    codes, absmax = torch.empty(n, dtype=torch.uint8), torch.empty(quant.nblocks(n))
    quant.quantize(x, codes, absmax, signed)
    code = quant.dynamic_map(signed)
    scale = absmax.repeat_interleave(quant.BLOCK)[:n]
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    best = ((x * inv)[:, None] - code[None, :]).abs()
    got = best.gather(1, codes.long()[:, None])[:, 0]
    assert bool((got <= best.min(dim=1).values).all())
    back = quant.dequantize(codes, absmax, signed)
    assert bool((back[quant.BLOCK:2 * quant.BLOCK] == 0).all())
    # the non-linear code keeps relative precision down to 1e-3 of the block maximum: at most
    # half the relative gap between neighbouring codes there (a linear code would give 0)
    mag = code[code >= 1e-3]
    half_gap = ((mag[1:] - mag[:-1]) / (2 * mag[:-1])).max().item()
    big = x.abs() > 1e-3 * scale
    assert ((back - x).abs()[big] / x.abs()[big]).max().item() <= half_gap * 1.001 < 0.3


def _adversarial_block_values(signed: bool) -> torch.Tensor:
    """Values for int8 quantization with a block maximum of 1: every midpoint of the code
    and its neighbouring floats, the codes themselves, +-0, denormals, +-inf, NaN."""
    code = quant.dynamic_map(signed)
    mid = (code[:-1] + code[1:]) * 0.5
    up, down = torch.nextafter(mid, torch.tensor(2.0)), torch.nextafter(mid, torch.tensor(-2.0))
    x = torch.cat([mid, up, down, code, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-45, float("nan")])])
    return x if signed else x.abs()


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_int8_quantization_at_midpoints_every_isa(signed, monkeypatch):
    """The kernels' int8 requantization on the values where a search can go wrong (exact
    midpoints and their neighbours, ties, zeros of both signs, denormals, NaN; blocks whose
    maximum is inf or a denormal): every ISA stores the codes and scales of the torch reference
    (quant.quantize), bit for bit. SGD with momentum at its first step stores the gradient in
    its one row, so the row is the quantization of chosen values; odd sizes, a short last block."""
    monkeypatch.setenv("OFFLOAD_NATIVE", "on")
    try:
        L = _native.lib()
    except ImportError as exc:
        pytest.skip(str(exc))
    x = _adversarial_block_values(signed)
    gen = torch.Generator().manual_seed(5)
    parts = []
    for scale in (1.0, 0.37, 3e-39):          # block maxima 1, 0.37 and a denormal
        v = x[torch.randperm(x.numel(), generator=gen)] * scale
        for b0 in range(0, v.numel(), quant.BLOCK - 1):
            parts += [torch.tensor([scale]), v[b0:b0 + quant.BLOCK - 1]]
    inf_block = torch.randn(quant.BLOCK, generator=gen)
    inf_block[7] = float("inf")
    g = torch.cat(parts + [inf_block if signed else inf_block.abs(), x[:77]])
    rule, group = get_rule("SGD"), dict(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)
    want_codes, want_absmax = torch.empty(g.numel(), dtype=torch.uint8), torch.empty(quant.nblocks(g.numel()))
    quant.quantize(g, want_codes, want_absmax, signed=True)   # momentum is a signed row
    isas = [n for c, n in sorted(_native.ISA_NAMES.items()) if c <= L.offload_kernel_best_isa()]
    try:
        for isa in isas:
            _native.kernel_set_isa(L, isa)
            p = torch.zeros(g.numel())
            st = rule.init_state(p, group, "int8")
            rule.cpu_step(p, g, st, group, 1)
            assert torch.equal(st["momentum_buffer"], want_codes), isa
            assert torch.equal(st["momentum_buffer_absmax"], want_absmax), isa
    finally:
        _native.kernel_set_isa(L, None)


def test_offload_isa_setting(monkeypatch):
    """OFFLOAD_ISA forces the kernels' ISA (reported by native_info), stays the default that
    kernel_set_isa(None) returns to, and a bad value is an error naming the valid ones."""
    monkeypatch.setenv("OFFLOAD_NATIVE", "on")
    try:
        L = _native.lib()
    except ImportError as exc:
        pytest.skip(str(exc))
    monkeypatch.setenv("OFFLOAD_ISA", "avx3")
    with pytest.raises(ValueError, match="OFFLOAD_ISA='avx3' is not valid: use auto or one of scalar, avx2"):
        _native.isa_setting()
    lower = "avx2" if L.offload_kernel_best_isa() >= 1 else "scalar"
    try:
        monkeypatch.setenv("OFFLOAD_ISA", lower)
        _native._apply_isa_setting(L)
        info = _native.native_info()
        assert (info["isa"], info["isa_setting"]) == (lower, lower)
        assert info["best_isa"] == _native.best_isa(L)
        _native.kernel_set_isa(L, "scalar")
        _native.kernel_set_isa(L, None)
        assert _native.native_info()["isa"] == lower
        if L.offload_kernel_best_isa() < max(_native.ISA_NAMES):
            monkeypatch.setenv("OFFLOAD_ISA", _native.ISA_NAMES[max(_native.ISA_NAMES)])
            with pytest.raises(ValueError, match="unset OFFLOAD_ISA or name an ISA at or below"):
                _native._apply_isa_setting(L)
    finally:
        monkeypatch.delenv("OFFLOAD_ISA")
        _native.kernel_set_isa(L, None)
    assert _native.native_info()["isa"] == _native.best_isa(L)


def test_int8_state_bytes_per_param():
    adam = get_rule("AdamW")
    assert adam.bytes_per_param("host", "int8") <= 6.2
    assert adam.bytes_per_param("host", "fp32") == 12.0
    assert get_rule("Lion").state_bytes_per_param("int8") == pytest.approx(1 + 4 / 256)
    p = torch.zeros(1000)
    st = adam.init_state(p, dict(adam.defaults), "int8")
    assert sum(t.numel() * t.element_size() for t in st.values()) == 2 * (1000 + 4 * 4)


def test_int8_adam_tracks_fp32(backend):
    """A least-squares fit: Adam with int8 state reaches the fp32-state loss within 2 %."""
    gen = torch.Generator().manual_seed(0)
    a, w_true = torch.randn(512, 64, generator=gen), torch.randn(64, 16, generator=gen)
    y = a @ w_true

    def fit(state_dtype):
        w = torch.zeros(64, 16, requires_grad=True)
        opt = CPUAdamW([w], lr=3e-2, weight_decay=0.0, state_dtype=state_dtype)
        for _ in range(200):
            loss = ((a @ w - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return ((a @ w - y) ** 2).mean().item()
    l32, l8 = fit("fp32"), fit("int8")
    start = (y ** 2).mean().item()
    assert l32 < 0.05 * start and abs(l8 - l32) <= 0.02 * start


def test_state_dtype_converts_loaded_state():
    """A torch AdamW state dict loads into an int8 optimizer (quantized at its next step)."""
    p0, grads = _params([(300,)]), _grads([(300,)], 3)
    _, topt = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False), p0, grads)
    ps = [p0[0].clone().requires_grad_(True)]
    opt = CPUAdamW(ps, lr=1e-2, state_dtype="int8")
    opt.load_state_dict(topt.state_dict())
    ps[0].grad = grads[0][0].clone()
    opt.step()
    st = opt.state[ps[0]]
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_absmax"].shape == (2,)
    assert int(st["step"].item()) == 4


def test_bad_hyperparameters_name_the_key():
    with pytest.raises(ValueError, match="lr"):
        CPULion([torch.zeros(3, requires_grad=True)], lr=float("nan"))
    with pytest.raises(ValueError, match="nesterov"):
        CPUSGD([torch.zeros(3, requires_grad=True)], nesterov=True)
    with pytest.raises(TypeError, match="momentum"):
        CPUAdagrad([torch.zeros(3, requires_grad=True)], momentum=0.9)
    with pytest.raises(ValueError, match="state_dtype"):
        CPULion([torch.zeros(3, requires_grad=True)], state_dtype="int4")
    with pytest.raises(ValueError, match="Lion"):
        get_rule("Adamax")


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_state_layout_views_step_in_place(state_dtype):
    """One buffer per shard (optim/state.py StateLayout): aligned regions, the rule steps its views in place, the
    description round-trips; int8 Adam with fp32 master is <= 6.2 bytes per parameter."""
    from offload.optim.state import ALIGN, StateLayout
    rule = get_rule("AdamW")
    group = dict(rule.defaults)
    n = 40960
    lay = StateLayout.for_rule(rule, group, n, state_dtype)
    assert all(r.offset % ALIGN == 0 for r in lay.regions)
    if state_dtype == "int8":
        assert lay.nbytes / n <= 6.2
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    master, state = lay.views(buf)
    master.copy_(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    p_ref = master.clone()
    st_ref = rule.init_state(p_ref, group, state_dtype)
    g = torch.randn(n, generator=torch.Generator().manual_seed(1))
    for step in (1, 2):
        rule.cpu_step(master, g, state, group, step)
        rule.cpu_step(p_ref, g, st_ref, group, step)
    assert torch.equal(master, p_ref) and all(torch.equal(state[k], st_ref[k]) for k in st_ref)
    assert StateLayout.from_description(lay.describe()).describe() == lay.describe()


def test_estimate_asks_the_rule():
    """`offload estimate`'s bytes per tier come from the rule (through the engine's memory
    plan): the optimizer state's share changes by exactly the rule's bytes per parameter,
    AdamW fp32 keeping 12, int8 state 6.03, SGD without momentum only the master."""
    from offload.planner.estimate import placement_bytes, spec_from_counts
    spec = spec_from_counts(1e8, 1e7)
    # page rounding: every region of a shard's layout (master, each row, each int8 row's
    # scales) starts on a 4 KiB page, so two layouts differ by at most 5 pages per block
    P, slack = spec.params, 4096 * 5 * spec.n_blocks
    adamw = get_rule("AdamW").bytes_per_param("nvme", "fp32")
    assert adamw == 12
    fp32 = placement_bytes(spec, "nvme", "none", "bf16")
    int8 = placement_bytes(spec, "nvme", "none", "bf16", state_dtype="int8")
    int8_bpp = get_rule("AdamW").bytes_per_param("nvme", "int8")
    assert int8_bpp < 6.2
    assert abs((fp32.nvme - int8.nvme) - (adamw - int8_bpp) * P) <= slack
    sgd_bpp = get_rule("SGD").bytes_per_param("host", "fp32")
    assert sgd_bpp == 4
    cpu_adamw = placement_bytes(spec, "cpu", "none", "bf16")
    cpu_sgd = placement_bytes(spec, "cpu", "none", "bf16", rule="SGD")
    assert abs((cpu_adamw.pinned - cpu_sgd.pinned) - (adamw - sgd_bpp) * P) <= slack