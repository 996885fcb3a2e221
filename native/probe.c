/* probe.c: the in-place bandwidth probe (benchmarks only): a rule's memory traffic without
 * its arithmetic, rw[k] += scale * d for k < nrw, on the kernels' pool, chunking and ISA (each ISA's
 * loop moves the bytes as the rules' loop of that ISA does: one pass, every array's element
 * together, the same vector width and software prefetch). scale = 0 reads d (a rule's own
 * gradient, so the probe moves exactly the rule's arrays) and leaves every rw value as it was
 * (rw + (+-0) = rw for finite d, a zero's sign aside); one multiply per vector of d, no other arithmetic. */
#include "kernel.h"

#define PROBE_MAX 4

struct probe_job { float *rw[PROBE_MAX]; int nrw; const float *d; float scale; struct chunking chunks; int isa; };

/* Every array's element in one pass, as a rule reads them (the scalar reference and the
 * vector loops' tails). */
static void probe_range(const struct probe_job *p, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
        const float x = p->d[i] * p->scale;
        for (int k = 0; k < p->nrw; k++) p->rw[k][i] += x;
    }
}

#ifdef HAVE_X86
/* The vector loops take the job by value and the array count as a literal (one loop per
 * count, as the rules' loops are compiled per row count): the pointers stay in registers and
 * the per-array loop unrolls. Prefetch as the rules' loops (kernel.h: KERNEL_PREFETCH_ELEMS
 * ahead, one line of each array per 16 elements), so the probe stays the best stream a rule's
 * loop of the same ISA could reach. */
KINLINE void probe_prefetch(const struct probe_job *p, int nrw, int64_t i) {
    _mm_prefetch((const char *)(p->d + i + KERNEL_PREFETCH_ELEMS), _MM_HINT_T0);
    for (int k = 0; k < nrw; k++) _mm_prefetch((const char *)(p->rw[k] + i + KERNEL_PREFETCH_ELEMS), _MM_HINT_T0);
}

I512 void probe_avx512_n(const struct probe_job *job, int64_t begin, int64_t end, const int nrw) {
    const struct probe_job local = *job, *p = &local;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        probe_prefetch(p, nrw, i);
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(p->d + i), _mm512_set1_ps(p->scale));
        for (int k = 0; k < nrw; k++)
            _mm512_storeu_ps(p->rw[k] + i, _mm512_add_ps(_mm512_loadu_ps(p->rw[k] + i), x));
    }
    probe_range(p, i, end);
}

I256 void probe_avx2_n(const struct probe_job *job, int64_t begin, int64_t end, const int nrw) {
    const struct probe_job local = *job, *p = &local;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        if ((i & 15) == 0) probe_prefetch(p, nrw, i); /* as the rules' AVX2 loop: once per 16 elements */
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p->d + i), _mm256_set1_ps(p->scale));
        for (int k = 0; k < nrw; k++)
            _mm256_storeu_ps(p->rw[k] + i, _mm256_add_ps(_mm256_loadu_ps(p->rw[k] + i), x));
    }
    probe_range(p, i, end);
}

TARGET_f32x16 static void probe_range_avx512(const struct probe_job *p, int64_t begin, int64_t end) {
    switch (p->nrw) {
    case 1: probe_avx512_n(p, begin, end, 1); return;
    case 2: probe_avx512_n(p, begin, end, 2); return;
    case 3: probe_avx512_n(p, begin, end, 3); return;
    default: probe_avx512_n(p, begin, end, 4); return;
    }
}

TARGET_f32x8 static void probe_range_avx2(const struct probe_job *p, int64_t begin, int64_t end) {
    switch (p->nrw) {
    case 1: probe_avx2_n(p, begin, end, 1); return;
    case 2: probe_avx2_n(p, begin, end, 2); return;
    case 3: probe_avx2_n(p, begin, end, 3); return;
    default: probe_avx2_n(p, begin, end, 4); return;
    }
}
#endif

static void probe_chunk(void *ctx, long c) {
    const struct probe_job *p = ctx;
    int64_t begin, end;
    kernel_chunk_range(p->chunks, c, &begin, &end);
#ifdef HAVE_X86
    if (p->isa >= OFFLOAD_ISA_AVX512) { probe_range_avx512(p, begin, end); return; }
    if (p->isa == OFFLOAD_ISA_AVX2) { probe_range_avx2(p, begin, end); return; }
#endif
    probe_range(p, begin, end);
}

OFFLOAD_API int offload_bandwidth_probe(float *const *rw, int nrw, const float *d, float scale, int64_t n) {
    if (n < 0 || nrw < 1 || nrw > PROBE_MAX || !rw || (n > 0 && !d)) return -EINVAL;
    struct probe_job job = {{0}, nrw, d, scale, kernel_chunking(n), kernel_isa()};
    for (int k = 0; k < nrw; k++) {
        if (n > 0 && !rw[k]) return -EINVAL;
        job.rw[k] = rw[k];
    }
    return n == 0 ? 0 : pool_run(probe_chunk, &job, kernel_nchunks(job.chunks));
}
