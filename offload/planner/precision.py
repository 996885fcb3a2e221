"""The compute precision that fits the machine: the matmul rate per dtype on the compute
device, and the choice of fp32, bf16 or fp16 made from it (used by ``offload finetune``,
``offload train``, ``offload plan`` and ``offload.hf.Trainer``).

    choice = decide(None)            # no precision asked for: the default, or fp32 where it is slow
    announce(choice, say=print)      # its reason, once per process

A precision is *slow* on a device when its matmul takes more than ``SLOW`` (2x) the time of
fp32's there (bf16 on a CPU without native bf16 instructions: tens of times). Why 2x: bf16
halves the bytes a step moves and stores, which buys back at most about 2x of a step bound
by memory or transfers; past that the compute loses more than the bytes gain.

- Asked for (``--precision``, ``TrainingArguments(bf16=True)``, a config's ``precision``):
  that precision runs; when it is slow here the measured factor is told once, as a warning.
- Not asked for: the caller's default (fp32 for ``finetune`` and ``Trainer``, bf16 for
  ``train`` on CUDA) unless the low precision in question (the default itself, or bf16 when
  the default is fp32) is slow here: then fp32, with the measured factor as the reason.

The rates come from a short matmul per dtype on the compute device (on a CPU on one thread,
so other processes holding the cores do not skew the ratio), measured once per process and
dtype: their ratio is what decides, the plan's absolute rate is its own fp32 measurement
(planner/measure.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Dict, Optional

import torch

from offload import dtypes

from offload import device as dev

SLOW = 2.0
_GROW_S = 0.01             # the probe's matrices double while one matmul takes less than this
_BUDGET_S = 0.05            # then timed runs until this much time is spent


def _sides(device: torch.device) -> tuple:
    """(first, largest) matrix side of the probe: a fast dtype grows to the largest (where
    threading and launch overheads stop mattering), a slow one stays small and cheap."""
    return (1024, 4096) if dev.is_cuda(device) else (256, 1024)


def _time(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    t = time.perf_counter()
    a @ b
    dev.synchronize(device)
    return time.perf_counter() - t


@functools.lru_cache(maxsize=None)
def _measured(precision: str, device: str) -> float:
    d = torch.device(device)
    n, largest = _sides(d)
    threads = torch.get_num_threads()
    if d.type == "cpu":
        torch.set_num_threads(1)    # the dtypes' ratio is the ISA's; one thread is not thrown off by
    try:                            # other processes holding the cores (a barrier waits on each one)
        while True:
            a = torch.randn(n, n, device=d).to(dtypes.compute_dtype(precision))
            b = torch.randn(n, n, device=d).to(dtypes.compute_dtype(precision))
            _time(a, b, d)                          # warm-up: kernel selection, first touch
            best = min(_time(a, b, d), _time(a, b, d))
            if best >= _GROW_S or n >= largest:
                break
            n *= 2
        spent, runs = 2 * best, 2
        while spent < _BUDGET_S and runs < 50:
            dt = _time(a, b, d)
            best, spent, runs = min(best, dt), spent + dt, runs + 1
    except RuntimeError:            # the dtype has no matmul on this device
        return 0.0
    finally:
        torch.set_num_threads(threads)
    return 2 * n ** 3 / max(best, 1e-9) / 1e12


def matmul_tflops(precision: str, device: Optional[torch.device] = None) -> float:
    """TFLOP/s of a dense matmul in ``precision`` on ``device`` (default: the compute device),
    measured once per process (0.0: that dtype does not compute there)."""
    if precision not in dtypes.PRECISIONS:
        raise ValueError(f"precision {precision!r} is not valid: use fp32, bf16 or fp16")
    return _measured(precision, str(torch.device(device or dev.compute_device())))


def rates(device: Optional[torch.device] = None) -> Dict[str, float]:
    """TFLOP/s per precision (fp32, bf16, fp16) on ``device``."""
    return {p: matmul_tflops(p, device) for p in dtypes.PRECISIONS}


def slowdown(precision: str, device: Optional[torch.device] = None,
             table: Optional[Dict[str, float]] = None) -> float:
    """How many times longer a matmul takes in ``precision`` than in fp32 (< 1: faster; inf:
    it does not compute): measured on ``device``, or from ``table`` (TFLOP/s per precision, as
    ``rates`` gives; a precision missing from it counts as fp32's equal)."""
    if precision == "fp32":
        return 1.0
    if table is not None:
        r32, r = table.get("fp32"), table.get(precision)
        if not r32 or r is None:
            return 1.0
    else:
        r32, r = matmul_tflops("fp32", device), matmul_tflops(precision, device)
    return math.inf if r <= 0 else r32 / r


@dataclasses.dataclass(frozen=True)
class PrecisionChoice:
    precision: str
    asked: bool                 # the user chose it
    message: Optional[str]      # the reason / the measured factor to tell (None: nothing to say)
    warning: bool = False       # an asked-for precision that is slow here


def _factor(f: float) -> str:
    if math.isinf(f):
        return "does not compute (its matmul fails)"
    return f"computes {f:.1f}x slower" if f < 10 else f"computes {f:.0f}x slower"


def decide(asked: Optional[str], default: str = "fp32", device: Optional[torch.device] = None,
           table: Optional[Dict[str, float]] = None, where: Optional[str] = None) -> PrecisionChoice:
    """The precision to train in (module docstring): ``asked`` when given (with a warning when
    it is slow here), else ``default``, or fp32 when the low precision in question is slow.
    The rates: measured on ``device`` (default the compute device), or ``table`` (a saved
    profile's, measured on ``where``)."""
    for name, value in (("precision", asked), ("default precision", default)):
        if value is not None and value not in dtypes.PRECISIONS:
            raise ValueError(f"{name} {value!r} is not valid: use fp32, bf16 or fp16")

    def measured(p: str) -> str:
        if table is not None:
            r32, r, name = table.get("fp32", 0.0), table.get(p, 0.0), where or "the profile's device"
        else:
            d = torch.device(device or dev.compute_device())
            r32, r, name = matmul_tflops("fp32", d), matmul_tflops(p, d), dev.device_name(d)
        return (f"on this device ({name}: matmul fp32 {r32:.3g}, {p} {r:.3g} TFLOP/s, measured; slow means "
                f"over {SLOW:g}x)")
    if asked is not None:
        f = slowdown(asked, device, table)
        if f <= SLOW:
            return PrecisionChoice(asked, True, None)
        return PrecisionChoice(asked, True, f"precision {asked} as asked, but {asked} {_factor(f)} than fp32 "
                                            f"{measured(asked)}; fp32 would train faster here", True)
    low = default if default != "fp32" else "bf16"
    f = slowdown(low, device, table)
    if f <= SLOW:
        return PrecisionChoice(default, False, None)
    return PrecisionChoice("fp32", False, f"precision fp32 (none asked for): {low} {_factor(f)} than fp32 "
                                          f"{measured(low)}; ask for {low} to use it anyway")


_told: set = set()


def announce(choice: PrecisionChoice, say: Optional[Callable[[str], None]] = None) -> None:
    """Tell ``choice``'s message, once per process and precision (a finetune run's own
    Trainer does not repeat it): through ``say``, else as a warning."""
    if choice.precision in _told:
        return
    _told.add(choice.precision)
    if choice.message is None:
        return
    if say is not None:
        say(choice.message)
    else:
        import warnings
        warnings.warn(choice.message, stacklevel=3)
