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

/* ---- CPU Adam (native/adam.c) --------------------------------------------------------- */
/* BEGIN ADAM SECTION */
/* Element types of the tensors handed to offload_adam_step (codes shared with _native.py). */
enum offload_dtype { OFFLOAD_DTYPE_NONE = -1, OFFLOAD_F32 = 0, OFFLOAD_BF16 = 1, OFFLOAD_F16 = 2 };

/* Instruction sets the kernel dispatches to, best last. */
enum offload_isa { OFFLOAD_ISA_AUTO = -1, OFFLOAD_ISA_SCALAR = 0, OFFLOAD_ISA_AVX2 = 1,
                   OFFLOAD_ISA_AVX512 = 2, OFFLOAD_ISA_AVX512_BF16 = 3 };

/* Per-call scalars, each already rounded to fp32 from the double that torch computes
 * (offload/optim/cpu_adam.py derives them; reference.py documents the order of use). */
typedef struct offload_adam_hparams {
    float grad_scale;   /* g = float(grad) * grad_scale, the first operation */
    float l2;           /* Adam (L2): g = g + l2 * p (fused); 0 for AdamW */
    float decay;        /* AdamW (decoupled): p = p * decay, decay = 1 - lr * wd; 1 for Adam */
    float lerp_weight;  /* 1 - beta1: exp_avg.lerp_(g, lerp_weight) */
    float beta2;
    float one_minus_beta2;
    float bias_correction2_sqrt; /* sqrt(1 - beta2^step) */
    float eps;
    float neg_step_size;         /* -lr / (1 - beta1^step) */
} offload_adam_hparams;

/* One fused pass over n elements, in place on param / exp_avg / exp_avg_sq:
 *   param      fp32 [n]                        read + written
 *   grad       grad_dtype (f32|bf16|f16) [n]   read only
 *   exp_avg, exp_avg_sq  state_dtype (f32|bf16) [n]  read + written
 *   param_copy copy_dtype (bf16|f16) [n] or NULL with OFFLOAD_DTYPE_NONE: written with the
 *              updated param rounded to nearest even.
 * Runs on the calling thread plus the pool's workers; returns when all are done. */
OFFLOAD_API int offload_adam_step(float *param, const void *grad, void *exp_avg, void *exp_avg_sq,
                                  void *param_copy, int64_t n, int grad_dtype, int state_dtype,
                                  int copy_dtype, const offload_adam_hparams *hp);

OFFLOAD_API int offload_adam_set_num_threads(int n); /* caller included, >= 1 */
OFFLOAD_API int offload_adam_get_num_threads(void);
OFFLOAD_API int offload_adam_isa(void);             /* the ISA offload_adam_step uses now */
OFFLOAD_API int offload_adam_best_isa(void);        /* the best this CPU supports */
OFFLOAD_API int offload_adam_set_isa(int isa);      /* for tests: force an ISA, or AUTO */

/* Benchmark probe: the same 28 bytes/element of traffic as the fp32 step, no arithmetic
 * to speak of: a += d; b += d; c += d (read a, b, c, d; write a, b, c), same pool and ISA. */
OFFLOAD_API int offload_adam_bandwidth_probe(float *a, float *b, float *c, const float *d, int64_t n);
/* END ADAM SECTION */

/* ---- I/O engine and checksums (native/aio.c, native/crc32c.c) ---------------------------- */
/* BEGIN AIO SECTION */
/* END AIO SECTION */

#ifdef __cplusplus
}
#endif
#endif
