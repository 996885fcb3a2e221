"""Frozen-weight quantization (offload/quantize.py): NF4 and int8 per row against their
published definitions, every native ISA against the torch reference bit for bit, and every
path against bitsandbytes' own functions (its CPU backend; a test dependency)."""
from __future__ import annotations

import copy

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


def _beside_midpoints() -> torch.Tensor:
    """NF4's 15 fp32 midpoints and the floats either side of each."""
    code = Q.nf4_code()
    mid = (code[:-1] + code[1:]) / 2
    return torch.cat([mid, torch.nextafter(mid, torch.tensor(2.0)), torch.nextafter(mid, torch.tensor(-2.0))])


def _adversarial_weights(n: int, gen) -> torch.Tensor:
    """n values with, in each block of 64, NF4's midpoints and their neighbouring floats at the
    block's scale (a maximum of 1, times a power of two), and blocks of zeros, of denormals,
    with +-inf, with NaN, with -0.0."""
    tricky = _beside_midpoints()
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


# ---- bitsandbytes: the same bits as its CPU backend ---------------------------------------------
# bitsandbytes' CPU backend: quantize_4bit is its torch op, dequantize_4bit its native kernel
# (an even last dimension; an odd one its torch op), the double quantization's 8-bit search its
# native quantize_cpu, int8_vectorwise_quant / _dequant its torch ops.
@pytest.fixture
def bnb():
    """bitsandbytes.functional (installed with the test extras); the kernels' default ISA
    restored afterwards, also when a test stops inside a _paths() loop."""
    import bitsandbytes.functional as F
    yield F
    L, _ = _isas()
    if L is not None:
        _native.kernel_set_isa(L, None)


def _paths():
    """(name, quantize_nf4, dequantize_nf4, quantize_int8_rows, dequantize_int8_rows) for every
    native ISA this CPU runs, then the torch reference."""
    L, isas = _isas()
    try:
        for isa in isas:
            _native.kernel_set_isa(L, isa)
            yield isa, Q.quantize_nf4, Q.dequantize_nf4, Q.quantize_int8_rows, Q.dequantize_int8_rows
    finally:
        if L is not None:
            _native.kernel_set_isa(L, None)
    yield ("torch", Q.quantize_nf4_reference, Q.dequantize_nf4_reference, Q.quantize_int8_rows_reference,
           Q.dequantize_int8_rows_reference)


def _bnb_dequantize(F, packed, state, dtype, shape):
    """bitsandbytes' dequantize_4bit into ``dtype``, in ``shape`` (it returns a 1-D shape as
    one row, and two elements or fewer transposed)."""
    state = copy.copy(state)
    state.dtype = dtype
    return F.dequantize_4bit(packed, state).reshape(shape)


def _same_bits_but_flushed(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """The same bits (NaN aside), except that where ours is a bf16 subnormal, theirs may be the
    zero of its sign: bitsandbytes' AVX-512 BF16 conversion (VCVTNEPS2BF16, taken when the
    element count is a multiple of its vector) flushes subnormal results, where torch's
    .to(bfloat16) and ours round them to nearest even."""
    if _same_bits(ours, theirs) or ours.dtype != torch.bfloat16 or theirs.dtype != torch.bfloat16:
        return _same_bits(ours, theirs)
    o, t = ours.view(torch.int16), theirs.view(torch.int16)
    differ = (o != t) & ~(ours.isnan() & theirs.isnan())
    subnormal = (o[differ] & 0x7F80) == 0
    zero_of_its_sign = ((t[differ] & 0x7FFF) == 0) & (((t[differ] ^ o[differ]) & -0x8000) == 0)
    return bool(subnormal.all() and zero_of_its_sign.all())


def _nf4_inputs(n: int, gen, dtype) -> torch.Tensor:
    """_adversarial_weights, its short last block (if any) one of midpoints and their neighbours
    at a power-of-two scale (bitsandbytes scales that block differently: see
    test_nf4_short_last_block_against_bitsandbytes)."""
    x = _adversarial_weights(n, gen)
    tail = n % Q.NF4_BLOCK
    if tail:
        tricky = _beside_midpoints()
        blk = x[n - tail:]
        blk.copy_(tricky[torch.randint(0, tricky.numel(), (tail,), generator=gen)])
        blk[0] = 1.0
        blk.mul_(2.0 ** -3)
    return x.to(dtype)


def test_bitsandbytes_tables_are_ours(bnb):
    """bitsandbytes' NF4 table is QLoRA's published one and ours; its signed dynamic map (the
    double quantization's code) is ours."""
    assert torch.equal(bnb.get_4bit_type("nf4", device="cpu"), Q.nf4_code())
    assert Q.nf4_code().tolist() == PUBLISHED_NF4
    assert torch.equal(bnb.create_dynamic_map(signed=True), q8.dynamic_map(True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nf4_equals_bitsandbytes(bnb, dtype):
    """bitsandbytes' quantize_4bit (NF4, blocksize 64) stores our codes and absmax bit for bit,
    at every ISA and in the torch reference, from fp32 / bf16 / fp16: odd sizes and short last
    blocks, values at and beside the midpoints, zero, denormal, inf and NaN blocks, -0.0. Its
    packed tensor is [ceil(n / 2), 1] uint8, ours flat: compared flat; the absmax is fp32 in
    both. Its dequantize_4bit and ours write the same bits into fp32 / bf16 / fp16, from
    either's state (they are the same), except bf16 subnormal results that its AVX-512 BF16
    conversion flushes to zero (_same_bits_but_flushed); its native kernel (an even last
    dimension, its AVX-512 path where the count allows) and its torch op (odd) both."""
    gen = torch.Generator().manual_seed(7)
    for shape in ((300, 98), (64, 64), (77, 65), (4097,), (2, 33), (5, 3, 22), (1,)):
        n = torch.Size(shape).numel()
        x = _unaligned(_nf4_inputs(n, gen, dtype).view(shape), 1)
        qb, sb = bnb.quantize_4bit(x, blocksize=64, quant_type="nf4")
        assert qb.shape == ((n + 1) // 2, 1) and qb.dtype == torch.uint8 and sb.absmax.dtype == torch.float32
        theirs = {d: _bnb_dequantize(bnb, qb, sb, d, shape) for d in DTYPES}
        for name, quantize, dequantize, _, _ in _paths():
            t = quantize(x)
            assert torch.equal(t.packed, qb.view(-1)) and _same_bits(t.absmax, sb.absmax), (name, shape)
            for d in DTYPES:
                assert _same_bits_but_flushed(dequantize(t, d), theirs[d]), (name, shape, d)


def _dynamic_index_midpoint(y: torch.Tensor) -> torch.Tensor:
    """Our 8-bit rule (offload/optim/quant.py): #{k : y > (code[k] + code[k + 1]) / 2}."""
    return torch.bucketize(y, q8._midpoints(True)).to(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nf4_double_quant_against_bitsandbytes(bnb, dtype):
    """compress_statistics=True: bitsandbytes' codes, offset (the mean of the absmax) and 8-bit
    scales of the absmax (blocks of 256, its signed dynamic map) are ours bit for bit. The 8-bit
    codes of the absmax: ours are the nearest code of y = (absmax - offset) * (1 / scale) by the
    fp32 midpoints (as bitsandbytes' CUDA kernel); its CPU search (a table-driven binary search
    of (absmax - offset) / scale, then the nearer of two) now and then returns the neighbour of
    the nearest code: where the two differ, its code is next to ours and strictly farther from
    the exact quotient. The dequantization of either state is bitsandbytes' bit for bit."""
    gen = torch.Generator().manual_seed(10)
    n = 64 * 3000 + 33
    spread = torch.logspace(-4, 1, Q.nblocks_of(n)).repeat_interleave(64)[:n]
    x = (torch.randn(n, generator=gen) * spread[torch.randperm(n, generator=gen)]).to(dtype)
    qd, sd = bnb.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
    assert sd.state2.blocksize == Q.ABSMAX_BLOCK and torch.equal(sd.state2.code, q8.dynamic_map(True))
    for name, quantize, dequantize, _, _ in _paths():
        td, plain = quantize(x, double_quant=True), quantize(x)
        assert torch.equal(td.packed, qd.view(-1)), name
        assert float(sd.offset) == td.absmax_offset and torch.equal(sd.state2.absmax, td.absmax_scale), name
        centred = plain.absmax - td.absmax_offset
        scale = td.absmax_scale.repeat_interleave(Q.ABSMAX_BLOCK)[:centred.numel()]
        assert torch.equal(td.absmax_q, _dynamic_index_midpoint(centred * (1 / scale))), name
        differ = sd.absmax != td.absmax_q
        exact = centred.double()[differ] / scale.double()[differ]
        code = q8.dynamic_map(True).double()
        ours_q, bnb_q = td.absmax_q[differ].long(), sd.absmax[differ].long()
        assert bool(((ours_q - bnb_q).abs() == 1).all()), name
        assert bool(((exact - code[ours_q]).abs() < (exact - code[bnb_q]).abs()).all()), name
        theirs = Q.NF4Tensor(qd.view(-1), None, x.shape, dtype, 64, sd.absmax, sd.state2.absmax, float(sd.offset))
        ours_in_bnb = copy.copy(sd)
        ours_in_bnb.absmax = td.absmax_q
        for d in DTYPES:
            assert _same_bits_but_flushed(dequantize(theirs, d), _bnb_dequantize(bnb, qd, sd, d, x.shape)), (name, d)
            assert _same_bits_but_flushed(dequantize(td, d), _bnb_dequantize(bnb, qd, ours_in_bnb, d, x.shape)), \
                (name, d)


def test_nf4_short_last_block_against_bitsandbytes(bnb):
    """The one place our 4-bit codes part from bitsandbytes' CPU backend: a short last block
    (numel not a multiple of 64). Its torch op scales that block by x / max(absmax, 1e-38) and
    stores max(absmax, 1e-38); its full blocks, its CUDA kernel and we scale every block by
    x * (1 / max(absmax, 1e-38)) (the CUDA kernel without the clamp) and store the absmax. So
    there, for values beside a midpoint at a scale that is not a power of two, a code can
    differ by one, and a zero or subnormal last block stores 1e-38 in bitsandbytes, its absmax
    here (its values are the same zeros). Full blocks stay the same bits; each side's last block
    follows its rule exactly; some codes do differ (this run's data is built for it)."""
    code = Q.nf4_code()
    mid = (code[:-1] + code[1:]) / 2
    gen = torch.Generator().manual_seed(12)
    floor = torch.tensor(1e-38)
    parted = 0
    for tail, kind in [(63, "midpoints")] * 40 + [(33, "midpoints"), (5, "zero"), (63, "subnormal"), (1, "midpoints")]:
        am = torch.rand(1, generator=gen) * 10 + 0.01
        if kind == "midpoints":
            v = mid[torch.randint(0, 15, (tail - 1,), generator=gen)] * am
            step = torch.randint(-1, 2, v.shape, generator=gen)
            v = torch.where(step > 0, torch.nextafter(v, torch.tensor(1e9)),
                            torch.where(step < 0, torch.nextafter(v, torch.tensor(-1e9)), v))
            last = torch.cat([am, v])[:tail]
        else:
            last = torch.zeros(tail) if kind == "zero" else (torch.rand(tail, generator=gen) * 2 - 1) * 1e-39
        x = torch.cat([torch.randn(64 * 3, generator=gen), last])
        qb, sb = bnb.quantize_4bit(x, blocksize=64, quant_type="nf4")
        a_last = last.abs().max()
        y_ours = torch.cat([last * (1 / torch.maximum(a_last, floor)), torch.zeros(tail % 2)])
        y_bnb = torch.cat([last / torch.maximum(a_last, floor), torch.zeros(tail % 2)])
        for name, quantize, dequantize, _, _ in _paths():
            t = quantize(x)
            assert torch.equal(t.packed[:96], qb.view(-1)[:96]) and torch.equal(t.absmax[:3], sb.absmax[:3]), name
            assert t.absmax[3] == a_last and sb.absmax[3] == torch.maximum(a_last, floor), (name, kind)
            q = torch.stack([t.packed[96:] >> 4, t.packed[96:] & 15], 1).view(-1)
            qbnb = torch.stack([qb.view(-1)[96:] >> 4, qb.view(-1)[96:] & 15], 1).view(-1)
            assert torch.equal(q, torch.bucketize(y_ours, mid).to(torch.uint8)), (name, kind)
            assert torch.equal(qbnb, torch.bucketize(y_bnb, mid).to(torch.uint8)), (name, kind)
            if kind == "zero":
                assert torch.equal(dequantize(t, torch.float32), _bnb_dequantize(bnb, qb, sb, torch.float32, x.shape))
        parted += int((q != qbnb).sum())
    assert parted > 0, "bitsandbytes' short last block now scales as its others: drop this exception"


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_rows_equal_bitsandbytes(bnb, dtype):
    """bitsandbytes' int8_vectorwise_quant (LLM.int8()'s row-wise absmax, threshold 0) stores
    our codes and row statistics bit for bit, at every ISA and in the torch reference, from
    fp32 / bf16 / fp16 at an unaligned address: odd row lengths, values at and beside the halves
    of the steps, a zero row, rows with inf or NaN; its int8_vectorwise_dequant of our state is
    our fp32 dequantization bit for bit. Rows whose 127 / absmax overflows (absmax below about
    3.7e-37: here a bf16 / fp32 row scaled by 1e-38) are ours clamped to +-127 and left out of
    the codes' comparison: bitsandbytes' are the int8 cast of +-inf (undefined behaviour in C;
    0 on x86)."""
    gen = torch.Generator().manual_seed(8)
    for cols in (1, 33, 512, 4097):
        x = (torch.randn(9, cols, generator=gen) * torch.logspace(-3, 3, 9)[:, None]).to(dtype)
        x[1] = 0
        x[2, ::5] = float("inf")
        x[3, 0] = float("nan")
        if dtype != torch.float16:
            x[4] = x[4] * 1e-38
        if cols == 512:
            x = torch.cat([x, _int8_halfway_rows(gen, dtype)])
        x = _unaligned(x, 3)
        codes, stats, outliers = bnb.int8_vectorwise_quant(x)
        assert outliers is None and codes.dtype == torch.int8 and stats.dtype == torch.float32
        overflow = (stats > 0) & torch.isinf(stats.reciprocal() * 127)
        assert bool(overflow.any()) == (dtype != torch.float16)
        for name, _, _, quantize, dequantize in _paths():
            t = quantize(x)
            assert _same_bits(t.absmax, stats), (name, cols)
            assert torch.equal(t.codes[~overflow], codes[~overflow]), (name, cols)
            assert torch.equal(t.codes[overflow], (torch.sign(x[overflow].float()) * 127).to(torch.int8)), name
            assert _same_bits(dequantize(t, torch.float32), bnb.int8_vectorwise_dequant(t.codes, t.absmax)), name
