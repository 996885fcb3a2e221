/* threadpool.c: persistent pthread workers for the native kernels (see threadpool.h).
 *
 * Work is split into many equal chunks claimed one at a time from an atomic counter, by
 * the caller and by whichever workers are running, so a call never waits for a worker to
 * be woken up and scheduled: measured on a 2-vCPU VM, a worker woken after a pause often
 * lands on the caller's CPU and starts 0.3-4 ms later. With static halves the caller then
 * waited; with chunks it just does more of them.
 *
 * Synchronization, per call (one at a time, run_lock):
 *   caller, under `lock`: publish fn/ctx/nchunks, next = 0, open = 1, bump `generation`,
 *     broadcast `wake`; then claim chunks until none are left.
 *   worker: on a new generation, under `lock`, joins only if the call is still `open`
 *     (active++), then claims chunks; on leaving, active-- and signals `done` at 0.
 *   caller, out of chunks: under `lock`, open = 0 (no worker joins from now on), then
 *     waits until active == 0. Every chunk has then returned, and no worker will touch
 *     fn/ctx (the caller's stack) again: late workers see open == 0 and go back to sleep.
 * Workers spin for a short while before sleeping, so back-to-back calls skip the wake-up.
 *
 * One thread budget with torch (OpenMP). torch's intra-op workers are OpenMP threads: after
 * each parallel region they spin (libgomp: GOMP_SPINCOUNT, 300000 pauses, ~4 ms of a core
 * measured here) before sleeping, so a kernel started right after torch work shared the cores
 * with them and lost ~25%. OpenMP runtimes shorten that spin (libgomp: to 1000 pauses, ~20 us,
 * still enough to catch back-to-back small ops) once the process has more OpenMP threads than
 * CPUs, which is the case whenever this pool and torch's team are both sized to the machine.
 * So when the process already has an OpenMP runtime loaded (torch's; found by soname with
 * RTLD_NOLOAD, never loaded here), the workers are started as the team of one OpenMP parallel
 * region that never ends: a host pthread enters GOMP_parallel and sleeps as the region's
 * master; team threads 1..k run worker_main below. The runtime then counts them as its own
 * threads and throttles every idle spin, torch's included. The protocol above is unchanged (no
 * OpenMP barrier is ever reached). Without a runtime, or with OFFLOAD_POOL=pthread, workers
 * are plain pthreads. offload_pool_runtime() reports which.
 */
#define _GNU_SOURCE
#include "threadpool.h"
#include "offload_native.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_MXCSR 1
static inline void cpu_relax(void) { _mm_pause(); }
#elif defined(__aarch64__)
static inline void cpu_relax(void) { __asm__ __volatile__("yield"); }
#else
static inline void cpu_relax(void) {}
#endif

#define WORKER_SPIN_NS 50000L  /* a worker polls this long for the next call before sleeping */
#define CALLER_SPIN_NS 200000L /* the caller polls this long for helpers to finish their last chunk */

static struct {
    pthread_mutex_t run_lock; /* held for the whole of one pool_run */
    pthread_mutex_t lock;     /* guards the fields below (generation and active are also polled) */
    pthread_cond_t wake;      /* workers wait for a new generation */
    pthread_cond_t done;      /* the caller waits for active == 0 */
    unsigned long generation;
    pool_chunk_fn fn;
    void *ctx;
    long nchunks;
    long next;    /* atomic: the next unclaimed chunk */
    int open;     /* workers may still join the current call */
    int helpers;  /* workers 1..helpers may join it */
    int active;   /* workers in the current call */
    int started;  /* workers running: indices 1..started */
    int threads;  /* configured total, caller included; 0 = not set yet (use the CPU count) */
    unsigned mxcsr; /* the caller's FP control word: workers round and flush like the caller */
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
       PTHREAD_COND_INITIALIZER, 0, NULL, NULL, 0, 0, 0, 0, 0, 0, 0, 0};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void claim_chunks(pool_chunk_fn fn, void *ctx, long nchunks) {
    for (long c; (c = __atomic_fetch_add(&P.next, 1, __ATOMIC_RELAXED)) < nchunks;) fn(ctx, c);
}

struct worker_start {
    int index;
    unsigned long generation; /* the generation current when the worker was made */
};

static void worker_loop(struct worker_start start) {
    unsigned long seen = start.generation;
    for (;;) {
        for (long t0 = now_ns(); __atomic_load_n(&P.generation, __ATOMIC_ACQUIRE) == seen;) {
            for (int i = 0; i < 64; i++) cpu_relax();
            if (now_ns() - t0 > WORKER_SPIN_NS) break;
        }
        pthread_mutex_lock(&P.lock);
        while (P.generation == seen) pthread_cond_wait(&P.wake, &P.lock);
        seen = P.generation;
        if (!P.open || start.index > P.helpers) { /* finished already, or not wanted */
            pthread_mutex_unlock(&P.lock);
            continue;
        }
        __atomic_add_fetch(&P.active, 1, __ATOMIC_RELAXED);
        pool_chunk_fn fn = P.fn;
        void *ctx = P.ctx;
        long nchunks = P.nchunks;
#ifdef HAVE_MXCSR
        unsigned mxcsr = P.mxcsr;
#endif
        pthread_mutex_unlock(&P.lock);
#ifdef HAVE_MXCSR
        if (_mm_getcsr() != mxcsr) _mm_setcsr(mxcsr);
#endif
        claim_chunks(fn, ctx, nchunks);
        pthread_mutex_lock(&P.lock);
        if (__atomic_sub_fetch(&P.active, 1, __ATOMIC_RELEASE) == 0 && !P.open) pthread_cond_signal(&P.done);
        pthread_mutex_unlock(&P.lock);
    }
}

static void *worker_main(void *arg) {
    struct worker_start start = *(struct worker_start *)arg;
    free(arg);
    worker_loop(start);
    return NULL;
}

/* ---- workers as an OpenMP team (see the header comment) -------------------------------- */
typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
typedef int (*omp_thread_num_fn)(void);

static struct {
    pthread_once_t once;
    gomp_parallel_fn parallel;
    omp_thread_num_fn thread_num;
    const char *name; /* the runtime's soname, or NULL: plain pthreads */
} OMP = {PTHREAD_ONCE_INIT, NULL, NULL, NULL};

static void find_openmp(void) {
    const char *want = getenv("OFFLOAD_POOL");
    if (want != NULL && strcmp(want, "pthread") == 0) return;
    static const char *const names[] = {"libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.so.5"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        void *h = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD); /* only a runtime already loaded */
        if (h == NULL) continue;
        gomp_parallel_fn par = (gomp_parallel_fn)dlsym(h, "GOMP_parallel"); /* LLVM, Intel: compat entry */
        omp_thread_num_fn num = (omp_thread_num_fn)dlsym(h, "omp_get_thread_num");
        if (par != NULL && num != NULL) {
            OMP.parallel = par;
            OMP.thread_num = num;
            OMP.name = names[i];
            return; /* the handle stays open: the runtime outlives the pool */
        }
        dlclose(h);
    }
}

struct team_start {
    int first;                /* pool index of team thread 1 */
    int size;                 /* team size asked for, master included */
    unsigned long generation;
};

/* The body of the never-ending region: team thread t >= 1 is pool worker first + t - 1; the
 * master (the host pthread, t == 0) only keeps the region, and so the team, alive. */
static void team_main(void *arg) {
    struct team_start *t = arg;
    int tn = OMP.thread_num();
    if (tn == 0) {
        for (;;) pause();
    }
    worker_loop((struct worker_start){.index = t->first + tn - 1, .generation = t->generation});
}

static void *team_host(void *arg) {
    struct team_start *t = arg;
    OMP.parallel(team_main, t, (unsigned)t->size, 0);
    return NULL; /* not reached */
}

/* Start `count` OpenMP team workers as pool indices first..first+count-1; 0 on success. */
static int start_team(int first, int count) {
    struct team_start *t = malloc(sizeof *t); /* lives as long as the region: forever */
    if (t == NULL) return -1;
    *t = (struct team_start){.first = first, .size = count + 1, .generation = P.generation};
    pthread_t tid;
    if (pthread_create(&tid, NULL, team_host, t) != 0) {
        free(t);
        return -1;
    }
    pthread_detach(tid);
    return 0;
}

const char *pool_runtime(void) {
    pthread_once(&OMP.once, find_openmp);
    return OMP.name != NULL ? OMP.name : "pthread";
}

OFFLOAD_API const char *offload_pool_runtime(void) { return pool_runtime(); }

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
    P.active = 0;
    P.open = 0;
}
static void register_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

static int cpu_count(void) {
    cpu_set_t set;
    int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > POOL_MAX_THREADS ? POOL_MAX_THREADS : n;
}

int pool_get_threads(void) {
    pthread_mutex_lock(&P.lock);
    if (P.threads == 0) P.threads = cpu_count();
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
    pthread_once(&OMP.once, find_openmp);
    if (OMP.parallel != NULL && P.started < want && start_team(P.started + 1, want - P.started) == 0)
        P.started = want; /* a runtime may give a smaller team: the missing workers never join */
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

int pool_run(pool_chunk_fn fn, void *ctx, long nchunks) {
    int threads = pool_get_threads();
    if (threads <= 1 || nchunks <= 1) {
        for (long c = 0; c < nchunks; c++) fn(ctx, c);
        return 0;
    }
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&P.run_lock);
    int helpers = (long)threads - 1 < nchunks - 1 ? threads - 1 : (int)(nchunks - 1);
    if (P.started < helpers) start_workers(helpers);
    if (helpers > P.started) helpers = P.started; /* thread creation failed: fewer helpers */

    pthread_mutex_lock(&P.lock);
    P.fn = fn;
    P.ctx = ctx;
    P.nchunks = nchunks;
    __atomic_store_n(&P.next, 0, __ATOMIC_RELAXED);
    P.open = 1;
    P.helpers = helpers;
#ifdef HAVE_MXCSR
    P.mxcsr = _mm_getcsr();
#endif
    __atomic_store_n(&P.generation, P.generation + 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.lock);

    claim_chunks(fn, ctx, nchunks);

    pthread_mutex_lock(&P.lock);
    P.open = 0; /* from here no worker joins; the ones that did finish their last chunk */
    pthread_mutex_unlock(&P.lock);
    for (long t0 = now_ns(); __atomic_load_n(&P.active, __ATOMIC_ACQUIRE) > 0 && now_ns() - t0 < CALLER_SPIN_NS;)
        for (int i = 0; i < 64; i++) cpu_relax();
    pthread_mutex_lock(&P.lock);
    while (P.active > 0) pthread_cond_wait(&P.done, &P.lock);
    pthread_mutex_unlock(&P.lock);
    pthread_mutex_unlock(&P.run_lock);
    return 0;
}
