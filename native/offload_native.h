/* offload_native.h: the whole C ABI of the offload native library.
 *
 * A handful of functions on raw pointers and sizes, loaded by offload/_native.py with
 * ctypes (which releases the GIL for every call). No Python or torch headers. Every
 * function returns 0 on success or a negative errno-style code; nothing here allocates
 * memory that the caller must free except through the matching *_destroy function.
 */
#ifndef OFFLOAD_NATIVE_H
#define OFFLOAD_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#define OFFLOAD_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

/* ---- common ------------------------------------------------------------------------ */
OFFLOAD_API int offload_abi_version(void);

/* ---- optimizer kernels (native/kernel.c, adam.c, lion.c, sgd.c, adagrad.c) ------------- */
/* BEGIN KERNEL SECTION */
/* Element types (codes shared with _native.py). OFFLOAD_Q8: int8 blockwise state (kernel.h). */
enum offload_dtype { OFFLOAD_DTYPE_NONE = -1, OFFLOAD_F32 = 0, OFFLOAD_BF16 = 1, OFFLOAD_F16 = 2,
                     OFFLOAD_Q8 = 3 };

/* Instruction sets the kernels dispatch to, best last. */
enum offload_isa { OFFLOAD_ISA_AUTO = -1, OFFLOAD_ISA_SCALAR = 0, OFFLOAD_ISA_AVX2 = 1,
                   OFFLOAD_ISA_AVX512 = 2, OFFLOAD_ISA_AVX512_BF16 = 3 };

/* The tensors of one elementwise step over n elements, any alignment:
 *   param       fp32 [n]                          the master copy, read + written
 *   grad        grad_dtype (f32|bf16|f16) [n]     read only, widened in registers
 *   state[r]    r < nrows: the rule's rows, state_dtype (f32|bf16|q8) [n], read + written
 *   absmax[r]   q8 only: fp32 [ceil(n / 256)], one scale per block of 256 elements
 *   qcode[r]    q8 only: fp32 [256], the row's sorted code (offload/optim/quant.py)
 *   param_copy  copy_dtype (bf16|f16|f32) [n], or NULL with OFFLOAD_DTYPE_NONE: written with the
 *               updated param rounded to nearest even (f32: the updated param itself, so that
 *               it lands where it goes next without a second pass over the master).
 *   param_src, state_src[r]   NULL: the step is in place. Otherwise the step reads the param and
 *               the rows from these (same dtype and length, not overlapping param / state) and
 *               writes param and state[r] only: an update computed into a second buffer, the
 *               first left as it was. Not with q8 state (-EINVAL).
 * Runs on the calling thread plus the pool's workers; returns when all are done. */
typedef struct offload_step_args {
    float *param;
    const void *grad;
    void *state[2];
    float *absmax[2];
    const float *qcode[2];
    void *param_copy;
    int64_t n;
    int32_t grad_dtype, state_dtype, copy_dtype, nrows;
    const float *param_src;
    const void *state_src[2];
} offload_step_args;

/* Each rule's .c file defines its hparams struct (its per-call fp32 scalars) and, through
 * KERNEL_ENTRY_POINT (kernel.h), exports
 *   int offload_<rule>_step(const offload_step_args *a, const <rule> hparams *hp);
 *   int64_t offload_<rule>_hparams_size(void);   checked by _native.py against its mirror
 * Rules: adam (rows exp_avg, exp_avg_sq), lion (exp_avg), sgd (none, or momentum_buffer),
 * adagrad (sum). */

/* sizeof(offload_step_args): checked by _native.py */
OFFLOAD_API int64_t offload_kernel_args_size(void);

OFFLOAD_API int offload_kernel_set_num_threads(int n); /* caller included, >= 1 */
OFFLOAD_API int offload_kernel_get_num_threads(void);
/* The OpenMP runtime (torch's) the pool registers with while it has work, so that runtime
 * shortens its idle spins next to the kernels: its soname, or "pthread" (never registers;
 * threadpool.c). offload_pool_registered: registrations alive now (0 once no kernel runs,
 * offload_pool_linger_ns has passed and the runtime stopped counting them). */
OFFLOAD_API const char *offload_pool_runtime(void);
/* The pool's settings as _native.py parsed them (the library reads no environment): called
 * once after loading, before any kernel; linger_ms 0..60000, else -1 and nothing changes. */
OFFLOAD_API int offload_pool_configure(int pthread_only, int64_t linger_ms);
OFFLOAD_API int offload_pool_registered(void);
OFFLOAD_API int64_t offload_pool_registrations(void); /* started since the library loaded */
OFFLOAD_API int64_t offload_pool_linger_ns(void);
/* Kernels run on the calling thread's own OpenMP team (the main thread, torch's team size
 * equal to the pool's; threadpool.c) since the library loaded. */
OFFLOAD_API int64_t offload_pool_team_runs(void);
OFFLOAD_API int offload_kernel_isa(void);             /* the ISA the kernels use now */
OFFLOAD_API int offload_kernel_best_isa(void);        /* the best this CPU supports */
OFFLOAD_API int offload_kernel_set_isa(int isa);      /* for tests: force an ISA, or AUTO */

/* Dequantization of frozen weights (native/quant.c; the formats: offload/quantize.py).
 *   codes        NF4: uint8 [ceil(n / 2)], element i in byte i / 2, the high half for even i;
 *                INT8_ROWS: int8 [n], row-major
 *   absmax       fp32 [ceil(n / blocksize)]: each block's scale (INT8_ROWS: each row's absmax);
 *                unused when absmax_q is set
 *   absmax_q     NF4 only, NULL or uint8 [ceil(n / blocksize)]: the scales double-quantized,
 *                scale[b] = absmax_code[absmax_q[b]] * absmax_scale[b / 256] + absmax_offset
 *   code         NF4: fp32 [16], the code's values
 *   out          out_dtype (f32 | bf16 | f16) [n], written rounded to nearest even
 *   blocksize    elements per scale: NF4 even (64 for QLoRA), INT8_ROWS the row length (n % it == 0)
 * Any alignment. Runs on the calling thread plus the pool's workers; returns when all are done. */
enum offload_qformat { OFFLOAD_QFMT_NF4 = 0, OFFLOAD_QFMT_INT8_ROWS = 1 };
typedef struct offload_dequant_args {
    const uint8_t *codes;
    const float *absmax;
    const uint8_t *absmax_q;
    const float *absmax_scale;
    const float *absmax_code;
    const float *code;
    void *out;
    int64_t n, blocksize;
    float absmax_offset;
    int32_t format, out_dtype;
} offload_dequant_args;
OFFLOAD_API int offload_dequantize(const offload_dequant_args *a);
OFFLOAD_API int64_t offload_dequant_args_size(void); /* checked by _native.py */
/* The other way: x (in_dtype f32 | bf16 | f16) [n] into codes (as above) and absmax [ceil(n /
 * blocksize)] (NF4 with single fp32 scales; the double quantization is offload/quantize.py's).
 * NF4 takes code fp32 [16], sorted. */
typedef struct offload_quant_args {
    const void *x;
    uint8_t *codes;
    float *absmax;
    const float *code;
    int64_t n, blocksize;
    int32_t format, in_dtype;
} offload_quant_args;
OFFLOAD_API int offload_quantize(const offload_quant_args *a);
OFFLOAD_API int64_t offload_quant_args_size(void); /* checked by _native.py */

/* Benchmark probe (native/probe.c): the in-place traffic of a rule without its arithmetic:
 * rw[k] += scale * d for k < nrw (read nrw + 1 fp32 arrays, write nrw), same pool and ISA;
 * scale 0 leaves rw's values as they were (d finite). */
OFFLOAD_API int offload_bandwidth_probe(float *const *rw, int nrw, const float *d, float scale, int64_t n);
/* END KERNEL SECTION */

/* ---- I/O engine and checksums (native/aio.c, native/crc32c.c) ---------------------------- */
/* BEGIN AIO SECTION */
/* One read or write of a key's bytes between a caller's buffer and a swap file.
 *
 * On-disk layout of a key of N bytes at file offset `offset` (4096-aligned):
 *   body  = N rounded down to 4096, stored as extents of block_size bytes (the last may be
 *           shorter); extent i covers [offset + i*block_size, ...). Moved directly between
 *           the file and `buf` (no copy).
 *   tail  = the last N % 4096 bytes, stored in one 4096-byte page right after the body, zero
 *           padded; it is the last extent. It moves through `tail_page`, a 4096-aligned
 *           bounce page owned by the caller: the bytes after the caller's tensor may belong
 *           to a neighbouring tensor, so they are never read into or written from.
 * Extents are the checksum unit: crcs[i] is the crc32c of extent i as stored on disk.
 *
 * Lifetime: the caller fills the inputs and keeps the struct, buf, tail_user, tail_page and
 * crcs alive and unmodified (buf: not written, for a write; not read, for a read) until
 * offload_aio_done() returns 1 or offload_aio_wait() returns 0. The engine never frees it. */
#define OFFLOAD_IO_READ 0
#define OFFLOAD_IO_WRITE 1
#define OFFLOAD_IO_PAGE 4096

typedef struct offload_io_req {
    /* inputs, read-only to the engine once submitted */
    void *buf;              /* body bytes; 4096-aligned when fd has O_DIRECT */
    uint64_t nbytes;        /* body bytes, a multiple of 4096 (may be 0) */
    uint64_t offset;        /* file offset of the body, 4096-aligned */
    void *tail_user;        /* tail_len bytes in the caller's buffer, right after the body */
    void *tail_page;        /* OFFLOAD_IO_PAGE-byte aligned bounce page for the tail */
    uint32_t *crcs;         /* NULL, or one crc32c per extent: filled by a write, checked by a read */
    int32_t fd;             /* long-lived descriptor owned by the caller */
    int32_t op;             /* OFFLOAD_IO_READ or OFFLOAD_IO_WRITE */
    uint32_t tail_len;      /* 0..4095 */
    /* results, valid once done */
    int32_t status;         /* 0; -errno; -ENODATA short transfer; -EBADMSG checksum mismatch */
    int64_t error_extent;   /* extent of the first error (lowest index), or -1 */
    int64_t short_got;      /* for -ENODATA: bytes moved of short_want in that extent */
    int64_t short_want;
    int64_t submit_ns, done_ns; /* CLOCK_MONOTONIC */
    /* engine-private */
    int32_t done;           /* set (release) once every extent has finished */
    uint32_t next_extent, nextents, remaining;
    struct offload_io_req *next;
} offload_io_req;

typedef struct offload_aio_config {
    uint64_t block_size;    /* extent / request size in bytes, a multiple of 4096 */
    int32_t queue_depth;    /* extents in flight across all workers (io_uring) */
    int32_t threads;        /* worker threads; without io_uring also the extents in flight */
    int32_t use_uring;      /* -1 when available, 0 never (pread/pwrite pool), 1 required */
    int32_t uring_active;   /* out: 1 when io_uring rings are in use */
    int32_t uring_error;    /* out: errno of the failed io_uring_setup, or 0 */
    int32_t ring_depth;     /* out: extents in flight per worker */
} offload_aio_config;

typedef struct offload_aio_stats {
    uint64_t bytes[2];      /* [OFFLOAD_IO_READ], [OFFLOAD_IO_WRITE]: body + tail pages moved */
    uint64_t busy_ns[2];    /* wall time with at least one request of that kind in flight */
    uint64_t requests[2];
} offload_aio_stats;

typedef struct offload_aio offload_aio;

/* sizeof the structs above (0: req, 1: config, 2: stats): checked by _native.py */
OFFLOAD_API int64_t offload_aio_sizeof(int which);
OFFLOAD_API int offload_aio_create(offload_aio_config *cfg, offload_aio **out);
/* Queue a request; returns at once. 0 or -EINVAL. */
OFFLOAD_API int offload_aio_submit(offload_aio *e, offload_io_req *req);
/* 0 once req is done, -ETIMEDOUT after timeout_ns (< 0: no limit). */
OFFLOAD_API int offload_aio_wait(offload_aio *e, offload_io_req *req, int64_t timeout_ns);
OFFLOAD_API int offload_aio_done(const offload_io_req *req);
OFFLOAD_API int offload_aio_stats_get(offload_aio *e, offload_aio_stats *out);
/* Finishes every queued request, then stops the workers and frees the engine. */
OFFLOAD_API void offload_aio_destroy(offload_aio *e);

/* crc32c (Castagnoli), standard: crc32c("123456789") == 0xE3069283; continue with crc. */
OFFLOAD_API uint32_t offload_crc32c(uint32_t crc, const void *buf, size_t n);
OFFLOAD_API uint32_t offload_crc32c_table(uint32_t crc, const void *buf, size_t n);  /* portable path */
OFFLOAD_API uint32_t offload_crc32c_sse42(uint32_t crc, const void *buf, size_t n);  /* crc32 instruction path */
/* 2 when offload_crc32c folds with AVX-512 VPCLMULQDQ, 1 when it uses the SSE4.2 instruction */
OFFLOAD_API int offload_crc32c_hw(void);
/* END AIO SECTION */

#ifdef __cplusplus
}
#endif
#endif
