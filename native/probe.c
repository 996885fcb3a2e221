/* probe.c: the in-place bandwidth probe (benchmarks only): a rule's memory traffic without
 * its arithmetic, rw[k] += d for k < nrw, on the kernels' pool, chunking and ISA. */
#include "kernel.h"

#define PROBE_MAX 4

struct probe_job { float *rw[PROBE_MAX]; int nrw; const float *d; struct chunking chunks; int isa; };

static void probe_range(const struct probe_job *p, int64_t begin, int64_t end) {
    for (int k = 0; k < p->nrw; k++) {
        float *restrict a = p->rw[k];
        const float *restrict d = p->d;
        for (int64_t i = begin; i < end; i++) a[i] += d[i];
    }
}

#ifdef HAVE_X86
TARGET_f32x16 static void probe_range_avx512(const struct probe_job *p, int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) { /* every array's element in one pass, as a rule reads them */
        /* the rules' own prefetch (kernel.h): the probe stays the best stream they could reach */
        _mm_prefetch((const char *)(p->d + i + KERNEL_PREFETCH_ELEMS), _MM_HINT_T0);
        for (int k = 0; k < p->nrw; k++) _mm_prefetch((const char *)(p->rw[k] + i + KERNEL_PREFETCH_ELEMS), _MM_HINT_T0);
        const __m512 x = _mm512_loadu_ps(p->d + i);
        for (int k = 0; k < p->nrw; k++)
            _mm512_storeu_ps(p->rw[k] + i, _mm512_add_ps(_mm512_loadu_ps(p->rw[k] + i), x));
    }
    probe_range(p, i, end);
}
#endif

static void probe_chunk(void *ctx, long c) {
    const struct probe_job *p = ctx;
    int64_t begin, end;
    kernel_chunk_range(p->chunks, c, &begin, &end);
#ifdef HAVE_X86
    if (p->isa >= OFFLOAD_ISA_AVX512) { probe_range_avx512(p, begin, end); return; }
#endif
    probe_range(p, begin, end);
}

OFFLOAD_API int offload_bandwidth_probe(float *const *rw, int nrw, const float *d, int64_t n) {
    if (n < 0 || nrw < 1 || nrw > PROBE_MAX || !rw || (n > 0 && !d)) return -EINVAL;
    struct probe_job job = {{0}, nrw, d, kernel_chunking(n), kernel_isa()};
    for (int k = 0; k < nrw; k++) {
        if (n > 0 && !rw[k]) return -EINVAL;
        job.rw[k] = rw[k];
    }
    return n == 0 ? 0 : pool_run(probe_chunk, &job, kernel_nchunks(job.chunks));
}
