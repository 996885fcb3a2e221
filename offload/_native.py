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
    lib.offload_pool_runtime.argtypes, lib.offload_pool_runtime.restype = [], ctypes.c_char_p


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
    return {"isa": ISA_NAMES[lib.offload_adam_isa()], "threads": lib.offload_adam_get_num_threads(),
            "pool": lib.offload_pool_runtime().decode()}
# END ADAM SECTION


# ---- I/O engine and checksums -------------------------------------------------------------
# BEGIN AIO SECTION
IO_READ, IO_WRITE, IO_PAGE = 0, 1, 4096


class IoReq(ctypes.Structure):
    """Mirror of offload_io_req (native/offload_native.h). One per read or write.

    Lifetime: the struct, and the memory its pointers name, must stay alive until the
    request is done; the engine links it into its queue and writes the results into it."""
    _fields_ = [
        ("buf", ctypes.c_void_p), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_uint64),
        ("tail_user", ctypes.c_void_p), ("tail_page", ctypes.c_void_p),
        ("crcs", ctypes.c_void_p), ("fd", ctypes.c_int32), ("op", ctypes.c_int32),
        ("tail_len", ctypes.c_uint32),
        ("status", ctypes.c_int32), ("error_extent", ctypes.c_int64),
        ("short_got", ctypes.c_int64), ("short_want", ctypes.c_int64),
        ("submit_ns", ctypes.c_int64), ("done_ns", ctypes.c_int64),
        ("done", ctypes.c_int32), ("next_extent", ctypes.c_uint32), ("nextents", ctypes.c_uint32),
        ("remaining", ctypes.c_uint32), ("next", ctypes.c_void_p),
    ]


class AioConfig(ctypes.Structure):
    _fields_ = [("block_size", ctypes.c_uint64), ("queue_depth", ctypes.c_int32),
                ("threads", ctypes.c_int32), ("use_uring", ctypes.c_int32),
                ("uring_active", ctypes.c_int32), ("uring_error", ctypes.c_int32),
                ("ring_depth", ctypes.c_int32)]


class AioStats(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint64 * 2), ("busy_ns", ctypes.c_uint64 * 2),
                ("requests", ctypes.c_uint64 * 2)]


def _declare_aio(lib: ctypes.CDLL) -> None:
    vp, i32, i64, u32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_size_t
    lib.offload_aio_sizeof.argtypes, lib.offload_aio_sizeof.restype = [i32], i64
    for which, cls in enumerate((IoReq, AioConfig, AioStats)):
        if lib.offload_aio_sizeof(which) != ctypes.sizeof(cls):
            raise OSError(f"struct {cls.__name__} is {ctypes.sizeof(cls)} bytes here but "
                          f"{lib.offload_aio_sizeof(which)} in the library: rebuild with `make native`")
    lib.offload_aio_create.argtypes, lib.offload_aio_create.restype = [ctypes.POINTER(AioConfig), ctypes.POINTER(vp)], i32
    lib.offload_aio_submit.argtypes, lib.offload_aio_submit.restype = [vp, ctypes.POINTER(IoReq)], i32
    lib.offload_aio_wait.argtypes, lib.offload_aio_wait.restype = [vp, ctypes.POINTER(IoReq), i64], i32
    lib.offload_aio_done.argtypes, lib.offload_aio_done.restype = [ctypes.POINTER(IoReq)], i32
    lib.offload_aio_stats_get.argtypes, lib.offload_aio_stats_get.restype = [vp, ctypes.POINTER(AioStats)], i32
    lib.offload_aio_destroy.argtypes, lib.offload_aio_destroy.restype = [vp], None
    for name in ("offload_crc32c", "offload_crc32c_table"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [u32, vp, sz], u32
    lib.offload_crc32c_hw.argtypes, lib.offload_crc32c_hw.restype = [], i32


def _check_errno(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")


def aio_create(block_size: int, queue_depth: int, threads: int, use_uring: int) -> tuple[int, AioConfig]:
    """Start an I/O engine; returns (handle, config with the out fields filled in)."""
    if block_size <= 0 or block_size % IO_PAGE:
        raise ValueError(f"block_size={block_size} must be a positive multiple of {IO_PAGE}")
    if queue_depth < 1 or threads < 1:
        raise ValueError(f"queue_depth={queue_depth} and threads={threads} must be >= 1")
    cfg = AioConfig(block_size=block_size, queue_depth=queue_depth, threads=threads, use_uring=use_uring)
    handle = ctypes.c_void_p()
    _check_errno(lib().offload_aio_create(ctypes.byref(cfg), ctypes.byref(handle)), "offload_aio_create")
    return handle.value, cfg


def aio_submit(engine: int, req: IoReq) -> None:
    if req.op not in (IO_READ, IO_WRITE) or not 0 <= req.tail_len < IO_PAGE:
        raise ValueError("bad I/O request")
    _check_errno(lib().offload_aio_submit(engine, ctypes.byref(req)), "offload_aio_submit")


def aio_wait(engine: int, req: IoReq, timeout_ns: int) -> bool:
    """True once req is done; False on timeout. Releases the GIL while it waits."""
    return lib().offload_aio_wait(engine, ctypes.byref(req), timeout_ns) == 0


def aio_done(req: IoReq) -> bool:
    return bool(lib().offload_aio_done(ctypes.byref(req)))


def aio_stats(engine: int) -> AioStats:
    out = AioStats()
    _check_errno(lib().offload_aio_stats_get(engine, ctypes.byref(out)), "offload_aio_stats_get")
    return out


def aio_destroy(engine: int) -> None:
    """Finishes every queued request, then frees the engine."""
    lib().offload_aio_destroy(engine)


def crc32c(address: int, nbytes: int, crc: int = 0, *, table: bool = False) -> int:
    """crc32c of nbytes at address (continuing from crc). Releases the GIL."""
    if nbytes < 0 or (nbytes and not address):
        raise ValueError(f"bad buffer: address={address:#x} nbytes={nbytes}")
    f = lib().offload_crc32c_table if table else lib().offload_crc32c
    return f(crc, address, nbytes)


def _aio_info(lib: ctypes.CDLL) -> dict:
    return {"crc32c": "sse4.2" if lib.offload_crc32c_hw() else "table"}
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
    info.update(_aio_info(L))
    return info
