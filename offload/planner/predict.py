"""The planner's step-time model: seconds per optimizer step for one placement, from the
measured rates (measure.py) and the bytes the engine moves (engine/memory_plan.py).

Prediction (one optimizer step = ``gradient_accumulation_steps`` micro-steps). Terms, seconds:

    compute   F + Bw: forward and backward, measured for the model on the device with no
              offload (``measure.measure_compute``); for a model known only by its size,
              6 * params * tokens / matmul rate in the run's precision, split 1:2
    adam      params / (CPU Adam rate) when the optimizer is offloaded, else
              params / (device Adam rate), run on the device (on a CPU-only machine the
              engine's device optimizer is the CPU kernel on the CPU: the CPU Adam rate)
    d2h       gradient bytes leaving the device, every micro-step (grad dtype as the engine's)
    h2d       updated parameters going back (optimizer offloaded), and offloaded parameters
              fetched for forward and backward (2 x p x params per micro-step)
    nvme      state read + write (memory_plan.state_bytes_per_param each way, once per step), parked
              gradients (clipping / fp16 / accumulation: written and read once per micro-step), parameters read
              by the forward and again by the backward, but for the device budget's worth still on
              the device at the turn, every micro-step, trainable ones written once per step
              (``trainable``: LoRA's adapters; frozen ones only fetched); one request per block:
              requests x latency + bytes / bandwidth, per direction; the directions overlap by the
              measured duplex share d: nvme = max(read, write) + (1 - d) * min(read, write)
    crc       every NVMe byte is checksummed (CRC32C) on the CPU: (read + write) / crc rate
    dequant   a frozen base stored quantized (offload_param.frozen_dtype): its elements are
              dequantized on the compute device each time their block is materialized (forward,
              and backward but for the budget's worth), at the measured rate; the links and the
              disk carry its quantized bytes instead of the compute dtype's

Terms are grouped by the resource that executes them: the device (compute, device Adam),
the CPU (CPU Adam), each link, the disk. On a CPU-only machine the device IS the CPU: compute,
both Adams and the "link" copies share one group; when the compute leaves the cores free
(bench_step's simulated layers) the gradient copies still run inline in backward (device
group) and the tier-none Adam on the engine's CPU workers (CPU group). The step is a pipeline over ``n`` blocks:

    global (overlap_step, optimizer offloaded): step() commits the update after the whole
      backward; the CPU step overlaps only the next forward, whose block k waits for block
      k's update alone:
                   step = Bw + max(F, rest) + (F + rest - max(F, rest)) / n
      where rest is the largest non-device group;
    overlapped (CPU-only compute, or no offload): everything shares one resource or runs on
      the device; the pipeline over blocks hides all but one block's share of the rest:
                   step = max(groups) + (sum(groups) - max(groups)) / n
    ahead (offload_optimizer.update_ahead, optimizer on cpu): each block's update starts as
      its gradients land, so the CPU step overlaps the backward and the next forward:
                   step = max(device, rest) + min(device, rest) / n
      (its out-of-place pass streams twice the state memory, not modelled: the profile's
      Adam rate is the in-place one);
    serial (overlap_step false): every term adds up.

The ``(sum - max) / n`` is the exposed part: the first block's fetch and the last block's
update cannot hide behind anything. Activation memory is not modelled (see estimate.py for the
memory side). When the model fits on the device without offload, that placement has no
transfers at all and wins: offloading a model that fits only slows it down, and the planner
says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from offload import budgets, dtypes
from offload.dtypes import BYTES_PER_PARAM
from offload.planner.estimate import ModelSpec
from offload.planner.measure import Compute, Profile
from offload.placement import Placement


def flops_compute(spec: ModelSpec, tokens: int, profile: Profile, precision: str = "fp32") -> Compute:
    """6 * params * tokens at the measured matmul rate in ``precision`` (an upper bound on
    speed), split 1:2; a mixture of experts counts its active parameters (``spec.computed``:
    top-k of each layer's experts), since the experts no token routes to do no matmul."""
    rate = profile.tflops(precision)
    total = 6.0 * spec.computed * tokens / (rate * 1e12) if rate > 0 else float("inf")
    return Compute(total / 3, 2 * total / 3, False, not profile.cuda)


@dataclass(frozen=True)
class Prediction:
    optimizer: str
    param: str
    step_s: float
    terms: Dict[str, float]           # seconds per term (module docstring)
    groups: Dict[str, float]          # seconds per resource
    bottleneck: str
    mode: str                         # overlapped | global | serial
    # bytes and requests per optimizer step behind the nvme term: nvme_read / nvme_write (all),
    # param_read (offloaded parameters read by forward and backward), reads / writes (requests)
    io: Dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"optimizer={self.optimizer} param={self.param}"


def predict(spec: ModelSpec, optimizer: str, param: str, profile: Profile, compute: Compute,
            precision: str = "fp32", gradient_accumulation_steps: int = 1, clipping: bool = False,
            overlap_step: bool = True, *, rule: str = "AdamW", state_dtype: str = "fp32",
            trainable: Optional[int] = None, device_budget_bytes: Optional[int] = None,
            update_ahead: bool = False) -> Prediction:
    """Predicted seconds per optimizer step for one placement (module docstring). The optimizer
    state's NVMe bytes per parameter come from the update rule (offload/optim).
    ``trainable``: parameters that train (LoRA: the adapters; default ``spec.trained``); the
    others are frozen: fetched like the rest, with no gradient, state or write-back.
    ``device_budget_bytes``: offload_param's device budget (default the engine's)."""
    p = BYTES_PER_PARAM[precision]
    P, gas, n = spec.params, gradient_accumulation_steps, max(spec.n_blocks, 1)
    qc, qh = quantized_bytes(spec, precision) if param != "none" else (0, 0)
    home = P * p - qc + qh                          # bytes of one pass over the parameters as stored
    Pt = spec.trained if trainable is None else trainable
    grad_bytes = dtypes.grad_bytes(precision, gas)
    gb = 1e9
    t = {"forward": compute.forward_s * gas, "backward": compute.backward_s * gas}
    offload_opt = optimizer != "none"
    t["adam"] = Pt / (profile.adam_params_per_s if offload_opt else profile.device_adam_params_per_s)
    d2h = Pt * grad_bytes * gas if offload_opt else 0
    h2d = Pt * p if offload_opt else 0
    if param != "none" and profile.cuda:     # on a CPU device the staged host copy is used in place
        h2d += 2 * home * gas
    t["d2h"] = d2h / (profile.d2h_gbps * gb)
    t["h2d"] = h2d / (profile.h2d_gbps * gb)
    # One request per block and direction: optimizer state read + written once per step;
    # offloaded parameters read from NVMe by the forward, and again by the backward except the
    # blocks still on the device at the turn (the device budget's worth: a released block's
    # staging buffer goes back to the pool), trainable ones written once per step.
    # Gradients that wait (clipping, fp16, accumulation) are parked on NVMe once per micro-step
    # and read back for the next one or the update (engine/memory_plan.py decides).
    from offload.engine import memory_plan as mp
    from offload.planner.estimate import plan_config
    cfg = plan_config(optimizer, param, precision, gradient_clipping=1.0 if clipping else 0.0,
                      gradient_accumulation_steps=gas, update_ahead=update_ahead)
    S = mp.state_bytes_per_param(cfg, rule, state_dtype)
    park = mp.grad_home(cfg, 1, 1) is Placement.NVME
    opt_nvme, prm_nvme = optimizer == "nvme", param == "nvme"
    g_park = Pt * mp.grad_bytes_per_param(cfg) * gas if park else 0
    budget = budgets.device_budget(device_budget_bytes, spec.largest_block * p)
    again = max(0, P * p - budget) / max(P * p, 1)  # share of the blocks the backward fetches again
    fetch = home * (1 + again)                      # bytes read per micro-step: forward + backward
    rate = profile.dequant_params_per_s.get(spec.frozen_dtype, 0.0) if qc else 0.0
    if rate > 0:
        t["dequant"] = qc / p * (1 + again) * gas / rate
    back_blocks = max(0, n - budget // max(spec.largest_block * p, 1))
    nvme_read = (S * Pt if opt_nvme else 0) + (fetch * gas if prm_nvme else 0) + g_park
    nvme_write = (S * Pt if opt_nvme else 0) + (Pt * p if prm_nvme else 0) + g_park
    reads = n * ((1 if opt_nvme else 0) + (gas if park else 0)) + ((n + back_blocks) * gas if prm_nvme else 0)
    writes = n * ((1 if opt_nvme else 0) + (1 if prm_nvme else 0) + (gas if park else 0))
    t_read = nvme_read / (profile.nvme_read_gbps * gb) + reads * profile.nvme_read_latency_s
    t_write = nvme_write / (profile.nvme_write_gbps * gb) + writes * profile.nvme_write_latency_s
    t["nvme"] = max(t_read, t_write) + (1.0 - profile.nvme_duplex) * min(t_read, t_write)
    # every byte moved to or from NVMe is checksummed (CRC32C) on the CPU by the I/O threads
    if profile.crc32c_gbps > 0:
        t["crc"] = (nvme_read + nvme_write) / (profile.crc32c_gbps * gb)

    # Where the Adam runs: the CPU when offloaded, and also with no offload on a CPU-only
    # machine (the engine's "device" optimizer is then the same CPU kernel, on its workers).
    adam_on_cpu = offload_opt or not profile.cuda
    device_work = t["forward"] + t["backward"] + t.get("dequant", 0.0) + (0.0 if adam_on_cpu else t["adam"])
    crc = t.get("crc", 0.0)
    if compute.shares_cpu:           # CPU-only: compute, Adam and copies share the cores
        groups = {"cpu": device_work + (t["adam"] if adam_on_cpu else 0.0) + t["d2h"] + t["h2d"] + crc,
                  "nvme": t["nvme"]}
        dev_key = "cpu"
    elif not profile.cuda:
        # Compute that leaves the cores free (bench_step's GIL-free waits) on a CPU device: the
        # gradient hooks still copy each gradient out inline, on the thread that runs backward.
        groups = {"device": device_work + t["d2h"], "cpu": (t["adam"] if adam_on_cpu else 0.0) + crc,
                  "h2d": t["h2d"], "nvme": t["nvme"]}
        dev_key = "device"
    else:
        groups = {"device": device_work, "cpu": (t["adam"] if adam_on_cpu else 0.0) + crc,
                  "d2h": t["d2h"], "h2d": t["h2d"], "nvme": t["nvme"]}
        dev_key = "device"
    groups = {k: v for k, v in groups.items() if v > 0}
    total = sum(groups.values())
    top = max(groups, key=groups.get)
    if not overlap_step:
        mode, step = "serial", sum(t.values())
    elif update_ahead and optimizer == "cpu" and not compute.shares_cpu:
        # the update of each block starts in backward, as the block's gradients land, and
        # the next forward of block k waits for its commit (a swap and a write-back)
        mode = "ahead"
        r = max((v for k, v in groups.items() if k != dev_key), default=0.0)
        step = max(groups[dev_key], r) + min(groups[dev_key], r) / n
    elif offload_opt and not compute.shares_cpu:
        # step() commits after backward (the update never runs inside backward); the CPU step
        # overlaps the next forward. (Clipping and fp16 cost nothing more: their norms are
        # computed during backward.)
        mode = "global"
        r = max((v for k, v in groups.items() if k != dev_key), default=0.0)
        fwd = groups[dev_key] - t["backward"]
        step = t["backward"] + max(fwd, r) + min(fwd, r) / n
    else:
        # (On a CPU-only machine a global step changes nothing: the cores do all the work anyway.)
        mode = "overlapped"
        step = groups[top] + (total - groups[top]) / n
    io = {"nvme_read": nvme_read, "nvme_write": nvme_write, "param_read": fetch * gas if prm_nvme else 0,
          "reads": reads, "writes": writes}
    return Prediction(optimizer, param, step, t, groups, top, mode, io)


def quantized_bytes(spec: ModelSpec, precision: str) -> Tuple[int, int]:
    """(bytes in the compute dtype, bytes at home) of the frozen parts stored quantized
    (``spec.frozen_dtype`` int8 / nf4; (0, 0) otherwise)."""
    if spec.frozen_dtype == "compute":
        return 0, 0
    from offload.planner.estimate import spec_blocks
    c = h = 0
    for b in spec_blocks(spec, precision):
        for f, at_home in zip(b.frozen, b.frozen_home):
            if at_home != f:
                c, h = c + f, h + at_home
    return c, h


def error(predicted: float, measured: float) -> float:
    """Relative error of a prediction, |predicted - measured| / measured."""
    return abs(predicted - measured) / measured if measured > 0 else float("inf")
