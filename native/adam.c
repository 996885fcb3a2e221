/* adam.c: the fused CPU Adam / AdamW step over flat shards, with runtime ISA dispatch.
 *
 * Layout: flat 1-D arrays of n elements, any alignment (unaligned loads and stores):
 *   param       fp32            the master copy, updated in place
 *   grad        fp32|bf16|fp16  read only, widened in registers (no upcast copy)
 *   exp_avg, exp_avg_sq  fp32|bf16  updated in place
 *   param_copy  bf16|fp16|none  written: the updated param for the accelerator
 *
 * Per element, in this order: the order of torch.optim.AdamW / Adam(foreach=False), written
 * out in offload/optim/reference.py. fp-contract is off below, so a multiply-add is fused only
 * where an fma is written: where torch's CPU kernels fuse (lerp, add with alpha, addcmul;
 * measured bit for bit against torch 2.13's x86-64 build). Every variant (scalar,
 * AVX2, AVX-512) performs the same IEEE operations, so all are bit-identical.
 *   g = float(grad) * grad_scale             grad.mul_(grad_scale): unscale / clip, fused
 *   Adam:  g = fma(l2, p, g)                 grad.add(param, alpha=weight_decay)
 *   p = p * decay                            AdamW: param.mul_(1 - lr * wd); decay = 1 is exact
 *   m = fma(w, g - m, m)      (|w| <  0.5)   exp_avg.lerp_(g, w = 1 - beta1)
 *   m = fma(w - 1, g - m, g)  (|w| >= 0.5)
 *   v = fma(omb2 * g, g, v * beta2)          exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
 *   d = sqrt(v) / bc2_sqrt + eps             (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
 *   p = p + (neg_step * m) / d               param.addcdiv_(m, d, value=-step_size)
 * bf16 state is widened on load and rounded once (nearest even) on store; the param update
 * uses the unrounded fp32 m and v. The param copy is the new fp32 param rounded to nearest even.
 *
 * Threads: the range is cut into chunks that the calling thread and the pool's workers
 * claim one at a time (chunking_for below, threadpool.c). Elements are independent, so neither
 * the chunking nor the thread count changes a single bit of the result.
 */
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

struct chunking { int64_t n, size; }; /* [0, n) in chunks of `size` (the last shorter) */

struct adam_job {
    float *param;
    const void *grad;
    void *exp_avg;
    void *exp_avg_sq;
    void *param_copy;
    int64_t n;
    int grad_dtype, state_dtype, copy_dtype;
    int isa;
    offload_adam_hparams hp;
    struct chunking chunks;
};

/* ---- scalar conversions (bit-exact with torch's c10::BFloat16 / c10::Half) ------------- */

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN -> quiet NaN */
    uint32_t u = f32_bits(f);
    return f != f ? 0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE half <-> single without F16C (the FP16 library's method, as in c10/util/Half.h). */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_f32(sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized)));
}

static inline uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float load_elem(const void *base, int dtype, int64_t i) {
    switch (dtype) {
    case OFFLOAD_BF16: return bf16_to_f32(((const uint16_t *)base)[i]);
    case OFFLOAD_F16: return f16_to_f32(((const uint16_t *)base)[i]);
    default: return ((const float *)base)[i];
    }
}

static inline void store_elem(void *base, int dtype, int64_t i, float x) {
    switch (dtype) {
    case OFFLOAD_BF16: ((uint16_t *)base)[i] = f32_to_bf16(x); break;
    case OFFLOAD_F16: ((uint16_t *)base)[i] = f32_to_f16(x); break;
    default: ((float *)base)[i] = x; break;
    }
}

/* ---- scalar reference: one element at a time, the order in the header comment --------- */

/* Element i; the dtypes are arguments so that a caller passing constants gets one loop per
 * combination, without a switch per element. */
static inline __attribute__((always_inline)) void adam_elem_t(const struct adam_job *j, const offload_adam_hparams *h,
                                                              int64_t i, int gdt, int sdt, int cdt) {
    float g = load_elem(j->grad, gdt, i) * h->grad_scale;
    float p = j->param[i];
    if (h->l2 != 0.0f) g = fmaf(h->l2, p, g);
    p = p * h->decay;
    float m = load_elem(j->exp_avg, sdt, i);
    const float w = h->lerp_weight;
    m = fabsf(w) < 0.5f ? fmaf(w, g - m, m) : fmaf(w - 1.0f, g - m, g);
    float v = load_elem(j->exp_avg_sq, sdt, i) * h->beta2;
    v = fmaf(h->one_minus_beta2 * g, g, v);
    const float d = sqrtf(v) / h->bias_correction2_sqrt + h->eps;
    p = p + (h->neg_step_size * m) / d;
    j->param[i] = p;
    store_elem(j->exp_avg, sdt, i, m);
    store_elem(j->exp_avg_sq, sdt, i, v);
    if (cdt != OFFLOAD_DTYPE_NONE) store_elem(j->param_copy, cdt, i, p);
}

static inline __attribute__((always_inline)) void adam_elem(const struct adam_job *j, int64_t i) {
    adam_elem_t(j, &j->hp, i, j->grad_dtype, j->state_dtype, j->copy_dtype);
}

/* Every (grad, state, copy) dtype combination, for the loops to specialise on. */
#define ADAM_COMBOS(X)                                                                        \
    X(OFFLOAD_F32, OFFLOAD_F32, OFFLOAD_DTYPE_NONE) X(OFFLOAD_F32, OFFLOAD_F32, OFFLOAD_BF16)  \
    X(OFFLOAD_F32, OFFLOAD_F32, OFFLOAD_F16) X(OFFLOAD_F32, OFFLOAD_BF16, OFFLOAD_DTYPE_NONE)  \
    X(OFFLOAD_F32, OFFLOAD_BF16, OFFLOAD_BF16) X(OFFLOAD_F32, OFFLOAD_BF16, OFFLOAD_F16)       \
    X(OFFLOAD_BF16, OFFLOAD_F32, OFFLOAD_DTYPE_NONE) X(OFFLOAD_BF16, OFFLOAD_F32, OFFLOAD_BF16) \
    X(OFFLOAD_BF16, OFFLOAD_F32, OFFLOAD_F16) X(OFFLOAD_BF16, OFFLOAD_BF16, OFFLOAD_DTYPE_NONE) \
    X(OFFLOAD_BF16, OFFLOAD_BF16, OFFLOAD_BF16) X(OFFLOAD_BF16, OFFLOAD_BF16, OFFLOAD_F16)     \
    X(OFFLOAD_F16, OFFLOAD_F32, OFFLOAD_DTYPE_NONE) X(OFFLOAD_F16, OFFLOAD_F32, OFFLOAD_BF16)   \
    X(OFFLOAD_F16, OFFLOAD_F32, OFFLOAD_F16) X(OFFLOAD_F16, OFFLOAD_BF16, OFFLOAD_DTYPE_NONE)  \
    X(OFFLOAD_F16, OFFLOAD_BF16, OFFLOAD_BF16) X(OFFLOAD_F16, OFFLOAD_BF16, OFFLOAD_F16)
#define COMBO(g, s, c) (((g) * 2 + (s)) * 4 + (c) + 1)

static void adam_scalar(const struct adam_job *j, int64_t begin, int64_t end) {
    const offload_adam_hparams h = j->hp; /* a local copy: the stores below cannot alias it */
    switch (COMBO(j->grad_dtype, j->state_dtype, j->copy_dtype)) {
#define X(g, s, c) case COMBO(g, s, c): for (int64_t i = begin; i < end; i++) adam_elem_t(j, &h, i, g, s, c); return;
        ADAM_COMBOS(X)
#undef X
    }
}

#ifdef HAVE_X86
/* The param copy is write-only and leaves by DMA: non-temporal stores put it in memory
 * without first reading each line in (2 of 30 bytes/element) and without evicting the
 * state from cache. They need aligned addresses (a head loop aligns the copy; a copy at an
 * odd byte address, or a short range, uses plain stores) and an sfence before the chunk
 * is reported done, since they are not ordered by the pool's mutex. */
#ifndef STREAM_MIN
#define STREAM_MIN 4096
#endif
static inline int stream_copy(const struct adam_job *j, int64_t begin, int64_t end) {
    return j->copy_dtype != OFFLOAD_DTYPE_NONE && end - begin >= STREAM_MIN && ((uintptr_t)j->param_copy & 1) == 0;
}

/* ---- AVX2 + FMA + F16C: 8 lanes, scalar tail ------------------------------------------- */
#define T256 __attribute__((target("avx2,fma,f16c")))
#define I256 static inline __attribute__((always_inline)) T256

I256 __m256 ld256(const void *base, int dtype, int64_t i) {
    if (dtype == OFFLOAD_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (dtype == OFFLOAD_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

I256 __m128i bf16_round256(__m256 x) { /* f32_to_bf16 on 8 lanes */
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* lanes 0-3, 4-7 -> low 128 */
    return _mm256_castsi256_si128(r);
}

I256 void st256(void *base, int dtype, int64_t i, __m256 x, int stream) {
    if (dtype == OFFLOAD_F32) { _mm256_storeu_ps((float *)base + i, x); return; }
    __m128i h = dtype == OFFLOAD_F16 ? _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                     : bf16_round256(x);
    __m128i *q = (__m128i *)((uint16_t *)base + i);
    if (stream) _mm_stream_si128(q, h); /* q is 16-byte aligned */
    else _mm_storeu_si128(q, h);
}

I256 void adam256_range(const struct adam_job *j, int64_t begin, int64_t end, int gdt, int sdt, int cdt) {
    const offload_adam_hparams *h = &j->hp;
    const __m256 gs = _mm256_set1_ps(h->grad_scale), l2 = _mm256_set1_ps(h->l2);
    const __m256 decay = _mm256_set1_ps(h->decay), b2 = _mm256_set1_ps(h->beta2);
    const __m256 omb2 = _mm256_set1_ps(h->one_minus_beta2), eps = _mm256_set1_ps(h->eps);
    const __m256 bc2 = _mm256_set1_ps(h->bias_correction2_sqrt), nss = _mm256_set1_ps(h->neg_step_size);
    const int l2_on = h->l2 != 0.0f, small = fabsf(h->lerp_weight) < 0.5f;
    const __m256 coeff = _mm256_set1_ps(small ? h->lerp_weight : h->lerp_weight - 1.0f);
    int64_t i = begin;
    const int stream = stream_copy(j, begin, end);
    if (stream) /* a scalar head brings the copy to 16-byte alignment */
        for (int64_t stop = i + (int64_t)((-(uintptr_t)((uint16_t *)j->param_copy + i)) & 15) / 2; i < stop; i++)
            adam_elem(j, i);
    for (; i + 8 <= end; i += 8) {
        __m256 g = _mm256_mul_ps(ld256(j->grad, gdt, i), gs);
        __m256 p = _mm256_loadu_ps(j->param + i);
        if (l2_on) g = _mm256_fmadd_ps(l2, p, g);
        p = _mm256_mul_ps(p, decay);
        __m256 m = ld256(j->exp_avg, sdt, i);
        m = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, m), small ? m : g);
        __m256 v = _mm256_mul_ps(ld256(j->exp_avg_sq, sdt, i), b2);
        v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, v);
        __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
        p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), d));
        _mm256_storeu_ps(j->param + i, p);
        st256(j->exp_avg, sdt, i, m, 0);
        st256(j->exp_avg_sq, sdt, i, v, 0);
        if (cdt != OFFLOAD_DTYPE_NONE) st256(j->param_copy, cdt, i, p, stream);
    }
    for (; i < end; i++) adam_elem(j, i);
    if (stream) _mm_sfence(); /* order the streamed copy before the pool reports this chunk done */
}

/* Both SIMD variants work on a local copy of the job: stores through the array pointers
 * cannot alias it, so the compiler keeps pointers and scalars in registers. */
T256 static void adam_avx2(const struct adam_job *job, int64_t begin, int64_t end) {
    const struct adam_job local = *job, *j = &local;
    switch (COMBO(j->grad_dtype, j->state_dtype, j->copy_dtype)) {
#define X(g, s, c) case COMBO(g, s, c): adam256_range(j, begin, end, g, s, c); return;
        ADAM_COMBOS(X)
#undef X
    }
}

/* ---- AVX-512 (F, BW, VL, DQ): 16 lanes, masked tail ------------------------------------- */
/* The target also names avx512bf16 so that one body serves both AVX-512 variants; it is
 * instantiated twice, and only the instantiation with native_bf16 = 1 (dispatched to on CPUs
 * that have AVX512-BF16) contains vcvtneps2bf16. */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define I512 static inline __attribute__((always_inline)) T512

I512 __m512 ld512(const void *base, int dtype, int64_t i, __mmask16 k, int full) {
    if (dtype == OFFLOAD_F32)
        return full ? _mm512_loadu_ps((const float *)base + i) : _mm512_maskz_loadu_ps(k, (const float *)base + i);
    const uint16_t *q = (const uint16_t *)base + i;
    __m256i h = full ? _mm256_loadu_si256((const __m256i *)q) : _mm256_maskz_loadu_epi16(k, q);
    if (dtype == OFFLOAD_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

I512 __m256i bf16_round512_sw(__m512 x) { /* f32_to_bf16 on 16 lanes */
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

I512 __m256i bf16_round512(__m512 x, int native_bf16) {
    if (!native_bf16) return bf16_round512_sw(x);
    __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
    /* vcvtneps2bf16 flushes denormal inputs to zero; round those lanes like the scalar code. */
    __mmask16 denormal = _mm512_fpclass_ps_mask(x, 0x20);
    if (__builtin_expect(denormal != 0, 0)) r = _mm256_mask_blend_epi16(denormal, r, bf16_round512_sw(x));
    return r;
}

/* x rounded to nearest even as 16 bf16 or fp16 values. */
I512 __m256i narrow512(__m512 x, int dtype, int native_bf16) {
    return dtype == OFFLOAD_F16 ? _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                : bf16_round512(x, native_bf16);
}

I512 void st512(void *base, int dtype, int64_t i, __m512 x, __mmask16 k, int full, int native_bf16) {
    if (dtype == OFFLOAD_F32) {
        if (full) _mm512_storeu_ps((float *)base + i, x);
        else _mm512_mask_storeu_ps((float *)base + i, k, x);
        return;
    }
    __m256i h = narrow512(x, dtype, native_bf16);
    uint16_t *q = (uint16_t *)base + i;
    if (full) _mm256_storeu_si256((__m256i *)q, h);
    else _mm256_mask_storeu_epi16(q, k, h);
}

struct c512 { __m512 gs, l2, decay, coeff, b2, omb2, bc2, eps, nss; int l2_on, small; };

/* 16 elements from i (the first `k` lanes when not `full`): param and moments updated and
 * stored; returns the new param for the caller to store the copy. */
I512 __m512 adam512_block(const struct adam_job *j, const struct c512 *c, int64_t i, __mmask16 k,
                          int full, int gdt, int sdt, int native_bf16) {
    __m512 g = _mm512_mul_ps(ld512(j->grad, gdt, i, k, full), c->gs);
    __m512 p = ld512(j->param, OFFLOAD_F32, i, k, full);
    if (c->l2_on) g = _mm512_fmadd_ps(c->l2, p, g);
    p = _mm512_mul_ps(p, c->decay);
    __m512 m = ld512(j->exp_avg, sdt, i, k, full);
    m = _mm512_fmadd_ps(c->coeff, _mm512_sub_ps(g, m), c->small ? m : g);
    __m512 v = _mm512_mul_ps(ld512(j->exp_avg_sq, sdt, i, k, full), c->b2);
    v = _mm512_fmadd_ps(_mm512_mul_ps(c->omb2, g), g, v);
    __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c->bc2), c->eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c->nss, m), d));
    st512(j->param, OFFLOAD_F32, i, p, k, full, 0);
    st512(j->exp_avg, sdt, i, m, k, full, native_bf16);
    st512(j->exp_avg_sq, sdt, i, v, k, full, native_bf16);
    return p;
}

/* Up to 16 elements from i, with the copy stored like the rest. */
I512 void adam512_step16(const struct adam_job *j, const struct c512 *c, int64_t i, int64_t count,
                         int gdt, int sdt, int cdt, int native_bf16) {
    const int full = count == 16;
    const __mmask16 k = full ? 0xFFFF : (__mmask16)((1u << count) - 1u);
    __m512 p = adam512_block(j, c, i, k, full, gdt, sdt, native_bf16);
    if (cdt != OFFLOAD_DTYPE_NONE) st512(j->param_copy, cdt, i, p, k, full, native_bf16);
}

I512 void adam512_range(const struct adam_job *j, const struct c512 *c, int64_t begin, int64_t end,
                        int gdt, int sdt, int cdt, int native_bf16) {
    int64_t i = begin;
    if (stream_copy(j, begin, end)) {
        /* Head: bring the copy to 64-byte alignment. Then 32 elements at a time, their copy
         * streamed as one full cache line (no partially written write-combining lines). */
        uint16_t *copy = (uint16_t *)j->param_copy;
        const int64_t aligned = i + (int64_t)((-(uintptr_t)(copy + i)) & 63) / 2;
        for (int64_t k; i < aligned; i += k) {
            k = aligned - i < 16 ? aligned - i : 16;
            adam512_step16(j, c, i, k, gdt, sdt, cdt, native_bf16);
        }
        for (; i + 32 <= end; i += 32) {
            __m256i lo = narrow512(adam512_block(j, c, i, 0xFFFF, 1, gdt, sdt, native_bf16), cdt, native_bf16);
            __m256i hi = narrow512(adam512_block(j, c, i + 16, 0xFFFF, 1, gdt, sdt, native_bf16), cdt, native_bf16);
            _mm512_stream_si512((__m512i *)(copy + i), _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
        }
        _mm_sfence(); /* order the streamed copy before the pool reports this chunk done */
    }
    for (int64_t k; i < end; i += k) {
        k = end - i < 16 ? end - i : 16;
        adam512_step16(j, c, i, k, gdt, sdt, cdt, native_bf16);
    }
}

T512 static void adam_avx512(const struct adam_job *job, int64_t begin, int64_t end, int native_bf16) {
    const struct adam_job local = *job, *j = &local;
    const offload_adam_hparams *h = &j->hp;
    const int small = fabsf(h->lerp_weight) < 0.5f;
    const struct c512 c = {
        _mm512_set1_ps(h->grad_scale), _mm512_set1_ps(h->l2), _mm512_set1_ps(h->decay),
        _mm512_set1_ps(small ? h->lerp_weight : h->lerp_weight - 1.0f), _mm512_set1_ps(h->beta2),
        _mm512_set1_ps(h->one_minus_beta2), _mm512_set1_ps(h->bias_correction2_sqrt),
        _mm512_set1_ps(h->eps), _mm512_set1_ps(h->neg_step_size), h->l2 != 0.0f, small};
    /* native_bf16 is a constant in each instantiation: the one without BF16 instructions
     * contains none, whatever the compiler does with branches. */
    if (native_bf16) {
        switch (COMBO(j->grad_dtype, j->state_dtype, j->copy_dtype)) {
#define X(g, s, cp) case COMBO(g, s, cp): adam512_range(j, &c, begin, end, g, s, cp, 1); return;
            ADAM_COMBOS(X)
#undef X
        }
    } else {
        switch (COMBO(j->grad_dtype, j->state_dtype, j->copy_dtype)) {
#define X(g, s, cp) case COMBO(g, s, cp): adam512_range(j, &c, begin, end, g, s, cp, 0); return;
            ADAM_COMBOS(X)
#undef X
        }
    }
}
#endif /* HAVE_X86 */

/* ---- dispatch ------------------------------------------------------------------------ */

static int detect_isa(void) {
#ifdef HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return __builtin_cpu_supports("avx512bf16") ? OFFLOAD_ISA_AVX512_BF16 : OFFLOAD_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return OFFLOAD_ISA_AVX2;
#endif
    return OFFLOAD_ISA_SCALAR;
}

static int g_forced_isa = OFFLOAD_ISA_AUTO; /* set only by tests and benchmarks */

OFFLOAD_API int offload_adam_best_isa(void) {
    static int best = -2;
    int b = __atomic_load_n(&best, __ATOMIC_RELAXED);
    if (b == -2) {
        b = detect_isa();
        __atomic_store_n(&best, b, __ATOMIC_RELAXED);
    }
    return b;
}

OFFLOAD_API int offload_adam_isa(void) {
    int forced = __atomic_load_n(&g_forced_isa, __ATOMIC_RELAXED);
    return forced == OFFLOAD_ISA_AUTO ? offload_adam_best_isa() : forced;
}

OFFLOAD_API int offload_adam_set_isa(int isa) {
    if (isa != OFFLOAD_ISA_AUTO && (isa < OFFLOAD_ISA_SCALAR || isa > offload_adam_best_isa())) return -ENOTSUP;
    __atomic_store_n(&g_forced_isa, isa, __ATOMIC_RELAXED);
    return 0;
}

OFFLOAD_API int offload_adam_set_num_threads(int n) { return pool_set_threads(n); }
OFFLOAD_API int offload_adam_get_num_threads(void) { return pool_get_threads(); }

static void adam_range(const struct adam_job *j, int64_t begin, int64_t end) {
    switch (j->isa) {
#ifdef HAVE_X86
    case OFFLOAD_ISA_AVX512_BF16: adam_avx512(j, begin, end, 1); return;
    case OFFLOAD_ISA_AVX512: adam_avx512(j, begin, end, 0); return;
    case OFFLOAD_ISA_AVX2: adam_avx2(j, begin, end); return;
#endif
    default: adam_scalar(j, begin, end); return;
    }
}

/* The pool's unit of work: a chunk of elements claimed by whichever thread is free. Chunks
 * are a multiple of 64 elements (no shared cache lines unless the arrays start unaligned),
 * at least MIN_CHUNK (~30 us of work, small against a worker's wake-up) and about 1/16 of a
 * thread's share, at most MAX_CHUNK: fine enough to balance the tail, coarse enough that
 * each thread streams long runs (measured at 64M elements on 2 threads: 32K-element chunks
 * ~2-3 % slower than 256K or than one static half per thread). */
#define MIN_CHUNK 32768
#define MAX_CHUNK 262144

static struct chunking chunking_for(int64_t n) {
    int64_t size = n / ((int64_t)pool_get_threads() * 16);
    size = size < MIN_CHUNK ? MIN_CHUNK : size > MAX_CHUNK ? MAX_CHUNK : (size + 63) & ~(int64_t)63;
    return (struct chunking){n, size};
}

static long nchunks(struct chunking ch) { return (long)((ch.n + ch.size - 1) / ch.size); }

static void chunk_range(struct chunking ch, long c, int64_t *begin, int64_t *end) {
    *begin = (int64_t)c * ch.size;
    *end = *begin + ch.size < ch.n ? *begin + ch.size : ch.n;
}

static void adam_chunk(void *ctx, long c) {
    const struct adam_job *j = ctx;
    int64_t begin, end;
    chunk_range(j->chunks, c, &begin, &end);
    adam_range(j, begin, end);
}

static int valid_dtype(int d, int allow_f16) {
    return d == OFFLOAD_F32 || d == OFFLOAD_BF16 || (allow_f16 && d == OFFLOAD_F16);
}

OFFLOAD_API int offload_adam_step(float *param, const void *grad, void *exp_avg, void *exp_avg_sq,
                                  void *param_copy, int64_t n, int grad_dtype, int state_dtype,
                                  int copy_dtype, const offload_adam_hparams *hp) {
    if (n < 0 || hp == NULL) return -EINVAL;
    if (!valid_dtype(grad_dtype, 1) || !valid_dtype(state_dtype, 0)) return -EINVAL;
    if (copy_dtype != OFFLOAD_DTYPE_NONE && copy_dtype != OFFLOAD_BF16 && copy_dtype != OFFLOAD_F16) return -EINVAL;
    if ((copy_dtype == OFFLOAD_DTYPE_NONE) != (param_copy == NULL)) return -EINVAL;
    if (n == 0) return 0;
    if (!param || !grad || !exp_avg || !exp_avg_sq) return -EINVAL;
    struct adam_job job = {param, grad, exp_avg, exp_avg_sq, param_copy, n, grad_dtype, state_dtype,
                           copy_dtype, offload_adam_isa(), *hp, chunking_for(n)};
    return pool_run(adam_chunk, &job, nchunks(job.chunks));
}

/* ---- bandwidth probe (benchmarks only) ------------------------------------------------- */

struct probe_job { float *a, *b, *c; const float *d; struct chunking chunks; };

static void probe_range(float *restrict a, float *restrict b, float *restrict c,
                        const float *restrict d, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
        a[i] += d[i];
        b[i] += d[i];
        c[i] += d[i];
    }
}

#ifdef HAVE_X86
T512 static void probe_range_avx512(float *restrict a, float *restrict b, float *restrict c,
                                    const float *restrict d, int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) { /* all loads before the stores, as in the Adam kernel */
        __m512 x = _mm512_loadu_ps(d + i), xa = _mm512_loadu_ps(a + i);
        __m512 xb = _mm512_loadu_ps(b + i), xc = _mm512_loadu_ps(c + i);
        _mm512_storeu_ps(a + i, _mm512_add_ps(xa, x));
        _mm512_storeu_ps(b + i, _mm512_add_ps(xb, x));
        _mm512_storeu_ps(c + i, _mm512_add_ps(xc, x));
    }
    probe_range(a, b, c, d, i, end);
}
#endif

static void probe_chunk(void *ctx, long c) {
    const struct probe_job *p = ctx;
    int64_t begin, end;
    chunk_range(p->chunks, c, &begin, &end);
#ifdef HAVE_X86
    if (offload_adam_isa() >= OFFLOAD_ISA_AVX512) { probe_range_avx512(p->a, p->b, p->c, p->d, begin, end); return; }
#endif
    probe_range(p->a, p->b, p->c, p->d, begin, end);
}

OFFLOAD_API int offload_adam_bandwidth_probe(float *a, float *b, float *c, const float *d, int64_t n) {
    if (n < 0 || (n > 0 && (!a || !b || !c || !d))) return -EINVAL;
    struct probe_job job = {a, b, c, d, chunking_for(n)};
    return n == 0 ? 0 : pool_run(probe_chunk, &job, nchunks(job.chunks));
}
