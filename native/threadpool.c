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
 * Workers spin for a short while before sleeping, so back-to-back calls skip the wake-up;
 * while a hold is taken (below) they go on polling, yielding the CPU, up to HELD_SPIN_NS, so
 * the next kernel of a phase finds them awake (worker_wait_spin).
 *
 * One thread budget with torch (OpenMP). torch's intra-op workers are OpenMP threads. After
 * each parallel region libgomp (the runtime torch ships) spins them GOMP_SPINCOUNT = 300000
 * pauses (~2-4 ms of a core here) before they sleep, unless the process holds more OpenMP
 * threads than CPUs: then 100 pauses (~5 us), decided when each spin starts. The long spin
 * is what lets back-to-back small torch ops find their workers awake (64K-float op: ~10 us;
 * with the short spin every op wakes a sleeping worker: ~90 us). It is also what slowed a
 * kernel started right after torch work: the spinning worker takes one core for its 2-4 ms.
 * So the pool registers with the runtime only while it has work: when a kernel starts and the
 * pool is not registered, a host pthread opens an OpenMP parallel region of the runtime the
 * process already loaded (torch's; found by soname with RTLD_NOLOAD, never loaded here) with
 * one thread per CPU, all asleep on a condition variable. The runtime then counts more
 * threads than CPUs, and every idle spin that starts from then on, torch's included, is the
 * short one: torch work interleaved with the kernels (the next forward during the optimizer
 * step, torch work between two blocks' updates) leaves no spinning worker next to a kernel.
 * Once no kernel runs and no hold is taken (below), and LINGER_NS (OFFLOAD_POOL_LINGER_MS,
 * default 0) has passed, the region ends and the host exits, which is when the runtime stops
 * counting those threads (libgomp frees a master's thread pool at its exit): torch's own work
 * then spins as it did before the pool existed.
 *
 * What a registration costs, and holds. Each one creates the host and the region's threads
 * (cpu_count + 1 thread creations and exits, ~0.1-0.3 ms of CPU here) and lasts as long as it
 * is wanted. Torch work inside it pays the short spin: back-to-back small ops each wake a
 * sleeping worker, so a registration that outlives the kernels slows the torch work after
 * them (with a 20 ms linger, torch work right after a block-sized step ran up to 1.45x
 * slower). A registration that ends with each kernel instead lets every gap between two
 * kernels of one optimizer step start torch spins at the full count, which then run next to
 * the following kernel (and the step re-registers per block). So the caller that knows a
 * phase of kernels is under way says so: offload_pool_hold() / offload_pool_release() bracket
 * it (the engine's optimizer pipeline: from a block's submission to its job's end; the
 * standalone optimizers: one step() over all their parameters). A hold starts no registration
 * by itself; the first kernel under it does, and the registration then lasts until the last
 * hold is released and no kernel runs: one per phase, ended as the phase ends.
 * Two things only the main thread can do, since it is the master of torch's team (the idle
 * spin of torch's workers ends only when their master starts its next region):
 *  - A kernel called on the main thread (CPUAdam.step, a user's adam_step) runs its chunks
 *    on that team (team_run below): torch's workers, spinning after the main thread's last
 *    torch op, claim the kernel's chunks instead of competing with it, and spin after it as
 *    after any torch op. No registration is made for it.
 *  - A handoff hold (offload_pool_hold_handoff: the engine's pipeline, submitting a block's
 *    job to its worker thread) starts the registration at once and opens an empty region of
 *    the main thread's team, so torch's workers leave their long spin for the short one
 *    before the worker's kernel starts.
 * Any other thread's kernel runs on the pthread workers, beside whatever spin torch's
 * workers are in. OFFLOAD_POOL=pthread never registers and never uses torch's team.
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
#define HELD_SPIN_NS 2000000L  /* ... and, while a hold is taken, yields and polls up to this long */
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
    int64_t tag;  /* the caller's offload_pool_set_tag when it published the call */
    unsigned mxcsr; /* the caller's FP control word: workers round and flush like the caller */
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
       PTHREAD_COND_INITIALIZER, 0, NULL, NULL, 0, 0, 0, 0, 0, 0, 0, -1, 0};

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

static int pool_held_now(void);

/* Between two calls a worker first polls WORKER_SPIN_NS (back-to-back calls of one kernel).
 * While a hold is taken (a phase of kernels: the engine's pipeline between one block's job
 * and the next, 0.2-0.5 ms of Python) it then goes on polling up to HELD_SPIN_NS, yielding
 * the CPU at every poll: a sleeping worker woken by the next call starts 0.3-4 ms late here,
 * so each block's kernel ran on its caller alone for most of its time (1.33 ms per block
 * against 0.92 ms back to back, measured); a yielding poll takes no time from a thread
 * that wants the CPU (torch's compute beside the pipeline), and stops with the hold. */
static long HELD_SPIN_CALLS; /* atomic: calls a worker found during its held spin (tests) */

static void worker_wait_spin(unsigned long seen) {
    long t0 = now_ns();
    while (__atomic_load_n(&P.generation, __ATOMIC_ACQUIRE) == seen) {
        for (int i = 0; i < 64; i++) cpu_relax();
        if (now_ns() - t0 > WORKER_SPIN_NS) break;
    }
    while (__atomic_load_n(&P.generation, __ATOMIC_ACQUIRE) == seen) {
        if (!pool_held_now() || now_ns() - t0 >= HELD_SPIN_NS) return;
        sched_yield();
        if (__atomic_load_n(&P.generation, __ATOMIC_ACQUIRE) != seen)
            __atomic_add_fetch(&HELD_SPIN_CALLS, 1, __ATOMIC_RELAXED);
    }
}

OFFLOAD_API int64_t offload_pool_held_spin_calls(void) { return __atomic_load_n(&HELD_SPIN_CALLS, __ATOMIC_RELAXED); }

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
typedef int (*omp_pause_fn)(int kind);

static struct {
    pthread_once_t once;
    gomp_parallel_fn parallel;
    omp_thread_num_fn thread_num;
    omp_thread_num_fn level;       /* omp_get_level: 0 outside every parallel region */
    omp_thread_num_fn max_threads; /* omp_get_max_threads: the calling thread's team size (torch's) */
    omp_pause_fn pause;            /* omp_pause_resource_all (OpenMP 5.0), or NULL */
    const char *name; /* the runtime's soname, or NULL: never register, never run on a team */
    int team_off;     /* a forked child: the parent's team threads do not exist here */
} OMP = {PTHREAD_ONCE_INIT, NULL, NULL, NULL, NULL, NULL, NULL, 0};

#define DEFAULT_LINGER_MS 0L /* holds bridge the gaps a phase of kernels has (see the header) */
static long LINGER_NS = DEFAULT_LINGER_MS * 1000000L;

static void find_openmp(void) {
    const char *linger = getenv("OFFLOAD_POOL_LINGER_MS");
    if (linger != NULL && *linger != '\0') {
        char *end;
        long ms = strtol(linger, &end, 10);
        if (*end == '\0' && ms >= 0 && ms <= 60000) LINGER_NS = ms * 1000000L; /* _native.py checks it */
    }
    const char *want = getenv("OFFLOAD_POOL");
    if (want != NULL && strcmp(want, "pthread") == 0) return;
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
            OMP.pause = (omp_pause_fn)dlsym(h, "omp_pause_resource_all");
            OMP.name = names[i];
            return; /* the handle stays open: the runtime outlives the pool */
        }
        dlclose(h);
    }
}

/* One registration: a host pthread, master of a region of `size` threads that only sleep.
 * Lifecycle (REG.lock): JOINING (host created) -> HELD (the region runs: the runtime counts
 * its threads) -> LEAVING (released once the pool idled LINGER_NS; the host returns and
 * exits) -> freed by the host. At most one registration is current; a kernel starting while
 * the current one is LEAVING makes a new one (both exist until the old host exits). */
enum reg_state { REG_JOINING, REG_HELD, REG_LEAVING };
struct reg {
    enum reg_state state;
    unsigned size; /* threads in the region, master included */
    int quieted;   /* the main thread's team was sent to its short spin under this registration */
};

static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;   /* busy / last_end changed (the current master waits on it) */
    pthread_cond_t release; /* a registration was released (its sleeping threads wait on it) */
    struct reg *current;   /* NULL: not registered (or the last one is leaving) */
    int alive;             /* registrations whose host has not exited */
    int busy;              /* pool_run calls in progress */
    int held;              /* offload_pool_hold() calls not yet released */
    long made;             /* registrations started since the library loaded */
    long last_end;         /* now_ns() when the last pool_run ended or the last hold was released */
} REG = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0, 0, 0};

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

/* The region's body. The master waits until no kernel runs, no hold is taken and LINGER_NS
 * has passed since the last of them, then releases the team; the others sleep until
 * released. Nothing here touches the pool's work. */
static void reg_team(void *arg) {
    struct reg *r = arg;
    pthread_mutex_lock(&REG.lock);
    if (OMP.thread_num() == 0) {
        r->state = REG_HELD;
        pthread_cond_broadcast(&REG.cond); /* a handoff hold waits for this (offload_pool_hold_handoff) */
        for (;;) {
            long now = now_ns(), due = REG.last_end + LINGER_NS;
            if (REG.busy == 0 && REG.held == 0 && now >= due) break;
            /* reg_exit and offload_pool_release broadcast; the timeout only bounds a lost wake-up */
            struct timespec until = realtime_in(REG.busy > 0 || REG.held > 0 ? 100000000L : due - now);
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
    pthread_cond_broadcast(&REG.cond); /* offload_pool_release waits for this */
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
    if (r != NULL) *r = (struct reg){REG_JOINING, (unsigned)cpu_count() + 1, 0};
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

/* A heuristic read (the spin of a worker between calls): no lock. */
static int pool_held_now(void) { return __atomic_load_n(&REG.held, __ATOMIC_RELAXED) > 0; }

OFFLOAD_API void offload_pool_hold(void) {
    pthread_mutex_lock(&REG.lock);
    __atomic_add_fetch(&REG.held, 1, __ATOMIC_RELAXED); /* also read without the lock (pool_held_now) */
    pthread_mutex_unlock(&REG.lock);
}

/* The main thread hands kernels to another thread (the engine's optimizer pipeline): a hold,
 * plus what only the main thread can do about torch's workers. Right after its torch work
 * they are in their long idle spin, which the runtime decided when the spin started and
 * which nothing but a new region of their master ends; the kernels would run beside it.
 * So the registration starts now (waited for, at most HANDOFF_WAIT_NS: the host's thread
 * and its region's threads being created and scheduled; the whole handoff measured 0.45 ms
 * median on the 2-CPU VM at load 2.4, 1.5-2.2 ms at load 3-6), and an empty region
 * of the main thread's team follows: the spinning workers join it and leave, and their next
 * spin starts registered, so it is the short one (~5 us) and they sleep. Once per
 * registration (later handoffs of the same phase find torch's spins short already). On
 * other threads, or without the runtime: a plain hold.
 * In two halves, so the main thread can work while the registration starts:
 * offload_pool_hold_begin_handoff takes the hold and starts the registration without waiting;
 * offload_pool_handoff_quiet (under that hold) waits for it, bounded, and quiets torch's team
 * once per registration; it returns whether it did. The engine's commit runs its first
 * block's update on the main thread between the two (on torch's team, see team_run). */
#define HANDOFF_WAIT_NS 2000000L /* bounded: past it the hold is a plain one */

static void quiet_body(void *arg) { (void)arg; }

static int on_main_thread_outside_regions(void) {
    if (OMP.parallel == NULL || __atomic_load_n(&OMP.team_off, __ATOMIC_RELAXED)) return 0;
    if ((pid_t)syscall(SYS_gettid) != getpid()) return 0;
    return OMP.level() == 0 && OMP.max_threads() > 1;
}

static long QUIETED; /* atomic: handoffs that sent the main thread's team to its short spin */

OFFLOAD_API void offload_pool_hold_begin_handoff(void) {
    pthread_once(&OMP.once, find_openmp);
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&REG.lock);
    __atomic_add_fetch(&REG.held, 1, __ATOMIC_RELAXED);
    if (on_main_thread_outside_regions()) reg_start_locked();
    pthread_mutex_unlock(&REG.lock);
}

OFFLOAD_API int offload_pool_handoff_quiet(void) {
    pthread_once(&OMP.once, find_openmp);
    if (!on_main_thread_outside_regions()) return 0;
    int quiet = 0;
    pthread_mutex_lock(&REG.lock);
    struct reg *r = REG.held > 0 ? REG.current : NULL; /* stays allocated: it cannot leave while held > 0 */
    if (r != NULL) {
        struct timespec until = realtime_in(HANDOFF_WAIT_NS);
        while (r->state == REG_JOINING)
            if (pthread_cond_timedwait(&REG.cond, &REG.lock, &until) != 0) break;
        quiet = r->state == REG_HELD && !r->quieted;
        if (quiet) r->quieted = 1;
    }
    pthread_mutex_unlock(&REG.lock);
    if (quiet) {
        OMP.parallel(quiet_body, NULL, 0, 0); /* 0: the team torch's next op would use */
        __atomic_add_fetch(&QUIETED, 1, __ATOMIC_RELAXED);
    }
    return quiet;
}

OFFLOAD_API void offload_pool_hold_handoff(void) {
    offload_pool_hold_begin_handoff();
    offload_pool_handoff_quiet();
}

/* The calling thread's own team (torch's intra-op workers, when it is the thread that runs
 * torch's ops) sent out of its idle spin now: omp_pause_resource_all(omp_pause_soft), where
 * the runtime has it (libgomp ends the team's threads, LLVM's puts them to sleep; the next
 * parallel region starts them again). For the engine's thread split (optim/thread_split.py):
 * once torch's team is cut to leave cores to the kernels, the workers it no longer uses
 * would spin out the long spin of the last region on exactly those cores. On the 2-CPU VM
 * the optimizer worker, woken beside that spin, started its first kernel 3-4 ms late and ran
 * it 5x slower, and the next forward waited for it in 20-30% of steps; the pause takes
 * ~0.1 ms, and the forward's first op on more than one thread ~0.1 ms more to start them.
 * Outside every parallel region only, never in a forked child (the parent's team threads do
 * not exist there). Returns 1 when it paused. */
static long PAUSED; /* atomic: teams paused */

OFFLOAD_API int offload_pool_pause_team(void) {
    pthread_once(&OMP.once, find_openmp);
    if (OMP.pause == NULL || OMP.parallel == NULL || __atomic_load_n(&OMP.team_off, __ATOMIC_RELAXED)) return 0;
    if (OMP.level() != 0) return 0;
    if (OMP.pause(1 /* omp_pause_soft */) != 0) return 0;
    __atomic_add_fetch(&PAUSED, 1, __ATOMIC_RELAXED);
    return 1;
}

OFFLOAD_API int64_t offload_pool_teams_paused(void) { return __atomic_load_n(&PAUSED, __ATOMIC_RELAXED); }

OFFLOAD_API int64_t offload_pool_handoffs_quieted(void) { return __atomic_load_n(&QUIETED, __ATOMIC_RELAXED); }

/* The last hold released with no kernel running and no linger: the phase is over and its
 * registration ends now, but asynchronously (its master wakes, releases the region's
 * threads, and its host exits). Until then the runtime still counts those threads, so torch
 * work started meanwhile spins short between its regions, and the region's threads take the
 * cores it runs on: on the 2-CPU VM, torch work started right after a block-sized step's job
 * found the registration alive in 32 of 40 rounds and ran 0.90x its isolated speed (its
 * matmuls 1.2x slower); started once the host had exited (0.2 ms median later), 1.01x. So
 * the release waits for the host, bounded (RELEASE_WAIT_NS): the engine releases on the
 * worker before the job's future is done, so the thread waiting for the job continues with
 * the registration gone. */
#define RELEASE_WAIT_NS 5000000L

OFFLOAD_API int offload_pool_release(void) {
    pthread_mutex_lock(&REG.lock);
    int ok = REG.held > 0;
    if (ok) {
        __atomic_sub_fetch(&REG.held, 1, __ATOMIC_RELAXED);
        REG.last_end = now_ns();
        pthread_cond_broadcast(&REG.cond);
        if (LINGER_NS == 0 && REG.held == 0 && REG.busy == 0 && REG.alive > 0) {
            struct timespec until = realtime_in(RELEASE_WAIT_NS);
            /* a new hold or kernel meanwhile starts the next phase: stop waiting */
            while (REG.alive > 0 && REG.held == 0 && REG.busy == 0)
                if (pthread_cond_timedwait(&REG.cond, &REG.lock, &until) != 0) break;
        }
    }
    pthread_mutex_unlock(&REG.lock);
    return ok ? 0 : -22; /* -EINVAL: no hold to release */
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
    REG.held = 0; /* the parent's holds belong to its threads, which the child lacks */
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

/* Helping (offload_pool_set_helpable / offload_pool_help). While the engine's thread split
 * leaves the kernels one thread, the thread that runs the forward waits, now and then, for
 * a block's update that one thread is still computing: its own core idles meanwhile. With
 * helping on, such single-thread calls are published like pooled ones (no worker woken,
 * no registration) so that the waiting thread can join the call in progress and claim its
 * remaining chunks, as a worker would, then go back to its wait. Each call is tagged with
 * its caller's offload_pool_set_tag (the engine: the block), and a helper joins only the
 * calls of the block it waits for, never the next block's (measured: a helper that joined
 * whatever call was open delayed the forward by 2-3 ms helping a block not yet needed).
 * Published calls run one at a time (run_lock): with several optimizer workers their
 * single-thread kernels take turns while helping is on. */
static int HELPABLE; /* atomic: single-thread calls are published for offload_pool_help */
static long HELPED;  /* atomic: calls a waiting thread joined */
static __thread int64_t CALL_TAG = -1; /* what this thread's calls are for (the engine: a block) */

OFFLOAD_API void offload_pool_set_tag(int64_t tag) { CALL_TAG = tag; }

OFFLOAD_API void offload_pool_set_helpable(int on) { __atomic_store_n(&HELPABLE, on != 0, __ATOMIC_RELAXED); }

OFFLOAD_API int offload_pool_helpable(void) { return __atomic_load_n(&HELPABLE, __ATOMIC_RELAXED); }

OFFLOAD_API int offload_pool_help(int64_t tag) {
    pthread_mutex_lock(&P.lock);
    if (!P.open || !__atomic_load_n(&HELPABLE, __ATOMIC_RELAXED) || (tag >= 0 && P.tag != tag)) {
        pthread_mutex_unlock(&P.lock);
        return 0;
    }
    __atomic_add_fetch(&P.active, 1, __ATOMIC_RELAXED);
    pool_chunk_fn fn = P.fn;
    void *ctx = P.ctx;
    long nchunks = P.nchunks;
#ifdef HAVE_MXCSR
    unsigned mxcsr = P.mxcsr, own = _mm_getcsr();
#endif
    pthread_mutex_unlock(&P.lock);
#ifdef HAVE_MXCSR
    if (own != mxcsr) _mm_setcsr(mxcsr);
#endif
    claim_chunks(fn, ctx, nchunks);
#ifdef HAVE_MXCSR
    if (own != mxcsr) _mm_setcsr(own);
#endif
    pthread_mutex_lock(&P.lock);
    if (__atomic_sub_fetch(&P.active, 1, __ATOMIC_RELEASE) == 0 && !P.open) pthread_cond_signal(&P.done);
    pthread_mutex_unlock(&P.lock);
    __atomic_add_fetch(&HELPED, 1, __ATOMIC_RELAXED);
    return 1;
}

OFFLOAD_API int64_t offload_pool_helped(void) { return __atomic_load_n(&HELPED, __ATOMIC_RELAXED); }

/* The rest of a wait for a block's update, under the split: join the block's calls as
 * offload_pool_help does, and between them spin (no sleep) until *done is set or spin_ns
 * pass with nothing to join. What follows the update's last kernel call on its worker (the
 * write-back's submit, the job's bookkeeping) takes ~0.3 ms; a waiter that slept through it
 * needed a core again to wake, and on a machine whose cores held the optimizer and an I/O
 * worker's checksum (SCHED_BATCH: a woken thread waits for the running one's slice) it woke
 * 1.5-3 ms after the update was done (measured: bench_prefetch, 2 cores). Returns 1 when
 * *done was seen set, 0 when the spin ran out (the caller then blocks). The open call is
 * read without the lock first (a hint; offload_pool_help checks it under the lock). */
OFFLOAD_API int offload_pool_help_wait(int64_t tag, const int *done, int64_t spin_ns) {
    long last = now_ns();
    for (;;) {
        if (__atomic_load_n(done, __ATOMIC_ACQUIRE)) return 1;
        if (__atomic_load_n(&P.open, __ATOMIC_RELAXED) && __atomic_load_n(&P.tag, __ATOMIC_RELAXED) == tag &&
            offload_pool_help(tag)) {
            last = now_ns();
            continue;
        }
        if (now_ns() - last > spin_ns) return __atomic_load_n(done, __ATOMIC_ACQUIRE);
        for (int i = 0; i < 64; i++) cpu_relax();
    }
}

int pool_run_on_team(pool_chunk_fn fn, void *ctx, long nchunks) {
    int threads = pool_get_threads();
    if (threads <= 1 || nchunks <= 1 || !on_main_team(threads)) return 1;
    pthread_once(&atfork_once, register_atfork);
    team_run(fn, ctx, nchunks, threads);
    return 0;
}

int pool_run(pool_chunk_fn fn, void *ctx, long nchunks) {
    int threads = pool_get_threads();
    int alone = threads <= 1; /* published only for a helper (HELPABLE): no worker, no registration */
    if (nchunks <= 1 || (alone && !__atomic_load_n(&HELPABLE, __ATOMIC_RELAXED))) {
        for (long c = 0; c < nchunks; c++) fn(ctx, c);
        return 0;
    }
    if (pool_run_on_team(fn, ctx, nchunks) == 0) return 0; /* torch's team: no registration */
    pthread_once(&atfork_once, register_atfork);
    if (!alone) reg_enter();
    pthread_mutex_lock(&P.run_lock);
    int helpers = alone ? 0 : (long)threads - 1 < nchunks - 1 ? threads - 1 : (int)(nchunks - 1);
    if (P.started < helpers) start_workers(helpers);
    if (helpers > P.started) helpers = P.started; /* thread creation failed: fewer helpers */

    pthread_mutex_lock(&P.lock);
    P.fn = fn;
    P.ctx = ctx;
    P.nchunks = nchunks;
    __atomic_store_n(&P.next, 0, __ATOMIC_RELAXED);
    P.open = 1;
    P.helpers = helpers;
    P.tag = CALL_TAG;
#ifdef HAVE_MXCSR
    P.mxcsr = _mm_getcsr();
#endif
    if (helpers > 0) { /* a call alone leaves the workers where they are */
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
    if (!alone) reg_exit();
    return 0;
}
