/* lion.c: Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), per element.
 *
 * The order of the plain-torch reference in offload/optim/lion.py (add with alpha is fused
 * on torch's CPU kernels):
 *   g = float(grad) * grad_scale
 *   p = p * decay                            param.mul_(1 - lr * weight_decay)
 *   c = fma(1 - beta1, g, m * beta1)         exp_avg.mul(beta1).add(g, alpha=1 - beta1)
 *   p = fma(-lr, sign(c), p)                 param.add_(c.sign_(), alpha=-lr)
 *   m = fma(1 - beta2, g, m * beta2)         exp_avg.mul_(beta2).add_(g, alpha=1 - beta2)
 * Rows: s0 = exp_avg.
 */
#include "kernel.h"

/* Per-call scalars (offload/optim/lion.py): decay = 1 - lr * weight_decay, neg_lr = -lr. */
typedef struct offload_lion_hparams {
    float grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr;
} offload_lion_hparams;

KINLINE void lion_ref(const offload_lion_hparams *h, float *param, float grad, float *exp_avg, float *unused) {
    (void)unused;
    const float g = grad * h->grad_scale, m = *exp_avg;
    const float p = *param * h->decay;
    const float c = fmaf(h->one_minus_beta1, g, m * h->beta1);
    const float sign = c > 0.0f ? 1.0f : c < 0.0f ? -1.0f : c; /* torch.sign: +-0 stays */
    *param = fmaf(h->neg_lr, sign, p);
    *exp_avg = fmaf(h->one_minus_beta2, g, m * h->beta2);
}

#define lion_MATH(T)                                                                              \
    KINLINE TARGET_##T void lion_vec_##T(const offload_lion_hparams *h, T *param, T grad, T *m, T *unused) { \
        (void)unused;                                                                             \
        const T g = grad * h->grad_scale, p = *param * h->decay;                                  \
        const T c = vfma(vset1(T, h->one_minus_beta1), g, *m * h->beta1);                        \
        *param = vfma(vset1(T, h->neg_lr), vsign(c), p);                                         \
        *m = vfma(vset1(T, h->one_minus_beta2), g, *m * h->beta2);                               \
    }

KERNEL_ELEMENTWISE_RULE(lion, offload_lion_hparams)
KERNEL_ENTRY_POINT(lion, offload_lion_hparams, 1, 1)
