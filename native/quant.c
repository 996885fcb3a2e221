/* quant.c: dequantization of frozen weights stored as NF4 or as int8 per row
 * (offload/quantize.py holds the format, the quantizers and the torch reference).
 *
 * Element i lies in block b = i / blocksize and its value, in fp32, is
 *   NF4        code[nibble(i)] * scale[b]    nibble(i): byte i / 2, its high half for even i
 *                                            (bitsandbytes' quantize_4bit order)
 *              scale[b] = absmax[b], or with the absmax double-quantized:
 *              absmax_code[absmax_q[b]] * absmax_scale[b / 256] + absmax_offset  (two roundings)
 *   INT8_ROWS  (q[i] * absmax[b]) * fp32(1 / 127)  (a block is a row, blocksize its length)
 * then stored in out_dtype, rounded to nearest even (bit-exact with torch's .to()).
 * The scalar loops below are the reference; the AVX2 and AVX-512 loops compute the same
 * fp32 products (one multiply per step, no fma), so every ISA stores the same bits.
 * Tables stay in registers (16 NF4 values: one vpermps on AVX-512, two and a blend on AVX2);
 * no gathers. Blocks are spread over the kernels' pool, whole blocks per chunk.
 *
 * Quantization (offload_quantize), the same arithmetic as the torch reference:
 *   NF4        absmax = max |x| over the block (NaN if any is NaN), inv = 1 / max(absmax, 1e-38),
 *              q = #{k < 15 : !(x * inv <= mid[k])} with mid[k] = (code[k] + code[k + 1]) / 2:
 *              the nearest code, ties to the lower one, NaN to the last (torch.bucketize; the
 *              reference's clamp to [-1, 1] moves no value across a midpoint); an odd n pads
 *              the last low half with the index of 0.0
 *   INT8_ROWS  absmax = max |x| over the row, f = absmax > 0 ? (1 / absmax) * 127 : 0 (two
 *              roundings, as torch's 127 / t and so bitsandbytes: not the quotient 127 / absmax),
 *              q = round-half-even(x * f) clamped to [-127, 127] (moves only values of a row
 *              whose f overflows: absmax below ~3.7e-37), NaN stored as 0
 */
#include "kernel.h"

#define DQ_ABSMAX_BLOCK 256 /* absmax values per scale of the double quantization */
#define DQ_MIN_CHUNK 32768  /* elements per pool chunk, at least (whole blocks) */

static const float INV127 = 1.0f / 127.0f; /* 0x3C010204, bitsandbytes' 7.874015718698502e-3 */

struct dq_job { const offload_dequant_args *a; int64_t nblocks, blocks_per_chunk; int isa; };

static float block_scale(const offload_dequant_args *a, int64_t b) {
    if (a->absmax_q == NULL) return a->absmax[b];
    const float v = a->absmax_code[a->absmax_q[b]] * a->absmax_scale[b / DQ_ABSMAX_BLOCK];
    return v + a->absmax_offset;
}

/* ---- the scalar reference ---------------------------------------------------------------- */
static void nf4_block_scalar(const offload_dequant_args *a, int64_t i, int64_t end, float s) {
    for (; i < end; i++) {
        const uint8_t byte = a->codes[i >> 1];
        const int nib = (i & 1) ? byte & 15 : byte >> 4;
        store1(a->out, a->out_dtype, i, a->code[nib] * s);
    }
}

static void int8_block_scalar(const offload_dequant_args *a, int64_t i, int64_t end, float s) {
    for (; i < end; i++) store1(a->out, a->out_dtype, i, ((float)(int8_t)a->codes[i] * s) * INV127);
}

#ifdef HAVE_X86
/* ---- AVX2: 16 NF4 values (8 bytes) or 8 int8 values per step, scalar tail -------------- */
I256 __m256 nf4_lookup_8(__m256 t0, __m256 t1, __m256i idx) { /* code[idx & 15] */
    const __m256 lo = _mm256_permutevar8x32_ps(t0, idx), hi = _mm256_permutevar8x32_ps(t1, idx);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28))); /* bit 3 */
}

/* f32_to_bf16 of 8 lanes, as int32 lanes holding the 16 bits */
I256 __m256i bf16_bits_8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

/* 16 values to bf16 with one pack for both halves (st_8 packs each half on its own). */
I256 void st_bf16_16(void *base, int64_t i, __m256 a, __m256 b) {
    const __m256i p = _mm256_packus_epi32(bf16_bits_8(a), bf16_bits_8(b)); /* a0-3 b0-3 a4-7 b4-7 */
    _mm256_storeu_si256((__m256i *)((uint16_t *)base + i), _mm256_permute4x64_epi64(p, 0xD8));
}

TARGET_f32x8 static void nf4_block_avx2(const offload_dequant_args *a, int64_t i, int64_t end, float s) {
    const __m256 t0 = _mm256_loadu_ps(a->code), t1 = _mm256_loadu_ps(a->code + 8), sv = _mm256_set1_ps(s);
    for (; i + 16 <= end; i += 16) { /* i is even: byte i / 2 starts the step */
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(a->codes + (i >> 1))));
        const __m256 even = nf4_lookup_8(t0, t1, _mm256_srli_epi32(b, 4)), odd = nf4_lookup_8(t0, t1, b);
        const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
        const __m256 v0 = _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x20), sv);
        const __m256 v1 = _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x31), sv);
        if (a->out_dtype == OFFLOAD_BF16) {
            st_bf16_16(a->out, i, v0, v1);
        } else {
            st_8(a->out, a->out_dtype, i, (f32x8)v0, 0);
            st_8(a->out, a->out_dtype, i + 8, (f32x8)v1, 0);
        }
    }
    nf4_block_scalar(a, i, end, s);
}

TARGET_f32x8 static void int8_block_avx2(const offload_dequant_args *a, int64_t i, int64_t end, float s) {
    const __m256 sv = _mm256_set1_ps(s), c = _mm256_set1_ps(INV127);
    for (; i + 8 <= end; i += 8) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(a->codes + i)));
        st_8(a->out, a->out_dtype, i, (f32x8)_mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), sv), c), 0);
    }
    int8_block_scalar(a, i, end, s);
}

/* ---- AVX-512: 32 NF4 values (16 bytes) or 16 int8 values per step, scalar tail ---------- */
I512 void nf4_block_avx512(const offload_dequant_args *a, int64_t i, int64_t end, float s, int native_bf16) {
    const __m512 t = _mm512_loadu_ps(a->code), sv = _mm512_set1_ps(s);
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (; i + 32 <= end; i += 32) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(a->codes + (i >> 1))));
        const __m512 even = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t), odd = _mm512_permutexvar_ps(b, t);
        st_16(a->out, a->out_dtype, i, (f32x16)_mm512_mul_ps(_mm512_permutex2var_ps(even, first, odd), sv),
              0xFFFF, 1, native_bf16);
        st_16(a->out, a->out_dtype, i + 16, (f32x16)_mm512_mul_ps(_mm512_permutex2var_ps(even, second, odd), sv),
              0xFFFF, 1, native_bf16);
    }
    nf4_block_scalar(a, i, end, s);
}

I512 void int8_block_avx512(const offload_dequant_args *a, int64_t i, int64_t end, float s, int native_bf16) {
    const __m512 sv = _mm512_set1_ps(s), c = _mm512_set1_ps(INV127);
    for (; i + 16 <= end; i += 16) {
        const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(a->codes + i)));
        st_16(a->out, a->out_dtype, i, (f32x16)_mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), sv), c),
              0xFFFF, 1, native_bf16);
    }
    int8_block_scalar(a, i, end, s);
}

I512 void blocks_avx512(const offload_dequant_args *a, int64_t b0, int64_t b1, int native_bf16) {
    for (int64_t b = b0; b < b1; b++) {
        const int64_t i = b * a->blocksize, end = i + a->blocksize < a->n ? i + a->blocksize : a->n;
        if (a->format == OFFLOAD_QFMT_NF4) nf4_block_avx512(a, i, end, block_scale(a, b), native_bf16);
        else int8_block_avx512(a, i, end, block_scale(a, b), native_bf16);
    }
}
/* one instantiation with the AVX512-BF16 conversion, one without (kernel.h's narrow_16) */
TARGET_f32x16 static void blocks_avx512_bf16(const offload_dequant_args *a, int64_t b0, int64_t b1) {
    blocks_avx512(a, b0, b1, 1);
}
TARGET_f32x16 static void blocks_avx512_plain(const offload_dequant_args *a, int64_t b0, int64_t b1) {
    blocks_avx512(a, b0, b1, 0);
}

TARGET_f32x8 static void blocks_avx2(const offload_dequant_args *a, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
        const int64_t i = b * a->blocksize, end = i + a->blocksize < a->n ? i + a->blocksize : a->n;
        if (a->format == OFFLOAD_QFMT_NF4) nf4_block_avx2(a, i, end, block_scale(a, b));
        else int8_block_avx2(a, i, end, block_scale(a, b));
    }
}
#endif

static void blocks_scalar(const offload_dequant_args *a, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
        const int64_t i = b * a->blocksize, end = i + a->blocksize < a->n ? i + a->blocksize : a->n;
        if (a->format == OFFLOAD_QFMT_NF4) nf4_block_scalar(a, i, end, block_scale(a, b));
        else int8_block_scalar(a, i, end, block_scale(a, b));
    }
}

static void dq_chunk(void *ctx, long c) {
    const struct dq_job *j = ctx;
    const int64_t b0 = (int64_t)c * j->blocks_per_chunk;
    const int64_t b1 = b0 + j->blocks_per_chunk < j->nblocks ? b0 + j->blocks_per_chunk : j->nblocks;
    switch (j->isa) {
#ifdef HAVE_X86
    case OFFLOAD_ISA_AVX512_BF16: blocks_avx512_bf16(j->a, b0, b1); return;
    case OFFLOAD_ISA_AVX512: blocks_avx512_plain(j->a, b0, b1); return;
    case OFFLOAD_ISA_AVX2: blocks_avx2(j->a, b0, b1); return;
#endif
    default: blocks_scalar(j->a, b0, b1); return;
    }
}

/* ---- quantization ------------------------------------------------------------------------- */
struct q_job { const offload_quant_args *a; float mid[15]; int64_t nblocks, blocks_per_chunk; int isa; };

static float absmax_scalar(const offload_quant_args *a, int64_t i, int64_t end) {
    float m = 0.0f;
    for (; i < end; i++) {
        const float v = fabsf(load1(a->x, a->in_dtype, i));
        if (v > m || v != v) m = v;        /* NaN wins, and stays */
        if (m != m) return m;
    }
    return m;
}

static uint8_t nf4_index(const float *mid, float y) {
    unsigned q = 0;
    for (int k = 0; k < 15; k++) q += !(y <= mid[k]);
    return (uint8_t)q;
}

static float nf4_inv(float absmax) {
    const float d = absmax != absmax ? absmax : absmax < 1e-38f ? 1e-38f : absmax;
    return 1.0f / d;
}

/* Indices of elements [i, end) of one block into qi[0 .. end - i): the scalar reference. */
static void nf4_indices_scalar(const struct q_job *j, int64_t i, int64_t end, float inv, uint8_t *qi) {
    for (int64_t k = 0; i < end; i++, k++) qi[k] = nf4_index(j->mid, load1(j->a->x, j->a->in_dtype, i) * inv);
}

static int8_t int8_code(float y) {
    float r = rintf(y);                    /* the default rounding mode: half to even */
    r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
    return r != r ? 0 : (int8_t)(int)r;
}

static void int8_block_quant_scalar(const offload_quant_args *a, int64_t i, int64_t end, float f) {
    for (; i < end; i++) ((int8_t *)a->codes)[i] = int8_code(load1(a->x, a->in_dtype, i) * f);
}

/* Two indices per byte, the even element high; an odd count pads with pad (0.0's index). */
static void nf4_pack(uint8_t *out, const uint8_t *qi, int64_t k, int64_t count, uint8_t pad) {
    for (; k + 1 < count; k += 2) out[k / 2] = (uint8_t)(qi[k] << 4 | qi[k + 1]);
    if (k < count) out[k / 2] = (uint8_t)(qi[k] << 4 | pad);
}

#ifdef HAVE_X86
TARGET_f32x8 static void nf4_pack_avx2(uint8_t *out, const uint8_t *qi, int64_t count, uint8_t pad) {
    int64_t k = 0;
    for (; k + 16 <= count; k += 16) { /* pairs (hi, lo) -> 16 hi + lo, then to bytes */
        const __m128i w = _mm_maddubs_epi16(_mm_loadu_si128((const __m128i *)(qi + k)), _mm_set1_epi16(0x0110));
        _mm_storel_epi64((__m128i *)(out + k / 2), _mm_packus_epi16(w, w));
    }
    nf4_pack(out, qi, k, count, pad);
}

TARGET_f32x8 static float absmax_avx2(const offload_quant_args *a, int64_t i, int64_t end) {
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX));
    for (; i + 8 <= end; i += 8) {
        const __m256 v = _mm256_and_ps((__m256)ld_8(a->x, a->in_dtype, i), abs);
        m = _mm256_max_ps(v, m);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    _Alignas(32) float l[8];
    _mm256_store_ps(l, m);
    float r = absmax_scalar(a, i, end);
    if (r != r) return r;
    for (int k = 0; k < 8; k++) r = l[k] > r ? l[k] : r;
    return r;
}

TARGET_f32x8 static void nf4_indices_avx2(const struct q_job *j, int64_t i, int64_t end, float inv, uint8_t *qi) {
    const int64_t i0 = i;
    const __m256 iv = _mm256_set1_ps(inv);
    for (; i + 8 <= end; i += 8) {
        const __m256 y = _mm256_mul_ps((__m256)ld_8(j->a->x, j->a->in_dtype, i), iv);
        __m256i q0 = _mm256_setzero_si256(), q1 = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int k = 0; k < 14; k += 2) { /* !(y <= mid): true for NaN */
            q0 = _mm256_sub_epi32(q0, _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_set1_ps(j->mid[k]), _CMP_NLE_UQ)));
            q1 = _mm256_sub_epi32(q1, _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_set1_ps(j->mid[k + 1]), _CMP_NLE_UQ)));
        }
        const __m256i q = _mm256_sub_epi32(_mm256_add_epi32(q0, q1),
                                           _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_set1_ps(j->mid[14]), _CMP_NLE_UQ)));
        const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(qi + (i - i0)), _mm_packus_epi16(w, w));
    }
    nf4_indices_scalar(j, i, end, inv, qi + (i - i0));
}

TARGET_f32x8 static void int8_block_quant_avx2(const offload_quant_args *a, int64_t i, int64_t end, float f) {
    const __m256 fv = _mm256_set1_ps(f);
    for (; i + 8 <= end; i += 8) {
        const __m256 y = _mm256_mul_ps((__m256)ld_8(a->x, a->in_dtype, i), fv);
        const __m256 r = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 c = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
        const __m256i q = _mm256_cvtps_epi32(_mm256_and_ps(c, _mm256_cmp_ps(r, r, _CMP_ORD_Q))); /* NaN -> 0 */
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)((int8_t *)a->codes + i), _mm_packs_epi16(w, w));
    }
    int8_block_quant_scalar(a, i, end, f);
}

TARGET_f32x16 static float absmax_avx512(const offload_quant_args *a, int64_t i, int64_t end) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (; i + 16 <= end; i += 16) {
        const __m512 v = _mm512_abs_ps((__m512)ld_16(a->x, a->in_dtype, i, 0xFFFF, 1));
        m = _mm512_max_ps(v, m);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (nan) return NAN;
    const float r = absmax_scalar(a, i, end), v = _mm512_reduce_max_ps(m);
    return r != r ? r : v > r ? v : r;
}

TARGET_f32x16 static void nf4_indices_avx512(const struct q_job *j, int64_t i, int64_t end, float inv, uint8_t *qi) {
    const int64_t i0 = i;
    const __m512 iv = _mm512_set1_ps(inv);
    const __m512i one = _mm512_set1_epi32(1);
    for (; i + 16 <= end; i += 16) {
        const __m512 y = _mm512_mul_ps((__m512)ld_16(j->a->x, j->a->in_dtype, i, 0xFFFF, 1), iv);
        __m512i q = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int k = 0; k < 15; k++)
            q = _mm512_mask_add_epi32(q, _mm512_cmp_ps_mask(y, _mm512_set1_ps(j->mid[k]), _CMP_NLE_UQ), q, one);
        _mm_storeu_si128((__m128i *)(qi + (i - i0)), _mm512_cvtepi32_epi8(q));
    }
    nf4_indices_scalar(j, i, end, inv, qi + (i - i0));
}

TARGET_f32x16 static void int8_block_quant_avx512(const offload_quant_args *a, int64_t i, int64_t end, float f) {
    const __m512 fv = _mm512_set1_ps(f);
    for (; i + 16 <= end; i += 16) {
        const __m512 y = _mm512_mul_ps((__m512)ld_16(a->x, a->in_dtype, i, 0xFFFF, 1), fv);
        const __m512 r = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 c = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
        const __m512i q = _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), c); /* NaN -> 0 */
        _mm_storeu_si128((__m128i *)((int8_t *)a->codes + i), _mm512_cvtsepi32_epi8(q));
    }
    int8_block_quant_scalar(a, i, end, f);
}
#endif

static float q_absmax(const struct q_job *j, int64_t i, int64_t end) {
#ifdef HAVE_X86
    if (j->isa >= OFFLOAD_ISA_AVX512) return absmax_avx512(j->a, i, end);
    if (j->isa == OFFLOAD_ISA_AVX2) return absmax_avx2(j->a, i, end);
#endif
    return absmax_scalar(j->a, i, end);
}

#define Q_PIECE 256 /* NF4 indices computed, then packed, this many at a time (even) */

static void q_chunk(void *ctx, long c) {
    const struct q_job *j = ctx;
    const offload_quant_args *a = j->a;
    const int64_t b0 = (int64_t)c * j->blocks_per_chunk;
    const int64_t b1 = b0 + j->blocks_per_chunk < j->nblocks ? b0 + j->blocks_per_chunk : j->nblocks;
    const uint8_t pad = nf4_index(j->mid, 0.0f);
    _Alignas(64) uint8_t qi[Q_PIECE];
    for (int64_t b = b0; b < b1; b++) {
        const int64_t i0 = b * a->blocksize, end = i0 + a->blocksize < a->n ? i0 + a->blocksize : a->n;
        const float absmax = q_absmax(j, i0, end);
        a->absmax[b] = absmax;
        if (a->format == OFFLOAD_QFMT_INT8_ROWS) {
            const float f = absmax > 0.0f ? (1.0f / absmax) * 127.0f : 0.0f;
#ifdef HAVE_X86
            if (j->isa >= OFFLOAD_ISA_AVX512) { int8_block_quant_avx512(a, i0, end, f); continue; }
            if (j->isa == OFFLOAD_ISA_AVX2) { int8_block_quant_avx2(a, i0, end, f); continue; }
#endif
            int8_block_quant_scalar(a, i0, end, f);
            continue;
        }
        const float inv = nf4_inv(absmax);
        for (int64_t i = i0; i < end; i += Q_PIECE) { /* i - i0 is even: whole bytes */
            const int64_t e = end - i < Q_PIECE ? end : i + Q_PIECE;
#ifdef HAVE_X86
            if (j->isa >= OFFLOAD_ISA_AVX512) nf4_indices_avx512(j, i, e, inv, qi);
            else if (j->isa == OFFLOAD_ISA_AVX2) nf4_indices_avx2(j, i, e, inv, qi);
            else
#endif
                nf4_indices_scalar(j, i, e, inv, qi);
#ifdef HAVE_X86
            if (j->isa >= OFFLOAD_ISA_AVX2) { nf4_pack_avx2(a->codes + i / 2, qi, e - i, pad); continue; }
#endif
            nf4_pack(a->codes + i / 2, qi, 0, e - i, pad);
        }
    }
}

OFFLOAD_API int64_t offload_quant_args_size(void) { return sizeof(offload_quant_args); }

OFFLOAD_API int offload_quantize(const offload_quant_args *a) {
    if (a == NULL || a->n < 0 || a->blocksize < 1) return -EINVAL;
    if (a->in_dtype != OFFLOAD_F32 && a->in_dtype != OFFLOAD_BF16 && a->in_dtype != OFFLOAD_F16) return -EINVAL;
    if (a->format == OFFLOAD_QFMT_NF4) {
        if (a->blocksize % 2) return -EINVAL;
    } else if (a->format != OFFLOAD_QFMT_INT8_ROWS || a->n % a->blocksize) {
        return -EINVAL;
    }
    if (a->n == 0) return 0;
    if (!a->x || !a->codes || !a->absmax || (a->format == OFFLOAD_QFMT_NF4 && !a->code)) return -EINVAL;
    struct q_job j = {.a = a, .nblocks = (a->n + a->blocksize - 1) / a->blocksize, .isa = kernel_isa()};
    if (a->format == OFFLOAD_QFMT_NF4)
        for (int k = 0; k < 15; k++) {
            if (!(a->code[k] <= a->code[k + 1])) return -EINVAL; /* sorted, no NaN */
            j.mid[k] = (a->code[k] + a->code[k + 1]) / 2.0f;
        }
    j.blocks_per_chunk = (DQ_MIN_CHUNK + a->blocksize - 1) / a->blocksize;
    return pool_run(q_chunk, &j, (long)((j.nblocks + j.blocks_per_chunk - 1) / j.blocks_per_chunk));
}

OFFLOAD_API int64_t offload_dequant_args_size(void) { return sizeof(offload_dequant_args); }

OFFLOAD_API int offload_dequantize(const offload_dequant_args *a) {
    if (a == NULL || a->n < 0 || a->blocksize < 1) return -EINVAL;
    if (a->out_dtype != OFFLOAD_F32 && a->out_dtype != OFFLOAD_BF16 && a->out_dtype != OFFLOAD_F16) return -EINVAL;
    if (a->format == OFFLOAD_QFMT_NF4) {
        if (a->blocksize % 2) return -EINVAL; /* a block starts on a whole byte */
    } else if (a->format == OFFLOAD_QFMT_INT8_ROWS) {
        if (a->n % a->blocksize || a->absmax_q != NULL) return -EINVAL;
    } else {
        return -EINVAL;
    }
    if (a->n == 0) return 0;
    if (!a->codes || !a->out || (a->format == OFFLOAD_QFMT_NF4 && !a->code)) return -EINVAL;
    if (a->absmax_q ? !a->absmax_scale || !a->absmax_code : !a->absmax) return -EINVAL;
    struct dq_job j = {a, (a->n + a->blocksize - 1) / a->blocksize, 1, kernel_isa()};
    j.blocks_per_chunk = (DQ_MIN_CHUNK + a->blocksize - 1) / a->blocksize;
    return pool_run(dq_chunk, &j, (long)((j.nblocks + j.blocks_per_chunk - 1) / j.blocks_per_chunk));
}
