"""The one file that loads the native C library and checks arguments at its boundary.

``OFFLOAD_NATIVE`` picks the backend:
  * ``auto`` (default): the native library when it loads, else the torch fallback;
  * ``on``: the native library or an ImportError that says how to build it;
  * ``off``: the torch fallback, even when the library is present.

``OFFLOAD_ISA`` picks the instruction set the native kernels dispatch to: ``auto`` (default:
the best this CPU runs) or one of ``scalar``, ``avx2``, ``avx512``, ``avx512_bf16`` at or below
it, so that a lower ISA's kernels (the scalar references included) can be run and measured on
a machine that has a higher one. Every ISA computes the same bits. ``native_info()`` reports
the ISA in use, the best one and the setting.

``OFFLOAD_NATIVE_LIB`` (a path) loads that build of the library instead of the one beside this
file: ``make sanitize`` points it at the AddressSanitizer / UndefinedBehaviorSanitizer build.

ctypes releases the GIL for the duration of every call into the library, so native
kernels run concurrently with PyTorch work on other threads.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import os
import threading

from offload.units import PAGE

_ABI_VERSION = 11
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


def isa_setting() -> str:
    """The OFFLOAD_ISA setting, validated against the ISA names (not yet against the CPU)."""
    value = os.environ.get("OFFLOAD_ISA", "auto").strip().lower() or "auto"
    if value != "auto" and value not in ISA_NAMES.values():
        raise ValueError(f"OFFLOAD_ISA={value!r} is not valid: use auto or one of "
                         f"{', '.join(ISA_NAMES.values())}")
    return value


def pool_setting() -> tuple:
    """(pthread_only, linger_ms) from OFFLOAD_POOL (``pthread``: never register the pool with
    torch's OpenMP runtime; unset or ``auto``: register while it has work; case and
    surrounding spaces ignored) and OFFLOAD_POOL_LINGER_MS (0..60000, default 0: how long the
    registration outlives the last kernel). Parsed here only: the library gets the result
    (``offload_pool_configure``) and reads no environment, so the two never disagree."""
    raw = os.environ.get("OFFLOAD_POOL", "auto")
    pool = raw.strip().lower() or "auto"
    if pool not in ("auto", "pthread"):
        raise ValueError(f"OFFLOAD_POOL={raw!r} is not valid: use auto or pthread")
    linger = os.environ.get("OFFLOAD_POOL_LINGER_MS", "").strip()
    if linger and not (linger.isdigit() and int(linger) <= 60000):
        raise ValueError(f"OFFLOAD_POOL_LINGER_MS={linger!r} is not valid: use milliseconds from 0 to 60000")
    return pool == "pthread", int(linger or 0)


def _find_library() -> str | None:
    chosen = os.environ.get("OFFLOAD_NATIVE_LIB", "").strip()
    if chosen:
        return chosen
    candidates = sorted(glob.glob(os.path.join(_HERE, "_offload_native*.so")))
    return candidates[0] if candidates else None


def _load() -> None:
    global _lib, _load_error, _loaded
    pthread_only, linger_ms = pool_setting()
    isa_setting()
    path = _find_library()
    if path is not None and not os.path.isfile(path):
        _load_error = f"OFFLOAD_NATIVE_LIB={path} is not a file: build it (`make sanitize` builds one) or unset it"
    elif path is None:
        _load_error = ("the native library offload/_offload_native*.so is not built: "
                       "run `pip install -e .` (or `make native`)")
    else:
        try:
            lib = ctypes.CDLL(path)
            version = lib.offload_abi_version()
            if version != _ABI_VERSION:
                raise OSError(f"ABI version {version}, expected {_ABI_VERSION}: rebuild with `make native`")
            _declare_kernels(lib)
            _declare_aio(lib)
            if lib.offload_pool_configure(int(pthread_only), linger_ms) != 0:
                raise OSError(f"the library refused OFFLOAD_POOL_LINGER_MS={linger_ms}")
            _apply_isa_setting(lib)
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


# ---- optimizer kernels -------------------------------------------------------------------
# BEGIN KERNEL SECTION
# Codes of enum offload_dtype / offload_isa in native/offload_native.h.
DTYPE_NONE, DTYPE_F32, DTYPE_BF16, DTYPE_F16, DTYPE_Q8 = -1, 0, 1, 2, 3
ISA_AUTO = -1
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512", 3: "avx512_bf16"}
Q8_BLOCK = 256  # KERNEL_Q8_BLOCK in native/kernel.h


class StepArgs(ctypes.Structure):
    """Mirror of offload_step_args: the tensors of one elementwise step (raw addresses)."""
    _fields_ = [("param", ctypes.c_void_p), ("grad", ctypes.c_void_p), ("state", ctypes.c_void_p * 2),
                ("absmax", ctypes.c_void_p * 2), ("qcode", ctypes.c_void_p * 2), ("param_copy", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("grad_dtype", ctypes.c_int32), ("state_dtype", ctypes.c_int32),
                ("copy_dtype", ctypes.c_int32), ("nrows", ctypes.c_int32),
                ("param_src", ctypes.c_void_p), ("state_src", ctypes.c_void_p * 2)]


def _declare_kernels(lib: ctypes.CDLL) -> None:
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.offload_kernel_args_size.argtypes, lib.offload_kernel_args_size.restype = [], i64
    if lib.offload_kernel_args_size() != ctypes.sizeof(StepArgs):
        raise OSError(f"struct StepArgs is {ctypes.sizeof(StepArgs)} bytes here but "
                      f"{lib.offload_kernel_args_size()} in the library: rebuild with `make native`")
    lib.offload_bandwidth_probe.argtypes = [ctypes.POINTER(vp), i32, vp, ctypes.c_float, i64]
    lib.offload_bandwidth_probe.restype = i32
    for name in ("offload_kernel_set_num_threads", "offload_kernel_set_isa"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [i32], i32
    for name in ("offload_kernel_get_num_threads", "offload_kernel_isa", "offload_kernel_best_isa"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], i32
    lib.offload_pool_runtime.argtypes, lib.offload_pool_runtime.restype = [], ctypes.c_char_p
    lib.offload_pool_registered.argtypes, lib.offload_pool_registered.restype = [], i32
    lib.offload_pool_linger_ns.argtypes, lib.offload_pool_linger_ns.restype = [], i64
    lib.offload_pool_registrations.argtypes, lib.offload_pool_registrations.restype = [], i64
    lib.offload_pool_team_runs.argtypes, lib.offload_pool_team_runs.restype = [], i64
    lib.offload_pool_configure.argtypes, lib.offload_pool_configure.restype = [i32, i64], i32

_kernels: dict = {}  # name -> the checked C entry point


def _kernel(L: ctypes.CDLL, name: str, hp_type: type):
    """offload_<name>_step, declared and its hparams struct checked against hp_type once."""
    fn = _kernels.get(name)
    if fn is None:
        try:
            size = getattr(L, f"offload_{name}_hparams_size")
            fn = getattr(L, f"offload_{name}_step")
        except AttributeError:
            raise OSError(f"the native library has no kernel {name!r}: rebuild with `make native`") from None
        size.argtypes, size.restype = [], ctypes.c_int64
        if size() != ctypes.sizeof(hp_type):
            raise OSError(f"struct {hp_type.__name__} is {ctypes.sizeof(hp_type)} bytes here but "
                          f"{size()} in the library: rebuild with `make native`")
        fn.argtypes, fn.restype = [ctypes.POINTER(StepArgs), ctypes.POINTER(hp_type)], ctypes.c_int
        _kernels[name] = fn
    return fn


def _kernel_check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")


def kernel_step(L: ctypes.CDLL, name: str, args: StepArgs, hp: ctypes.Structure) -> None:
    """One fused pass of the kernel offload_<name>_step with hparams struct hp (its mirror is
    defined beside the rule, offload/optim/<rule>.py). Arguments are checked by the caller
    (offload/optim/rule.py); the library re-checks only codes, row counts and null pointers.
    Releases the GIL."""
    _kernel_check(_kernel(L, name, type(hp))(ctypes.byref(args), ctypes.byref(hp)), f"offload_{name}_step")


def bandwidth_probe(L: ctypes.CDLL, rw: list, d: int, n: int, scale: float = 1.0) -> None:
    """rw[k] += scale * d over n fp32 elements for each address in rw (1..4): (len(rw) * 2 + 1)
    * 4 bytes of traffic per element, the kernels' pool and ISA. scale=0 reads d and leaves
    rw's values unchanged (d finite): a rule's own arrays, probed without altering them."""
    arr = (ctypes.c_void_p * len(rw))(*rw)
    _kernel_check(L.offload_bandwidth_probe(arr, len(rw), d, scale, n), "offload_bandwidth_probe")


def adam_bandwidth_probe(L: ctypes.CDLL, a: int, b: int, c: int, d: int, n: int) -> None:
    """a += d; b += d; c += d: the fp32 Adam step's 28 bytes/element of traffic."""
    bandwidth_probe(L, [a, b, c], d, n)


def kernel_set_num_threads(L: ctypes.CDLL, n: int) -> None:
    _kernel_check(L.offload_kernel_set_num_threads(n), f"offload_kernel_set_num_threads({n})")


def kernel_set_isa(L: ctypes.CDLL, isa: str | None) -> None:
    """Force the kernels' ISA by name (tests, benchmarks); None restores the default (the
    OFFLOAD_ISA setting, automatic dispatch unless it names an ISA)."""
    codes = {name: code for code, name in ISA_NAMES.items()}
    if isa is None:
        isa = None if isa_setting() == "auto" else isa_setting()
    elif isa not in codes:
        raise ValueError(f"unknown ISA {isa!r}: use one of {sorted(codes)} or None")
    rc = L.offload_kernel_set_isa(ISA_AUTO if isa is None else codes[isa])
    if rc < 0:
        raise ValueError(f"this CPU cannot run the {isa} kernel (best: {ISA_NAMES[L.offload_kernel_best_isa()]})")


def _apply_isa_setting(L: ctypes.CDLL) -> None:
    """OFFLOAD_ISA, applied once when the library loads. An ISA this CPU lacks is a
    ValueError naming the best one (raised by the first ``lib()``, not a silent fallback)."""
    setting = isa_setting()
    if setting == "auto":
        return
    try:
        kernel_set_isa(L, setting)
    except ValueError as exc:
        raise ValueError(f"OFFLOAD_ISA={setting}: {exc}: unset OFFLOAD_ISA or name an ISA at or below "
                         f"{best_isa(L)}") from None


def best_isa(L: ctypes.CDLL) -> str:
    return ISA_NAMES[L.offload_kernel_best_isa()]


# Names kept from when Adam was the only kernel.
adam_set_num_threads, adam_set_isa = kernel_set_num_threads, kernel_set_isa


def pool_registered(L: ctypes.CDLL) -> int:
    """Registrations of the native pool with torch's OpenMP runtime alive now (the pool holds
    one while it has work, and for ``pool_linger_s`` after; threadpool.c)."""
    return L.offload_pool_registered()


def pool_registrations(L: ctypes.CDLL) -> int:
    """Registrations started since the library loaded."""
    return L.offload_pool_registrations()


def pool_team_runs(L: ctypes.CDLL) -> int:
    """Kernels run on the calling thread's own OpenMP team since the library loaded: a kernel
    called on the main thread runs its chunks on torch's intra-op workers (threadpool.c)."""
    return L.offload_pool_team_runs()


# Frozen-weight dequantization (native/quant.c; formats in offload/quantize.py).
QFMT_NF4, QFMT_INT8_ROWS = 0, 1   # enum offload_qformat


class DequantArgs(ctypes.Structure):
    """Mirror of offload_dequant_args: one dequantization of n elements (raw addresses)."""
    _fields_ = [("codes", ctypes.c_void_p), ("absmax", ctypes.c_void_p), ("absmax_q", ctypes.c_void_p),
                ("absmax_scale", ctypes.c_void_p), ("absmax_code", ctypes.c_void_p), ("code", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("n", ctypes.c_int64), ("blocksize", ctypes.c_int64),
                ("absmax_offset", ctypes.c_float), ("format", ctypes.c_int32), ("out_dtype", ctypes.c_int32)]


class QuantArgs(ctypes.Structure):
    """Mirror of offload_quant_args: one quantization of n elements (raw addresses)."""
    _fields_ = [("x", ctypes.c_void_p), ("codes", ctypes.c_void_p), ("absmax", ctypes.c_void_p),
                ("code", ctypes.c_void_p), ("n", ctypes.c_int64), ("blocksize", ctypes.c_int64),
                ("format", ctypes.c_int32), ("in_dtype", ctypes.c_int32)]


def _quant_fn(L: ctypes.CDLL, name: str, args_type: type):
    """offload_<name>, declared and its args struct checked against args_type once."""
    fn = _kernels.get(name)
    if fn is None:
        size_name = {"dequantize": "offload_dequant_args_size", "quantize": "offload_quant_args_size"}[name]
        try:
            size, fn = getattr(L, size_name), getattr(L, f"offload_{name}")
        except AttributeError:
            raise OSError(f"the native library has no offload_{name}: rebuild with `make native`") from None
        size.argtypes, size.restype = [], ctypes.c_int64
        if size() != ctypes.sizeof(args_type):
            raise OSError(f"struct {args_type.__name__} is {ctypes.sizeof(args_type)} bytes here but {size()} in "
                          f"the library: rebuild with `make native`")
        fn.argtypes, fn.restype = [ctypes.POINTER(args_type)], ctypes.c_int
        _kernels[name] = fn
    return fn


def dequantize(L: ctypes.CDLL, args: DequantArgs) -> None:
    """One pass of offload_dequantize over the pool, at the kernels' ISA. Shapes and dtypes
    are checked by the caller (offload/quantize.py); the library re-checks codes, sizes and
    null pointers. Releases the GIL."""
    _kernel_check(_quant_fn(L, "dequantize", DequantArgs)(ctypes.byref(args)), "offload_dequantize")


def quantize(L: ctypes.CDLL, args: QuantArgs) -> None:
    """One pass of offload_quantize (codes and absmax written), as ``dequantize``."""
    _kernel_check(_quant_fn(L, "quantize", QuantArgs)(ctypes.byref(args)), "offload_quantize")


def _kernel_info(lib: ctypes.CDLL) -> dict:
    return {"isa": ISA_NAMES[lib.offload_kernel_isa()], "best_isa": ISA_NAMES[lib.offload_kernel_best_isa()],
            "isa_setting": isa_setting(), "threads": lib.offload_kernel_get_num_threads(),
            "pool": lib.offload_pool_runtime().decode(), "pool_linger_s": lib.offload_pool_linger_ns() / 1e9}
# END KERNEL SECTION


# ---- I/O engine and checksums -------------------------------------------------------------
# BEGIN AIO SECTION
IO_READ, IO_WRITE = 0, 1
IO_PAGE = PAGE                      # the native library's page (io.c), the package's one


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
    for name in ("offload_crc32c", "offload_crc32c_table", "offload_crc32c_sse42"):
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
    rc = lib().offload_aio_create(ctypes.byref(cfg), ctypes.byref(handle))
    if rc == -errno.ETIMEDOUT:   # the workers did not all start within the engine's bound (30 s)
        raise OSError(errno.ETIMEDOUT, f"offload_aio_create: the {threads} I/O threads did not start within "
                                       f"30 s (is the machine overloaded?)")
    _check_errno(rc, "offload_aio_create")
    return handle.value, cfg


def aio_submit(engine: int, req: IoReq) -> None:
    if not engine:
        raise ValueError("aio_submit on a closed I/O engine")
    if req.op not in (IO_READ, IO_WRITE) or not 0 <= req.tail_len < IO_PAGE:
        raise ValueError("bad I/O request")
    _check_errno(lib().offload_aio_submit(engine, ctypes.byref(req)), "offload_aio_submit")


def aio_wait(engine: int, req: IoReq, timeout_ns: int) -> bool:
    """True once req is done; False on timeout. Releases the GIL while it waits. ``engine``
    must be open (storage/nvme.py's NativeBackend guards it); a null one is an error."""
    if not engine:
        raise ValueError("aio_wait on a closed I/O engine")
    rc = lib().offload_aio_wait(engine, ctypes.byref(req), timeout_ns)
    if rc == -errno.ETIMEDOUT:
        return False
    _check_errno(rc, "offload_aio_wait")
    return True


def aio_done(req: IoReq) -> bool:
    return bool(lib().offload_aio_done(ctypes.byref(req)))


def aio_stats(engine: int) -> AioStats:
    out = AioStats()
    _check_errno(lib().offload_aio_stats_get(engine, ctypes.byref(out)), "offload_aio_stats_get")
    return out


def aio_destroy(engine: int) -> None:
    """Finishes every queued request, then frees the engine."""
    lib().offload_aio_destroy(engine)


def crc32c(address: int, nbytes: int, crc: int = 0, *, table: bool = False, sse42: bool = False) -> int:
    """crc32c of nbytes at address (continuing from crc). Releases the GIL. ``table`` /
    ``sse42``: that path instead of the fastest the CPU has (parity tests)."""
    if nbytes < 0 or (nbytes and not address):
        raise ValueError(f"bad buffer: address={address:#x} nbytes={nbytes}")
    f = lib().offload_crc32c_table if table else lib().offload_crc32c_sse42 if sse42 else lib().offload_crc32c
    return f(crc, address, nbytes)


def _aio_info(lib: ctypes.CDLL) -> dict:
    return {"crc32c": {2: "vpclmulqdq", 1: "sse4.2"}.get(lib.offload_crc32c_hw(), "table")}
# END AIO SECTION


def native_info() -> dict:
    """Which backend is in use, the CPU ISA the kernels dispatch to, and the thread count."""
    L = lib()
    if L is None:
        import torch
        return {"backend": "torch", "isa": "torch", "threads": torch.get_num_threads(),
                "reason": "OFFLOAD_NATIVE=off" if mode() == "off" else _load_error}
    info = {"backend": "native", "abi": _ABI_VERSION}
    info.update(_kernel_info(L))
    info.update(_aio_info(L))
    return info
