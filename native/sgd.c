/* sgd.c: SGD with momentum, dampening, Nesterov and L2 weight decay, per element.
 *
 * The order of torch.optim.SGD(foreach=False) (add with alpha is fused on torch's CPU kernels):
 *   g = float(grad) * grad_scale
 *   g = fma(weight_decay, p, g)                  grad.add(param, alpha=weight_decay)
 *   momentum != 0 (one row, s0 = momentum_buffer):
 *     first step: b = g                          torch.clone(grad)
 *     else:       b = fma(1 - dampening, g, b * momentum)
 *                                                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
 *     g = nesterov ? fma(momentum, b, g) : b     grad.add(buf, alpha=momentum)
 *   p = fma(-lr, g, p)                           param.add_(grad, alpha=-lr)
 * With momentum 0 the kernel runs with no rows.
 */
#include "kernel.h"

/* Per-call scalars (offload/optim/sgd.py). */
typedef struct offload_sgd_hparams {
    float grad_scale, weight_decay, momentum, one_minus_dampening, neg_lr;
    int32_t nesterov;   /* 1: g = g + momentum * buf */
    int32_t first;      /* 1: the momentum buffer starts as the gradient (torch's clone) */
} offload_sgd_hparams;

KINLINE void sgd_ref(const offload_sgd_hparams *h, float *param, float grad, float *buf, float *unused) {
    (void)unused;
    float g = grad * h->grad_scale;
    if (h->weight_decay != 0.0f) g = fmaf(h->weight_decay, *param, g);
    if (h->momentum != 0.0f) {
        const float b = h->first ? g : fmaf(h->one_minus_dampening, g, *buf * h->momentum);
        g = h->nesterov ? fmaf(h->momentum, b, g) : b;
        *buf = b;
    }
    *param = fmaf(h->neg_lr, g, *param);
}

#define sgd_MATH(T)                                                                               \
    KINLINE TARGET_##T void sgd_vec_##T(const offload_sgd_hparams *h, T *param, T grad, T *buf, T *unused) { \
        (void)unused;                                                                             \
        T g = grad * h->grad_scale;                                                               \
        if (h->weight_decay != 0.0f) g = vfma(vset1(T, h->weight_decay), *param, g);             \
        if (h->momentum != 0.0f) {                                                                \
            const T b = h->first ? g : vfma(vset1(T, h->one_minus_dampening), g, *buf * h->momentum); \
            g = h->nesterov ? vfma(vset1(T, h->momentum), b, g) : b;                             \
            *buf = b;                                                                             \
        }                                                                                         \
        *param = vfma(vset1(T, h->neg_lr), g, *param);                                           \
    }

KERNEL_ELEMENTWISE_RULE(sgd, offload_sgd_hparams)
KERNEL_ENTRY_POINT(sgd, offload_sgd_hparams, 0, 1)
