"""CPU Adam: parity with torch.optim.AdamW / Adam, the reference, every dtype combination,
odd sizes and unaligned views, on the native kernel and on the torch fallback.

fp32 parity bound: torch's own fused and single-tensor (foreach=False) kernels differ by a
few ulp (different operation order; torch.sqrt on CPU floats is not correctly rounded in
this build). Each test measures that difference on its own data and requires ours to be
at least as close to foreach=False, with a floor of one ulp of the largest value.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import offload
from offload import _native
from offload.optim import CPUAdam, adam_step, get_num_threads, reference, set_num_threads
from _paths import ROOT, TESTS

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SIZES = [1, 7, 15, 17, 1023]
LARGE = 2**20 + 3
STEPS = 100
LR = 1e-2
MODES = [(True, 0.0), (True, 0.01), (False, 0.0), (False, 0.01)]  # (adamw_mode, weight_decay)

# Documented tolerances for the low-precision combinations, against the reference
# (on this torch build the native kernel matches the reference bit for bit; the slack
# covers torch builds whose kernels fuse multiply-adds differently):
#   fp32 state:  |param diff| <= 1e-6 (a few ulp at |p| ~ 3 after 100 steps at lr 1e-2)
#   bf16 state:  moments within 1 bf16 ulp (rtol 2**-8); param within 1e-4 (one flipped
#                rounding of a bf16 moment changes a step by ~0.4 % of lr, over 100 steps)
PARAM_ATOL_F32_STATE = 1e-6
PARAM_ATOL_BF16_STATE = 1e-4
MOMENT_RTOL_BF16 = 2**-8


@pytest.fixture(autouse=True, scope="module")
def _torch_single_thread():
    """torch's reference runs on one thread: its OpenMP pool slows down badly when the 2-core
    machine is shared with other work, and elementwise results do not depend on it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(params=["native", "torch"])
def backend(request, monkeypatch):
    if request.param == "native":
        monkeypatch.setenv("OFFLOAD_NATIVE", "on")
        try:
            _native.lib()
        except ImportError as exc:
            pytest.skip(str(exc))
    else:
        monkeypatch.setenv("OFFLOAD_NATIVE", "off")
    return request.param


@pytest.fixture
def native(monkeypatch):
    monkeypatch.setenv("OFFLOAD_NATIVE", "on")
    try:
        L = _native.lib()
    except ImportError as exc:
        pytest.skip(str(exc))
    yield L
    _native.adam_set_isa(L, None)


def _grads(n: int, dtype: torch.dtype, steps: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for _ in range(steps)]


def _param0(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _view(n: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    """A zeroed contiguous view starting `offset` elements into a larger buffer (unaligned)."""
    return torch.zeros(n + offset + 8, dtype=dtype)[offset:offset + n]


def _run_torch(kind: str, p0, grads, adamw: bool, wd: float, betas=(0.9, 0.999)):
    p = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    kw = {"fused": True} if kind == "fused" else {"foreach": kind == "foreach"}
    opt = cls([p], lr=LR, betas=betas, weight_decay=wd, **kw)
    for g in grads:
        p.grad = g.float()
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def _run_ours(p0, grads, adamw, wd, *, state_dtype=F32, copy_dtype=None, offset=0, grad_scale=1.0,
              step_fn=adam_step, betas=(0.9, 0.999)):
    n = p0.numel()
    p = _view(n, F32, offset + 1 if offset else 0)
    p.copy_(p0)
    m, v = _view(n, state_dtype, 3 * offset), _view(n, state_dtype, 5 * offset)
    copy = None if copy_dtype is None else _view(n, copy_dtype, 7 * offset)
    for step, g in enumerate(grads, 1):
        if offset:  # the grad too, at yet another misalignment
            gv = _view(n, g.dtype, 2 * offset)
            gv.copy_(g)
            g = gv
        step_fn(p, g, m, v, step=step, lr=LR, betas=betas, eps=1e-8, weight_decay=wd,
                adamw_mode=adamw, param_copy=copy, grad_scale=grad_scale)
    return p, m, v, copy


def _maxdiff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _bound(single, fused, foreach) -> float:
    floor = torch.finfo(F32).eps * single.abs().max().item()
    return max(_maxdiff(fused, single), _maxdiff(foreach, single), floor)


@functools.lru_cache(maxsize=None)
def _torch_results(n: int, grad_dtype: torch.dtype, adamw: bool, wd: float):
    """torch foreach=False's (param, exp_avg, exp_avg_sq) after STEPS steps, and the bound
    for each: how far torch's fused (and, for small n, foreach) kernels are from it.
    Cached: the native and fallback tests share it; callers must not modify the tensors."""
    p0, grads = _param0(n), _grads(n, grad_dtype, STEPS)
    single = _run_torch("single", p0, grads, adamw, wd)
    fused = _run_torch("fused", p0, grads, adamw, wd)
    foreach = _run_torch("foreach", p0, grads, adamw, wd) if n < 10**5 else single
    return single, [_bound(s, f, e) for s, f, e in zip(single, fused, foreach)]


def _check_parity(n, grad_dtype, adamw, wd, variants=((None, 0), (BF16, 0), (F16, 1))):
    """Ours (copy dtypes, aligned and unaligned) against torch foreach=False."""
    single, bounds = _torch_results(n, grad_dtype, adamw, wd)
    p0, grads = _param0(n), _grads(n, grad_dtype, STEPS)
    first = None
    for copy_dtype, offset in variants:
        p, m, v, copy = _run_ours(p0, grads, adamw, wd, copy_dtype=copy_dtype, offset=offset)
        for name, ours, ref, bound in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), single, bounds):
            assert _maxdiff(ours, ref) <= bound, (name, p0.numel(), copy_dtype, offset, _maxdiff(ours, ref), bound)
        if copy is not None:
            assert torch.equal(copy, p.to(copy_dtype)), "param_copy is not the rounded new param"
        if first is None:
            first = p
        else:  # alignment and the copy never change the update
            assert torch.equal(p, first)


@pytest.mark.parametrize("adamw,wd", MODES)
@pytest.mark.parametrize("grad_dtype", [F32, BF16, F16])
def test_parity_with_torch(backend, grad_dtype, adamw, wd):
    for n in SIZES:
        _check_parity(n, grad_dtype, adamw, wd)


@pytest.mark.slow
@pytest.mark.parametrize("backend_name,grad_dtype,adamw,wd", [
    ("native", F32, True, 0.01), ("native", BF16, False, 0.01), ("torch", F32, True, 0.01)])
def test_parity_with_torch_large(monkeypatch, backend_name, grad_dtype, adamw, wd):
    monkeypatch.setenv("OFFLOAD_NATIVE", "on" if backend_name == "native" else "off")
    if backend_name == "native":
        try:
            _native.lib()
        except ImportError as exc:
            pytest.skip(str(exc))
    _check_parity(LARGE, grad_dtype, adamw, wd, variants=((BF16, 1),))


def _check_against_reference(p0, grads, adamw, wd, state_dtype, copy_dtype, offset, betas=(0.9, 0.999)):
    ours = _run_ours(p0, grads, adamw, wd, state_dtype=state_dtype, copy_dtype=copy_dtype, offset=offset, betas=betas)
    ref = _run_ours(p0, grads, adamw, wd, state_dtype=state_dtype, copy_dtype=copy_dtype,
                    step_fn=reference.adam_step, betas=betas)
    atol = PARAM_ATOL_F32_STATE if state_dtype == F32 else PARAM_ATOL_BF16_STATE
    assert _maxdiff(ours[0], ref[0]) <= atol
    for a, b in zip(ours[1:3], ref[1:3]):
        if state_dtype == F32:
            assert _maxdiff(a, b) <= PARAM_ATOL_F32_STATE
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=MOMENT_RTOL_BF16, atol=1e-30)
    if copy_dtype is not None:
        assert torch.equal(ours[3], ours[0].to(copy_dtype))


@pytest.mark.parametrize("adamw,wd", [(True, 0.01), (False, 0.01)])
@pytest.mark.parametrize("grad_dtype", [F32, BF16, F16])
def test_bf16_state_against_reference(backend, grad_dtype, adamw, wd):
    for i, n in enumerate(SIZES):
        copy_dtype = [None, BF16, F16][i % 3]
        _check_against_reference(_param0(n), _grads(n, grad_dtype, STEPS), adamw, wd, BF16, copy_dtype, i % 2)


@pytest.mark.slow
def test_bf16_state_against_reference_large(backend):
    _check_against_reference(_param0(LARGE), _grads(LARGE, BF16, 20), True, 0.01, BF16, BF16, 1)


def test_lerp_weight_above_half(backend):
    """beta1 < 0.5 takes torch's other lerp formula."""
    for n in (17, 1023):
        _check_against_reference(_param0(n), _grads(n, F32, 20), True, 0.01, F32, None, 0, betas=(0.3, 0.999))


def test_bf16_state_accuracy_cost(backend):
    """The memory-saving mode's documented cost (reference.py: 0.4 % of the distance moved
    after 100 steps); a gross error (wrong rounding, state not written back) breaks 2 %."""
    n = 4096
    p0, grads = _param0(n), _grads(n, F32, STEPS)
    p32 = _run_ours(p0, grads, True, 0.0)[0]
    p16 = _run_ours(p0, grads, True, 0.0, state_dtype=BF16)[0]
    moved = (p32 - p0).norm()
    assert ((p16 - p32).norm() / moved).item() < 0.02


@pytest.mark.parametrize("grad_dtype", [F32, BF16, F16])
def test_grad_scale_is_grad_mul(backend, grad_dtype):
    """grad_scale = c gives bit for bit what multiplying the fp32 gradient by c first gives."""
    n, c = 1023, 0.37
    p0, grads = _param0(n), _grads(n, grad_dtype, 20)
    fused = _run_ours(p0, grads, True, 0.01, grad_scale=c, copy_dtype=BF16, offset=1)
    premultiplied = _run_ours(p0, [g.to(F32, copy=True).mul_(c) for g in grads], True, 0.01, copy_dtype=BF16)
    for a, b in zip(fused, premultiplied):
        assert torch.equal(a, b)


def test_grad_scale_matches_torch(backend):
    """grad.mul_(clip_coef) then torch AdamW: bit-identical on the fallback (torch's fused
    kernel), within the fused / foreach=False bound on the native kernel."""
    n, c = 1023, 0.37
    p0, grads = _param0(n), _grads(n, F32, 20)
    ours = _run_ours(p0, grads, True, 0.01, grad_scale=c)
    scaled = [g.mul(c) for g in grads]
    fused = _run_torch("fused", p0, scaled, True, 0.01)
    single = _run_torch("single", p0, scaled, True, 0.01)
    for o, f, s in zip(ours, fused, single):
        if backend == "torch":
            assert torch.equal(o, f)
        else:
            assert _maxdiff(o, s) <= _bound(s, f, s)


def _all_combos():
    for g in (F32, BF16, F16):
        for s in (F32, BF16):
            for c in (None, BF16, F16, F32):
                yield g, s, c


def test_isa_variants_bit_identical(native):
    """Every SIMD variant and thread count gives the scalar C kernel's bits, for every dtype
    combination, odd sizes, unaligned views, both lerp branches, and denormal moments."""
    best = _native.ISA_NAMES[native.offload_kernel_best_isa()]
    isas = [name for code, name in sorted(_native.ISA_NAMES.items()) if code <= native.offload_kernel_best_isa()]
    assert best in isas
    for g_dtype, s_dtype, c_dtype in _all_combos():
        for n, offset, adamw, betas in [(1, 0, True, (0.9, 0.999)), (15, 1, False, (0.9, 0.999)),
                                        (33, 1, True, (0.3, 0.99)), (70001, 1, False, (0.9, 0.999))]:
            grads = _grads(n, F32, 3)
            for g in grads:  # every 5th element's moments in the denormal range
                g[::5] *= 1e-37
            grads = [g.to(g_dtype) for g in grads]
            results = []
            for isa in isas:
                _native.adam_set_isa(native, isa)
                results.append(_run_ours(_param0(n), grads, adamw, 0.01, state_dtype=s_dtype,
                                         copy_dtype=c_dtype, offset=offset, betas=betas))
            for isa, r in zip(isas[1:], results[1:]):
                for a, b in zip(r, results[0]):
                    if a is not None:
                        assert torch.equal(a, b), (isa, g_dtype, s_dtype, c_dtype, n)
            if c_dtype == F32:  # an fp32 copy is the new param itself, bit for bit
                for isa, (p, _, _, copy) in zip(isas, results):
                    assert torch.equal(copy.view(torch.int32), p.view(torch.int32)), (isa, g_dtype, s_dtype, n)
    _native.adam_set_isa(native, None)


def test_isa_variants_bit_identical_over_the_whole_float_range(native):
    """The SIMD variants divide by the bias correction without the divider (kernel.h:
    vdivc, a double-precision product): their bits equal the scalar fp32 division over
    second moments drawn from every finite exponent, zeros, infinities and NaNs, at steps
    where the bias correction is far from 1 and at the awkward constants later steps give."""
    isas = [name for code, name in sorted(_native.ISA_NAMES.items()) if code <= native.offload_kernel_best_isa()]
    gen = torch.Generator().manual_seed(5)
    n = 1 << 18
    v0 = torch.randint(0, 0x7F800000, (n,), generator=gen, dtype=torch.int32).view(F32)  # finite, >= +0
    v0[::97], v0[1::97], v0[2::97] = 0.0, float("inf"), float("nan")
    m0 = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-60, 60, (n,), generator=gen).float())
    g = torch.randn(n, generator=gen) * 1e-3
    try:
        for step, betas, eps in [(1, (0.9, 0.999), 1e-8), (7, (0.9, 0.9999), 1e-8), (123, (0.8, 0.98), 0.0),
                                 (5000, (0.9, 0.999), 1e-6)]:
            results = []
            for isa in isas:
                _native.adam_set_isa(native, isa)
                p, m, v = _param0(n), m0.clone(), v0.clone()
                adam_step(p, g, m, v, step=step, lr=1e-3, betas=betas, eps=eps, weight_decay=0.01)
                results.append((p, m, v))
            for isa, r in zip(isas[1:], results[1:]):
                for a, b in zip(r, results[0]):  # NaN lanes: the same bits too
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (isa, step, betas, eps)
    finally:
        _native.adam_set_isa(native, None)


@pytest.mark.parametrize("copy_dtype", [BF16, F16, F32])
def test_param_copy_at_every_alignment(backend, copy_dtype):
    """The copy is streamed after an aligning head: every start offset within a cache line.
    An fp32 copy is the updated param itself, bit for bit."""
    n = 5000  # one chunk, long enough for the streamed path
    p0, g = _param0(n), _grads(n, BF16, 1)[0]
    kw = dict(step=1, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    expected = p0.clone()
    adam_step(expected, g, torch.zeros(n), torch.zeros(n), **kw)
    L = _native.lib()
    isas = [None] if L is None else [name for code, name in _native.ISA_NAMES.items()
                                     if code <= L.offload_kernel_best_isa()]
    try:
        for isa in isas:
            if L is not None:
                _native.adam_set_isa(L, isa)
            for offset in range(33):
                p, copy = p0.clone(), _view(n, copy_dtype, offset)
                adam_step(p, g, torch.zeros(n), torch.zeros(n), param_copy=copy, **kw)
                assert torch.equal(p, expected), (isa, offset)
                assert torch.equal(copy, expected.to(copy_dtype)), (isa, offset)
    finally:
        if L is not None:
            _native.adam_set_isa(L, None)


def test_thread_count_does_not_change_bits(native):
    n = LARGE
    grads = _grads(n, BF16, 3)
    saved = get_num_threads()
    try:
        out = []
        for threads in (1, 2, 3):
            set_num_threads(threads)
            assert get_num_threads() == threads
            out.append(_run_ours(_param0(n), grads, True, 0.01, copy_dtype=BF16, offset=1))
        for r in out[1:]:
            for a, b in zip(r, out[0]):
                assert torch.equal(a, b)
    finally:
        set_num_threads(saved)


def test_workers_follow_the_callers_denormal_mode(native):
    """With flush-to-zero set on the calling thread (torch.set_flush_denormal), the pool's
    workers flush too: the thread count still changes no bit."""
    n = 1 << 20
    grads = [g.mul_(1e-38) for g in _grads(n, F32, 2)]  # moments in the denormal range
    plain = _run_ours(_param0(n), grads, True, 0.0, state_dtype=BF16)
    saved = get_num_threads()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        out = []
        for threads in (1, 2):
            set_num_threads(threads)
            out.append(_run_ours(_param0(n), grads, True, 0.0, state_dtype=BF16))
    finally:
        torch.set_flush_denormal(False)
        set_num_threads(saved)
    for a, b in zip(out[1][:3], out[0][:3]):
        assert torch.equal(a, b)
    assert not torch.equal(out[0][1], plain[1])  # flushing did change exp_avg


def test_concurrent_with_torch(backend):
    """adam_step on a Python thread while the main thread runs torch ops: both results are
    right, nothing deadlocks, and (native) the GIL is released during the kernel."""
    n, steps = 1 << 22, 8
    p0, grads = _param0(n), _grads(n, F32, steps)
    expected = _run_ours(p0, grads, True, 0.01, copy_dtype=BF16)
    out = {}

    def worker():
        out["result"] = _run_ours(p0, grads, True, 0.01, copy_dtype=BF16)

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    ab = a @ b
    t = threading.Thread(target=worker)
    t.start()
    matmuls = 0
    while t.is_alive() or matmuls < 20:
        torch.testing.assert_close(a @ b, ab)
        matmuls += 1
    t.join(timeout=120)
    assert not t.is_alive(), "adam_step did not finish: deadlock?"
    for x, y in zip(out["result"], expected):
        assert torch.equal(x, y)


def test_gil_released(native):
    n = 1 << 24
    p, g, m, v = torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n)
    started = threading.Event()

    def worker():
        started.set()
        for step in range(1, 4):
            adam_step(p, g, m, v, step=step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    ticks = 0
    while t.is_alive():
        ticks += 1
    t.join()
    assert ticks > 1000, f"the main thread ran only {ticks} loop iterations during the kernel"


def test_concurrent_callers(backend):
    """Several Python threads calling at once (the native pool serializes them)."""
    n = 300001
    jobs = [(_param0(n, seed), _grads(n, F32, 4, seed)) for seed in range(3)]
    expected = [_run_ours(p0, grads, True, 0.01) for p0, grads in jobs]
    results = [None] * len(jobs)

    def worker(i):
        results[i] = _run_ours(*jobs[i], True, 0.01)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    for r, e in zip(results, expected):
        for a, b in zip(r[:3], e[:3]):
            assert torch.equal(a, b)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_pool_after_fork():
    """A forked child starts fresh pool workers instead of waiting for the parent's. Run in a
    fresh interpreter: fork() of the test process itself can fail with ENOMEM once earlier
    tests have reserved large host pools."""
    code = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import torch
        from test_cpu_adam import _param0, _grads, _run_ours, F32
        n = 1 << 20
        p0, grads = _param0(n), _grads(n, F32, 2)
        expected = _run_ours(p0, grads, True, 0.0)[0]   # the parent's workers are running now
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)   # keep torch's own (OpenMP) pool out of the forked child
            os._exit(0 if torch.equal(_run_ours(p0, grads, True, 0.0)[0], expected) else 1)
        deadline = time.time() + 60
        while time.time() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                sys.exit(os.waitstatus_to_exitcode(status))
            time.sleep(0.05)
        os.kill(pid, 9)
        sys.exit("adam_step hung in a forked child")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           [ROOT, TESTS, os.environ.get("PYTHONPATH", "")])))
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


# ---- CPUAdam: the torch.optim.Optimizer ------------------------------------------------

def _model_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(8, 5), (5,), (), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _train(opt, params, steps, sched=None, seed=3):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("adamw", [True, False])
def test_cpuadam_matches_torch_with_groups_and_scheduler(backend, adamw):
    ours_p, ref_p = _model_params(), _model_params()

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.0}]

    ours = CPUAdam(groups(ours_p), lr=1e-2, weight_decay=0.05, adamw_mode=adamw)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = cls(groups(ref_p), lr=1e-2, weight_decay=0.05, foreach=False)
    s1 = torch.optim.lr_scheduler.StepLR(ours, step_size=5, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(ref, step_size=5, gamma=0.5)
    _train(ours, ours_p, 20, s1)
    _train(ref, ref_p, 20, s2)
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[a][key], ref.state[b][key], rtol=1e-6, atol=1e-9)
        assert ours.state[a]["step"].item() == ref.state[b]["step"].item() == 20


def test_state_dict_round_trip_with_torch_adamw(backend):
    # CPUAdam -> torch.optim.AdamW
    ours_p, ref_p = _model_params(), _model_params()
    ours = CPUAdam(ours_p, lr=1e-2, weight_decay=0.01)
    _train(ours, ours_p, 5)
    sd = copy.deepcopy(ours.state_dict())  # load_state_dict would alias our live tensors
    st = sd["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert st["step"].dtype == F32 and st["step"].dim() == 0 and st["step"].item() == 5
    with torch.no_grad():
        for a, b in zip(ref_p, ours_p):
            a.copy_(b)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.01, foreach=False)
    ref.load_state_dict(sd)
    _train(ours, ours_p, 5, seed=4)
    _train(ref, ref_p, 5, seed=4)
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

    # torch.optim.AdamW -> CPUAdam
    back = CPUAdam(ours_p, lr=1.0)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert back.param_groups[0]["adamw_mode"] is True and back.param_groups[0]["lr"] == 1e-2
    _train(back, ours_p, 5, seed=5)
    _train(ref, ref_p, 5, seed=5)
    for a, b in zip(ours_p, ref_p):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_cpuadam_rejects_non_contiguous_param(backend):
    p = torch.nn.Parameter(torch.randn(4, 6).t())
    opt = CPUAdam([p])
    p.grad = torch.randn(4, 6).t()
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()


# ---- argument checking -----------------------------------------------------------------

def _args(n=8, **over):
    a = dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))
    a.update(over)
    return a


KW = dict(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


@pytest.mark.parametrize("over,extra,exc,match", [
    (dict(param=torch.zeros(8, dtype=BF16)), {}, TypeError, "param has dtype"),
    (dict(grad=torch.zeros(8, dtype=torch.int32)), {}, TypeError, "grad has dtype"),
    (dict(exp_avg=torch.zeros(8, dtype=F16)), {}, TypeError, "exp_avg has dtype"),
    (dict(exp_avg=torch.zeros(8, dtype=BF16)), {}, TypeError, "same dtype"),
    (dict(param=torch.zeros(2, 4)), {}, ValueError, r"view\(-1\)"),
    (dict(grad=torch.zeros(16)[::2]), {}, ValueError, "not contiguous"),
    (dict(exp_avg_sq=torch.zeros(9)), {}, ValueError, "9 elements"),
    (dict(param=torch.zeros(8, device="meta")), {}, ValueError, "CPU"),
    (dict(grad=[0.0] * 8), {}, TypeError, "torch.Tensor"),
    ({}, dict(param_copy=torch.zeros(8, dtype=torch.float64)), TypeError, "param_copy has dtype"),
    ({}, dict(param_copy=torch.zeros(7, dtype=BF16)), ValueError, "param_copy has 7"),
    ({}, dict(step=0), ValueError, "step"),
    ({}, dict(step=1.5), ValueError, "step"),
    ({}, dict(betas=(1.0, 0.999)), ValueError, "betas"),
    ({}, dict(lr=float("nan")), ValueError, "lr"),
    ({}, dict(grad_scale=float("inf")), ValueError, "grad_scale"),
])
def test_argument_errors(backend, over, extra, exc, match):
    args = _args(**over)
    before = args["param"].clone() if args["param"].device.type == "cpu" else None
    with pytest.raises(exc, match=match):
        adam_step(**args, **{**KW, **extra})
    if before is not None:
        assert torch.equal(args["param"], before)  # nothing written before the error


def test_native_info_and_threads(monkeypatch):
    monkeypatch.setenv("OFFLOAD_NATIVE", "off")
    assert offload.native_info()["backend"] == "torch"
    monkeypatch.setenv("OFFLOAD_NATIVE", "on")
    try:
        L = _native.lib()
    except ImportError as exc:
        pytest.skip(str(exc))
    info = offload.native_info()
    assert info["backend"] == "native"
    assert info["isa"] in _native.ISA_NAMES.values()
    assert info["isa"] == _native.ISA_NAMES[L.offload_kernel_best_isa()]
    saved = get_num_threads()
    try:
        set_num_threads(1)
        assert offload.native_info()["threads"] == 1 == get_num_threads()
    finally:
        set_num_threads(saved)
    with pytest.raises(ValueError):
        set_num_threads(0)
    monkeypatch.setenv("OFFLOAD_NATIVE", "bogus")
    with pytest.raises(ValueError, match="OFFLOAD_NATIVE"):
        adam_step(**_args(), **KW)


def test_profiler_range(backend):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        adam_step(**_args(), **KW)
    assert any(e.name == "offload::cpu_adam" for e in prof.events())


_SPIN_HELPERS = r"""
import json, os, threading, time, torch
torch.set_num_threads(2)
from offload import _native
from offload.optim import adam_step
L = _native.lib()
me = threading.get_native_id()
a, b, c = torch.randn(384, 384), torch.randn(384, 384), torch.randn(1 << 20)

def thread_clock(tid):  # the thread's CPU-time clock (Linux: clock id from the thread id)
    return time.clock_gettime_ns((~tid << 3) | 6)

def schedstat(tid):  # the same count as the kernel's scheduler sees it (zeros on some kernels)
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])

def works(read):  # the source shows the CPU this thread just burned
    try:
        t0 = read(me); sum(range(300000)); return read(me) > t0
    except (OSError, ValueError):
        return False

source = next((s for s in (thread_clock, schedstat) if works(s)), None)

def cpu_ns():
    out = {}
    if source is None:
        return out
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = source(int(tid))
        except (OSError, ValueError):
            pass  # the thread has exited
    return out

def burst():  # torch's small ops: matmuls and an elementwise op over its own parallel_for
    for _ in range(5):
        a @ b
        torch.mul(c, 1.0001, out=c)

# torch's OpenMP workers: the threads that run during torch work, before the pool exists
x = cpu_ns(); burst(); y = cpu_ns()
torch_tids = {t for t in y if t != me and y[t] > x.get(t, 0)}

def idle_spin_ms(rounds=5):
    # CPU that torch's workers burn in the 100 ms after each burst: their idle spin (a window
    # long enough for a spinner preempted by other load to finish its count of pauses)
    if source is None:
        return None
    total = 0
    for _ in range(rounds):
        burst()
        x = cpu_ns(); time.sleep(0.1); y = cpu_ns()
        total += sum(y[t] - x.get(t, 0) for t in torch_tids if t in y)
    return total / 1e6
"""
_SPIN_SCRIPT = _SPIN_HELPERS + r"""
out = {"clock": source and source.__name__, "torch_workers": len(torch_tids),
       "registered_before": _native.pool_registered(L), "default": idle_spin_ms()}
n = 1 << 20
p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
stop = threading.Event()
def kernels():  # the optimizer's thread, stepping blocks while torch works
    while not stop.is_set():
        adam_step(p, g, m, v, step=2, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        time.sleep(0.002)                     # a gap between two blocks' kernels
made = _native.pool_registrations(L)
bg = threading.Thread(target=kernels); bg.start()
time.sleep(0.05)
out["registered_busy"] = _native.pool_registered(L)
out["busy"] = idle_spin_ms()
stop.set(); bg.join()
out["registrations_in_phase"] = _native.pool_registrations(L) - made
deadline = time.monotonic() + 10
while _native.pool_registered(L) and time.monotonic() < deadline:
    time.sleep(0.005)
out["registered_idle"] = _native.pool_registered(L)
time.sleep(0.02)  # the runtime stops counting the region's threads when its host has exited
out["idle"] = idle_spin_ms()
print(json.dumps(out))
"""


def _run_fresh(script: str, **env_over: str) -> dict:
    """Run ``script`` in a fresh process with two torch threads, the native pool's defaults
    (but ``env_over``) and libgomp's default wait policy (what torch's users run with); its
    last line is JSON."""
    env = dict(os.environ, OFFLOAD_NATIVE="on", OMP_NUM_THREADS="2")
    for name in ("OFFLOAD_POOL", "OFFLOAD_POOL_LINGER_MS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(name, None)
    env.update(env_over)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or "OpenMP" not in torch.__config__.parallel_info(),
                    reason="needs Linux and torch on OpenMP")
def test_pool_registers_with_torchs_openmp_runtime_only_while_it_has_work(native):
    """While kernels run, the pool is registered with torch's OpenMP runtime, which then sees
    more threads than CPUs and cuts the idle spin of torch's workers to microseconds (they
    do not burn a core next to the kernel); once the pool has idled, the registration ends and
    torch's workers spin after their work as they did before the pool existed (what keeps
    back-to-back small torch ops fast). The kernels run as the engine's pipeline runs them,
    with gaps between them shorter than the linger: one registration for the phase. Measured as the CPU
    torch's worker threads burn while idle (each thread's CPU clock, or schedstat where that
    clock is missing, so other load does not enter), in a fresh process."""
    if offload.native_info()["pool"] == "pthread":
        pytest.skip("no OpenMP runtime found in the process (or OFFLOAD_POOL=pthread)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: torch's two workers outnumber the CPUs before the pool exists")
    out = _run_fresh(_SPIN_SCRIPT, OFFLOAD_POOL_LINGER_MS="50")   # the linger carries it over the gaps
    assert out["registered_before"] == 0 and out["registered_busy"] == 1 and out["registered_idle"] == 0, out
    assert out["registrations_in_phase"] == 1, f"the linger did not carry one registration over the gaps: {out}"
    if out["clock"] is None:
        pytest.skip("registration checked; the spin is not: this kernel shows no per-thread CPU time "
                    "(no thread CPU clock, schedstat all zeros)")
    assert out["torch_workers"] >= 1, f"torch ran its ops on the calling thread alone: {out}"
    assert out["default"] > 1.0, f"torch's idle workers did not spin before the pool existed: {out}"
    assert out["busy"] < 0.2 * out["default"], f"torch's idle workers spun next to the kernels: {out}"
    assert out["idle"] > 0.3 * out["default"], f"torch's default spin did not come back once the pool idled: {out}"


_TEAM_SCRIPT = _SPIN_HELPERS + r"""
n = 1 << 20
gen = torch.Generator().manual_seed(0)
p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
kw = dict(step=3, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
def run(where):
    p, m, v = p0.clone(), torch.full((n,), 0.1), torch.full((n,), 0.01)
    if where == "main":
        adam_step(p, g, m, v, **kw)
    else:
        t = threading.Thread(target=adam_step, args=(p, g, m, v), kwargs=kw); t.start(); t.join()
    return p, m, v
out = {"clock": source and source.__name__, "torch_workers": len(torch_tids), "default": idle_spin_ms()}
runs, made = _native.pool_team_runs(L), _native.pool_registrations(L)
out["after_team"] = 0
for _ in range(3):
    burst(); on_main = run("main")          # right after torch work, on torch's master thread
    x = cpu_ns(); time.sleep(0.1); y = cpu_ns()  # torch's workers after it: the usual long spin
    out["after_team"] = max(out["after_team"], sum(y[t] - x.get(t, 0) for t in torch_tids if t in y) / 1e6)
out["team_runs_main"] = _native.pool_team_runs(L) - runs
out["registrations_main"] = _native.pool_registrations(L) - made
runs = _native.pool_team_runs(L)
on_worker = run("worker")
out["team_runs_worker"] = _native.pool_team_runs(L) - runs
out["same_bits"] = all(torch.equal(a, b) for a, b in zip(on_main, on_worker))
deadline = time.monotonic() + 10
while _native.pool_registered(L) and time.monotonic() < deadline:
    time.sleep(0.005)
out["registered_after"] = _native.pool_registered(L)
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or "OpenMP" not in torch.__config__.parallel_info(),
                    reason="needs Linux and torch on OpenMP")
def test_main_thread_kernel_runs_on_torchs_team(native):
    """A kernel called on the main thread right after torch work runs its chunks on the main
    thread's own OpenMP team (torch's workers, still spinning, do the kernel's chunks instead
    of competing with it), registers nothing, gives the pthread pool's bits, and leaves
    torch's workers spinning as after any torch op (measured as their CPU clocks, in a fresh
    process). A kernel on another thread uses the pthread pool."""
    if offload.native_info()["pool"] == "pthread" or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("no OpenMP runtime found in the process (or OFFLOAD_POOL=pthread), or one CPU")
    out = _run_fresh(_TEAM_SCRIPT)
    assert out["team_runs_main"] == 3 and out["registrations_main"] == 0, out
    assert out["team_runs_worker"] == 0 and out["same_bits"], out
    assert out["registered_after"] == 0, out
    if out["clock"] is None:
        pytest.skip("paths and registration checked; the spin is not: this kernel shows no per-thread CPU time")
    assert out["torch_workers"] >= 1 and out["default"] > 1.0, f"torch's idle workers did not spin: {out}"
    assert out["after_team"] > 0.3 * out["default"] / 5, f"torch's workers did not spin after the team's kernel: {out}"


@pytest.mark.parametrize("value", ["pthread", "PTHREAD", " pthread "])
def test_pool_runtime_can_be_plain_pthreads(value):
    """OFFLOAD_POOL=pthread, in any case and with spaces around it: the workers are plain
    pthreads (the kernel gives the same bits). Python parses the setting once and the library
    follows it (it reads no environment), so the two cannot disagree."""
    code = ("import torch, offload; from offload.optim import adam_step; "
            "p, g, m, v = torch.ones(1 << 20), torch.ones(1 << 20), torch.zeros(1 << 20), torch.zeros(1 << 20); "
            "adam_step(p, g, m, v, step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0); "
            "assert torch.allclose(p, torch.full_like(p, 0.9)), p[:4]; print(offload.native_info().get('pool'))")
    env = dict(os.environ, OFFLOAD_POOL=value, OFFLOAD_NATIVE="auto")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if offload.native_info()["backend"] == "native":
        assert out.stdout.strip() == "pthread"


@pytest.mark.parametrize("value, want", [("", False), ("auto", False), (" Auto ", False), ("pthread", True),
                                         ("PTHREAD", True), (" pthread ", True)])
def test_pool_setting_is_parsed_once(monkeypatch, value, want):
    """OFFLOAD_POOL is read in one place (``_native.pool_setting``), case and spaces ignored;
    the library gets its result."""
    from offload import _native
    monkeypatch.setenv("OFFLOAD_POOL", value)
    monkeypatch.setenv("OFFLOAD_POOL_LINGER_MS", " 50 ")
    assert _native.pool_setting() == (want, 50)


def test_pool_setting_rejects_a_misspelling(monkeypatch):
    from offload import _native
    monkeypatch.setenv("OFFLOAD_POOL", "pthreads")
    with pytest.raises(ValueError, match="OFFLOAD_POOL='pthreads' is not valid: use auto or pthread"):
        _native.pool_setting()
