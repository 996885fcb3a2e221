"""The planner's measurements: the rates one step depends on, on this machine.

``measure_profile()`` measures (``Profile.load`` reads back) the CPU Adam rate (the engine's
own AdamW rule, ``adam_probe``), the device's Adam rate (torch AdamW on the device, for
placements that keep the optimizer there), host<->device copy bandwidth (pinned copies; on a
CPU-only machine the "link" is a host memcpy), NVMe write and read bandwidth, per-request
latency and duplex share (through ``offload.storage.NvmeStore``, one block-sized request at a
time as the optimizer pipeline issues them; else plain file I/O with fsync and
``posix_fadvise(DONTNEED)`` so the page cache does not flatter the numbers), the CRC32C rate,
and the device's matmul rate in fp32 with the ratio per dtype from ``planner/precision.py``.
``measure_compute`` times a model's forward and backward with no offload.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch


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
    # elements per second dequantized into bf16 on the compute device, per frozen_dtype
    # (offload_param.frozen_dtype: "nf4", "int8"; {}: not measured, the term is not counted)
    dequant_params_per_s: Dict[str, float] = field(default_factory=dict)

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
        missing = names - set(d) - {"created", "crc32c_gbps", "matmul_tflops_by_dtype", "dequant_params_per_s"}
        if missing:
            raise ValueError(f"profile {path!r} lacks {sorted(missing)}: measure it again with --save-profile")
        return cls(**{k: v for k, v in d.items() if k in names})



def _best_rate(fn: Callable[[], None], work: float, repeat: int = 3) -> float:
    """work / best time of ``repeat`` runs after one warm-up (best: other load only slows runs)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return work / max(best, 1e-9)


def adam_probe(numel: int = 4 << 20) -> Tuple[Callable[[], None], str]:
    """(one CPU Adam step over ``numel`` fp32 parameters, its backend's name): the engine's own
    update, the AdamW rule's ``cpu_step`` (optim/rule.py), so the plan prices the
    kernel that runs."""
    from offload import _native
    from offload.optim.rule import AdamW
    rule = AdamW()
    group = dict(rule.defaults, weight_decay=0.0)
    p = torch.randn(numel)
    g = torch.randn(numel) * 1e-3
    state = rule.init_state(p, group)
    backend = f"rule {rule.name} ({'native ' + rule.kernel if _native.lib() is not None else 'torch'})"

    def run():
        rule.cpu_step(p, g, state, group, 1)
    return run, backend


def measure_cpu_adam(numel: int = 4 << 20) -> Tuple[float, str]:
    """(parameters per second, backend) of the CPU Adam the engine runs (``adam_probe``)."""
    run, backend = adam_probe(numel)
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
    """Measure this machine: every rate of ``Profile``, each probe short and repeated (best of
    a few runs), so ``offload plan`` can rank placements before any training starts."""
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
                   matmul_tflops_by_dtype=precision.rates(device), dequant_params_per_s=measure_dequant(device))


def measure_dequant(device: torch.device, numel: int = 32 << 20) -> Dict[str, float]:
    """Elements per second a quantized frozen base is dequantized into bf16 when its block is
    materialized, per format, the way params/quantized.py does it: the native kernels into a
    flat used before on a CPU device (``DequantFlats``), ``offload.quantize``'s torch
    references into a flat from torch's caching allocator on CUDA."""
    from offload import quantize as qz
    x = torch.randn(numel // 4096, 4096)
    flat = torch.empty(x.shape, dtype=torch.bfloat16)
    rates = {}
    for fmt, quant, native, ref in (("nf4", qz.quantize_nf4, qz.dequantize_nf4, qz.dequantize_nf4_reference),
                                    ("int8", qz.quantize_int8_rows, qz.dequantize_int8_rows,
                                     qz.dequantize_int8_rows_reference)):
        t = quant(x)
        if device.type == "cuda":
            t = replace(t, **{f.name: getattr(t, f.name).to(device) for f in fields(t)
                              if isinstance(getattr(t, f.name), torch.Tensor)})

            def run(t=t, ref=ref):
                torch.empty(numel, dtype=torch.bfloat16, device=device).copy_(ref(t, torch.bfloat16).reshape(-1))
                _sync(device)
        else:
            def run(t=t, native=native):
                native(t, torch.bfloat16, out=flat)
        rates[fmt] = _best_rate(run, numel)
    return rates


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
