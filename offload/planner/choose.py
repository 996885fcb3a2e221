"""The planner's choice of one placement for a model, with the reason in words (what
``offload finetune`` uses when the user gives no placement).

    choice = choose(model, tokens=8 * 256, precision="fp32")
    print(choice.optimizer, choice.param, choice.reason)
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from offload.planner import estimate as est
from offload.planner import plan
from offload.units import fmt_bytes


@dataclasses.dataclass(frozen=True)
class Choice:
    optimizer: str          # offload_optimizer.device
    param: str              # offload_param.device
    reason: str
    step_s: float           # predicted seconds per optimizer step


def choose(model, tokens: int, precision: str = "fp32", gradient_accumulation_steps: int = 1,
           clipping: bool = False, nvme_path: Optional[str] = None, device_memory: Optional[int] = None,
           profile: Optional[plan.Profile] = None, name: str = "model", rule: str = "AdamW",
           state_dtype: str = "fp32", frozen_dtype: str = "compute") -> Choice:
    """Measure this machine (a few seconds; or use ``profile``), rank every placement for
    ``model`` (a built module, the meta device is fine) at ``tokens`` per micro-step, with the
    update rule's state bytes (``rule`` / ``state_dtype``; a placement the engine refuses for
    them is never chosen), and pick:
    no offload when the model's states fit on the device, else the fastest placement that fits
    the device, host memory and disk. Every parameter is counted as trained (a LoRA model's
    frozen base is over-counted for optimizer state, so the choice errs towards offloading).
    ``frozen_dtype`` int8 / nf4 (offload_param.frozen_dtype): a frozen base is stored quantized,
    so it needs its parameters offloaded: the host tier when the quantized base fits there,
    NVMe otherwise (never ``none``, where nothing would be quantized)."""
    spec = est.spec_from_module(model, name, precision, frozen_dtype=frozen_dtype)
    profile = profile or plan.measure_profile(nvme_path)
    compute = plan.flops_compute(spec, tokens, profile, precision)
    machine = est.this_machine(nvme_path, device_memory)
    ranked = plan.rank(spec, profile, compute, machine, precision, gradient_accumulation_steps, clipping,
                       rule=rule, state_dtype=state_dtype)
    if frozen_dtype != "compute":           # quantized homes exist only with parameter offload
        ranked = [r for r in ranked if r.memory.param != "none"]
        ranked.sort(key=lambda r: (not r.fits, r.memory.param != "cpu"))   # stable: fastest first within
    base = plan.fits_without_offload(ranked) if frozen_dtype == "compute" else None
    if base is not None:
        return Choice("none", "none", f"the model's states ({fmt_bytes(base.memory.device)}) fit on the device "
                      f"({fmt_bytes(machine.device_bytes)}): offloading would only slow it down",
                      base.prediction.step_s)
    best = next((r for r in ranked if r.fits), None)
    if best is None:
        raise est.EstimateError(f"no placement fits this machine for {spec.describe()}: more host memory, "
                                "disk (--nvme-path), or a smaller model")
    p, m = best.prediction, best.memory
    device = ("device size unknown (no accelerator): assumed to have room" if machine.device_bytes is None
              else f"device {fmt_bytes(m.device)} of {fmt_bytes(machine.device_bytes)}")
    return Choice(m.optimizer, m.param, f"fastest placement that fits: predicted {p.step_s * 1e3:.0f} ms per step, "
                  f"bottleneck {p.bottleneck}; {device}, host {fmt_bytes(m.host_total)}, nvme {fmt_bytes(m.nvme)}",
                  p.step_s)


