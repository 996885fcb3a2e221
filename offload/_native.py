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
def _declare_adam(lib: ctypes.CDLL) -> None:
    pass


def _adam_info(lib: ctypes.CDLL) -> dict:
    return {}
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
