/* aio.c: the swap-file I/O engine.
 *
 * A request (offload_io_req, see offload_native.h for its layout on disk) is cut into
 * extents of block_size bytes. Worker threads take extents from one FIFO queue and move
 * them with either
 *   - io_uring: each worker owns a ring (raw io_uring_setup / io_uring_enter + mmap, no
 *     liburing) and keeps up to ring_depth extents in flight, or
 *   - a pthread pool of pread/pwrite, one extent in flight per worker, when io_uring_setup
 *     is refused (seccomp or sysctl in containers, old kernels) or not wanted.
 * The worker that moves an extent also checksums it (crc32c): before the write is issued,
 * after the read completes. Checksums therefore run in parallel across workers and overlap
 * the other extents' I/O.
 *
 * Scheduling: workers run under SCHED_BATCH (when the process runs under the default
 * SCHED_OTHER). A submit wakes them; under SCHED_OTHER a woken worker preempts the thread
 * that submitted (an optimizer job handing over its write-back) or the one running beside it,
 * and its checksum then holds that core for the whole extent: on a small machine the update
 * chain the next forward trails stalls behind its own write-backs. SCHED_BATCH keeps the
 * workers' full share of the CPU (nice unchanged, so reads are not starved) and only drops
 * the wakeup preemption: a worker starts on an idle core, or at the running thread's next
 * scheduling point. Each worker switches first thing, and offload_aio_create returns once all
 * have (bounded wait), so no request is moved under the caller's policy. Best effort (another
 * policy is left as it is; a refusal is ignored).
 *
 * Locking: one mutex guards the queue, the per-request counters and the statistics; it is
 * never held across a system call or a checksum. Requests are owned by the caller; the
 * engine links them into its queue through req->next and never allocates per request.
 */
#define _GNU_SOURCE
#include "offload_native.h"

#include <errno.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ---- raw io_uring ----------------------------------------------------------------------- */

typedef struct ring {
    int fd;
    unsigned entries;
    /* submission queue: pointers into the mmapped SQ ring, plus the SQE array */
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    struct io_uring_sqe *sqes;
    /* completion queue */
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_map_len, cq_map_len, sqes_len;
} ring_t;

static int ring_setup(ring_t *r, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    memset(r, 0, sizeof *r);
    int fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0) return -errno;
    /* IORING_OP_READ / WRITE arrived in 5.6 together with this feature bit. */
    if (!(p.features & IORING_FEAT_RW_CUR_POS)) { close(fd); return -ENOSYS; }
    r->fd = fd;
    r->entries = p.sq_entries;
    r->sq_map_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_map_len > r->sq_map_len) r->sq_map_len = r->cq_map_len;
        r->cq_map_len = r->sq_map_len;
    }
    r->sq_map = mmap(NULL, r->sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED) goto fail;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_map = r->sq_map;
    } else {
        r->cq_map = mmap(NULL, r->cq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                         IORING_OFF_CQ_RING);
        if (r->cq_map == MAP_FAILED) goto fail;
    }
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                   IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) goto fail;
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
fail:;
    int err = -errno;
    if (r->sq_map && r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_map_len);
    if (r->cq_map && r->cq_map != MAP_FAILED && r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_len);
    close(fd);
    memset(r, 0, sizeof *r);
    return err;
}

static void ring_free(ring_t *r) {
    if (!r->sq_map) return; /* never set up */
    munmap(r->sqes, r->sqes_len);
    if (r->cq_map != r->sq_map) munmap(r->cq_map, r->cq_map_len);
    munmap(r->sq_map, r->sq_map_len);
    close(r->fd);
}

/* Queue one read or write SQE; the caller guarantees a free SQ slot. */
static void ring_push(ring_t *r, int op, int fd, void *buf, uint64_t len, uint64_t off, uint64_t tag) {
    unsigned tail = *r->sq_tail;
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = op == OFFLOAD_IO_READ ? IORING_OP_READ : IORING_OP_WRITE;
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)buf;
    sqe->len = (uint32_t)len;
    sqe->off = off;
    sqe->user_data = tag;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* ---- engine -------------------------------------------------------------------------------- */

typedef struct worker_arg {
    struct offload_aio *e;
    int id;
} worker_arg_t;

struct offload_aio {
    pthread_mutex_t mu;
    pthread_cond_t work_cv;      /* queue gained extents, or stop */
    pthread_cond_t done_cv;      /* some request finished */
    offload_io_req *head, *tail; /* requests with extents not yet taken by a worker */
    int stop;
    uint64_t block;
    int threads, depth;          /* depth: extents in flight per worker */
    ring_t *rings;               /* one per worker, or NULL for the pread/pwrite pool */
    pthread_t *tids;
    struct worker_arg *args;     /* one per worker, alive until destroy */
    int started;
    int ready;                   /* workers past their start-up (policy set), see worker_ready */
    int outstanding[2];          /* requests submitted and not done, per op */
    int64_t busy_since[2];
    offload_aio_stats st;
};

/* One extent being moved; `got` advances over partial transfers. */
typedef struct extent {
    offload_io_req *req;
    uint32_t idx;
    char *buf;
    uint64_t off, len, got;
} extent_t;


static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static uint32_t body_extents(const offload_aio *e, const offload_io_req *r) {
    return (uint32_t)((r->nbytes + e->block - 1) / e->block);
}

static void extent_geometry(const offload_aio *e, offload_io_req *r, uint32_t idx, extent_t *x) {
    x->req = r;
    x->idx = idx;
    x->got = 0;
    if (idx < body_extents(e, r)) {
        uint64_t start = (uint64_t)idx * e->block;
        x->buf = (char *)r->buf + start;
        x->off = r->offset + start;
        x->len = r->nbytes - start < e->block ? r->nbytes - start : e->block;
    } else { /* the tail page, right after the body */
        x->buf = r->tail_page;
        x->off = r->offset + r->nbytes;
        x->len = OFFLOAD_IO_PAGE;
    }
}

/* Take up to `max` extents from the queue. Lock held. */
static int take_extents(offload_aio *e, extent_t *out, int max) {
    int n = 0;
    while (n < max && e->head) {
        offload_io_req *r = e->head;
        extent_geometry(e, r, r->next_extent++, &out[n++]);
        if (r->next_extent == r->nextents) {
            e->head = r->next;
            if (!e->head) e->tail = NULL;
        }
    }
    return n;
}

static int is_tail(const extent_t *x) { return x->buf == x->req->tail_page && x->req->tail_len; }

/* Before a write is issued: fill the tail page from the caller's bytes. */
static void extent_begin(extent_t *x) {
    offload_io_req *r = x->req;
    if (r->op == OFFLOAD_IO_WRITE && is_tail(x)) {
        memcpy(r->tail_page, r->tail_user, r->tail_len);
        memset((char *)r->tail_page + r->tail_len, 0, OFFLOAD_IO_PAGE - r->tail_len);
    }
}

/* The checksum of a write, taken while the write is in flight: the caller does not modify
 * the buffer until the request is done, so the bytes hashed are the bytes stored. */
static void extent_checksum_write(extent_t *x) {
    offload_io_req *r = x->req;
    if (r->op == OFFLOAD_IO_WRITE && r->crcs) r->crcs[x->idx] = offload_crc32c(0, x->buf, x->len);
}

/* After the transfer: verify a read, deliver the tail, count the extent; the request is
 * done (and its buffers free for the caller) when its last extent gets here. */
static void extent_end(offload_aio *e, extent_t *x, int status) {
    offload_io_req *r = x->req;
    if (status == 0 && r->op == OFFLOAD_IO_READ) {
        if (r->crcs && offload_crc32c(0, x->buf, x->len) != r->crcs[x->idx]) status = -EBADMSG;
        else if (is_tail(x)) memcpy(r->tail_user, r->tail_page, r->tail_len);
    }
    pthread_mutex_lock(&e->mu);
    if (status && (r->status == 0 || (int64_t)x->idx < r->error_extent)) {
        r->status = status;
        r->error_extent = x->idx;
        r->short_got = status == -ENODATA ? (int64_t)x->got : 0;
        r->short_want = status == -ENODATA ? (int64_t)x->len : 0;
    }
    e->st.bytes[r->op] += x->got;
    if (--r->remaining == 0) {
        int64_t t = now_ns();
        r->done_ns = t;
        if (--e->outstanding[r->op] == 0) e->st.busy_ns[r->op] += (uint64_t)(t - e->busy_since[r->op]);
        __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&e->done_cv);
    }
    pthread_mutex_unlock(&e->mu);
}

/* Wait for work; returns 0 when the worker should exit. Lock held. */
static int wait_for_work(offload_aio *e, int inflight) {
    while (!e->stop && !e->head && inflight == 0) pthread_cond_wait(&e->work_cv, &e->mu);
    return !(e->stop && !e->head && inflight == 0);
}

/* pread/pwrite the whole extent; -ENODATA when the file gives no progress (EOF). */
static int move_sync(extent_t *x) {
    int fd = x->req->fd;
    while (x->got < x->len) {
        ssize_t n = x->req->op == OFFLOAD_IO_READ
                        ? pread(fd, x->buf + x->got, x->len - x->got, (off_t)(x->off + x->got))
                        : pwrite(fd, x->buf + x->got, x->len - x->got, (off_t)(x->off + x->got));
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (n == 0) return -ENODATA;
        x->got += (uint64_t)n;
    }
    return 0;
}

/* The calling worker to SCHED_BATCH when it runs under SCHED_OTHER (see the header), then
 * counted as ready: offload_aio_create returns once every worker is, so that none takes a
 * request under the caller's policy (glibc's thread attributes do not take SCHED_BATCH). */
static void worker_ready(offload_aio *e) {
#ifdef SCHED_BATCH
    int policy;
    struct sched_param sp;
    if (pthread_getschedparam(pthread_self(), &policy, &sp) == 0 && policy == SCHED_OTHER) {
        sp.sched_priority = 0;
        pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
    }
#endif
    pthread_mutex_lock(&e->mu);
    e->ready++;
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
}

static void *worker_sync(void *arg) {
    offload_aio *e = ((worker_arg_t *)arg)->e;
    extent_t x;
    worker_ready(e);
    for (;;) {
        pthread_mutex_lock(&e->mu);
        if (!wait_for_work(e, 0)) { pthread_mutex_unlock(&e->mu); break; }
        take_extents(e, &x, 1);
        pthread_mutex_unlock(&e->mu);
        extent_begin(&x);
        extent_checksum_write(&x);
        extent_end(e, &x, move_sync(&x));
    }
    return NULL;
}

/* One io_uring worker: its ring, the extents in its slots (user_data = slot index). */
typedef struct uring_worker {
    offload_aio *e;
    ring_t *r;
    extent_t *slots;
    int *free_slots, nfree;
    int inflight;   /* extents in slots */
    int pending;    /* SQEs pushed but not yet taken by the kernel */
} uring_worker_t;

/* io_uring_enter: submit the pending SQEs and optionally wait for one completion.
 * Returns 0, or the errno of a ring that failed (see uw_fail_pending). */
static int uw_enter(uring_worker_t *w, int wait) {
    for (;;) {
        int ret = (int)syscall(__NR_io_uring_enter, w->r->fd, w->pending, wait ? 1 : 0,
                               wait ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
        if (ret >= 0) {
            w->pending -= ret;
            return 0;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EBUSY) return 0; /* retried on the next call */
        return -errno;
    }
}

/* The ring refused to take SQEs: fail the extents the kernel never saw (the last
 * `pending` pushed) with its errno; what it did take still completes through the CQ. */
static void uw_fail_pending(uring_worker_t *w, int err) {
    ring_t *r = w->r;
    unsigned tail = *r->sq_tail;
    for (int k = 0; k < w->pending; k++) {
        int s = (int)r->sqes[(tail - 1 - k) & *r->sq_mask].user_data;
        extent_end(w->e, &w->slots[s], err);
        w->free_slots[w->nfree++] = s;
        w->inflight--;
    }
    __atomic_store_n(r->sq_tail, tail - w->pending, __ATOMIC_RELEASE);
    w->pending = 0;
}

static void uw_push(uring_worker_t *w, int s) {
    extent_t *x = &w->slots[s];
    ring_push(w->r, x->req->op, x->req->fd, x->buf + x->got, x->len - x->got, x->off + x->got, (uint64_t)s);
    w->pending++;
}

/* Take extents for the free slots and issue them all, then checksum the writes among them
 * while the disk works on them. */
static void uw_fill(uring_worker_t *w, extent_t *fresh) {
    offload_aio *e = w->e;
    pthread_mutex_lock(&e->mu);
    int n = take_extents(e, fresh, w->nfree);
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < n; i++) {
        int s = w->free_slots[--w->nfree];
        w->slots[s] = fresh[i];
        w->inflight++;
        extent_begin(&w->slots[s]);
        uw_push(w, s);
    }
    int err = w->pending ? uw_enter(w, 0) : 0;
    /* Checksums before any extent can be ended: ending the last one releases the request. */
    for (int i = 0; i < n; i++) extent_checksum_write(&fresh[i]);
    if (err) uw_fail_pending(w, err);
}

/* Move finished extents from the CQ to done[] (their results to status[]) and re-issue
 * partial transfers. Returns how many finished. */
static int uw_reap(uring_worker_t *w, extent_t *done, int *status) {
    ring_t *r = w->r;
    int n = 0;
    unsigned head = *r->cq_head;
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    for (; head != tail; head++) {
        struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
        int s = (int)cqe->user_data, res = cqe->res;
        extent_t *x = &w->slots[s];
        if (res == -EINTR || res == -EAGAIN || (res > 0 && x->got + (uint64_t)res < x->len)) {
            if (res > 0) x->got += (uint64_t)res; /* partial: issue the rest */
            uw_push(w, s);
            continue;
        }
        if (res > 0) x->got += (uint64_t)res;
        status[n] = res < 0 ? res : (x->got < x->len ? -ENODATA : 0);
        done[n++] = *x;
        w->free_slots[w->nfree++] = s;
        w->inflight--;
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    int err = w->pending ? uw_enter(w, 0) : 0;
    if (err) uw_fail_pending(w, err);
    return n;
}

static void *worker_uring(void *arg) {
    offload_aio *e = ((worker_arg_t *)arg)->e;
    uring_worker_t w = {.e = e, .r = &e->rings[((worker_arg_t *)arg)->id], .nfree = e->depth};
    w.slots = calloc((size_t)e->depth, sizeof *w.slots);
    w.free_slots = calloc((size_t)e->depth, sizeof *w.free_slots);
    extent_t *fresh = calloc((size_t)e->depth, sizeof *fresh);
    extent_t *done = calloc((size_t)e->depth, sizeof *done);
    int *status = calloc((size_t)e->depth, sizeof *status);
    worker_ready(e);
    for (int i = 0; i < e->depth; i++) w.free_slots[i] = e->depth - 1 - i;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        int more = wait_for_work(e, w.inflight);
        pthread_mutex_unlock(&e->mu);
        if (!more) break;
        uw_fill(&w, fresh);
        if (w.inflight == 0) continue;
        int n = uw_reap(&w, done, status);
        if (n == 0) {
            int err = uw_enter(&w, 1);
            if (err) uw_fail_pending(&w, err);
            n = uw_reap(&w, done, status);
        }
        /* Refill the ring before checksumming what finished, so the disk stays busy. */
        uw_fill(&w, fresh);
        for (int i = 0; i < n; i++) extent_end(e, &done[i], status[i]);
    }
    free(w.slots);
    free(w.free_slots);
    free(fresh);
    free(done);
    free(status);
    return NULL;
}

OFFLOAD_API int64_t offload_aio_sizeof(int which) {
    switch (which) {
    case 0: return (int64_t)sizeof(offload_io_req);
    case 1: return (int64_t)sizeof(offload_aio_config);
    case 2: return (int64_t)sizeof(offload_aio_stats);
    default: return -EINVAL;
    }
}

OFFLOAD_API void offload_aio_destroy(offload_aio *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1; /* workers drain the queue and their rings, then exit */
    pthread_cond_broadcast(&e->work_cv);
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < e->started; i++) pthread_join(e->tids[i], NULL);
    if (e->rings)
        for (int i = 0; i < e->threads; i++) ring_free(&e->rings[i]);
    free(e->rings);
    free(e->tids);
    free(e->args);
    pthread_cond_destroy(&e->work_cv);
    pthread_cond_destroy(&e->done_cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

#define AIO_START_TIMEOUT_NS (30 * (int64_t)1000000000) /* for the workers to start */

static struct timespec deadline_after(int64_t ns) {
    int64_t t = now_ns() + ns;
    struct timespec d = {.tv_sec = t / 1000000000, .tv_nsec = t % 1000000000};
    return d;
}

/* Wait (bounded) until every started worker is ready; 0 on timeout. */
static int workers_ready(offload_aio *e, int64_t timeout_ns) {
    struct timespec deadline = deadline_after(timeout_ns);
    pthread_mutex_lock(&e->mu);
    int timed_out = 0;
    while (e->ready < e->started && !timed_out)
        timed_out = pthread_cond_timedwait(&e->done_cv, &e->mu, &deadline) == ETIMEDOUT;
    int ok = e->ready >= e->started;
    pthread_mutex_unlock(&e->mu);
    return ok;
}

OFFLOAD_API int offload_aio_create(offload_aio_config *cfg, offload_aio **out) {
    if (!cfg || !out || cfg->block_size == 0 || cfg->block_size % OFFLOAD_IO_PAGE || cfg->threads < 1 ||
        cfg->queue_depth < 1)
        return -EINVAL;
    offload_aio *e = calloc(1, sizeof *e);
    if (!e) return -ENOMEM;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work_cv, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->done_cv, &ca);
    pthread_condattr_destroy(&ca);
    e->block = cfg->block_size;
    e->threads = cfg->threads;
    e->depth = 1;
    cfg->uring_active = 0;
    cfg->uring_error = 0;
    if (cfg->use_uring != 0) {
        int depth = (cfg->queue_depth + cfg->threads - 1) / cfg->threads;
        e->rings = calloc((size_t)e->threads, sizeof *e->rings);
        int err = e->rings ? 0 : -ENOMEM;
        for (int i = 0; i < e->threads && !err; i++) err = ring_setup(&e->rings[i], (unsigned)depth);
        if (err) {
            for (int i = 0; e->rings && i < e->threads; i++) ring_free(&e->rings[i]);
            free(e->rings);
            e->rings = NULL;
            cfg->uring_error = -err;
            if (cfg->use_uring == 1) { offload_aio_destroy(e); return err; }
        } else {
            e->depth = depth;
            cfg->uring_active = 1;
        }
    }
    cfg->ring_depth = e->depth;
    e->tids = calloc((size_t)e->threads, sizeof *e->tids);
    e->args = calloc((size_t)e->threads, sizeof *e->args);
    if (!e->tids || !e->args) { offload_aio_destroy(e); return -ENOMEM; }
    for (int i = 0; i < e->threads; i++) {
        e->args[i].e = e;
        e->args[i].id = i;
        int rc = pthread_create(&e->tids[i], NULL, e->rings ? worker_uring : worker_sync, &e->args[i]);
        if (rc) { offload_aio_destroy(e); return -rc; }
        e->started++;
    }
    if (!workers_ready(e, AIO_START_TIMEOUT_NS)) { offload_aio_destroy(e); return -ETIMEDOUT; }
    *out = e;
    return 0;
}

OFFLOAD_API int offload_aio_submit(offload_aio *e, offload_io_req *req) {
    if (!e || !req || (req->op != OFFLOAD_IO_READ && req->op != OFFLOAD_IO_WRITE) ||
        (req->nbytes == 0 && req->tail_len == 0) || req->tail_len >= OFFLOAD_IO_PAGE ||
        (req->tail_len && (!req->tail_page || !req->tail_user)) || (req->nbytes && !req->buf))
        return -EINVAL;
    req->status = 0;
    req->error_extent = -1;
    req->short_got = req->short_want = 0;
    req->done = 0;
    req->next = NULL;
    req->next_extent = 0;
    req->nextents = body_extents(e, req) + (req->tail_len ? 1 : 0);
    req->remaining = req->nextents;
    pthread_mutex_lock(&e->mu);
    if (e->stop) { /* destroy has begun: no worker would ever complete the request */
        pthread_mutex_unlock(&e->mu);
        return -ESHUTDOWN;
    }
    req->submit_ns = now_ns();
    req->done_ns = 0;
    if (e->outstanding[req->op]++ == 0) e->busy_since[req->op] = req->submit_ns;
    e->st.requests[req->op]++;
    if (e->tail) e->tail->next = req;
    else e->head = req;
    e->tail = req;
    pthread_cond_broadcast(&e->work_cv);
    pthread_mutex_unlock(&e->mu);
    return 0;
}

OFFLOAD_API int offload_aio_done(const offload_io_req *req) {
    return __atomic_load_n(&req->done, __ATOMIC_ACQUIRE);
}

OFFLOAD_API int offload_aio_wait(offload_aio *e, offload_io_req *req, int64_t timeout_ns) {
    if (!e || !req) return -EINVAL;
    struct timespec deadline = deadline_after(timeout_ns >= 0 ? timeout_ns : 0);
    int rc = 0;
    pthread_mutex_lock(&e->mu);
    while (!req->done && rc == 0) {
        if (timeout_ns < 0) pthread_cond_wait(&e->done_cv, &e->mu);
        else if (pthread_cond_timedwait(&e->done_cv, &e->mu, &deadline) == ETIMEDOUT && !req->done)
            rc = -ETIMEDOUT;
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

OFFLOAD_API int offload_aio_stats_get(offload_aio *e, offload_aio_stats *out) {
    if (!e || !out) return -EINVAL;
    pthread_mutex_lock(&e->mu);
    *out = e->st;
    int64_t t = now_ns();
    for (int op = 0; op < 2; op++) /* count the current busy period too */
        if (e->outstanding[op]) out->busy_ns[op] += (uint64_t)(t - e->busy_since[op]);
    pthread_mutex_unlock(&e->mu);
    return 0;
}
