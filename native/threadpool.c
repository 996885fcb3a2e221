/* threadpool.c: persistent pthread workers for the native kernels (see threadpool.h).
 *
 * Work is split into many equal chunks claimed one at a time from an atomic counter, by
 * the caller and by whichever workers are running, so a call never waits for a worker to
 * be woken up and scheduled: a worker that starts late finds fewer chunks left.
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
 * One thread budget with torch (OpenMP). torch's intra-op workers are OpenMP threads. After
 * each parallel region libgomp (the runtime torch ships) spins them for a long while before
 * they sleep, unless the process holds more OpenMP threads than CPUs: then briefly, decided
 * when each spin starts. The long spin keeps back-to-back small torch ops fast, and takes a
 * core from a kernel started right after torch work. So the pool registers with the runtime
 * while it has work: when a kernel starts and the pool is not registered, a host pthread
 * opens an OpenMP parallel region of the runtime the process already loaded (torch's; found
 * by soname with RTLD_NOLOAD, never loaded here) with one thread per CPU, all asleep on a
 * condition variable. The runtime then counts more threads than CPUs, and every idle spin
 * that starts from then on, torch's included, is the short one. Once no kernel runs and
 * LINGER_NS (OFFLOAD_POOL_LINGER_MS, default 0; offload_pool_configure) has passed, the region ends and the host
 * exits, which is when the runtime stops counting those threads: torch's own work then spins
 * as it did before the pool existed.
 * A kernel called on the main thread (CPUAdam.step, a user's adam_step) runs its chunks on
 * that thread's own OpenMP team instead (team_run below): torch's workers claim the kernel's
 * chunks rather than compete with it, and no registration is made for it.
 * OFFLOAD_POOL=pthread (offload_pool_configure) never registers and never uses torch's team.
 * offload_pool_runtime() names the runtime (or "pthread"); offload_pool_registered() says
 * whether a registration is alive; offload_pool_team_runs() counts kernels run on the team.
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
#include <sys/syscall.h>
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
static void register_atfork(void);

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

/* Between two calls a worker polls WORKER_SPIN_NS (back-to-back calls of one kernel), then sleeps. */
static void worker_wait_spin(unsigned long seen) {
    long t0 = now_ns();
    while (__atomic_load_n(&P.generation, __ATOMIC_ACQUIRE) == seen) {
        for (int i = 0; i < 64; i++) cpu_relax();
        if (now_ns() - t0 > WORKER_SPIN_NS) break;
    }
}

static void worker_loop(struct worker_start start) {
    unsigned long seen = start.generation;
    for (;;) {
        worker_wait_spin(seen);
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

/* ---- registration with the process's OpenMP runtime (see the header comment) --------- */
typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
typedef int (*omp_thread_num_fn)(void);

static struct {
    pthread_once_t once;
    gomp_parallel_fn parallel;
    omp_thread_num_fn thread_num;
    omp_thread_num_fn level;       /* omp_get_level: 0 outside every parallel region */
    omp_thread_num_fn max_threads; /* omp_get_max_threads: the calling thread's team size (torch's) */
    const char *name; /* the runtime's soname, or NULL: never register, never run on a team */
    int team_off;     /* a forked child: the parent's team threads do not exist here */
} OMP = {PTHREAD_ONCE_INIT, NULL, NULL, NULL, NULL, NULL, 0};

#define DEFAULT_LINGER_MS 0L /* the registration ends with the last kernel (see the header) */
static long LINGER_NS = DEFAULT_LINGER_MS * 1000000L;

static int PTHREAD_ONLY = 0; /* OFFLOAD_POOL=pthread: never register, never run on a team */

/* The pool's settings, read and checked once by _native.py (OFFLOAD_POOL, OFFLOAD_POOL_LINGER_MS)
 * and passed here right after the library loads, before any kernel: the library reads no
 * environment of its own, so the two can never disagree. Returns 0, or -1 (nothing changed)
 * for a linger outside 0..60000 ms. */
OFFLOAD_API int offload_pool_configure(int pthread_only, int64_t linger_ms) {
    if (linger_ms < 0 || linger_ms > 60000) return -1;
    PTHREAD_ONLY = pthread_only != 0;
    LINGER_NS = (long)linger_ms * 1000000L;
    return 0;
}

static void find_openmp(void) {
    if (PTHREAD_ONLY) return;
    static const char *const names[] = {"libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.so.5"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        void *h = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD); /* only a runtime already loaded */
        if (h == NULL) continue;
        gomp_parallel_fn par = (gomp_parallel_fn)dlsym(h, "GOMP_parallel"); /* LLVM, Intel: compat entry */
        omp_thread_num_fn num = (omp_thread_num_fn)dlsym(h, "omp_get_thread_num");
        omp_thread_num_fn level = (omp_thread_num_fn)dlsym(h, "omp_get_level");
        omp_thread_num_fn max = (omp_thread_num_fn)dlsym(h, "omp_get_max_threads");
        if (par != NULL && num != NULL && level != NULL && max != NULL) {
            OMP.parallel = par;
            OMP.thread_num = num;
            OMP.level = level;
            OMP.max_threads = max;
            OMP.name = names[i];
            return; /* the handle stays open: the runtime outlives the pool */
        }
        dlclose(h);
    }
}

/* One registration: a host pthread, master of a region of `size` threads that only sleep.
 * Lifecycle (REG.lock): JOINING (host created) -> RUNNING (the region runs: the runtime counts
 * its threads) -> LEAVING (released once the pool idled LINGER_NS; the host returns and
 * exits) -> freed by the host. At most one registration is current; a kernel starting while
 * the current one is LEAVING makes a new one (both exist until the old host exits). */
enum reg_state { REG_JOINING, REG_RUNNING, REG_LEAVING };
struct reg {
    enum reg_state state;
    unsigned size; /* threads in the region, master included */
};

static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;   /* busy / last_end changed (the current master waits on it) */
    pthread_cond_t release; /* a registration was released (its sleeping threads wait on it) */
    struct reg *current;   /* NULL: not registered (or the last one is leaving) */
    int alive;             /* registrations whose host has not exited */
    int busy;              /* pool_run calls in progress */
    long made;             /* registrations started since the library loaded */
    long last_end;         /* now_ns() when the last pool_run ended */
} REG = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0, 0};

/* The condition variables' clock (CLOCK_REALTIME) ``ns`` from now, for a bounded wait. */
static struct timespec realtime_in(long ns) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += ns / 1000000000L;
    t.tv_nsec += ns % 1000000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

/* The region's body. The master waits until no kernel runs and LINGER_NS has passed since
 * the last one, then releases the team; the others sleep until
 * released. Nothing here touches the pool's work. */
static void reg_team(void *arg) {
    struct reg *r = arg;
    pthread_mutex_lock(&REG.lock);
    if (OMP.thread_num() == 0) {
        r->state = REG_RUNNING;
        for (;;) {
            long now = now_ns(), due = REG.last_end + LINGER_NS;
            if (REG.busy == 0 && now >= due) break;
            /* reg_exit broadcasts; the timeout only bounds a lost wake-up */
            struct timespec until = realtime_in(REG.busy > 0 ? 100000000L : due - now);
            pthread_cond_timedwait(&REG.cond, &REG.lock, &until);
        }
        r->state = REG_LEAVING;
        if (REG.current == r) REG.current = NULL;
        pthread_cond_broadcast(&REG.release);
    } else {
        while (r->state != REG_LEAVING) pthread_cond_wait(&REG.release, &REG.lock);
    }
    pthread_mutex_unlock(&REG.lock);
}

static void *reg_host(void *arg) {
    struct reg *r = arg;
    OMP.parallel(reg_team, r, r->size, 0);
    /* The runtime stops counting the region's threads when this thread exits (its thread
     * pool is freed by the runtime's thread destructor), a few microseconds from here. */
    pthread_mutex_lock(&REG.lock);
    REG.alive--;
    pthread_mutex_unlock(&REG.lock);
    free(r);
    return NULL;
}

static int cpu_count(void);

/* Starts a registration if none is current (asynchronously: the host starts the region);
 * called with REG.lock held. */
static void reg_start_locked(void) {
    if (REG.current != NULL) return;
    struct reg *r = malloc(sizeof *r);
    pthread_t tid;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* the host and the runtime's threads block signals */
    /* one thread per CPU besides the master: more threads than CPUs whatever torch's own count */
    if (r != NULL) *r = (struct reg){REG_JOINING, (unsigned)cpu_count() + 1};
    if (r != NULL && pthread_create(&tid, NULL, reg_host, r) == 0) {
        pthread_detach(tid);
        REG.current = r;
        REG.alive++;
        REG.made++;
    } else {
        free(r); /* not registered: the kernel runs all the same */
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* A kernel starts: registered from now on. */
static void reg_enter(void) {
    pthread_once(&OMP.once, find_openmp);
    if (OMP.parallel == NULL) return;
    pthread_mutex_lock(&REG.lock);
    REG.busy++;
    reg_start_locked();
    pthread_mutex_unlock(&REG.lock);
}

static void reg_exit(void) {
    if (OMP.parallel == NULL) return;
    pthread_mutex_lock(&REG.lock);
    REG.busy--;
    REG.last_end = now_ns();
    pthread_cond_broadcast(&REG.cond);
    pthread_mutex_unlock(&REG.lock);
}

/* The calling thread is the process's main thread (the master of torch's team), outside
 * every parallel region, with a team of more than one thread, in the process that loaded
 * the runtime's threads (not a forked child). */
static int on_main_thread_outside_regions(void) {
    if (OMP.parallel == NULL || __atomic_load_n(&OMP.team_off, __ATOMIC_RELAXED)) return 0;
    if ((pid_t)syscall(SYS_gettid) != getpid()) return 0;
    return OMP.level() == 0 && OMP.max_threads() > 1;
}

OFFLOAD_API int offload_pool_registered(void) {
    pthread_mutex_lock(&REG.lock);
    int n = REG.alive;
    pthread_mutex_unlock(&REG.lock);
    return n;
}

OFFLOAD_API int64_t offload_pool_registrations(void) {
    pthread_mutex_lock(&REG.lock);
    long n = REG.made;
    pthread_mutex_unlock(&REG.lock);
    return n;
}

OFFLOAD_API int64_t offload_pool_linger_ns(void) {
    pthread_once(&OMP.once, find_openmp);
    return LINGER_NS;
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
    /* no host exists in the child (the runtime's count inherited from the parent stays) */
    pthread_mutex_init(&REG.lock, NULL);
    pthread_cond_init(&REG.cond, NULL);
    pthread_cond_init(&REG.release, NULL);
    REG.current = NULL;
    REG.alive = 0;
    REG.busy = 0;
    OMP.team_off = 1; /* the runtime's team threads of the parent do not exist in the child */
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

/* ---- a kernel on the main thread: its chunks on the main thread's own OpenMP team ------
 * The main thread is the master of torch's intra-op team. Right after its torch work that
 * team's workers are in their long idle spin, docked for the master's next region; any
 * other thread's work (the pool's workers) would share the cores with them. A region of the
 * master's own ends that spin at once: the spinning workers join it and claim the kernel's
 * chunks, as they would run torch's next op. After it they dock and spin as after any torch
 * op (no registration is made), so torch's next op finds them as usual. Used when the
 * calling thread is the process's main thread, outside any parallel region, with torch's
 * team size (omp_get_max_threads) equal to the pool's thread count (then the team is the
 * one torch runs: no thread is created that torch would not create, and none of torch's
 * workers is left spinning beside the kernel), in the process that loaded the runtime's
 * threads (not a forked child). Elsewhere: the pthread pool below. */
struct team_call {
    pool_chunk_fn fn;
    void *ctx;
    long nchunks;
    long next;      /* atomic: the next unclaimed chunk */
    unsigned mxcsr; /* the caller's FP control word: team threads round and flush like it */
};

static long TEAM_RUNS; /* atomic: kernels run on the caller's OpenMP team */

static void team_body(void *arg) {
    struct team_call *t = arg;
#ifdef HAVE_MXCSR
    const unsigned own = _mm_getcsr(); /* torch's worker keeps its own mode after the region */
    if (own != t->mxcsr) _mm_setcsr(t->mxcsr);
#endif
    for (long c; (c = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED)) < t->nchunks;) t->fn(t->ctx, c);
#ifdef HAVE_MXCSR
    if (own != t->mxcsr) _mm_setcsr(own);
#endif
}

static int on_main_team(int threads) {
    pthread_once(&OMP.once, find_openmp);
    return on_main_thread_outside_regions() && OMP.max_threads() == threads;
}

static void team_run(pool_chunk_fn fn, void *ctx, long nchunks, int threads) {
    struct team_call t = {fn, ctx, nchunks, 0, 0};
#ifdef HAVE_MXCSR
    t.mxcsr = _mm_getcsr();
#endif
    __atomic_add_fetch(&TEAM_RUNS, 1, __ATOMIC_RELAXED);
    /* the region's end is a barrier: every chunk has returned (and its stores are visible) */
    OMP.parallel(team_body, &t, (unsigned)(threads < nchunks ? threads : nchunks), 0);
}

OFFLOAD_API int64_t offload_pool_team_runs(void) { return __atomic_load_n(&TEAM_RUNS, __ATOMIC_RELAXED); }

int pool_run_on_team(pool_chunk_fn fn, void *ctx, long nchunks) {
    int threads = pool_get_threads();
    if (threads <= 1 || nchunks <= 1 || !on_main_team(threads)) return 1;
    pthread_once(&atfork_once, register_atfork);
    team_run(fn, ctx, nchunks, threads);
    return 0;
}

int pool_run(pool_chunk_fn fn, void *ctx, long nchunks) {
    int threads = pool_get_threads();
    if (nchunks <= 1 || threads <= 1) {
        for (long c = 0; c < nchunks; c++) fn(ctx, c);
        return 0;
    }
    if (pool_run_on_team(fn, ctx, nchunks) == 0) return 0; /* torch's team: no registration */
    pthread_once(&atfork_once, register_atfork);
    reg_enter();
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
    if (helpers > 0) { /* wake the workers that may join */
        __atomic_store_n(&P.generation, P.generation + 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&P.wake);
    }
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
    reg_exit();
    return 0;
}
