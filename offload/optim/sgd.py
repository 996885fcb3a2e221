"""SGD as torch.optim.SGD: momentum, dampening, Nesterov, L2 weight decay. One row,
momentum_buffer (signed), when momentum != 0; none otherwise. The buffer starts as the first
gradient (step 1), as torch's clone does."""
from __future__ import annotations

import ctypes

import torch

from offload.optim.rule import Row, UpdateRule


class SgdHparams(ctypes.Structure):
    """Mirror of offload_sgd_hparams (native/sgd.c)."""
    _fields_ = [(name, ctypes.c_float) for name in (
        "grad_scale", "weight_decay", "momentum", "one_minus_dampening", "neg_lr")] + [
        ("nesterov", ctypes.c_int32), ("first", ctypes.c_int32)]


class SGD(UpdateRule):
    name = "SGD"
    kernel = "sgd"
    hparams_type = SgdHparams
    torch_optimizer = "SGD"
    defaults = dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)

    def rows(self, group, shape=None):
        return (Row("momentum_buffer", signed=True),) if float(group.get("momentum", 0.0)) != 0.0 else ()

    def validate(self, group):
        super().validate(group)
        for key in ("momentum", "dampening"):
            v = float(group.get(key, 0.0))
            if not (v >= 0.0 and v == v and v != float("inf")):
                raise ValueError(f"SGD: {key}={group.get(key)!r} must be a finite number >= 0")
        if group.get("nesterov") and (float(group.get("momentum", 0.0)) <= 0 or float(group.get("dampening", 0.0)) != 0):
            raise ValueError("SGD: nesterov=True requires momentum > 0 and dampening = 0 (as torch.optim.SGD)")

    def native_hparams(self, group, step, grad_scale):
        return SgdHparams(grad_scale=float(grad_scale), weight_decay=float(group["weight_decay"]),
                          momentum=float(group["momentum"]), one_minus_dampening=1 - float(group["dampening"]),
                          neg_lr=-float(group["lr"]), nesterov=int(bool(group["nesterov"])), first=int(step == 1))

    def reference(self, param, grad, state, group, step, grad_scale=1.0):
        wd, momentum = float(group["weight_decay"]), float(group["momentum"])
        g = grad.mul(grad_scale) if grad_scale != 1.0 else grad
        if wd != 0:
            g = g.add(param, alpha=wd)
        if momentum != 0:
            buf = state["momentum_buffer"].view(param.shape)
            if step == 1:
                buf.copy_(g)
            else:
                buf.mul_(momentum).add_(g, alpha=1 - float(group["dampening"]))
            g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
        param.add_(g, alpha=-float(group["lr"]))

    def device_step(self, params, grads, states, group, steps):
        bufs = [s["momentum_buffer"].view(p.shape) if "momentum_buffer" in s else None for p, s in zip(params, states)]
        rows = list(bufs)
        bufs = [None if (b is None or step == 1) else b for b, step in zip(bufs, steps)]
        torch.optim.sgd.sgd(params, grads, bufs, weight_decay=float(group["weight_decay"]),
                            momentum=float(group["momentum"]), lr=float(group["lr"]),
                            dampening=float(group["dampening"]), nesterov=bool(group["nesterov"]),
                            maximize=False, foreach=True)
        for row, b in zip(rows, bufs):  # torch created the buffers of a first step in the list
            if row is not None and b is not None and b.data_ptr() != row.data_ptr():
                row.copy_(b)
