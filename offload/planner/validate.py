"""Checking the model against the engine: each case run through ``offload.initialize`` at each
placement, its measured step time beside the prediction made from the rates the machine has
during the run (``offload plan --check``), so a wrong term shows as an error per placement."""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from offload.planner.estimate import ModelSpec
from offload.planner.measure import Compute, Profile, _fwd_bwd, adam_probe, measure_nvme
from offload.planner.predict import error, predict


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


class _LiveAdam:
    """A small probe of the CPU Adam, run beside each measured engine window, so the prediction
    uses the rate the CPU has *now* (other processes share the machine). The disk is not probed
    live: short probes of a shared virtual disk swing widely and mislead more than they help."""

    def __init__(self, numel: int = 4 << 20):
        self.rates: List[float] = []
        self._numel = numel
        self._run, _ = adam_probe(numel)

    def sample(self) -> None:
        t = time.perf_counter()
        self._run()
        self.rates.append(self._numel / (time.perf_counter() - t))

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
