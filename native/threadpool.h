/* threadpool.h: the native library's persistent worker pool (internal, not part of the ABI).
 *
 * Workers are pthreads started lazily on the first parallel call and kept for the life of
 * the process (re-created lazily in a forked child). One parallel call runs at a time: a
 * second caller waits on pool_run's lock, so calls from several Python threads are safe.
 */
#ifndef OFFLOAD_THREADPOOL_H
#define OFFLOAD_THREADPOOL_H

/* fn(ctx, chunk) is called exactly once for every chunk in [0, nchunks), in no particular
 * order, by the calling thread and by the workers that wake up in time to help. */
typedef void (*pool_chunk_fn)(void *ctx, long chunk);

int pool_run(pool_chunk_fn fn, void *ctx, long nchunks);
/* The same, only where it runs on torch's own team (the main thread, outside any region, the
 * pool's thread count torch's): returns 1, having run nothing, anywhere else. For work that
 * must not start a registration or wake the pool's threads (a landing copy). */
int pool_run_on_team(pool_chunk_fn fn, void *ctx, long nchunks);
int pool_set_threads(int n); /* threads a call may use, caller included; 1..POOL_MAX_THREADS */
int pool_get_threads(void);
const char *pool_runtime(void); /* "pthread", or the soname of the OpenMP runtime the workers belong to */

#define POOL_MAX_THREADS 256

#endif
