/* adam.c: Adam / AdamW, per element (the plumbing is kernel.h's).
 *
 * The order of torch.optim.AdamW / Adam(foreach=False), written out in offload/optim/reference.py.
 * A multiply-add is fused only where an fma is written: where torch's CPU kernels fuse (lerp,
 * add with alpha, addcmul; measured bit for bit against torch 2.13's x86-64 build).
 *   g = float(grad) * grad_scale             grad.mul_(grad_scale): unscale / clip, fused
 *   Adam:  g = fma(l2, p, g)                 grad.add(param, alpha=weight_decay)
 *   p = p * decay                            AdamW: param.mul_(1 - lr * wd); decay = 1 is exact
 *   m = fma(w, g - m, m)      (|w| <  0.5)   exp_avg.lerp_(g, w = 1 - beta1)
 *   m = fma(w - 1, g - m, g)  (|w| >= 0.5)
 *   v = fma(omb2 * g, g, v * beta2)          exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
 *   d = sqrt(v) / bc2_sqrt + eps             (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
 *   p = p + (neg_step * m) / d               param.addcdiv_(m, d, value=-step_size)
 * sqrt is correctly rounded. torch's single-tensor path takes its sqrt from MKL's vector math
 * (builds with MKL), which on some CPUs rounds within 1 ulp instead (benchmarks/RESULTS.md):
 * there the parameters differ from that path by an ulp in some elements, and match torch's
 * fused AdamW bit for bit.
 * Rows: s0 = exp_avg, s1 = exp_avg_sq. Low-precision state is widened on load and rounded
 * once on store (kernel.h); the param update uses the unrounded fp32 m and v.
 */
#include "kernel.h"

/* Per-call scalars, each rounded to fp32 from the double that torch computes (offload/optim/rule.py). */
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

/* The scalar reference. */
KINLINE void adam_ref(const offload_adam_hparams *h, float *param, float grad, float *exp_avg, float *exp_avg_sq) {
    float g = grad * h->grad_scale, p = *param, m = *exp_avg;
    if (h->l2 != 0.0f) g = fmaf(h->l2, p, g);
    p = p * h->decay;
    const float w = h->lerp_weight;
    m = fabsf(w) < 0.5f ? fmaf(w, g - m, m) : fmaf(w - 1.0f, g - m, g);
    const float v = fmaf(h->one_minus_beta2 * g, g, *exp_avg_sq * h->beta2);
    const float d = sqrtf(v) / h->bias_correction2_sqrt + h->eps;
    *param = p + (h->neg_step_size * m) / d;
    *exp_avg = m;
    *exp_avg_sq = v;
}

/* The same operations on a vector of T. */
#define adam_MATH(T)                                                                              \
    KINLINE TARGET_##T void adam_vec_##T(const offload_adam_hparams *h, T *param, T grad, T *m, T *v) { \
        T g = grad * h->grad_scale, p = *param;                                                   \
        if (h->l2 != 0.0f) g = vfma(vset1(T, h->l2), p, g);                                      \
        p = p * h->decay;                                                                         \
        const float w = h->lerp_weight;                                                           \
        *m = fabsf(w) < 0.5f ? vfma(vset1(T, w), g - *m, *m) : vfma(vset1(T, w - 1.0f), g - *m, g); \
        *v = vfma(g * h->one_minus_beta2, g, *v * h->beta2);                                      \
        const T d = vdivc(vsqrt(*v), vdivc_recip(h->bias_correction2_sqrt)) + h->eps;            \
        *param = p + (*m * h->neg_step_size) / d;                                                 \
    }

KERNEL_ELEMENTWISE_RULE(adam, offload_adam_hparams)
KERNEL_ENTRY_POINT(adam, offload_adam_hparams, 2, 2)
