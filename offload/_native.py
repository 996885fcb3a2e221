"""The one file that loads the native C library and checks arguments at its boundary.

``OFFLOAD_NATIVE`` picks the backend:
  * ``auto`` (default): the native library when it loads, else the torch fallback;
  * ``on``: the native library or an ImportError that says how to build it;
  * ``off``: the torch fallback, even when the library is present.

ctypes releases the GIL for the duration of every call into the library, so native
kernels run concurrently with PyTorch work on other threads.
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading

_ABI_VERSION = 1
_HERE = os.path.dirname(os.path.abspath(__file__))
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_loaded = False

c_float_p = ctypes.POINTER(ctypes.c_float)


def mode() -> str:
    """The OFFLOAD_NATIVE setting, validated."""
    value = os.environ.get("OFFLOAD_NATIVE", "auto").strip().lower()
    if value not in ("auto", "on", "off"):
        raise ValueError(f"OFFLOAD_NATIVE={value!r} is not valid: use auto, on or off")
    return value


def _find_library() -> str | None:
    candidates = sorted(glob.glob(os.path.join(_HERE, "_offload_native*.so")))
    return candidates[0] if candidates else None


def _load() -> None:
    global _lib, _load_error, _loaded
    path = _find_library()
    if path is None:
        _load_error = ("the native library offload/_offload_native*.so is not built: "
                       "run `pip install -e .` (or `make native`)")
    else:
        try:
            lib = ctypes.CDLL(path)
            version = lib.offload_abi_version()
            if version != _ABI_VERSION:
                raise OSError(f"ABI version {version}, expected {_ABI_VERSION}: rebuild with `make native`")
            _declare_adam(lib)
            _declare_aio(lib)
            _lib = lib
        except (OSError, AttributeError) as exc:
            _load_error = f"cannot load {path}: {exc}"
    _loaded = True


def lib() -> ctypes.CDLL | None:
    """The loaded library, or None when the torch fallback is in use."""
    m = mode()
    if m == "off":
        return None
    with _lock:
        if not _loaded:
            _load()
    if _lib is None and m == "on":
        raise ImportError(f"OFFLOAD_NATIVE=on but {_load_error}")
    return _lib


def load_error() -> str | None:
    return _load_error


def ptr(t) -> int:
    """Address of a torch tensor's first element (no copy)."""
    return t.data_ptr()


# ---- CPU Adam ---------------------------------------------------------------------------
# BEGIN ADAM SECTION
# Codes of enum offload_dtype / offload_isa in native/offload_native.h.
DTYPE_NONE, DTYPE_F32, DTYPE_BF16, DTYPE_F16 = -1, 0, 1, 2
ISA_AUTO = -1
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512", 3: "avx512_bf16"}


class AdamHparams(ctypes.Structure):
    """Mirror of offload_adam_hparams: the per-call fp32 scalars (offload/optim/cpu_adam.py
    derives them in double, as torch does, and ctypes rounds each to fp32)."""
    _fields_ = [(name, ctypes.c_float) for name in (
        "grad_scale", "l2", "decay", "lerp_weight", "beta2", "one_minus_beta2",
        "bias_correction2_sqrt", "eps", "neg_step_size")]


def _declare_adam(lib: ctypes.CDLL) -> None:
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.offload_adam_step.argtypes = [vp, vp, vp, vp, vp, i64, i32, i32, i32, ctypes.POINTER(AdamHparams)]
    lib.offload_adam_step.restype = i32
    lib.offload_adam_bandwidth_probe.argtypes, lib.offload_adam_bandwidth_probe.restype = [vp, vp, vp, vp, i64], i32
    for name in ("offload_adam_set_num_threads", "offload_adam_set_isa"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [i32], i32
    for name in ("offload_adam_get_num_threads", "offload_adam_isa", "offload_adam_best_isa"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], i32


def _adam_check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")


def adam_step(L: ctypes.CDLL, param: int, grad: int, exp_avg: int, exp_avg_sq: int, param_copy: int | None,
              n: int, grad_dtype: int, state_dtype: int, copy_dtype: int, hp: AdamHparams) -> None:
    """One fused Adam pass on raw addresses. Arguments are checked by the caller
    (offload/optim/cpu_adam.py); the library re-checks only codes and null pointers."""
    rc = L.offload_adam_step(param, grad, exp_avg, exp_avg_sq, param_copy, n,
                             grad_dtype, state_dtype, copy_dtype, ctypes.byref(hp))
    _adam_check(rc, "offload_adam_step")


def adam_bandwidth_probe(L: ctypes.CDLL, a: int, b: int, c: int, d: int, n: int) -> None:
    """a += d; b += d; c += d over n fp32 elements: the fp32 step's 28 bytes/element of traffic."""
    _adam_check(L.offload_adam_bandwidth_probe(a, b, c, d, n), "offload_adam_bandwidth_probe")


def adam_set_num_threads(L: ctypes.CDLL, n: int) -> None:
    _adam_check(L.offload_adam_set_num_threads(n), f"offload_adam_set_num_threads({n})")


def adam_set_isa(L: ctypes.CDLL, isa: str | None) -> None:
    """Force the kernel's ISA by name (tests, benchmarks); None restores automatic dispatch."""
    codes = {name: code for code, name in ISA_NAMES.items()}
    if isa is not None and isa not in codes:
        raise ValueError(f"unknown ISA {isa!r}: use one of {sorted(codes)} or None")
    rc = L.offload_adam_set_isa(ISA_AUTO if isa is None else codes[isa])
    if rc < 0:
        raise ValueError(f"this CPU cannot run the {isa} kernel (best: {ISA_NAMES[L.offload_adam_best_isa()]})")


def _adam_info(lib: ctypes.CDLL) -> dict:
    return {"isa": ISA_NAMES[lib.offload_adam_isa()], "threads": lib.offload_adam_get_num_threads()}
# END ADAM SECTION


# ---- I/O engine and checksums -------------------------------------------------------------
# BEGIN AIO SECTION
def _declare_aio(lib: ctypes.CDLL) -> None:
    pass
# END AIO SECTION


def native_info() -> dict:
    """Which backend is in use, the CPU ISA the kernels dispatch to, and the thread count."""
    L = lib()
    if L is None:
        import torch
        return {"backend": "torch", "isa": "torch", "threads": torch.get_num_threads(),
                "reason": "OFFLOAD_NATIVE=off" if mode() == "off" else _load_error}
    info = {"backend": "native", "abi": _ABI_VERSION}
    info.update(_adam_info(L))
    return info
