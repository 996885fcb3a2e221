/* copier.c: the CPU compute device's copy engine for gradient landings.
 *
 * On a CUDA device a gradient leaves the device on a copy stream while the host goes on with
 * backward. On a CPU device the same landing is a memcpy into the block's gradient buffer,
 * and done on the thread that runs backward it sits on that thread's path: 2-3 ms per
 * 16 MiB on this project's 2-core machine. This engine runs such copies on one worker
 * thread under SCHED_IDLE, so a copy uses a core only when nothing else wants it (a forward
 * waiting for an accelerator or for I/O), and never takes a core from torch's team or the
 * optimizer: an idle-policy thread is preempted by any other at once. Whoever needs the
 * bytes first finishes the copy itself: offload_copy_wait claims the pieces the worker has
 * not started and copies them on the calling thread, so a copy is never later than one
 * done inline (the worker starved on a busy machine, or absent in a forked child), except
 * for the one piece the worker may be inside (OFFLOAD_COPY_PIECE bytes).
 *
 * One job at a time (the caller waits for the last one before it submits the next: one
 * gradient in flight beside the one being produced). Jobs are caller-owned structs; the
 * engine links nothing and allocates nothing per job. Locking: one mutex guards the slot
 * (`job`, `active`) and the condition variables; pieces are claimed with atomics.
 */
#define _GNU_SOURCE
#include "offload_native.h"
#include "threadpool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#define HAVE_STREAM_STORES 1
#endif

#define OFFLOAD_COPY_PIECE (256L << 10) /* bytes per claim: the most a waiter waits on the worker */

struct offload_copier {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work; /* the worker waits for a job or stop */
    pthread_cond_t done; /* waiters wait for the worker to leave their job */
    offload_copy *job;    /* submitted, not yet taken by the worker */
    offload_copy *active; /* the job the worker is copying pieces of */
    int stop;
    int idle; /* the worker runs under SCHED_IDLE */
    int started;
    pid_t pid; /* the creating process: a forked child copies inline */
};

/* Claim and copy pieces of `j` until none is left. */
static void copy_pieces(offload_copy *j) {
    for (;;) {
        int64_t p = __atomic_fetch_add(&j->next, 1, __ATOMIC_ACQ_REL);
        if (p >= j->npieces) return;
        int64_t off = p * OFFLOAD_COPY_PIECE;
        int64_t n = j->nbytes - off < OFFLOAD_COPY_PIECE ? j->nbytes - off : OFFLOAD_COPY_PIECE;
        memcpy((char *)j->dst + off, (const char *)j->src + off, (size_t)n);
        __atomic_add_fetch(&j->finished, 1, __ATOMIC_RELEASE);
    }
}

static void *worker(void *arg) {
    offload_copier *c = arg;
#ifdef SCHED_IDLE
    struct sched_param sp = {0};
    int idle = pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp) == 0;
#else
    int idle = 0;
#endif
    pthread_mutex_lock(&c->mu);
    c->idle = idle;
    c->started = 1;
    pthread_cond_broadcast(&c->done);
    for (;;) {
        while (!c->stop && !c->job) pthread_cond_wait(&c->work, &c->mu);
        if (!c->job) break; /* stop, nothing queued */
        offload_copy *j = c->job;
        c->job = NULL;
        c->active = j;
        pthread_mutex_unlock(&c->mu);
        copy_pieces(j);
        pthread_mutex_lock(&c->mu);
        c->active = NULL; /* from here the worker no longer touches j */
        pthread_cond_broadcast(&c->done);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

OFFLOAD_API int offload_copier_create(offload_copier **out) {
    offload_copier *c = calloc(1, sizeof *c);
    if (!c) return -ENOMEM;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->work, NULL);
    pthread_cond_init(&c->done, NULL);
    c->pid = getpid();
    int rc = pthread_create(&c->thread, NULL, worker, c);
    if (rc != 0) {
        free(c);
        return -rc;
    }
    pthread_mutex_lock(&c->mu);
    while (!c->started) pthread_cond_wait(&c->done, &c->mu);
    pthread_mutex_unlock(&c->mu);
    *out = c;
    return 0;
}

OFFLOAD_API int offload_copier_idle(offload_copier *c) { return c->idle; }

OFFLOAD_API int offload_copier_submit(offload_copier *c, offload_copy *j) {
    if (j->nbytes < 0 || (j->nbytes > 0 && (!j->dst || !j->src))) return -EINVAL;
    j->npieces = (j->nbytes + OFFLOAD_COPY_PIECE - 1) / OFFLOAD_COPY_PIECE;
    __atomic_store_n(&j->next, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&j->finished, 0, __ATOMIC_RELEASE);
    if (getpid() != c->pid) { /* a forked child: no worker here */
        copy_pieces(j);
        return 0;
    }
    pthread_mutex_lock(&c->mu);
    if (c->job || c->active || c->stop) {
        pthread_mutex_unlock(&c->mu);
        return -EBUSY; /* the last job was not waited for, or the copier is closing */
    }
    c->job = j;
    pthread_cond_signal(&c->work);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

OFFLOAD_API void offload_copy_wait(offload_copier *c, offload_copy *j) {
    copy_pieces(j); /* what the worker has not started, on this thread */
    if (getpid() != c->pid) return;
    pthread_mutex_lock(&c->mu);
    if (c->job == j) c->job = NULL; /* never taken: all of it was copied here */
    while (c->active == j) pthread_cond_wait(&c->done, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

OFFLOAD_API void offload_copier_destroy(offload_copier *c) {
    if (!c) return;
    if (getpid() == c->pid) {
        pthread_mutex_lock(&c->mu);
        c->stop = 1;
        pthread_cond_signal(&c->work);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->thread, NULL); /* it finishes a queued job first */
    }
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->work);
    pthread_cond_destroy(&c->done);
    free(c);
}

/* A landing done now by the thread that needs it (offload_copy_now): the pieces run on
 * torch's own team (native/threadpool.c: pool_run_on_team) with streaming stores. Only there:
 * on any other thread the pool would register with torch's OpenMP runtime for each copy (a
 * host thread and a region's threads started per landing), so the caller copies instead
 * (return 1). A copy of one piece runs on the calling thread, whichever it is. A landing's
 * destination is read next by the update, after the rest of backward has gone through the
 * cache, so a store that first reads the line it overwrites (what memcpy and torch's copy_
 * do below the size where they switch to streaming) only adds traffic: 12 copies of 4 MiB
 * took 5.5 ms this way against 7.6 ms with torch's copy_ on the 2-core VM. */
static void stream_copy(char *dst, const char *src, int64_t n) {
#ifdef HAVE_STREAM_STORES
    int64_t head = (int64_t)((16 - ((uintptr_t)dst & 15)) & 15); /* to dst's 16-byte alignment */
    if (head > n) head = n;
    memcpy(dst, src, (size_t)head);
    dst += head, src += head, n -= head;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32)), d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, (size_t)(n - i));
    _mm_sfence(); /* this thread's streaming stores are visible before its piece counts as done */
#else
    memcpy(dst, src, (size_t)n);
#endif
}

struct copy_now { char *dst; const char *src; int64_t nbytes; };

static void copy_now_piece(void *ctx, long p) {
    const struct copy_now *j = ctx;
    int64_t off = (int64_t)p * OFFLOAD_COPY_PIECE;
    int64_t n = j->nbytes - off < OFFLOAD_COPY_PIECE ? j->nbytes - off : OFFLOAD_COPY_PIECE;
    stream_copy(j->dst + off, j->src + off, n);
}

OFFLOAD_API int offload_copy_now(void *dst, const void *src, int64_t nbytes) {
    if (nbytes < 0 || (nbytes > 0 && (!dst || !src))) return -EINVAL;
    struct copy_now j = {dst, src, nbytes};
    long pieces = (long)((nbytes + OFFLOAD_COPY_PIECE - 1) / OFFLOAD_COPY_PIECE);
    if (pieces <= 1) { /* one piece: the calling thread alone, on any thread */
        stream_copy(dst, src, nbytes);
        return 0;
    }
    return pool_run_on_team(copy_now_piece, &j, pieces);
}
