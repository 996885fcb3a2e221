/* threadpool.c: persistent pthread workers for the native kernels (see threadpool.h).
 *
 * Synchronization: one pool_run at a time (run_lock). Under `lock`, the caller publishes
 * the task (fn, ctx, nparts), sets `pending` to the number of worker parts, bumps
 * `generation` and broadcasts `wake`. A worker that sees a new generation copies the task,
 * runs its part if its index < nparts, then decrements `pending`; the last one signals
 * `done`. The caller runs part 0 itself and returns only when `pending` is 0, so the task
 * and everything it points to (the caller's stack) outlive every worker's use of them.
 * A worker never runs a part of generation k+1 before k is finished, because k+1 cannot
 * be published before the caller of k has seen pending == 0.
 */
#define _GNU_SOURCE
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define HAVE_MXCSR 1
#endif

static struct {
    pthread_mutex_t run_lock; /* held for the whole of one pool_run */
    pthread_mutex_t lock;     /* guards the fields below */
    pthread_cond_t wake;      /* workers wait for a new generation */
    pthread_cond_t done;      /* the caller waits for pending == 0 */
    unsigned long generation;
    pool_task_fn fn;
    void *ctx;
    int nparts;
    int pending;  /* worker parts of the current generation not yet finished */
    int started;  /* workers running: indices 1..started */
    int threads;  /* configured total, caller included; 0 = not set yet (use the CPU count) */
    unsigned mxcsr; /* the caller's FP control word: workers round and flush like the caller */
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
       PTHREAD_COND_INITIALIZER, 0, NULL, NULL, 0, 0, 0, 0, 0};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

struct worker_start {
    int index;
    unsigned long generation; /* the generation already finished when the worker was made */
};

static void *worker_main(void *arg) {
    struct worker_start start = *(struct worker_start *)arg;
    free(arg);
    unsigned long seen = start.generation;
    for (;;) {
        pthread_mutex_lock(&P.lock);
        while (P.generation == seen) pthread_cond_wait(&P.wake, &P.lock);
        seen = P.generation;
        pool_task_fn fn = P.fn;
        void *ctx = P.ctx;
        int nparts = P.nparts;
#ifdef HAVE_MXCSR
        unsigned mxcsr = P.mxcsr;
#endif
        pthread_mutex_unlock(&P.lock);
        if (start.index >= nparts) continue; /* not needed for this call */
#ifdef HAVE_MXCSR
        if (_mm_getcsr() != mxcsr) _mm_setcsr(mxcsr);
#endif
        fn(ctx, start.index, nparts);
        pthread_mutex_lock(&P.lock);
        if (--P.pending == 0) pthread_cond_signal(&P.done);
        pthread_mutex_unlock(&P.lock);
    }
    return NULL;
}

/* fork(): prepare holds run_lock so no call is in flight; the child has no workers, so it
 * starts with fresh locks and starts workers again on its first parallel call. */
static void atfork_prepare(void) { pthread_mutex_lock(&P.run_lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&P.run_lock); }
static void atfork_child(void) {
    pthread_mutex_init(&P.run_lock, NULL);
    pthread_mutex_init(&P.lock, NULL);
    pthread_cond_init(&P.wake, NULL);
    pthread_cond_init(&P.done, NULL);
    P.started = 0;
    P.pending = 0;
}
static void register_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

static int cpu_count(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

int pool_get_threads(void) {
    pthread_mutex_lock(&P.lock);
    if (P.threads == 0) P.threads = cpu_count() < POOL_MAX_THREADS ? cpu_count() : POOL_MAX_THREADS;
    int n = P.threads;
    pthread_mutex_unlock(&P.lock);
    return n;
}

int pool_set_threads(int n) {
    if (n < 1 || n > POOL_MAX_THREADS) return -22; /* -EINVAL */
    pthread_mutex_lock(&P.lock);
    P.threads = n; /* workers beyond n - 1 stay asleep; none are stopped */
    pthread_mutex_unlock(&P.lock);
    return 0;
}

/* Start workers up to index `want`; called with run_lock held and no call in flight. */
static void start_workers(int want) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* workers inherit a mask that blocks signals */
    while (P.started < want) {
        struct worker_start *start = malloc(sizeof *start);
        if (start == NULL) break;
        start->index = P.started + 1;
        start->generation = P.generation;
        pthread_t tid;
        if (pthread_create(&tid, NULL, worker_main, start) != 0) {
            free(start);
            break;
        }
        pthread_detach(tid);
        P.started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

int pool_run(pool_task_fn fn, void *ctx, int nparts) {
    int threads = pool_get_threads();
    if (nparts > threads) nparts = threads;
    if (nparts <= 1) {
        fn(ctx, 0, 1);
        return 0;
    }
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&P.run_lock);
    if (P.started < nparts - 1) start_workers(nparts - 1);
    if (nparts > P.started + 1) nparts = P.started + 1; /* thread creation failed: use fewer */

    pthread_mutex_lock(&P.lock);
    P.fn = fn;
    P.ctx = ctx;
    P.nparts = nparts;
    P.pending = nparts - 1;
#ifdef HAVE_MXCSR
    P.mxcsr = _mm_getcsr();
#endif
    P.generation++;
    pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.lock);

    fn(ctx, 0, nparts);

    pthread_mutex_lock(&P.lock);
    while (P.pending > 0) pthread_cond_wait(&P.done, &P.lock);
    pthread_mutex_unlock(&P.lock);
    pthread_mutex_unlock(&P.run_lock);
    return 0;
}
