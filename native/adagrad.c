/* adagrad.c: Adagrad, per element.
 *
 * The order of torch.optim.Adagrad(foreach=False) (addcmul and add with alpha are fused on
 * torch's CPU kernels):
 *   g = float(grad) * grad_scale
 *   g = fma(weight_decay, p, g)              grad.add(param, alpha=weight_decay)
 *   s = fma(g, g, s)                         state_sum.addcmul_(grad, grad, value=1)
 *   d = sqrt(s) + eps                        state_sum.sqrt().add_(eps)
 *   p = p + (neg_clr * g) / d                param.addcdiv_(grad, std, value=-clr)
 * Rows: s0 = sum.
 */
#include "kernel.h"

/* Per-call scalars (offload/optim/adagrad.py): neg_clr = -lr / (1 + (step - 1) * lr_decay). */
typedef struct offload_adagrad_hparams {
    float grad_scale, weight_decay, eps, neg_clr;
} offload_adagrad_hparams;

KINLINE void adagrad_ref(const offload_adagrad_hparams *h, float *param, float grad, float *sum, float *unused) {
    (void)unused;
    float g = grad * h->grad_scale;
    if (h->weight_decay != 0.0f) g = fmaf(h->weight_decay, *param, g);
    const float s = fmaf(g, g, *sum);
    const float d = sqrtf(s) + h->eps;
    *param = *param + (h->neg_clr * g) / d;
    *sum = s;
}

#define adagrad_MATH(T)                                                                           \
    KINLINE TARGET_##T void adagrad_vec_##T(const offload_adagrad_hparams *h, T *param, T grad, T *sum, T *unused) { \
        (void)unused;                                                                             \
        T g = grad * h->grad_scale;                                                               \
        if (h->weight_decay != 0.0f) g = vfma(vset1(T, h->weight_decay), *param, g);             \
        *sum = vfma(g, g, *sum);                                                                  \
        const T d = vsqrt(*sum) + h->eps;                                                         \
        *param = *param + (g * h->neg_clr) / d;                                                   \
    }

KERNEL_ELEMENTWISE_RULE(adagrad, offload_adagrad_hparams)
KERNEL_ENTRY_POINT(adagrad, offload_adagrad_hparams, 1, 1)
