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

TARGET_f32x8 static void nf4_block_avx2(const offload_dequant_args *a, int64_t i, int64_t end, float s) {
    const __m256 t0 = _mm256_loadu_ps(a->code), t1 = _mm256_loadu_ps(a->code + 8), sv = _mm256_set1_ps(s);
    for (; i + 16 <= end; i += 16) { /* i is even: byte i / 2 starts the step */
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(a->codes + (i >> 1))));
        const __m256 even = nf4_lookup_8(t0, t1, _mm256_srli_epi32(b, 4)), odd = nf4_lookup_8(t0, t1, b);
        const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
        st_8(a->out, a->out_dtype, i, (f32x8)_mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x20), sv), 0);
        st_8(a->out, a->out_dtype, i + 8, (f32x8)_mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x31), sv), 0);
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
