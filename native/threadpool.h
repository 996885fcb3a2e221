/* threadpool.h: the native library's persistent worker pool (internal, not part of the ABI).
 *
 * Workers are pthreads started lazily on the first parallel call and kept for the life of
 * the process (re-created lazily in a forked child). One parallel call runs at a time: a
 * second caller waits on pool_run's lock, so calls from several Python threads are safe.
 */
#ifndef OFFLOAD_THREADPOOL_H
#define OFFLOAD_THREADPOOL_H

/* fn(ctx, part, nparts) is called once for every part in [0, nparts); part 0 runs on the
 * calling thread, parts 1.. on workers. pool_run returns when all parts have returned. */
typedef void (*pool_task_fn)(void *ctx, int part, int nparts);

int pool_run(pool_task_fn fn, void *ctx, int nparts);
int pool_set_threads(int n); /* total threads a call may use, caller included; 1..POOL_MAX_THREADS */
int pool_get_threads(void);

#define POOL_MAX_THREADS 256

#endif
