"""Tier planner: measure this machine, predict the step time of each placement, rank them.

Profile. ``measure_profile()`` measures (or ``Profile.load`` reads back) the rates the step
depends on: the CPU Adam rate (``offload.optim.adam_step``, the engine's kernel; torch's fused
AdamW when that is missing), the device's Adam rate (torch AdamW on the device, for placements
that keep the optimizer there), host<->device copy bandwidth (pinned ``torch`` copies; on a
CPU-only machine the "link" is a host memcpy), NVMe write and read bandwidth and per-request
latency (through ``offload.storage.NvmeStore``, O_DIRECT, one block-sized request at a time as
the engine's optimizer pipeline issues them; else plain file I/O with fsync and
``posix_fadvise(DONTNEED)`` so the page cache does not flatter the numbers) and the device's
matmul rate, in fp32 and relative to it per dtype (``offload.planner.precision``).

Prediction (one optimizer step = ``gradient_accumulation_steps`` micro-steps). Terms, seconds:

    compute   F + Bw: forward and backward, measured for the model on the device with no
              offload (``measure_compute``); for a model known only by its size,
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
      (its out-of-place pass streams twice the state memory: 1.5x the in-place time on
      this project's machine, not modelled; the profile's Adam rate is the in-place one);
    serial (overlap_step false): every term adds up.

The ``(sum - max) / n`` is the exposed part: the first block's fetch and the last block's
update cannot hide behind anything. Activation memory is not modelled (see estimate.py for the
memory side). When the model fits on the device without offload, that placement has no
transfers at all and wins: offloading a model that fits only slows it down, and the planner
says so.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from offload import budgets, dtypes
from offload.dtypes import BYTES_PER_PARAM
from offload.planner.estimate import TIERS, Machine, ModelSpec, Placement, check_fit, placement_bytes


@dataclass
class Profile:
    """Measured rates of one machine (JSON round-trips with ``save``/``load``)."""
    device: str                         # "cpu" or the CUDA device name
    cpu_threads: int
    adam_params_per_s: float            # CPU Adam
    adam_backend: str
    device_adam_params_per_s: float     # torch AdamW on the compute device
    h2d_gbps: float
    d2h_gbps: float
    host_memcpy_gbps: float
    nvme_read_gbps: float               # bandwidth of one request at a time, large requests
    nvme_write_gbps: float
    nvme_read_latency_s: float          # fixed cost per request (t = latency + bytes / bandwidth)
    nvme_write_latency_s: float
    nvme_duplex: float                  # share of the shorter direction hidden under the longer
    io_backend: str
    nvme_path: str
    matmul_tflops: float
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))
    crc32c_gbps: float = 0.0            # the NVMe tier's checksum rate on one core (0: not counted)
    # the quick per-dtype matmul probe (precision.rates: fp32, bf16, fp16); only the ratios are
    # used, on matmul_tflops ({}: a profile saved before, every dtype at the fp32 rate)
    matmul_tflops_by_dtype: Dict[str, float] = field(default_factory=dict)

    def slowdown(self, precision: str) -> float:
        """How many times longer a matmul takes in ``precision`` than in fp32 here (< 1: faster)."""
        from offload.planner.precision import slowdown
        return slowdown(precision, table=self.matmul_tflops_by_dtype)

    def tflops(self, precision: str) -> float:
        """The dense matmul rate in ``precision``: the fp32 rate over its measured slowdown."""
        return self.matmul_tflops / self.slowdown(precision)

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"

    def save(self, path: str) -> str:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)
        return path

    @classmethod
    def load(cls, path: str) -> "Profile":
        from offload.config.schema import read_json
        d = read_json(path, "profile", f": measure one with --save-profile {path}", error=ValueError,
                      missing_error=FileNotFoundError)
        names = set(cls.__dataclass_fields__)
        missing = names - set(d) - {"created", "crc32c_gbps", "matmul_tflops_by_dtype"}
        if missing:
            raise ValueError(f"profile {path!r} lacks {sorted(missing)}: measure it again with --save-profile")
        return cls(**{k: v for k, v in d.items() if k in names})


# ---- measurements -------------------------------------------------------------------------------
def _best_rate(fn: Callable[[], None], work: float, repeat: int = 3) -> float:
    """work / best time of ``repeat`` runs after one warm-up (best: other load only slows runs)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return work / max(best, 1e-9)


def measure_cpu_adam(numel: int = 4 << 20) -> Tuple[float, str]:
    """(parameters per second, backend) of the CPU Adam the engine uses."""
    p = torch.randn(numel)
    g = torch.randn(numel) * 1e-3
    m, v = torch.zeros(numel), torch.zeros(numel)
    try:
        from offload.optim import adam_step
        from offload import native_info
        backend = f"offload.optim ({native_info().get('backend', '?')})"

        def run():
            adam_step(p, g, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    except ImportError:
        backend = "torch fused AdamW"
        step = torch.tensor(1.0)

        def run():
            torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                                weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    return _best_rate(run, numel), backend


def measure_device_adam(device: torch.device, numel: int = 4 << 20) -> float:
    p = torch.nn.Parameter(torch.randn(numel, device=device))
    p.grad = torch.randn(numel, device=device) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)

    def run():
        opt.step()
        _sync(device)
    return _best_rate(run, numel)


def measure_links(device: torch.device, nbytes: int = 64 << 20) -> Tuple[float, float, float]:
    """(h2d, d2h, host memcpy) in GB/s. Without CUDA, h2d = d2h = host memcpy."""
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty(nbytes, dtype=torch.uint8)
    a.fill_(1)
    memcpy = _best_rate(lambda: b.copy_(a), nbytes / 1e9)
    if device.type != "cuda":
        return memcpy, memcpy, memcpy
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)
    return _best_rate(h2d, nbytes / 1e9), _best_rate(d2h, nbytes / 1e9), memcpy


def _aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)     # O_DIRECT wants 4096-aligned buffers
    start = (-raw.data_ptr()) % 4096
    buf = raw[start:start + nbytes]
    buf.fill_(7)
    return buf


@dataclass(frozen=True)
class NvmeRates:
    read_gbps: float
    read_latency_s: float
    write_gbps: float
    write_latency_s: float
    duplex: float          # 0: a read and a write in flight take as long as both; 1: as the longer
    backend: str


def measure_nvme(path: Optional[str] = None, sizes: Tuple[int, int] = (4 << 20, 32 << 20),
                 total: int = 128 << 20, aio=None) -> NvmeRates:
    """Swap-file I/O under ``path`` the way the engine moves optimizer state and parameters:
    the engine's I/O settings (``aio``, an ``offload.config.AioConfig``; default: the config's
    defaults), one request per block, one at a time, on files written once before (the first
    write of a fresh extent costs more than the steady state). Two request sizes give
    t = latency + bytes / bandwidth; a read and a write issued together give the duplex share
    (the engine reads the next block's state while the last one's is written)."""
    path = path or tempfile.gettempdir()
    try:
        from offload.storage import NvmeStore
    except ImportError:
        (r, rl), (w, wl) = _measure_file_io(path, total, sizes)
        return NvmeRates(r, rl, w, wl, 0.0, "file I/O (fsync, fadvise DONTNEED)")
    from offload.config import AioConfig
    a = aio or AioConfig()
    per = {"read": [], "write": []}
    with NvmeStore(path, name="plan-probe", backend=a.backend, block_size=a.block_size,
                   queue_depth=a.queue_depth, threads=a.thread_count, checksum=a.checksum) as store:
        for size in sizes:
            keys = [f"s{size}-{i}" for i in range(max(4, total // size // 2))]
            store.reserve({k: size for k in keys})
            buf, other = _aligned(size), _aligned(size)
            for k in keys:
                store.write(k, buf).wait()

            def one_at_a_time(op):
                ts = []
                for k in keys:
                    t = time.perf_counter()
                    op(k, buf).wait()
                    ts.append(time.perf_counter() - t)
                return statistics.median(ts)
            per["write"].append(min(one_at_a_time(store.write) for _ in range(2)))
            per["read"].append(min(one_at_a_time(store.read) for _ in range(2)))

        def together():     # read key i while writing key i + 1 (the large size's keys)
            ts = []
            for k_read, k_write in zip(keys[0::2], keys[1::2]):
                t = time.perf_counter()
                r, w = store.read(k_read, buf), store.write(k_write, other)
                r.wait()
                w.wait()
                ts.append(time.perf_counter() - t)
            return statistics.median(ts)
        both = min(together() for _ in range(2))
        backend = f"NvmeStore ({store.backend}{', O_DIRECT' if store.direct else ', buffered'})"
    tr, tw = per["read"][-1], per["write"][-1]
    duplex = min(1.0, max(0.0, (tr + tw - both) / min(tr, tw)))
    (r, rl), (w, wl) = _fit(sizes, per["read"]), _fit(sizes, per["write"])
    return NvmeRates(r, rl, w, wl, duplex, backend)


def _fit(sizes: Tuple[int, int], times: List[float]) -> Tuple[float, float]:
    """(GB/s, latency s) of t = latency + bytes / bandwidth through two (size, time) points."""
    (s1, s2), (t1, t2) = sizes, times
    if t2 > t1:
        bw = (s2 - s1) / (t2 - t1)
        lat = t1 - s1 / bw
        if lat >= 0:
            return bw / 1e9, lat
    return s2 / t2 / 1e9, 0.0     # noise made the points inconsistent: bandwidth alone


def _measure_file_io(path: str, total: int, sizes: Tuple[int, int]):
    """Without NvmeStore: plain file writes (fsync'd) and reads (after fadvise DONTNEED, so the
    page cache does not flatter them), one request at a time, fitted like measure_nvme."""
    fd, name = tempfile.mkstemp(dir=path, prefix=".offload-plan-")
    try:
        per = {"read": [], "write": []}
        for size in sizes:
            data = memoryview(os.urandom(size))
            n = max(2, total // size // 2)

            def write():
                os.lseek(fd, 0, os.SEEK_SET)
                t = time.perf_counter()
                for _ in range(n):
                    os.write(fd, data)
                    os.fsync(fd)
                return (time.perf_counter() - t) / n

            def read():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.lseek(fd, 0, os.SEEK_SET)
                t = time.perf_counter()
                for _ in range(n):
                    os.read(fd, size)
                return (time.perf_counter() - t) / n
            write()
            per["write"].append(min(write() for _ in range(2)))
            per["read"].append(min(read() for _ in range(2)))
        return _fit(sizes, per["read"]), _fit(sizes, per["write"])
    finally:
        os.close(fd)
        os.unlink(name)


def measure_matmul(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024) -> float:
    """Dense matmul TFLOP/s on the device."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def run():
        for _ in range(4):
            a @ b
        _sync(device)
    return _best_rate(run, 4 * 2 * n ** 3 / 1e12)


def measure_profile(nvme_path: Optional[str] = None, io_bytes: int = 64 << 20,
                    device: Optional[torch.device] = None) -> Profile:
    """Measure this machine (a few seconds)."""
    from offload.planner import precision
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    adam, adam_backend = measure_cpu_adam()
    h2d, d2h, memcpy = measure_links(device)
    io = measure_nvme(nvme_path, total=io_bytes)
    return Profile(device="cpu" if device.type == "cpu" else torch.cuda.get_device_name(device),
                   cpu_threads=torch.get_num_threads(), adam_params_per_s=adam, adam_backend=adam_backend,
                   # on a CPU device the engine's "device" optimizer is the same CPU kernel
                   device_adam_params_per_s=measure_device_adam(device) if device.type == "cuda" else adam,
                   h2d_gbps=h2d, d2h_gbps=d2h,
                   host_memcpy_gbps=memcpy, nvme_read_gbps=io.read_gbps, nvme_write_gbps=io.write_gbps,
                   nvme_read_latency_s=io.read_latency_s, nvme_write_latency_s=io.write_latency_s,
                   nvme_duplex=io.duplex, io_backend=io.backend,
                   nvme_path=os.path.abspath(nvme_path or tempfile.gettempdir()),
                   matmul_tflops=measure_matmul(device), crc32c_gbps=measure_crc32c(),
                   matmul_tflops_by_dtype=precision.rates(device))


def measure_crc32c(nbytes: int = 64 << 20) -> float:
    """GB/s of the CRC32C every NVMe extent gets (the native one; 0 without the library)."""
    from offload import _native
    if _native.lib() is None:
        return 0.0
    a = torch.ones(nbytes, dtype=torch.uint8)
    return _best_rate(lambda: _native.crc32c(a.data_ptr(), nbytes), nbytes / 1e9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Compute:
    """Forward and backward seconds of one micro-step, measured or derived from FLOPs."""
    forward_s: float
    backward_s: float
    measured: bool
    shares_cpu: bool            # the compute runs on the CPU cores the CPU optimizer uses

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def measure_compute(model: torch.nn.Module, make_batch: Callable[[], tuple], device: torch.device,
                    dtype: torch.dtype = torch.float32, iters: int = 5) -> Compute:
    """Median forward and backward time of ``model(*batch)`` on ``device``, no offload, no
    optimizer (the model must return a scalar loss)."""
    model = model.to(device=device, dtype=dtype)
    fwd, bwd = [], []
    for i in range(iters + 2):
        f, b = _fwd_bwd(model, make_batch(), device)
        if i >= 2:          # two warm-up iterations
            fwd.append(f)
            bwd.append(b)
    return Compute(statistics.median(fwd), statistics.median(bwd), True, device.type == "cpu")


def flops_compute(spec: ModelSpec, tokens: int, profile: Profile, precision: str = "fp32") -> Compute:
    """6 * params * tokens at the measured matmul rate in ``precision`` (an upper bound on
    speed), split 1:2."""
    rate = profile.tflops(precision)
    total = 6.0 * spec.params * tokens / (rate * 1e12) if rate > 0 else float("inf")
    return Compute(total / 3, 2 * total / 3, False, not profile.cuda)


# ---- prediction -----------------------------------------------------------------------------------
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
    Pt = spec.trained if trainable is None else trainable
    grad_bytes = dtypes.grad_bytes(precision, gas)
    gb = 1e9
    t = {"forward": compute.forward_s * gas, "backward": compute.backward_s * gas}
    offload_opt = optimizer != "none"
    t["adam"] = Pt / (profile.adam_params_per_s if offload_opt else profile.device_adam_params_per_s)
    d2h = Pt * grad_bytes * gas if offload_opt else 0
    h2d = Pt * p if offload_opt else 0
    if param != "none" and profile.cuda:     # on a CPU device the staged host copy is used in place
        h2d += 2 * P * p * gas
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
    park = mp.grad_home(cfg, 1, 1) is mp.GradHome.SPILL
    opt_nvme, prm_nvme = optimizer == "nvme", param == "nvme"
    g_park = Pt * mp.grad_bytes_per_param(cfg) * gas if park else 0
    budget = budgets.device_budget(device_budget_bytes, spec.largest_block * p)
    fetch = P * p + max(0, P * p - budget)          # bytes read per micro-step: forward + backward
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
    device_work = t["forward"] + t["backward"] + (0.0 if adam_on_cpu else t["adam"])
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


@dataclass(frozen=True)
class RankedPlacement:
    prediction: Prediction
    memory: Placement
    fit: Dict[str, Optional[bool]]

    @property
    def fits(self) -> bool:
        return self.memory.refused is None and all(v is not False for v in self.fit.values())


def rank(spec: ModelSpec, profile: Profile, compute: Compute, machine: Machine, precision: str = "fp32",
         gradient_accumulation_steps: int = 1, clipping: bool = False, world_size: int = 1,
         buffer_count: int = 4, placements: Optional[Sequence[Tuple[str, str]]] = None, *,
         rule: str = "AdamW", state_dtype: str = "fp32", device_budget_bytes: Optional[int] = None,
         host_lookahead_bytes: Optional[int] = None, update_ahead: bool = False) -> List[RankedPlacement]:
    """All placements, fitting ones first, each group fastest first (the optimizer state's
    bytes from ``rule`` / ``state_dtype``; ``update_ahead`` for the optimizer on cpu; a
    placement the engine refuses never fits)."""
    out = []
    for o, prm in placements or [(o, prm) for o in TIERS for prm in TIERS]:
        pred = predict(spec, o, prm, profile, compute, precision, gradient_accumulation_steps, clipping,
                       rule=rule, state_dtype=state_dtype, device_budget_bytes=device_budget_bytes,
                       update_ahead=update_ahead)
        mem = placement_bytes(spec, o, prm, precision, world_size, buffer_count, 1.0 if clipping else 0.0,
                              gradient_accumulation_steps, rule=rule, state_dtype=state_dtype,
                              device_budget_bytes=device_budget_bytes, host_lookahead_bytes=host_lookahead_bytes,
                              update_ahead=update_ahead)
        out.append(RankedPlacement(pred, mem, check_fit(mem, machine)))
    out.sort(key=lambda r: (not r.fits, r.prediction.step_s))
    return out


def fits_without_offload(ranked: Sequence[RankedPlacement]) -> Optional[RankedPlacement]:
    """The no-offload placement when it fits on every known tier (device capacity known)."""
    for r in ranked:
        if r.memory.optimizer == "none" and r.memory.param == "none":
            return r if r.fit["device"] is True and r.fits else None
    return None


def error(predicted: float, measured: float) -> float:
    """Relative error of a prediction, |predicted - measured| / measured."""
    return abs(predicted - measured) / measured if measured > 0 else float("inf")


# ---- checking predictions against measured runs -------------------------------------------------
@dataclass(frozen=True)
class CheckCase:
    """A model to run through the engine: how to build it, feed it, and its compute term."""
    name: str
    build: Callable[[], torch.nn.Module]
    make_batch: Callable[[], tuple]
    spec: ModelSpec
    # Only ``shares_cpu`` is used: the compute itself is always measured (no offload). None:
    # the compute runs on the profile's device (on a CPU-only machine, the CPU's cores).
    compute: Optional[Compute] = None


@dataclass(frozen=True)
class CheckResult:
    case: str
    optimizer: str
    param: str
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        return error(self.predicted_s, self.measured_s)


def _fwd_bwd(model, batch, device) -> Tuple[float, float]:
    _sync(device)
    t0 = time.perf_counter()
    loss = model(*batch)
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


class _LiveAdam:
    """A small probe of the CPU Adam, run beside each measured engine window, so the prediction
    uses the rate the CPU has *now* (other processes share the machine). The disk is not probed
    live: short probes of a shared virtual disk swing tenfold and mislead more than they help."""

    def __init__(self, numel: int = 4 << 20):
        self.rates: List[float] = []
        self._p, self._g = torch.randn(numel), torch.randn(numel) * 1e-3
        self._m, self._v = torch.zeros(numel), torch.zeros(numel)

    def sample(self) -> None:
        from offload.optim import adam_step
        t = time.perf_counter()
        adam_step(self._p, self._g, self._m, self._v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                  weight_decay=0.0)
        self.rates.append(self._p.numel() / (time.perf_counter() - t))

    def apply(self, profile: Profile) -> Profile:
        rate = statistics.median(self.rates)
        changes = {"adam_params_per_s": rate}
        if not profile.cuda:
            changes["device_adam_params_per_s"] = rate
        return dataclasses.replace(profile, **changes)


def measure_case(case: CheckCase, config: dict, device: torch.device, rounds: int = 5, window: int = 3,
                 warmup: int = 4) -> Tuple[Compute, float, _LiveAdam]:
    """(compute, seconds per engine step, live rates) for ``case`` at ``config``, measured
    interleaved so that all see the same machine load. Each round: a forward+backward of a
    plain copy of the model (no offload, no optimizer), a probe of the CPU Adam, ``window`` engine steps from a drained pipeline to a drained
    pipeline (no queued work left uncounted), and another plain forward+backward. Medians."""
    import offload
    plain = case.build().to(device)
    torch.manual_seed(0)
    engine = offload.initialize(case.build(), config)
    live = _LiveAdam()
    fwd, bwd, steps = [], [], []
    try:
        for _ in range(warmup):          # first steps record orders, touch memory, first-write files
            loss = engine(*case.make_batch())
            engine.backward(loss)
            engine.step()
        _fwd_bwd(plain, case.make_batch(), device)
        for _ in range(rounds):
            f0, b0 = _fwd_bwd(plain, case.make_batch(), device)
            engine.synchronize()
            live.sample()
            t0 = time.perf_counter()
            for _ in range(window):
                loss = engine(*case.make_batch())
                engine.backward(loss)
                engine.step()
            engine.synchronize()
            steps.append((time.perf_counter() - t0) / window)
            f1, b1 = _fwd_bwd(plain, case.make_batch(), device)
            fwd.append((f0 + f1) / 2)
            bwd.append((b0 + b1) / 2)
    finally:
        engine.close()
    shares = device.type == "cpu" if case.compute is None else case.compute.shares_cpu
    return Compute(statistics.median(fwd), statistics.median(bwd), True, shares), statistics.median(steps), live


def check(cases: Sequence[CheckCase], profile: Profile, placements: Sequence[Tuple[str, str]],
          nvme_path: str, rounds: int = 5, log: Callable[[str], None] = lambda s: None) -> List[CheckResult]:
    """Predicted vs measured step time for each case at each placement (fp32, no clipping).

    The prediction takes the rates the machine has during the run, not those of the profile
    alone: the compute is measured interleaved with the engine's steps, the CPU Adam probed
    beside them, and the disk probed before and after each NVMe placement (other processes
    share this machine's cores and disk, and its rates drift within minutes)."""
    results = []
    device = torch.device("cuda") if profile.cuda else torch.device("cpu")
    for case in cases:
        log(case.spec.describe())
        for o, prm in placements:
            cfg = {"optimizer": {"lr": 1e-4},
                   "offload_optimizer": {"device": o, "nvme_path": nvme_path if o == "nvme" else None},
                   "offload_param": {"device": prm, "nvme_path": nvme_path if prm == "nvme" else None}}
            uses_disk = "nvme" in (o, prm)
            disk = [measure_nvme(nvme_path)] if uses_disk else []
            try:
                compute, measured, live = measure_case(case, cfg, device, rounds=rounds)
            except NotImplementedError as exc:
                log(f"  optimizer={o} param={prm}: skipped ({exc})")
                continue
            now = live.apply(profile)
            if uses_disk:
                # A shared disk's rate drifts within minutes: probe it before and after the run.
                disk.append(measure_nvme(nvme_path))
                mean = {f: sum(getattr(d, f) for d in disk) / 2 for f in
                        ("read_gbps", "read_latency_s", "write_gbps", "write_latency_s", "duplex")}
                now = dataclasses.replace(now, nvme_read_gbps=mean["read_gbps"], nvme_write_gbps=mean["write_gbps"],
                                          nvme_read_latency_s=mean["read_latency_s"],
                                          nvme_write_latency_s=mean["write_latency_s"], nvme_duplex=mean["duplex"])
            pred = predict(case.spec, o, prm, now, compute)
            results.append(CheckResult(case.name, o, prm, pred.step_s, measured))
            log(f"  optimizer={o:<5} param={prm:<5} compute {compute.total_s * 1e3:7.1f} ms, predicted "
                f"{pred.step_s * 1e3:7.1f} ms, measured {measured * 1e3:7.1f} ms, error {results[-1].error:4.0%}")
    return results
