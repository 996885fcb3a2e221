/* kernel.c: what the elementwise optimizer kernels share at run time: ISA detection and
 * dispatch, thread count, argument checks, chunking over the pool, and the int8 block loop.
 *
 * Threads: the range is cut into chunks that the calling thread and the pool's workers
 * claim one at a time (threadpool.c). Elements are independent, so neither the chunking nor
 * the thread count changes a single bit of the result.
 */
#include "kernel.h"

#include <stddef.h>

/* ---- ISA ------------------------------------------------------------------------------ */
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

OFFLOAD_API int offload_kernel_best_isa(void) {
    static int best = -2;
    int b = __atomic_load_n(&best, __ATOMIC_RELAXED);
    if (b == -2) {
        b = detect_isa();
        __atomic_store_n(&best, b, __ATOMIC_RELAXED);
    }
    return b;
}

OFFLOAD_API int offload_kernel_isa(void) {
    int forced = __atomic_load_n(&g_forced_isa, __ATOMIC_RELAXED);
    return forced == OFFLOAD_ISA_AUTO ? offload_kernel_best_isa() : forced;
}

int kernel_isa(void) { return offload_kernel_isa(); }

OFFLOAD_API int offload_kernel_set_isa(int isa) {
    if (isa != OFFLOAD_ISA_AUTO && (isa < OFFLOAD_ISA_SCALAR || isa > offload_kernel_best_isa())) return -ENOTSUP;
    __atomic_store_n(&g_forced_isa, isa, __ATOMIC_RELAXED);
    return 0;
}

OFFLOAD_API int offload_kernel_set_num_threads(int n) { return pool_set_threads(n); }
OFFLOAD_API int offload_kernel_get_num_threads(void) { return pool_get_threads(); }

OFFLOAD_API int64_t offload_kernel_args_size(void) { return sizeof(offload_step_args); }

/* ---- chunking -------------------------------------------------------------------------
 * The pool's unit of work: a chunk of elements claimed by whichever thread is free. Chunks
 * are a multiple of KERNEL_Q8_BLOCK (so int8 blocks never straddle two threads; no shared
 * cache lines unless the arrays start unaligned), at least MIN_CHUNK (enough work to be small
 * against a worker's wake-up) and about 1/16 of a thread's share, at most MAX_CHUNK: fine
 * enough to balance the tail, coarse enough that each thread streams long runs (smaller
 * chunks measured slower: benchmarks/RESULTS.md). */
#define MIN_CHUNK 32768
#define MAX_CHUNK 262144

struct chunking kernel_chunking(int64_t n) {
    int64_t size = n / ((int64_t)pool_get_threads() * 16);
    size = size < MIN_CHUNK ? MIN_CHUNK : size > MAX_CHUNK ? MAX_CHUNK
                                                           : (size + KERNEL_Q8_BLOCK - 1) & ~(int64_t)(KERNEL_Q8_BLOCK - 1);
    return (struct chunking){n, size};
}

long kernel_nchunks(struct chunking ch) { return (long)((ch.n + ch.size - 1) / ch.size); }

void kernel_chunk_range(struct chunking ch, long c, int64_t *begin, int64_t *end) {
    *begin = (int64_t)c * ch.size;
    *end = *begin + ch.size < ch.n ? *begin + ch.size : ch.n;
}

/* ---- arguments ------------------------------------------------------------------------ */
static int valid_dtype(int d, int allow_f16) {
    return d == OFFLOAD_F32 || d == OFFLOAD_BF16 || (allow_f16 && d == OFFLOAD_F16);
}

int kernel_job_init(struct kjob *j, const offload_step_args *a, int rows_min, int rows_max,
                    struct q8_table *tables) {
    if (a->n < 0 || a->nrows < rows_min || a->nrows > rows_max) return -EINVAL;
    if (!valid_dtype(a->grad_dtype, 1)) return -EINVAL;
    if (!valid_dtype(a->state_dtype, 0) && a->state_dtype != OFFLOAD_Q8) return -EINVAL;
    if (a->copy_dtype != OFFLOAD_DTYPE_NONE && !valid_dtype(a->copy_dtype, 1)) return -EINVAL;
    if ((a->copy_dtype == OFFLOAD_DTYPE_NONE) != (a->param_copy == NULL)) return -EINVAL;
    if (a->n == 0) return 0;
    if (!a->param || !a->grad) return -EINVAL;
    memset(j, 0, offsetof(struct kjob, hp));
    const int out_of_place = a->param_src != NULL;
    if (out_of_place && a->state_dtype == OFFLOAD_Q8) return -EINVAL;
    j->param = a->param;
    j->sparam = out_of_place ? a->param_src : a->param;
    j->grad = a->grad;
    j->param_copy = a->param_copy;
    j->n = a->n;
    j->grad_dtype = a->grad_dtype;
    j->state_dtype = a->state_dtype;
    j->copy_dtype = a->copy_dtype;
    j->nrows = a->nrows;
    j->isa = kernel_isa();
    j->chunks = kernel_chunking(a->n);
    for (int r = 0; r < a->nrows; r++) {
        if (!a->state[r] || out_of_place != (a->state_src[r] != NULL)) return -EINVAL;
        j->state[r] = a->state[r];
        j->sstate[r] = out_of_place ? a->state_src[r] : a->state[r];
        if (a->state_dtype != OFFLOAD_Q8) continue;
        if (!a->absmax[r] || !a->qcode[r]) return -EINVAL;
        j->absmax[r] = a->absmax[r];
        struct q8_table *t = &tables[r];
        memcpy(t->code, a->qcode[r], sizeof t->code);
        for (int k = 0; k < 255; k++) {
            if (!(t->code[k] <= t->code[k + 1])) return -EINVAL; /* sorted, no NaN */
            t->mid[k] = (t->code[k] + t->code[k + 1]) * 0.5f;
        }
        t->mid[255] = INFINITY;
        for (int g = 0; g < 16; g++) {
            t->last[g] = t->mid[16 * g + 15];
            for (int k = 0; k < 15; k++) t->mt[k][g] = t->mid[16 * g + k];
        }
        for (int g = 0; g < 8; g++) {
            t->last8[g] = t->mid[32 * g + 31];
            for (int k = 0; k < 31; k++) t->mt8[k][g] = t->mid[32 * g + k];
        }
        j->q8[r] = t;
    }
    return 0;
}

struct run_ctx { const struct kjob *job; void (*range)(const struct kjob *, int64_t, int64_t); };

static void run_chunk(void *ctx, long c) {
    const struct run_ctx *r = ctx;
    int64_t begin, end;
    kernel_chunk_range(r->job->chunks, c, &begin, &end);
    r->range(r->job, begin, end);
}

int kernel_run(struct kjob *j, void (*range)(const struct kjob *, int64_t, int64_t)) {
    struct run_ctx ctx = {j, range};
    return pool_run(run_chunk, &ctx, kernel_nchunks(j->chunks));
}

/* ---- int8 blockwise state ---------------------------------------------------------------
 * Per block of KERNEL_Q8_BLOCK elements: dequantize each row into an fp32 scratch block,
 * step the block with the rule's fp32 loop (the same code as fp32 state), then requantize:
 * absmax over the new values, codes by binary search over the midpoints (kernel.h). The
 * scalar and SIMD lookups compute the same products and comparisons, so every ISA stores
 * the same bytes. */
#ifdef HAVE_X86
TARGET_f32x16 static int64_t q8_dequant_avx512(const uint8_t *q, const struct q8_table *tab, float scale,
                                               int64_t nb, float *out) {
    struct q8_tables16 t;
    q8_load_tables16(&t, tab);
    int64_t i = 0;
    for (; i + 16 <= nb; i += 16) _mm512_storeu_ps(out + i, (__m512)q8_dequant_16(&t, q + i, scale));
    return i;
}
TARGET_f32x8 static int64_t q8_dequant_avx2(const uint8_t *q, const float *code, float scale, int64_t nb, float *out) {
    int64_t i = 0;
    for (; i + 8 <= nb; i += 8) _mm256_storeu_ps(out + i, (__m256)q8_dequant_8(q + i, code, scale));
    return i;
}
TARGET_f32x16 static int64_t q8_quant_avx512(uint8_t *q, const struct q8_table *tab, const float *x,
                                             float inv, int64_t nb) {
    struct q8_tables16 t;
    q8_load_tables16(&t, tab);
    int64_t i = 0;
    for (; i + 16 <= nb; i += 16) q8_quant_16(&t, q + i, (f32x16)_mm512_loadu_ps(x + i) * inv);
    return i;
}
/* max |x[i]| over i < nb, NaN ignored (as the scalar loop below): 16 / 8 lanes at a time. */
TARGET_f32x16 static float q8_absmax_avx512(const float *x, int64_t nb) {
    __m512 m = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= nb; i += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
        m = _mm512_mask_max_ps(m, _mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), m, a);
    }
    float absmax = _mm512_reduce_max_ps(m);
    for (; i < nb; i++) absmax = fabsf(x[i]) > absmax ? fabsf(x[i]) : absmax;
    return absmax;
}

TARGET_f32x8 static float q8_absmax_avx2(const float *x, int64_t nb) {
    __m256 m = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX));
    int64_t i = 0;
    for (; i + 8 <= nb; i += 8) /* vmaxps returns its second operand when either is NaN */
        m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs), m);
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 h2 = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float absmax = _mm_cvtss_f32(_mm_max_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
    for (; i < nb; i++) absmax = fabsf(x[i]) > absmax ? fabsf(x[i]) : absmax;
    return absmax;
}

TARGET_f32x8 static int64_t q8_quant_avx2(uint8_t *q, const struct q8_table *tab, const float *x, float inv, int64_t nb) {
    int64_t i = 0;
    for (; i + 8 <= nb; i += 8) q8_quant_8(q + i, tab, (f32x8)_mm256_loadu_ps(x + i) * inv);
    return i;
}
#endif

static void q8_dequant(const struct kjob *j, int r, int64_t b0, int64_t nb, float *out) {
    const uint8_t *q = (const uint8_t *)j->state[r] + b0;
    const float *code = j->q8[r]->code, scale = j->absmax[r][b0 / KERNEL_Q8_BLOCK];
    int64_t i = 0;
#ifdef HAVE_X86
    if (j->isa >= OFFLOAD_ISA_AVX512) i = q8_dequant_avx512(q, j->q8[r], scale, nb, out);
    else if (j->isa == OFFLOAD_ISA_AVX2) i = q8_dequant_avx2(q, code, scale, nb, out);
#endif
    for (; i < nb; i++) out[i] = code[q[i]] * scale;
}

static void q8_quant(const struct kjob *j, int r, int64_t b0, int64_t nb, const float *x) {
    uint8_t *q = (uint8_t *)j->state[r] + b0;
    const float *mid = j->q8[r]->mid;
    float absmax = 0.0f;
#ifdef HAVE_X86
    if (j->isa >= OFFLOAD_ISA_AVX512) absmax = q8_absmax_avx512(x, nb);
    else if (j->isa == OFFLOAD_ISA_AVX2) absmax = q8_absmax_avx2(x, nb);
    else
#endif
        for (int64_t i = 0; i < nb; i++) {
            const float a = fabsf(x[i]);
            absmax = a > absmax ? a : absmax; /* NaN never wins */
        }
    j->absmax[r][b0 / KERNEL_Q8_BLOCK] = absmax;
    const float inv = absmax > 0.0f ? 1.0f / absmax : 0.0f;
    int64_t i = 0;
#ifdef HAVE_X86
    if (j->isa >= OFFLOAD_ISA_AVX512) i = q8_quant_avx512(q, j->q8[r], x, inv, nb);
    else if (j->isa == OFFLOAD_ISA_AVX2) i = q8_quant_avx2(q, j->q8[r], x, inv, nb);
#endif
    for (; i < nb; i++) q[i] = q8_index_scalar(mid, x[i] * inv);
}

/* A block's arithmetic (dequantize, step, requantize) is long against its memory traffic, and
 * the hardware prefetchers do not run ahead of it: without help each block first stalls on
 * its param and grad lines, then computes with the memory idle. So the lines of the block
 * Q8_PREFETCH_BLOCKS ahead are requested at the start of each block (param, grad, each row's
 * codes and scale); prefetches change no result. */
#define Q8_PREFETCH_BLOCKS 2
static inline void q8_prefetch(const struct kjob *j, int64_t b0, int64_t end, int gsize) {
#ifdef HAVE_X86
    if (b0 >= end) return;
    const int64_t nb = end - b0 < KERNEL_Q8_BLOCK ? end - b0 : KERNEL_Q8_BLOCK;
    const char *param = (const char *)(j->param + b0), *grad = (const char *)j->grad + b0 * gsize;
    for (int64_t off = 0; off < nb * 4; off += 64) _mm_prefetch(param + off, _MM_HINT_T0);
    for (int64_t off = 0; off < nb * gsize; off += 64) _mm_prefetch(grad + off, _MM_HINT_T0);
    for (int r = 0; r < j->nrows; r++) {
        const char *q = (const char *)j->state[r] + b0;
        for (int64_t off = 0; off < nb; off += 64) _mm_prefetch(q + off, _MM_HINT_T0);
        _mm_prefetch((const char *)(j->absmax[r] + b0 / KERNEL_Q8_BLOCK), _MM_HINT_T0);
    }
#else
    (void)j, (void)b0, (void)end, (void)gsize;
#endif
}

void kernel_q8_range(const struct kjob *j, int64_t begin, int64_t end,
                     void (*range)(const struct kjob *, int64_t, int64_t)) {
    _Alignas(64) float scratch[KERNEL_MAX_ROWS][KERNEL_Q8_BLOCK];
    struct kjob copy = *j, *local = &copy;
    local->state_dtype = OFFLOAD_F32;
    local->copy_dtype = j->copy_dtype;
    for (int r = 0; r < j->nrows; r++) local->state[r] = scratch[r], local->sstate[r] = scratch[r];
    const int gsize = dtype_size(j->grad_dtype), csize = dtype_size(j->copy_dtype);
    for (int64_t b0 = begin; b0 < end; b0 += KERNEL_Q8_BLOCK) {
        const int64_t nb = end - b0 < KERNEL_Q8_BLOCK ? end - b0 : KERNEL_Q8_BLOCK;
        q8_prefetch(j, b0 + Q8_PREFETCH_BLOCKS * KERNEL_Q8_BLOCK, end, gsize);
        for (int r = 0; r < j->nrows; r++) q8_dequant(j, r, b0, nb, scratch[r]);
        local->param = j->param + b0;
        local->sparam = local->param;     /* q8 steps in place only (kernel_job_init) */
        local->grad = (const char *)j->grad + b0 * gsize;
        local->param_copy = j->param_copy ? (char *)j->param_copy + b0 * csize : NULL;
        local->n = nb;
        range(local, 0, nb);
        for (int r = 0; r < j->nrows; r++) q8_quant(j, r, b0, nb, scratch[r]);
    }
}
