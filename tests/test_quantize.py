"""Frozen-weight quantization (offload/quantize.py): NF4 and int8 per row against their
published definitions, every native ISA against the torch reference bit for bit, and
bitsandbytes' own functions where bitsandbytes is installed (it is not a dependency)."""
from __future__ import annotations

import pytest
import torch

from offload import _native
from offload import quantize as Q
from offload.optim import quant as q8

# QLoRA (Dettmers et al. 2023), appendix E: the NF4 values.
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _isas():
    """The ISAs this CPU runs, with the library (None: the torch fallback only)."""
    try:
        L = _native.lib()
    except ImportError:
        return None, []
    if L is None:
        return None, []
    return L, [n for c, n in sorted(_native.ISA_NAMES.items()) if c <= L.offload_kernel_best_isa()]


def test_nf4_code_is_qlora_table():
    """The code constructed from normal quantiles is QLoRA's published table, bit for bit."""
    code = Q.nf4_code()
    assert code.dtype == torch.float32 and code.tolist() == PUBLISHED_NF4


def _nearest_index(y: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The midpoint rule: q = #{k : y > (code[k] + code[k + 1]) / 2 in fp32}."""
    mid = (code[:-1] + code[1:]) / 2
    return (y[:, None] > mid[None, :]).sum(dim=1)


@pytest.mark.parametrize("n", [64 * 5, 64 * 3 + 17, 1])
def test_nf4_layout_and_nearest_code(n):
    """Block absmax, the nearest code of x / absmax by the midpoint rule (midpoints and their
    neighbouring floats included), two codes per byte with the even element in the high half,
    an odd count padded with the index of 0.0; values that are codes times a power of two
    come back exactly."""
    code = Q.nf4_code()
    mid = (code[:-1] + code[1:]) / 2
    tricky = torch.cat([mid, torch.nextafter(mid, torch.tensor(2.0)), torch.nextafter(mid, torch.tensor(-2.0)), code])
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(n, generator=gen) * 2 - 1
    x[:min(n, tricky.numel())] = tricky[:n]
    scales = 2.0 ** torch.randint(-20, 20, (Q.nblocks_of(n),), generator=gen).float()
    blocks = x.split(Q.NF4_BLOCK)
    for b, blk in enumerate(blocks):
        blk[0] = 1.0                                   # a block maximum of 1, then scaled
        blk.mul_(scales[b])
    t = Q.quantize_nf4(x)
    assert t.packed.numel() == (n + 1) // 2 and torch.equal(t.absmax, scales)
    q = torch.stack([t.packed >> 4, t.packed & 15], dim=1).view(-1)
    y = x / scales.repeat_interleave(Q.NF4_BLOCK)[:n]            # exact: powers of two
    assert torch.equal(q[:n].long(), _nearest_index(y, code))
    if n % 2:
        assert q[n].item() == 7 and code[7].item() == 0.0
    exact = code[q[:n].long()] * scales.repeat_interleave(Q.NF4_BLOCK)[:n]
    assert torch.equal(Q.dequantize_nf4_reference(t), exact)


def test_nf4_double_quant_restores_absmax_within_its_code():
    """QLoRA's double quantization: the absmax values less their mean, 8-bit blockwise over
    256 with the signed dynamic map; restored, each is within half the local gap of that code
    (times its block's scale) of the absmax, and the weights dequantize through it."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64 * 700 + 30, generator=gen) * torch.rand(64 * 700 + 30, generator=gen)
    t, plain = Q.quantize_nf4(x, double_quant=True), Q.quantize_nf4(x)
    assert torch.equal(t.packed, plain.packed) and t.absmax is None
    assert t.absmax_q.numel() == plain.absmax.numel() and t.absmax_scale.numel() == q8.nblocks(plain.absmax.numel())
    assert t.absmax_offset == plain.absmax.mean().item()
    code8 = q8.dynamic_map(True)
    half_gap = torch.cat([code8[1:] - code8[:-1], torch.zeros(1)]).maximum(
        torch.cat([torch.zeros(1), code8[1:] - code8[:-1]])) / 2
    scale = t.absmax_scale.repeat_interleave(Q.ABSMAX_BLOCK)[:plain.absmax.numel()]
    restored = Q.nf4_absmax(t)
    bound = half_gap[t.absmax_q.long()] * scale + 2 * torch.finfo(torch.float32).eps * plain.absmax
    assert bool(((restored - plain.absmax).abs() <= bound).all())
    assert t.nbytes < plain.nbytes
    want = Q.nf4_code()[torch.stack([t.packed >> 4, t.packed & 15], 1).view(-1)[:x.numel()].long()] * \
        restored.repeat_interleave(64)[:x.numel()]
    assert torch.equal(Q.dequantize_nf4_reference(t, torch.float32), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_rows(dtype):
    """Per row: absmax, codes round(x * 127 / absmax) (half to even) in [-127, 127], the
    row's largest magnitude at +-127, a zero row stored as zeros; values within half a step."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 300, generator=gen) * torch.logspace(-3, 3, 9)[:, None]).to(dtype)
    x[4] = 0
    t = Q.quantize_int8_rows(x)
    xf = x.float()
    absmax = xf.abs().amax(dim=1)
    assert torch.equal(t.absmax, absmax) and t.codes.dtype == torch.int8
    factor = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    assert torch.equal(t.codes, torch.round(xf * factor[:, None]).to(torch.int8))
    assert int(t.codes.abs().amax(dim=1)[absmax > 0].min()) == 127 and not t.codes[4].any()
    back = Q.dequantize_int8_rows_reference(t, torch.float32)
    step = absmax[:, None] / 127
    assert bool(((back - xf).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all())


def _random_nf4(n: int, gen, double: bool, odd_scales: bool) -> Q.NF4Tensor:
    """An NF4 tensor of random codes and scales (zeros, denormals, huge and inf among them)."""
    nb = Q.nblocks_of(n)
    packed = torch.randint(0, 256, ((n + 1) // 2,), generator=gen, dtype=torch.uint8)
    absmax = torch.rand(nb, generator=gen) * 10
    if odd_scales and nb > 4:
        absmax[:4] = torch.tensor([0.0, 1e-40, 3e38, float("inf")])
    if not double:
        return Q.NF4Tensor(packed, absmax, torch.Size([n]), torch.float32)
    aq = torch.randint(0, 256, (nb,), generator=gen, dtype=torch.uint8)
    sc = torch.rand(q8.nblocks(nb), generator=gen) * 3
    return Q.NF4Tensor(packed, None, torch.Size([n]), torch.float32, 64, aq, sc, 0.8125)


def _unaligned(t: torch.Tensor, offset: int) -> torch.Tensor:
    """t's values in a contiguous view `offset` elements into a larger buffer."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype)
    buf[offset:].copy_(t.reshape(-1))
    return buf[offset:].view(t.shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, NaN aside (0 * inf: any NaN; torch's own bf16 conversions differ in its bits)."""
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    nan = a.isnan()
    return a.dtype == b.dtype and torch.equal(nan, b.isnan()) and torch.equal(a.view(view)[~nan], b.view(view)[~nan])


@pytest.mark.parametrize("kind", ["nf4", "nf4_double", "int8_rows"])
def test_every_isa_equals_the_reference(kind):
    """The native dequantization at every ISA this CPU runs (scalar, AVX2, AVX-512 with and
    without its bf16 conversion) writes the torch reference's bits, into fp32, bf16 and fp16:
    odd sizes and short last blocks, codes and outputs at unaligned addresses, blocks whose
    scale is zero, denormal, huge (overflowing the narrow dtypes) or inf."""
    L, isas = _isas()
    if L is None:
        pytest.skip("the native library is not in use")
    gen = torch.Generator().manual_seed(4)
    cases = []
    for n, off in ((1, 0), (31, 1), (64, 3), (64 * 9 + 33, 1), (64 * 600 + 7, 5), (70001, 0)):
        if kind == "int8_rows":
            rows = max(1, n // 257)
            cols = max(1, n // rows)
            codes = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
            absmax = torch.rand(rows, generator=gen) * 10
            if rows > 3:
                absmax[:4] = torch.tensor([0.0, 1e-40, 3e38, float("inf")])
            t = Q.Int8RowTensor(_unaligned(codes, off), absmax, torch.float32)
        else:
            t = _random_nf4(n, gen, kind == "nf4_double", odd_scales=True)
            t = Q.NF4Tensor(_unaligned(t.packed, off), t.absmax, t.shape, t.dtype, t.blocksize, t.absmax_q,
                            t.absmax_scale, t.absmax_offset)
        cases.append((t, off))
    deq = Q.dequantize_int8_rows if kind == "int8_rows" else Q.dequantize_nf4
    ref = Q.dequantize_int8_rows_reference if kind == "int8_rows" else Q.dequantize_nf4_reference
    try:
        for isa in isas:
            _native.kernel_set_isa(L, isa)
            for t, off in cases:
                for dtype in DTYPES:
                    want = ref(t, dtype)
                    out = _unaligned(torch.full(want.shape, float("nan"), dtype=dtype), (off + 1) % 4)
                    got = deq(t, dtype, out=out)
                    assert got is out and _same_bits(got, want), (isa, kind, tuple(t.shape), dtype)
    finally:
        _native.kernel_set_isa(L, None)


def _adversarial_weights(n: int, gen) -> torch.Tensor:
    """n values with, in each block of 64, NF4's midpoints and their neighbouring floats at the
    block's scale (a maximum of 1, times a power of two), and blocks of zeros, of denormals,
    with +-inf, with NaN, with -0.0."""
    code = Q.nf4_code()
    mid = (code[:-1] + code[1:]) / 2
    tricky = torch.cat([mid, torch.nextafter(mid, torch.tensor(2.0)), torch.nextafter(mid, torch.tensor(-2.0))])
    x = torch.rand(n, generator=gen) * 2 - 1
    for b, blk in enumerate(x.split(64)):
        k = b % 8
        if k == 1:
            blk.zero_()
        elif k == 2:
            blk.mul_(1e-39)
        elif k == 3:
            blk[::7] = float("inf") if b % 16 < 8 else -float("inf")
        elif k == 4:
            blk[-1] = float("nan")
        elif k == 5:
            blk[::3] = -0.0
        else:
            m = min(blk.numel(), tricky.numel())
            blk[:m] = tricky[torch.randperm(tricky.numel(), generator=gen)[:m]]
            blk[0] = 1.0
            blk.mul_(2.0 ** (b % 11 - 5))
    return x


def _int8_halfway_rows(gen, dtype, rows: int = 48) -> torch.Tensor:
    """Rows whose values sit at, and one float beside, the halves (k + 0.5) * absmax / 127 of
    their int8 steps (absmax not a power of two): where x * (127 / absmax) rounds one way or
    the other depending on how 127 / absmax itself was rounded."""
    a = (torch.rand(rows, 1, generator=gen, dtype=torch.float64) * 10 + 0.01).to(dtype).double()
    v = ((torch.arange(127, dtype=torch.float64) + 0.5) * a / 127).float()
    up, down = torch.nextafter(v, torch.full_like(v, 1e9)), torch.nextafter(v, torch.full_like(v, -1e9))
    return torch.cat([a.float(), -a.float(), (a / 2).float(), (-a / 2).float(), v, -v, up, down], dim=1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_quantize_equals_the_reference(dtype):
    """The native quantizers (NF4 codes and absmax; int8 rows' codes and absmax) at every ISA
    store the torch reference's bytes, from fp32, bf16 and fp16 inputs at unaligned
    addresses: odd sizes and short last blocks, values at and beside the midpoints, zero,
    denormal, inf and NaN blocks, -0.0; int8 rows with values at and beside the halves of
    their steps."""
    L, isas = _isas()
    if L is None:
        pytest.skip("the native library is not in use")
    gen = torch.Generator().manual_seed(9)
    try:
        for n, off in ((1, 0), (63, 1), (64 * 17 + 5, 3), (64 * 700, 2)):
            x = _unaligned(_adversarial_weights(n, gen).to(dtype), off)
            want = Q.quantize_nf4_reference(x, double_quant=True)
            rows = x[: n - n % 13].view(13, -1) if n >= 13 else x.view(1, -1)
            want8 = Q.quantize_int8_rows_reference(rows)
            for isa in isas:
                _native.kernel_set_isa(L, isa)
                got = Q.quantize_nf4(x, double_quant=True)
                assert torch.equal(got.packed, want.packed), (isa, dtype, n)
                assert torch.equal(got.absmax_q, want.absmax_q) and torch.equal(got.absmax_scale, want.absmax_scale)
                assert got.absmax_offset == want.absmax_offset or (got.absmax_offset != got.absmax_offset and
                                                                   want.absmax_offset != want.absmax_offset)
                got8 = Q.quantize_int8_rows(rows)
                assert torch.equal(got8.codes, want8.codes), (isa, dtype, n)
                assert _same_bits(got8.absmax, want8.absmax)
            _native.kernel_set_isa(L, None)
            plain, plain_ref = Q.quantize_nf4(x), Q.quantize_nf4_reference(x)
            assert _same_bits(plain.absmax, plain_ref.absmax) and torch.equal(plain.packed, plain_ref.packed)
        halfway = _unaligned(_int8_halfway_rows(gen, dtype), 1)
        want8 = Q.quantize_int8_rows_reference(halfway)
        for isa in isas:
            _native.kernel_set_isa(L, isa)
            assert torch.equal(Q.quantize_int8_rows(halfway).codes, want8.codes), (isa, dtype)
    finally:
        _native.kernel_set_isa(L, None)


def test_torch_fallback_and_bad_input(monkeypatch):
    """OFFLOAD_NATIVE=off dequantizes with the reference; bad arguments name the fix."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(130, 7, generator=gen)
    t, r = Q.quantize_nf4(x, double_quant=True), Q.quantize_int8_rows(x)
    native = Q.dequantize_nf4(t), Q.dequantize_int8_rows(r)
    monkeypatch.setenv("OFFLOAD_NATIVE", "off")
    assert torch.equal(Q.quantize_nf4(x, double_quant=True).packed, t.packed)
    assert torch.equal(Q.quantize_int8_rows(x).codes, r.codes)
    assert torch.equal(Q.dequantize_nf4(t), Q.dequantize_nf4_reference(t)) and torch.equal(native[0], Q.dequantize_nf4(t))
    assert torch.equal(Q.dequantize_int8_rows(r), native[1])
    assert Q.dequantize_nf4(t).shape == x.shape
    with pytest.raises(ValueError, match="even number of elements"):
        Q.quantize_nf4(x, blocksize=63)
    with pytest.raises(ValueError, match="2-D tensor"):
        Q.quantize_int8_rows(x.view(-1))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        Q.quantize_nf4(x.double())
    with pytest.raises(ValueError, match="out must be a contiguous CPU torch.bfloat16 tensor of 910"):
        Q.dequantize_nf4(t, torch.bfloat16, out=torch.empty(910))


# ---- bitsandbytes, where it is installed ------------------------------------------------------
def _bnb():
    return pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is not installed")


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (300, 97)), (torch.bfloat16, (77, 65)),
                                         (torch.float16, (4097,))])
def test_nf4_equals_bitsandbytes(dtype, shape):
    """bitsandbytes' quantize_4bit (NF4, blocksize 64) stores our codes and absmax bit for bit
    and its dequantize_4bit gives our values, fp32 / bf16 / fp16. With double quantization the
    offset and the scales of the absmax are bitsandbytes' bit for bit, and its dequantization
    of its own state equals ours of that state; its 8-bit codes of the absmax (its CPU backend
    searches approximately) differ from ours only where ours is the nearer code."""
    F = _bnb()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=gen).to(dtype)
    qb, sb = F.quantize_4bit(x, blocksize=64, quant_type="nf4")
    t = Q.quantize_nf4(x)
    assert torch.equal(qb.view(-1), t.packed) and torch.equal(sb.absmax, t.absmax)
    assert torch.equal(F.dequantize_4bit(qb, sb), Q.dequantize_nf4(t))
    qd, sd = F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
    td = Q.quantize_nf4(x, double_quant=True)
    assert torch.equal(qd.view(-1), td.packed)
    assert float(sd.offset) == td.absmax_offset and torch.equal(sd.state2.absmax, td.absmax_scale)
    theirs = Q.NF4Tensor(qd.view(-1), None, x.shape, dtype, 64, sd.absmax, sd.state2.absmax, float(sd.offset))
    assert torch.equal(F.dequantize_4bit(qd, sd), Q.dequantize_nf4(theirs))
    differ = (sd.absmax != td.absmax_q).nonzero().flatten()
    if differ.numel():
        code8 = q8.dynamic_map(True)
        y = (t.absmax.double() - td.absmax_offset) / td.absmax_scale.double().repeat_interleave(256)[:t.absmax.numel()]
        d_ours = (y[differ] - code8[td.absmax_q[differ].long()].double()).abs()
        d_bnb = (y[differ] - code8[sd.absmax[differ].long()].double()).abs()
        assert bool((d_ours <= d_bnb + 1e-7).all())


def test_int8_rows_equal_bitsandbytes():
    """bitsandbytes' int8_vectorwise_quant / _dequant (LLM.int8()'s row-wise absmax): our codes,
    row statistics and values, bit for bit (rows not all zero)."""
    F = _bnb()
    gen = torch.Generator().manual_seed(8)
    for dtype in DTYPES:
        x = (torch.randn(33, 130, generator=gen) * 3).to(dtype)
        codes, stats, _ = F.int8_vectorwise_quant(x)
        t = Q.quantize_int8_rows(x)
        assert torch.equal(codes, t.codes) and torch.equal(stats, t.absmax), dtype
        assert torch.equal(F.int8_vectorwise_dequant(codes, stats), Q.dequantize_int8_rows(t, torch.float32))
