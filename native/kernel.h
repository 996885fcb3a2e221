/* kernel.h: the plumbing every elementwise optimizer kernel shares (internal, not the ABI).
 *
 * A rule's .c file holds only its per-element math, twice: a readable scalar reference
 * (`<rule>_ref`, plain C on floats) and the same IEEE operations written once for every
 * vector width (`<rule>_MATH(T)`, T = f32x8 or f32x16, GCC vector extensions plus the
 * helpers below). KERNEL_ELEMENTWISE_RULE(rule, hparams type) then generates the rest:
 *   - loads of fp32 / bf16 / fp16 (widened in registers) and stores with round-to-nearest-even,
 *     bit-exact with torch's c10::BFloat16 / c10::Half conversions;
 *   - one loop per (grad, state, copy) dtype combination, for the scalar reference, AVX2
 *     (8 lanes, scalar tail) and AVX-512 (16 lanes, masked tail; instantiated with and without
 *     the AVX512-BF16 conversion instruction);
 *   - streamed (non-temporal) stores of the low-precision param copy in whole cache lines;
 *   - int8 blockwise state (OFFLOAD_Q8): each block of KERNEL_Q8_BLOCK elements is dequantized
 *     into an fp32 scratch block, stepped by the fp32 loop, and requantized with a fresh
 *     absmax (see the Q8 section below);
 *   - chunking over the thread pool and runtime ISA dispatch (kernel.c).
 * The tests force each ISA and require every variant to equal the scalar reference bit for bit.
 *
 * fp-contract is off in every kernel file (KERNEL_NO_CONTRACT below): a multiply-add is
 * fused only where vfma / fmaf is written, so all variants perform the same operations.
 */
#ifndef OFFLOAD_KERNEL_H
#define OFFLOAD_KERNEL_H

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "offload_native.h"
#include "threadpool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

#define KINLINE static inline __attribute__((always_inline))

/* Software prefetch distance of the SIMD main loops, in elements (2 KB of an fp32 array):
 * every array a rule streams is prefetched this far ahead. The divisions and the square root
 * of a rule such as Adam keep the out-of-order window full of arithmetic, so the hardware
 * prefetchers alone left the loads waiting on memory (measured: Adam at 16M elements on one
 * thread, 0.84 of the bandwidth probe's rate without, 0.92-0.99 with; 128-1024 all help). */
#define KERNEL_PREFETCH_ELEMS 512

/* ---- chunking over the pool (kernel.c) ------------------------------------------------- */
struct chunking { int64_t n, size; }; /* [0, n) in chunks of `size` (the last shorter) */

struct chunking kernel_chunking(int64_t n);  /* chunks are multiples of KERNEL_Q8_BLOCK */
long kernel_nchunks(struct chunking ch);
void kernel_chunk_range(struct chunking ch, long c, int64_t *begin, int64_t *end);
int kernel_isa(void);                        /* offload_kernel_isa() */

/* ---- scalar conversions (bit-exact with torch's c10::BFloat16 / c10::Half) ------------- */
KINLINE uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
KINLINE float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

KINLINE float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

KINLINE uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN -> quiet NaN */
    uint32_t u = f32_bits(f);
    return f != f ? 0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE half <-> single without F16C (the FP16 library's method, as in c10/util/Half.h). */
KINLINE float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_f32(sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized)));
}

KINLINE uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

KINLINE float load1(const void *base, int dtype, int64_t i) {
    switch (dtype) {
    case OFFLOAD_BF16: return bf16_to_f32(((const uint16_t *)base)[i]);
    case OFFLOAD_F16: return f16_to_f32(((const uint16_t *)base)[i]);
    default: return ((const float *)base)[i];
    }
}

KINLINE void store1(void *base, int dtype, int64_t i, float x) {
    switch (dtype) {
    case OFFLOAD_BF16: ((uint16_t *)base)[i] = f32_to_bf16(x); break;
    case OFFLOAD_F16: ((uint16_t *)base)[i] = f32_to_f16(x); break;
    default: ((float *)base)[i] = x; break;
    }
}

KINLINE int dtype_size(int dtype) {
    return dtype == OFFLOAD_F32 ? 4 : dtype == OFFLOAD_Q8 ? 1 : dtype == OFFLOAD_DTYPE_NONE ? 0 : 2;
}

/* ---- the job every elementwise rule runs ---------------------------------------------- */
#define KERNEL_MAX_ROWS 2
#define KERNEL_HP_BYTES 64 /* room for any rule's hparams struct (checked at compile time) */

/* A row's int8 code, its midpoints, and the midpoints laid out for the 16- and 8-lane searches. */
struct q8_table {
    float code[256];     /* sorted values in [-1, 1] */
    float mid[256];      /* mid[k] = (code[k] + code[k + 1]) / 2, mid[255] = +inf */
    float last[16];      /* last[g] = mid[16 g + 15] */
    float mt[15][16];    /* mt[t][g] = mid[16 g + t] */
    float last8[8];      /* last8[g] = mid[32 g + 31] */
    float mt8[31][8];    /* mt8[t][g] = mid[32 g + t] */
};

struct kjob {
    float *param;
    const float *sparam;             /* read: param, or param_src (out of place) */
    const void *grad;
    void *state[KERNEL_MAX_ROWS];
    const void *sstate[KERNEL_MAX_ROWS];   /* read: state[r], or state_src[r] */
    float *absmax[KERNEL_MAX_ROWS];  /* OFFLOAD_Q8 state: one fp32 scale per block */
    void *param_copy;
    int64_t n;
    int grad_dtype, state_dtype, copy_dtype, nrows, isa;
    _Alignas(16) unsigned char hp[KERNEL_HP_BYTES]; /* the rule's hparams struct, by value */
    const struct q8_table *q8[KERNEL_MAX_ROWS]; /* OFFLOAD_Q8: each row's code tables */
    struct chunking chunks;
};

/* Checks the arguments and fills a job (the rule's hparams are copied in by the caller);
 * int8 tables are built in `tables` (the caller's, alive for the call). */
int kernel_job_init(struct kjob *j, const offload_step_args *a, int rows_min, int rows_max,
                    struct q8_table *tables);
/* Runs fn over every chunk of the job on the pool. */
int kernel_run(struct kjob *j, void (*range)(const struct kjob *, int64_t, int64_t));

/* Every (grad, state, copy) dtype combination, for the loops to specialise on. State here is
 * the in-register state dtype: int8 state is stepped as fp32 in a scratch block. The copy is
 * none, bf16, fp16 or fp32 (the updated parameter itself, written where it goes next). */
#define KERNEL_COPIES_R(X, R, g, s) \
    X(R, g, s, OFFLOAD_DTYPE_NONE) X(R, g, s, OFFLOAD_BF16) X(R, g, s, OFFLOAD_F16) X(R, g, s, OFFLOAD_F32)
#define KERNEL_COMBOS_R(X, R)                                                                   \
    KERNEL_COPIES_R(X, R, OFFLOAD_F32, OFFLOAD_F32) KERNEL_COPIES_R(X, R, OFFLOAD_F32, OFFLOAD_BF16)   \
    KERNEL_COPIES_R(X, R, OFFLOAD_BF16, OFFLOAD_F32) KERNEL_COPIES_R(X, R, OFFLOAD_BF16, OFFLOAD_BF16) \
    KERNEL_COPIES_R(X, R, OFFLOAD_F16, OFFLOAD_F32) KERNEL_COPIES_R(X, R, OFFLOAD_F16, OFFLOAD_BF16)
#define KERNEL_COMBO(g, s, c) (((g) * 2 + (s)) * 4 + (c) + 1)

/* ---- int8 blockwise state (OFFLOAD_Q8) --------------------------------------------------
 * As 8-bit Adam (Dettmers et al. 2022) stores it: a row is n uint8 codes plus one fp32
 * absmax per block of KERNEL_Q8_BLOCK elements (the last block shorter). Value of code q in
 * block b: code[q] * absmax[b], with `code` a sorted 256-entry non-linear map in [-1, 1]
 * (offload/optim/quant.py builds it: signed for signed moments, unsigned for non-negative
 * ones). Requantizing a block: absmax = max |x| over the block's new values, then
 * q = #{k : x * (1 / absmax) > mid[k]}, the nearest code (ties to the lower one; absmax 0
 * stores every value as the code nearest 0). Blocks start at element 0 of the call: a shard
 * handed to the kernel starts on a block boundary of its row. */
#define KERNEL_Q8_BLOCK 256

KINLINE uint8_t q8_index_scalar(const float *mid, float x) { /* binary search, no branches */
    unsigned k = 0;
    for (unsigned step = 128; step >= 1; step >>= 1) k += step & -(unsigned)(x > mid[k + step - 1]);
    return (uint8_t)k;
}

/* ---- vector types and the math helpers rules use ---------------------------------------- */
typedef float f32x8 __attribute__((vector_size(32), aligned(4)));
typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i32x8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64), aligned(4)));

#ifdef HAVE_X86
#define TARGET_f32x8 __attribute__((target("avx2,fma,f16c")))
/* The AVX-512 target also names avx512bf16 so that one body serves both AVX-512 variants;
 * only the instantiation with native_bf16 = 1 (dispatched to on CPUs that have it) contains
 * vcvtneps2bf16. */
#define TARGET_f32x16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define I256 KINLINE TARGET_f32x8
#define I512 KINLINE TARGET_f32x16

I256 f32x8 vfma_8(f32x8 a, f32x8 b, f32x8 c) { return (f32x8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
I256 f32x8 vsqrt_8(f32x8 a) { return (f32x8)_mm256_sqrt_ps((__m256)a); }
I256 f32x8 vmax_8(f32x8 a, f32x8 b) { return (f32x8)_mm256_max_ps((__m256)a, (__m256)b); }
I512 f32x16 vfma_16(f32x16 a, f32x16 b, f32x16 c) { return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
I512 f32x16 vsqrt_16(f32x16 a) { return (f32x16)_mm512_sqrt_ps((__m512)a); }
I512 f32x16 vmax_16(f32x16 a, f32x16 b) { return (f32x16)_mm512_max_ps((__m512)a, (__m512)b); }

/* torch.sign on floats: +1, -1, or x itself for +-0 (and NaN): copysign(1, x) where x != 0. */
#define VSIGN_BODY(T, I)                                                                       \
    const I one = (I)((T){0} + 1.0f), sgn = (I)x & ((I){0} + INT32_MIN);                        \
    const I nz = (I)(x != 0);                                                                    \
    return (T)(((one | sgn) & nz) | ((I)x & ~nz));
I256 f32x8 vsign_8(f32x8 x) { VSIGN_BODY(f32x8, i32x8) }
I512 f32x16 vsign_16(f32x16 x) { VSIGN_BODY(f32x16, i32x16) }
#define VABS_BODY(T, I) return (T)((I)x & ((I){0} + INT32_MAX));
I256 f32x8 vabs_8(f32x8 x) { VABS_BODY(f32x8, i32x8) }
I512 f32x16 vabs_16(f32x16 x) { VABS_BODY(f32x16, i32x16) }

/* x / c for a per-call constant c, correctly rounded (bit for bit the fp32 division) without
 * the divider: x times recip = 1 / (double)c in double precision, rounded once to fp32. Why
 * exact: recip and the product each carry a relative error of at most 2^-53, so the double
 * result is within 2^-51 of x / c; a quotient of two 24-bit floats is never closer than
 * 2^-49 (relative) to a midpoint between two floats (x - m c is a nonzero multiple of the
 * last bit of m c), so both round to the same fp32, overflow to inf included. Zeros,
 * infinities and NaNs (payload kept) come out as the division's; with c > 0 and x = 0 or a
 * normal, no result is subnormal, so flush-to-zero changes neither. The caller hoists recip
 * (vdivc_recip) out of its loop; the vector division unit (shared by sqrt and every other
 * division) is left to the operations that need it. */
KINLINE double vdivc_recip(float c) { return 1.0 / (double)c; }
I256 f32x8 vdivc_8(f32x8 x, double recip) {
    const __m256d r = _mm256_set1_pd(recip);
    const __m128 lo = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)x)), r));
    const __m128 hi = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)x, 1)), r));
    return (f32x8)_mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}
I512 f32x16 vdivc_16(f32x16 x, double recip) {
    const __m512d r = _mm512_set1_pd(recip);
    const __m256 lo = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)x)), r));
    const __m256 hi = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps((__m512)x, 1)), r));
    return (f32x16)_mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

/* The math helpers by lane type (rules call these; + - * / are the vector operators). */
#define vfma(a, b, c) _Generic((a), f32x8: vfma_8, f32x16: vfma_16)(a, b, c)
#define vsqrt(a) _Generic((a), f32x8: vsqrt_8, f32x16: vsqrt_16)(a)
#define vsign(a) _Generic((a), f32x8: vsign_8, f32x16: vsign_16)(a)
#define vabs(a) _Generic((a), f32x8: vabs_8, f32x16: vabs_16)(a)
#define vdivc(a, recip) _Generic((a), f32x8: vdivc_8, f32x16: vdivc_16)(a, recip)
/* A vector with every lane x, -0.0 included (x - (+0) is x exactly; a scalar operand of
 * + - * / is broadcast by GCC already). */
#define vset1(T, x) ((float)(x) - (T){0})

/* ---- AVX2 loads and stores (8 lanes, full vectors only) -------------------------------- */
I256 f32x8 ld_8(const void *base, int dtype, int64_t i) {
    if (dtype == OFFLOAD_F32) return (f32x8)_mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (dtype == OFFLOAD_F16) return (f32x8)_mm256_cvtph_ps(h);
    return (f32x8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

I256 __m128i bf16_round_8(__m256 x) { /* f32_to_bf16 on 8 lanes */
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* lanes 0-3, 4-7 -> low 128 */
    return _mm256_castsi256_si128(r);
}

I256 void st_8(void *base, int dtype, int64_t i, f32x8 v, int stream) {
    __m256 x = (__m256)v;
    if (dtype == OFFLOAD_F32) {
        if (stream) _mm256_stream_ps((float *)base + i, x); /* 32-byte aligned */
        else _mm256_storeu_ps((float *)base + i, x);
        return;
    }
    __m128i h = dtype == OFFLOAD_F16 ? _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                     : bf16_round_8(x);
    __m128i *q = (__m128i *)((uint16_t *)base + i);
    if (stream) _mm_stream_si128(q, h); /* q is 16-byte aligned */
    else _mm_storeu_si128(q, h);
}

/* ---- AVX-512 loads and stores (16 lanes; the first lanes of mask k unless `full`) ------- */
I512 f32x16 ld_16(const void *base, int dtype, int64_t i, __mmask16 k, int full) {
    if (dtype == OFFLOAD_F32)
        return (f32x16)(full ? _mm512_loadu_ps((const float *)base + i) : _mm512_maskz_loadu_ps(k, (const float *)base + i));
    const uint16_t *q = (const uint16_t *)base + i;
    __m256i h = full ? _mm256_loadu_si256((const __m256i *)q) : _mm256_maskz_loadu_epi16(k, q);
    if (dtype == OFFLOAD_F16) return (f32x16)_mm512_cvtph_ps(h);
    return (f32x16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

I512 __m256i bf16_round_16_sw(__m512 x) { /* f32_to_bf16 on 16 lanes */
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

I512 __m256i bf16_round_16(__m512 x, int native_bf16) {
    if (!native_bf16) return bf16_round_16_sw(x);
    __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
    /* vcvtneps2bf16 flushes denormal inputs to zero; round those lanes like the scalar code. */
    __mmask16 denormal = _mm512_fpclass_ps_mask(x, 0x20);
    if (__builtin_expect(denormal != 0, 0)) r = _mm256_mask_blend_epi16(denormal, r, bf16_round_16_sw(x));
    return r;
}

/* x rounded to nearest even as 16 bf16 or fp16 values. */
I512 __m256i narrow_16(f32x16 x, int dtype, int native_bf16) {
    return dtype == OFFLOAD_F16 ? _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                : bf16_round_16((__m512)x, native_bf16);
}

I512 void st_16(void *base, int dtype, int64_t i, f32x16 x, __mmask16 k, int full, int native_bf16) {
    if (dtype == OFFLOAD_F32) {
        if (full) _mm512_storeu_ps((float *)base + i, (__m512)x);
        else _mm512_mask_storeu_ps((float *)base + i, k, (__m512)x);
        return;
    }
    __m256i h = narrow_16(x, dtype, native_bf16);
    uint16_t *q = (uint16_t *)base + i;
    if (full) _mm256_storeu_si256((__m256i *)q, h);
    else _mm256_mask_storeu_epi16(q, k, h);
}

/* 16 values stored whole with a non-temporal store: fp32 at a 64-byte, bf16 / fp16 at a
 * 32-byte aligned address (kernel_stream_out_head). */
I512 void sst_16(void *base, int dtype, int64_t i, f32x16 x, int native_bf16) {
    if (dtype == OFFLOAD_F32) _mm512_stream_ps((float *)base + i, (__m512)x);
    else _mm256_stream_si256((__m256i *)((uint16_t *)base + i), narrow_16(x, dtype, native_bf16));
}

/* The param copy is write-only and leaves by DMA: non-temporal stores put it in memory
 * without first reading each line in and without evicting the state from cache. They need
 * aligned addresses (a head loop aligns the copy; a copy not aligned to its element size, or
 * a short range, uses plain stores) and an sfence before the chunk is reported done, since
 * they are not ordered by the pool's mutex. An fp32 copy is the updated parameter itself,
 * written straight where it goes next (a staging buffer) instead of copied from the master
 * after the step; every variant stores the same value, so the copy equals the master. */
#ifndef STREAM_MIN
#define STREAM_MIN 4096
#endif
KINLINE int kernel_stream_copy(const struct kjob *j, int64_t begin, int64_t end) {
    return j->copy_dtype != OFFLOAD_DTYPE_NONE && end - begin >= STREAM_MIN &&
           ((uintptr_t)j->param_copy & (uintptr_t)(dtype_size(j->copy_dtype) - 1)) == 0;
}
/* Out of place (param_src set): param and the rows are written whole and never read, so on
 * AVX-512 they are streamed too, where every one of them (and the copy, when it is) reaches a
 * whole vector at the same element: without it each written line is first read in
 * (read-for-ownership): about a third more traffic than the step in place. Returns the head (the
 * elements before that point, stepped with plain stores), or -1 where it does not apply. */
KINLINE int64_t kernel_stream_out_head(const struct kjob *j, int64_t begin, int64_t end, int sdt) {
    if (j->sparam == j->param || sdt == OFFLOAD_Q8 || end - begin < STREAM_MIN) return -1;
    if (((uintptr_t)j->param & 3) != 0) return -1;
    const int64_t head = (int64_t)((-(uintptr_t)(j->param + begin)) & 63) / 4;
    const int ss = dtype_size(sdt);
    for (int r = 0; r < j->nrows; r++)
        if (((uintptr_t)((const char *)j->state[r] + (begin + head) * ss) & (uintptr_t)(16 * ss - 1)) != 0) return -1;
    return head;
}
KINLINE int kernel_stream_out_copy(const struct kjob *j, int64_t at) {
    if (j->copy_dtype == OFFLOAD_DTYPE_NONE) return 0;
    const int cs = dtype_size(j->copy_dtype);
    return ((uintptr_t)((const char *)j->param_copy + at * cs) & (uintptr_t)(16 * cs - 1)) == 0;
}

/* Elements from i until the copy's address is a multiple of `align` bytes (a power of two). */
KINLINE int64_t kernel_copy_head(const struct kjob *j, int64_t i, int cdt, uintptr_t align) {
    const int cs = dtype_size(cdt);
    return (int64_t)((-(uintptr_t)((char *)j->param_copy + i * cs)) & (align - 1)) / cs;
}

/* int8 code lookups on 16 lanes without gathers (slow on CPUs with the gather-data-sampling
 * mitigation): the 256-entry tables sit in registers.
 * Dequantize: code[q] as one of 8 two-register permutes, picked by q >> 5.
 * Quantize: q = #{k : x > mid[k]} in two levels: the group g = #{groups whose last midpoint
 * mid[16 g + 15] is below x} (a 4-step search in one register), then the count of the
 * group's other 15 midpoints below x, each looked up by g in a transposed register
 * (mt[t][g] = mid[16 g + t]). The same comparisons as the scalar search: the same index. */
struct q8_tables16 { __m512 code[16]; __m512 last; __m512 mt[15]; };

I512 void q8_load_tables16(struct q8_tables16 *t, const struct q8_table *q) {
    for (int k = 0; k < 16; k++) t->code[k] = _mm512_loadu_ps(q->code + 16 * k);
    t->last = _mm512_loadu_ps(q->last);
    for (int k = 0; k < 15; k++) t->mt[k] = _mm512_loadu_ps(q->mt[k]);
}

I512 f32x16 q8_dequant_16(const struct q8_tables16 *t, const uint8_t *q, float scale) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    const __m512i hi = _mm512_srli_epi32(idx, 5);
    __m512 v = _mm512_setzero_ps();
    for (int k = 0; k < 8; k++) {
        const __m512 part = _mm512_permutex2var_ps(t->code[2 * k], idx, t->code[2 * k + 1]); /* uses idx & 31 */
        v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(hi, _mm512_set1_epi32(k)), part);
    }
    return (f32x16)_mm512_mul_ps(v, _mm512_set1_ps(scale));
}

I512 void q8_quant_16(const struct q8_tables16 *t, uint8_t *q, f32x16 xv) {
    const __m512 x = (__m512)xv;
    __m512i g = _mm512_setzero_si512();
    for (int step = 8; step >= 1; step >>= 1) {
        const __m512 probe = _mm512_permutexvar_ps(_mm512_add_epi32(g, _mm512_set1_epi32(step - 1)), t->last);
        g = _mm512_mask_add_epi32(g, _mm512_cmp_ps_mask(x, probe, _CMP_GT_OQ), g, _mm512_set1_epi32(step));
    }
    __m512i k = _mm512_slli_epi32(g, 4);
    for (int j = 0; j < 15; j++)
        k = _mm512_mask_add_epi32(k, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(g, t->mt[j]), _CMP_GT_OQ), k,
                                  _mm512_set1_epi32(1));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(k));
}
/* The 8-lane lookups, without gathers either (a gather costs tens of cycles under the
 * gather-data-sampling mitigation, and the search below would chain eight of them).
 * Dequantize: eight scalar loads of code[q] into one vector (the table stays in L1).
 * Quantize: q = #{k : x > mid[k]} in two levels: the group g = #{groups of 32 whose last
 * midpoint mid[32 g + 31] is below x} (7 broadcast comparisons), then the count of the
 * group's other 31 midpoints below x, each looked up by g in an 8-entry register
 * (mt8[t][g] = mid[32 g + t], one vpermps). The same comparisons as the scalar search (a
 * NaN compares false everywhere: 0): the same index. */
I256 f32x8 q8_dequant_8(const uint8_t *q, const float *code, float scale) {
    uint64_t w;
    memcpy(&w, q, 8);
    const __m256 v = _mm256_setr_ps(code[w & 255], code[(w >> 8) & 255], code[(w >> 16) & 255], code[(w >> 24) & 255],
                                    code[(w >> 32) & 255], code[(w >> 40) & 255], code[(w >> 48) & 255], code[w >> 56]);
    return (f32x8)_mm256_mul_ps(v, _mm256_set1_ps(scale));
}
I256 void q8_quant_8(uint8_t *q, const struct q8_table *t, f32x8 xv) {
    const __m256 x = (__m256)xv;
    __m256i g = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int k = 0; k < 7; k++) /* a true comparison is -1: subtracting it counts */
        g = _mm256_sub_epi32(g, _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_set1_ps(t->last8[k]), _CMP_GT_OQ)));
    /* unrolled, two running counts: no loop overhead and half the add chain */
    __m256i k0 = _mm256_slli_epi32(g, 5), k1 = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int j = 0; j < 30; j += 2) {
        const __m256 m0 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(t->mt8[j]), g);
        const __m256 m1 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(t->mt8[j + 1]), g);
        k0 = _mm256_sub_epi32(k0, _mm256_castps_si256(_mm256_cmp_ps(x, m0, _CMP_GT_OQ)));
        k1 = _mm256_sub_epi32(k1, _mm256_castps_si256(_mm256_cmp_ps(x, m1, _CMP_GT_OQ)));
    }
    const __m256 m30 = _mm256_permutevar8x32_ps(_mm256_loadu_ps(t->mt8[30]), g);
    const __m256i k = _mm256_sub_epi32(_mm256_add_epi32(k0, k1), _mm256_castps_si256(_mm256_cmp_ps(x, m30, _CMP_GT_OQ)));
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1)); /* 0..255 */
    _mm_storel_epi64((__m128i *)q, _mm_packus_epi16(w, w));
}

/* The line KERNEL_PREFETCH_ELEMS ahead of element i of each array the loop reads (and, in
 * place, writes); the param copy is write-only (streamed). A prefetch past an array's end
 * is harmless: it never faults. */
KINLINE void kernel_prefetch(const struct kjob *j, int64_t i, int gdt, int sdt, int nr) {
    _mm_prefetch((const char *)(j->sparam + i), _MM_HINT_T0);
    _mm_prefetch((const char *)j->grad + i * dtype_size(gdt), _MM_HINT_T0);
    if (nr > 0) _mm_prefetch((const char *)j->sstate[0] + i * dtype_size(sdt), _MM_HINT_T0);
    if (nr > 1) _mm_prefetch((const char *)j->sstate[1] + i * dtype_size(sdt), _MM_HINT_T0);
}
#endif /* HAVE_X86 */

/* ---- the generated kernel ---------------------------------------------------------------
 * A rule defines:
 *   typedef struct { ... } HP;                                        (offload_native.h)
 *   KINLINE void RULE_ref(const HP *h, float *p, float g, float *s0, float *s1)
 *                        the scalar reference: one element, g already widened to fp32
 *   #define RULE_MATH(T) ... RULE_vec_##T(const HP *h, T *p, T g, T *s0, T *s1) ...
 *                        the same operations on a vector (instantiated for f32x8, f32x16)
 * Rows the rule does not keep (nrows below 2) are passed as dummies and never stored. */
#define KERNEL_ELEMENTWISE_RULE(RULE, HP)                                                        \
    KINLINE void RULE##_elem(const struct kjob *j, const HP *h, int64_t i, int gdt, int sdt, int cdt) { \
        float p = j->sparam[i], g = load1(j->grad, gdt, i), s0 = 0.0f, s1 = 0.0f;               \
        if (j->nrows > 0) s0 = load1(j->sstate[0], sdt, i);                                     \
        if (j->nrows > 1) s1 = load1(j->sstate[1], sdt, i);                                     \
        RULE##_ref(h, &p, g, &s0, &s1);                                                          \
        j->param[i] = p;                                                                         \
        if (j->nrows > 0) store1(j->state[0], sdt, i, s0);                                      \
        if (j->nrows > 1) store1(j->state[1], sdt, i, s1);                                      \
        if (cdt != OFFLOAD_DTYPE_NONE) store1(j->param_copy, cdt, i, p);                        \
    }                                                                                            \
    static void RULE##_scalar(const struct kjob *j, int64_t begin, int64_t end) {               \
        HP h; memcpy(&h, j->hp, sizeof h); /* a local copy: the stores cannot alias it */       \
        switch (KERNEL_COMBO(j->grad_dtype, j->state_dtype, j->copy_dtype)) {                   \
        KERNEL_COMBOS_R(KERNEL_SCALAR_CASE, RULE)                                                        \
        }                                                                                        \
    }                                                                                            \
    KERNEL_SIMD_RULE(RULE, HP)

#define KERNEL_SCALAR_CASE(RULE, g, s, c) \
    case KERNEL_COMBO(g, s, c): for (int64_t i = begin; i < end; i++) RULE##_elem(j, &h, i, g, s, c); return;

#ifdef HAVE_X86
/* NR: the row count, a literal (each SIMD loop is compiled for the row count it runs with:
 * no per-vector tests of it, and only the counts a rule accepts are compiled). */
#define KERNEL_DISPATCH(RULE, j, begin, end, NR)                                                 \
    switch ((j)->isa) {                                                                          \
    case OFFLOAD_ISA_AVX512_BF16: RULE##_avx512_r##NR(j, begin, end, 1); return;                 \
    case OFFLOAD_ISA_AVX512: RULE##_avx512_r##NR(j, begin, end, 0); return;                      \
    case OFFLOAD_ISA_AVX2: RULE##_avx2_r##NR(j, begin, end); return;                             \
    default: RULE##_scalar(j, begin, end); return;                                               \
    }

#define KERNEL_SIMD_RULE(RULE, HP)                                                               \
    RULE##_MATH(f32x8)                                                                           \
    RULE##_MATH(f32x16)                                                                          \
    /* ---- AVX2: 8 lanes, scalar tail ---- */                                                   \
    I256 void RULE##_v8(const struct kjob *j, const HP *h, int64_t i, int gdt, int sdt, int cdt, int nr, int stream) { \
        f32x8 p = ld_8(j->sparam, OFFLOAD_F32, i), g = ld_8(j->grad, gdt, i), s0 = {0}, s1 = {0};  \
        if (nr > 0) s0 = ld_8(j->sstate[0], sdt, i);                                             \
        if (nr > 1) s1 = ld_8(j->sstate[1], sdt, i);                                             \
        RULE##_vec_f32x8(h, &p, g, &s0, &s1);                                                    \
        st_8(j->param, OFFLOAD_F32, i, p, 0);                                                    \
        if (nr > 0) st_8(j->state[0], sdt, i, s0, 0);                                            \
        if (nr > 1) st_8(j->state[1], sdt, i, s1, 0);                                            \
        if (cdt != OFFLOAD_DTYPE_NONE) st_8(j->param_copy, cdt, i, p, stream);                   \
    }                                                                                            \
    I256 void RULE##_range8(const struct kjob *j, const HP *h, int64_t begin, int64_t end, int gdt, int sdt, int cdt, int nr) { \
        int64_t i = begin;                                                                       \
        const int stream = kernel_stream_copy(j, begin, end);                                    \
        if (stream) /* a scalar head aligns the copy to a whole vector (16 or 32 bytes) */       \
            for (int64_t stop = i + kernel_copy_head(j, i, cdt, 8 * (uintptr_t)dtype_size(cdt)); i < stop && i < end; i++) \
                RULE##_elem(j, h, i, gdt, sdt, cdt);                                             \
        for (; i + 8 <= end; i += 8) {                                                           \
            if ((i & 15) == 0) kernel_prefetch(j, i + KERNEL_PREFETCH_ELEMS, gdt, sdt, nr);       \
            RULE##_v8(j, h, i, gdt, sdt, cdt, nr, stream);                                       \
        }                                                                                        \
        for (; i < end; i++) RULE##_elem(j, h, i, gdt, sdt, cdt);                                \
        if (stream) _mm_sfence(); /* the streamed copy lands before the chunk is reported done */ \
    }                                                                                            \
    I256 void RULE##_avx2(const struct kjob *job, int64_t begin, int64_t end, const int nr) {    \
        const struct kjob local = *job, *j = &local; /* no aliasing: pointers stay in registers */ \
        HP h; memcpy(&h, j->hp, sizeof h);                                                       \
        switch (KERNEL_COMBO(j->grad_dtype, j->state_dtype, j->copy_dtype)) {                   \
        KERNEL_COMBOS_R(KERNEL_AVX2_CASE, RULE)                                                          \
        }                                                                                        \
    }                                                                                            \
    /* ---- AVX-512: 16 lanes, masked tail ---- */                                              \
    I512 f32x16 RULE##_v16(const struct kjob *j, const HP *h, int64_t i, __mmask16 k, int full, int gdt, int sdt, int nr, int nb) { \
        f32x16 p = ld_16(j->sparam, OFFLOAD_F32, i, k, full), g = ld_16(j->grad, gdt, i, k, full); \
        f32x16 s0 = {0}, s1 = {0};                                                               \
        if (nr > 0) s0 = ld_16(j->sstate[0], sdt, i, k, full);                                   \
        if (nr > 1) s1 = ld_16(j->sstate[1], sdt, i, k, full);                                   \
        RULE##_vec_f32x16(h, &p, g, &s0, &s1);                                                   \
        st_16(j->param, OFFLOAD_F32, i, p, k, full, 0);                                          \
        if (nr > 0) st_16(j->state[0], sdt, i, s0, k, full, nb);                                 \
        if (nr > 1) st_16(j->state[1], sdt, i, s1, k, full, nb);                                 \
        return p;                                                                                \
    }                                                                                            \
    I512 void RULE##_step16(const struct kjob *j, const HP *h, int64_t i, int64_t count, int gdt, int sdt, int cdt, int nr, int nb) { \
        const int full = count == 16;                                                            \
        const __mmask16 k = full ? 0xFFFF : (__mmask16)((1u << count) - 1u);                    \
        f32x16 p = RULE##_v16(j, h, i, k, full, gdt, sdt, nr, nb);                               \
        if (cdt != OFFLOAD_DTYPE_NONE) st_16(j->param_copy, cdt, i, p, k, full, nb);             \
    }                                                                                            \
    I512 void RULE##_out16(const struct kjob *j, const HP *h, int64_t i, int gdt, int sdt, int cdt, int nr, int nb, int scopy) { \
        f32x16 p = ld_16(j->sparam, OFFLOAD_F32, i, 0xFFFF, 1), g = ld_16(j->grad, gdt, i, 0xFFFF, 1); \
        f32x16 s0 = {0}, s1 = {0};                                                               \
        if (nr > 0) s0 = ld_16(j->sstate[0], sdt, i, 0xFFFF, 1);                                 \
        if (nr > 1) s1 = ld_16(j->sstate[1], sdt, i, 0xFFFF, 1);                                 \
        RULE##_vec_f32x16(h, &p, g, &s0, &s1);                                                   \
        sst_16(j->param, OFFLOAD_F32, i, p, nb);                                                 \
        if (nr > 0) sst_16(j->state[0], sdt, i, s0, nb);                                         \
        if (nr > 1) sst_16(j->state[1], sdt, i, s1, nb);                                         \
        if (cdt != OFFLOAD_DTYPE_NONE) {                                                         \
            if (scopy) sst_16(j->param_copy, cdt, i, p, nb);                                     \
            else st_16(j->param_copy, cdt, i, p, 0xFFFF, 1, nb);                                 \
        }                                                                                        \
    }                                                                                            \
    I512 void RULE##_range16(const struct kjob *j, const HP *h, int64_t begin, int64_t end, int gdt, int sdt, int cdt, int nr, int nb) { \
        int64_t i = begin;                                                                       \
        const int64_t out_head = kernel_stream_out_head(j, begin, end, sdt);                     \
        if (out_head >= 0) {                                                                     \
            /* out of place: a head with plain stores, then whole vectors streamed */            \
            for (int64_t k, aligned = i + out_head; i < aligned; i += k) {                       \
                k = aligned - i < 16 ? aligned - i : 16;                                         \
                RULE##_step16(j, h, i, k, gdt, sdt, cdt, nr, nb);                                \
            }                                                                                    \
            const int scopy = kernel_stream_out_copy(j, i);                                      \
            for (; i + 16 <= end; i += 16) {                                                     \
                kernel_prefetch(j, i + KERNEL_PREFETCH_ELEMS, gdt, sdt, nr);                      \
                RULE##_out16(j, h, i, gdt, sdt, cdt, nr, nb, scopy);                             \
            }                                                                                    \
            _mm_sfence(); /* the streamed lines land before the chunk is reported done */       \
            if (i < end) RULE##_step16(j, h, i, end - i, gdt, sdt, cdt, nr, nb);                 \
            return;                                                                              \
        }                                                                                        \
        if (cdt == OFFLOAD_F32 && kernel_stream_copy(j, begin, end)) {                           \
            /* Head: bring the copy to 64-byte alignment; then one streamed line per vector. */ \
            for (int64_t k, aligned = i + kernel_copy_head(j, i, cdt, 64); i < aligned; i += k) { \
                k = aligned - i < 16 ? aligned - i : 16;                                         \
                RULE##_step16(j, h, i, k, gdt, sdt, cdt, nr, nb);                                \
            }                                                                                    \
            for (; i + 16 <= end; i += 16) {                                                     \
                kernel_prefetch(j, i + KERNEL_PREFETCH_ELEMS, gdt, sdt, nr);                      \
                _mm512_stream_ps((float *)j->param_copy + i,                                     \
                                 (__m512)RULE##_v16(j, h, i, 0xFFFF, 1, gdt, sdt, nr, nb));       \
            }                                                                                    \
            _mm_sfence(); /* the streamed copy lands before the chunk is reported done */       \
        } else if (cdt != OFFLOAD_F32 && kernel_stream_copy(j, begin, end)) {                    \
            /* Head: bring the copy to 64-byte alignment. Then 32 elements at a time, their     \
             * copy streamed as one full cache line (no partially written combining lines). */   \
            uint16_t *copy = (uint16_t *)j->param_copy;                                          \
            const int64_t aligned = i + (int64_t)((-(uintptr_t)(copy + i)) & 63) / 2;            \
            for (int64_t k; i < aligned; i += k) {                                               \
                k = aligned - i < 16 ? aligned - i : 16;                                         \
                RULE##_step16(j, h, i, k, gdt, sdt, cdt, nr, nb);                                \
            }                                                                                    \
            for (; i + 32 <= end; i += 32) {                                                     \
                __m256i lo = narrow_16(RULE##_v16(j, h, i, 0xFFFF, 1, gdt, sdt, nr, nb), cdt, nb); \
                __m256i hi = narrow_16(RULE##_v16(j, h, i + 16, 0xFFFF, 1, gdt, sdt, nr, nb), cdt, nb); \
                _mm512_stream_si512((__m512i *)(copy + i), _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)); \
            }                                                                                    \
            _mm_sfence(); /* the streamed copy lands before the chunk is reported done */       \
        }                                                                                        \
        /* whole vectors, then one masked tail: no mask or count computed per vector */         \
        for (; i + 16 <= end; i += 16) {                                                         \
            kernel_prefetch(j, i + KERNEL_PREFETCH_ELEMS, gdt, sdt, nr);                          \
            RULE##_step16(j, h, i, 16, gdt, sdt, cdt, nr, nb);                                   \
        }                                                                                        \
        if (i < end) RULE##_step16(j, h, i, end - i, gdt, sdt, cdt, nr, nb);                     \
    }                                                                                            \
    I512 void RULE##_avx512(const struct kjob *job, int64_t begin, int64_t end, int native_bf16, const int nr) { \
        const struct kjob local = *job, *j = &local;                                             \
        HP h; memcpy(&h, j->hp, sizeof h);                                                       \
        /* native_bf16 is a constant in each instantiation: the one without BF16 instructions  \
         * contains none, whatever the compiler does with branches. */                          \
        if (native_bf16) {                                                                       \
            switch (KERNEL_COMBO(j->grad_dtype, j->state_dtype, j->copy_dtype)) {               \
            KERNEL_COMBOS_R(KERNEL_AVX512_CASE_BF16, RULE)                                               \
            }                                                                                    \
        } else {                                                                                 \
            switch (KERNEL_COMBO(j->grad_dtype, j->state_dtype, j->copy_dtype)) {               \
            KERNEL_COMBOS_R(KERNEL_AVX512_CASE, RULE)                                                    \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    /* one compiled loop set per row count (only those KERNEL_ENTRY_POINT's range names) */     \
    TARGET_f32x8 static void RULE##_avx2_r0(const struct kjob *j, int64_t b, int64_t e) { RULE##_avx2(j, b, e, 0); } \
    TARGET_f32x8 static void RULE##_avx2_r1(const struct kjob *j, int64_t b, int64_t e) { RULE##_avx2(j, b, e, 1); } \
    TARGET_f32x8 static void RULE##_avx2_r2(const struct kjob *j, int64_t b, int64_t e) { RULE##_avx2(j, b, e, 2); } \
    TARGET_f32x16 static void RULE##_avx512_r0(const struct kjob *j, int64_t b, int64_t e, int bf) { RULE##_avx512(j, b, e, bf, 0); } \
    TARGET_f32x16 static void RULE##_avx512_r1(const struct kjob *j, int64_t b, int64_t e, int bf) { RULE##_avx512(j, b, e, bf, 1); } \
    TARGET_f32x16 static void RULE##_avx512_r2(const struct kjob *j, int64_t b, int64_t e, int bf) { RULE##_avx512(j, b, e, bf, 2); }

#define KERNEL_AVX2_CASE(RULE, g, s, c) case KERNEL_COMBO(g, s, c): RULE##_range8(j, &h, begin, end, g, s, c, nr); return;
#define KERNEL_AVX512_CASE(RULE, g, s, c) \
    case KERNEL_COMBO(g, s, c): RULE##_range16(j, &h, begin, end, g, s, c, nr, 0); return;
#define KERNEL_AVX512_CASE_BF16(RULE, g, s, c) \
    case KERNEL_COMBO(g, s, c): RULE##_range16(j, &h, begin, end, g, s, c, nr, 1); return;
#else
#define KERNEL_DISPATCH(RULE, j, begin, end, NR) { RULE##_scalar(j, begin, end); return; }
#define KERNEL_SIMD_RULE(RULE, HP)
#endif

/* The entry point of an elementwise rule: `offload_<rule>_step(args, hparams)`. int8 state
 * goes through kernel_q8_range with this rule's fp32 range. */
void kernel_q8_range(const struct kjob *j, int64_t begin, int64_t end,
                     void (*range)(const struct kjob *, int64_t, int64_t));

#define KERNEL_ENTRY_POINT(RULE, HP, ROWS_MIN, ROWS_MAX)                                         \
    static void RULE##_range(const struct kjob *j, int64_t begin, int64_t end) {                \
        /* kernel_job_init checked ROWS_MIN <= nrows <= ROWS_MAX; the other counts fold away */ \
        if ((ROWS_MIN) <= 0 && j->nrows == 0) { KERNEL_DISPATCH(RULE, j, begin, end, 0) }       \
        if ((ROWS_MIN) <= 1 && (ROWS_MAX) >= 1 && j->nrows == 1) { KERNEL_DISPATCH(RULE, j, begin, end, 1) } \
        if ((ROWS_MAX) >= 2 && j->nrows == 2) { KERNEL_DISPATCH(RULE, j, begin, end, 2) }       \
        RULE##_scalar(j, begin, end);                                                            \
    }                                                                                            \
    static void RULE##_chunk_range(const struct kjob *j, int64_t begin, int64_t end) {          \
        if (j->state_dtype == OFFLOAD_Q8) kernel_q8_range(j, begin, end, RULE##_range);          \
        else RULE##_range(j, begin, end);                                                        \
    }                                                                                            \
    OFFLOAD_API int offload_##RULE##_step(const offload_step_args *a, const HP *hp) {            \
        _Static_assert(sizeof(HP) <= KERNEL_HP_BYTES, "hparams too large for struct kjob");      \
        if (a == NULL || hp == NULL) return -EINVAL;                                             \
        struct kjob job, *j = &job;                                                              \
        struct q8_table tables[KERNEL_MAX_ROWS];                                                 \
        int rc = kernel_job_init(j, a, ROWS_MIN, ROWS_MAX, tables);                              \
        if (rc != 0 || a->n == 0) return rc;                                                     \
        memcpy(j->hp, hp, sizeof *hp);                                                           \
        return kernel_run(j, RULE##_chunk_range);                                                \
    }                                                                                            \
    OFFLOAD_API int64_t offload_##RULE##_hparams_size(void) { return sizeof(HP); }

#endif
