"""The only file that knows CUDA: the compute device, streams, events, pinned memory.

On a machine without CUDA every function here has a CPU path: the compute device is the
CPU, a "stream" is None (work is synchronous), an event is None and is always complete.
Callers never test ``torch.cuda.is_available()`` themselves.
"""
from __future__ import annotations

import ctypes
import os
import warnings
from typing import Optional

import torch


def compute_device() -> torch.device:
    """``cuda`` (the current CUDA device) when present, ``cpu`` otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def device_name(device: torch.device) -> str:
    """``cpu``, or the CUDA device's product name."""
    return torch.cuda.get_device_name(device) if is_cuda(device) else "cpu"


def link(src: torch.device, dst: torch.device) -> str:
    """The telemetry name of a copy from memory on ``src`` into memory on ``dst``: ``h2d`` /
    ``d2h`` across the host-device boundary, ``h2h`` within host memory (every copy of a
    CPU compute device, whose device memory is the host's), ``d2d`` within device memory."""
    return _LINKS[src.type == "cuda", dst.type == "cuda"]


_LINKS = {(False, False): "h2h", (False, True): "h2d", (True, False): "d2h", (True, True): "d2d"}


def can_pin() -> bool:
    return torch.cuda.is_available()


def empty_host(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A 1-D host tensor, page-locked when ``pin`` and CUDA is present."""
    return torch.empty(numel, dtype=dtype, pin_memory=bool(pin and can_pin()))


def new_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """A side stream for copies on CUDA; None on the CPU."""
    return torch.cuda.Stream(device=device) if is_cuda(device) else None


def current_stream(device: torch.device):
    return torch.cuda.current_stream(device) if is_cuda(device) else None


def record_event(stream) -> Optional["torch.cuda.Event"]:
    """An event marking all work queued so far on ``stream``; None (already complete) on CPU."""
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def use_stream(stream):
    """A context in which kernels are queued on ``stream`` (a no-op context on the CPU)."""
    if stream is None:
        import contextlib
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def wait_event(stream, event) -> None:
    """Make ``stream`` wait for ``event`` without blocking the host."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def sync_event(event) -> None:
    """Block the calling host thread until ``event`` has completed."""
    if event is not None:
        event.synchronize()


def copy_(dst: torch.Tensor, src: torch.Tensor, stream=None):
    """Copy ``src`` into ``dst`` on ``stream`` (asynchronous when one side is pinned host memory
    and the other is on CUDA). Returns the event that marks completion; until it fires, neither
    buffer may be reused. On CPU the copy is synchronous and the event is None."""
    if stream is None:
        dst.copy_(src)
        return None
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        return record_event(stream)


def empty_on(stream, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A device buffer allocated from ``stream``'s share of the caching allocator, so memory
    that the compute stream freed (and may still be reading) is never handed to a copy on
    ``stream``. Whoever reads it on another stream marks it with ``mark_used``."""
    if stream is None:
        return torch.empty(numel, dtype=dtype, device=device)
    with torch.cuda.stream(stream):
        return torch.empty(numel, dtype=dtype, device=device)


def mark_used(tensor: torch.Tensor, stream) -> None:
    """``tensor`` is read by work queued on ``stream``: its memory is not reused before
    that work completes."""
    if stream is not None and tensor.is_cuda:
        tensor.record_stream(stream)


def synchronize(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def memory_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if is_cuda(device) else 0


def copy_to_host_async(dst: torch.Tensor, src: torch.Tensor, stream):
    """Device -> host copy of ``src`` on the side ``stream``, ordered after the work already
    queued on the current stream (which produced ``src``). ``src`` is marked as used by
    ``stream`` so the caching allocator does not hand its memory out before the copy ends.
    Returns the completion event (None on CPU, where the copy is done on return)."""
    if stream is None or not src.is_cuda:
        dst.copy_(src)
        return None
    stream.wait_stream(torch.cuda.current_stream(src.device))
    src.record_stream(stream)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        return record_event(stream)


HUGE_PAGE_BYTES = 2 << 20            # an x86-64 / arm64 transparent huge page
_THP_ENV = "THP_MEM_ALLOC_ENABLE"    # torch's switch, read once, at the process's first CPU allocation
_huge_pages: Optional[bool] = None


def prefer_huge_pages() -> bool:
    """On a CPU compute device, ask torch to put CPU tensors of 2 MiB and more on transparent
    huge pages (torch's ``THP_MEM_ALLOC_ENABLE``: page-aligned and ``madvise(MADV_HUGEPAGE)``),
    unless the user has set the variable. For a process whose saved activations will leave a
    CPU device (``offload_activations``); to be called before any CPU tensor exists, as the
    ``offload`` command does once its flags are read: torch reads the variable once, at its
    first CPU allocation. Returns whether large tensors are on huge pages now (the variable
    is set only for torch's first allocation, which the check makes; children do not inherit it).

    Why: with activations offloaded the heap stays "bounded" (below), so every large tensor
    is a fresh mapping whose pages fault in on first touch, one fault per page: a 2 MiB page
    takes the faults of 512 small ones (benchmarks/RESULTS.md, "Huge pages"). A huge page is
    used only where a tensor covers a whole aligned 2 MiB, so no tensor grows; a fresh tensor
    still faults its unaligned ends in 4 KiB pages. The kernel's
    ``transparent_hugepage/enabled`` must be ``madvise`` or ``always``.

    Why not always: with malloc untouched (large blocks reused from the heap) the same switch
    slowed plain torch training (bench_step), so the engine asks for it only where the
    bounded heap makes it pay."""
    if torch.cuda.is_available():
        return False
    if _THP_ENV in os.environ:
        return huge_pages_in_effect()         # the user's own setting stands
    os.environ[_THP_ENV] = "1"
    try:
        return huge_pages_in_effect()         # its probe is torch's first CPU allocation if none came before
    finally:
        del os.environ[_THP_ENV]              # child processes get the user's environment


def huge_pages_in_effect() -> bool:
    """Whether torch advises huge pages for large CPU tensors in this process: the mapping
    that holds a fresh 4 MiB tensor carries the ``hg`` flag (``MADV_HUGEPAGE``) in
    ``/proc/self/smaps``; False where that file does not exist. torch decides at its first CPU
    allocation, which this check may be, so the answer is kept."""
    global _huge_pages
    if _huge_pages is None:
        probe = torch.empty(2 * HUGE_PAGE_BYTES, dtype=torch.uint8)
        _huge_pages = "hg" in _mapping_flags(probe.data_ptr())
    return _huge_pages


def _mapping_flags(address: int) -> list:
    """The ``VmFlags`` of the mapping of this process that holds ``address`` ([] if none)."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "VmFlags:":
                    return line.split()[1:]
    except (OSError, ValueError):
        pass
    return []


def _kernel_huge_pages() -> bool:
    """The kernel's transparent huge pages mode is ``always`` or ``madvise`` (Linux only)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _warn_without_huge_pages() -> None:
    """Saved activations keep the heap bounded on 4 KiB pages: say how to get huge pages,
    unless the user turned them off or the kernel has none."""
    if os.environ.get(_THP_ENV) == "0" or not _kernel_huge_pages() or huge_pages_in_effect():
        return
    warnings.warn("saved activations leave a CPU device while large CPU tensors are on 4 KiB pages: each "
                  "one faults in afresh, page by page, every step (device.prefer_huge_pages). "
                  f"Start the process with {_THP_ENV}=1 (torch reads it at its first CPU allocation; the "
                  f"offload command sets it), or {_THP_ENV}=0 to keep 4 KiB pages without this warning",
                  stacklevel=5)


_heap_mode: Optional[str] = None     # None: malloc as glibc sets it; "bounded" / "reuse" below
_heap_kept_bounded = False           # an engine of this process needs "bounded" while it trains
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3        # glibc mallopt parameters
REUSE_MMAP_THRESHOLD = 32 << 20
REUSE_TRIM_THRESHOLD = 64 << 20


def return_freed_host_memory(bound_large_allocations: bool = False, keep: bool = False) -> None:
    """Give the heap's free pages back (``trim_host_heap``); with ``bound_large_allocations``
    also keep large allocations out of the heap, process-wide, glibc only ("bounded" heap
    mode; ``keep``: for as long as the process lives, see ``reuse_heap``).

    On a CPU compute device with parameters offloaded, "device" memory is the process heap
    and fetched parameter blocks, activations and gradients are large, short-lived host
    allocations: glibc raises its mmap threshold after such a block is freed and then serves
    the next ones from the heap, which keeps freed memory resident, so peak RSS grows with
    model size. Fixing the threshold (``OFFLOAD_MMAP_THRESHOLD`` bytes, default 4 MiB; 0
    leaves malloc alone) keeps them mmapped and returned on free. It has a price, paid by
    every allocation of the process, the user's own torch work included: each such
    allocation is a fresh mapping whose pages fault in on first touch and unmap on free
    (several times the cost of one served from the heap on 4 KiB pages; huge pages,
    ``prefer_huge_pages``, take most of the faults away), and glibc's trim threshold stops
    following the mmap threshold.
    So the engine asks for it only where it bounds memory that would otherwise grow with
    the model (parameters or saved activations offloaded from a CPU device), and for
    parameters only while ``initialize`` loads the model (``reuse_heap``)."""
    global _heap_mode, _heap_kept_bounded
    trim_host_heap()
    if not bound_large_allocations or torch.cuda.is_available():
        return
    _heap_kept_bounded = _heap_kept_bounded or keep
    if _heap_mode != "bounded":
        threshold = int(os.environ.get("OFFLOAD_MMAP_THRESHOLD", 4 << 20))
        if threshold > 0 and _mallopt({M_MMAP_THRESHOLD: threshold, M_TRIM_THRESHOLD: 128 << 10}):
            _heap_mode = "bounded"
    if _heap_mode == "bounded" and keep:
        _warn_without_huge_pages()


def reuse_heap() -> None:
    """After ``initialize`` has loaded the model in "bounded" heap mode: let blocks up to
    ``REUSE_MMAP_THRESHOLD`` come from the heap again and keep up to ``REUSE_TRIM_THRESHOLD``
    free at its top ("reuse" mode), unless saved activations leave a CPU device in this
    process (``keep``), which stays bounded.

    Loading needs the bound: each block's transient copies would otherwise stay resident
    in heap holes, one block after another, so the load's peak RSS would grow with depth.
    Training does not: a step frees and asks for the same blocks again (fetched parameters,
    gradients), so from the heap they are reused warm instead of being mapped and faulted in
    afresh every step, while the heap's size is still set by one step's working set, not by
    the model (training's peak RSS stays flat in depth: benchmarks/RESULTS.md). Saved
    activations are another matter: there the freed but resident heap is the very memory
    that offloading them is meant to save, so they keep the bound."""
    global _heap_mode
    if _heap_mode != "bounded" or _heap_kept_bounded:
        return
    if _mallopt({M_MMAP_THRESHOLD: REUSE_MMAP_THRESHOLD, M_TRIM_THRESHOLD: REUSE_TRIM_THRESHOLD}):
        _heap_mode = "reuse"


def heap_mode() -> Optional[str]:
    """The process's heap mode: None (malloc untouched), "bounded" or "reuse"."""
    return _heap_mode


def _mallopt(settings: dict) -> bool:
    """glibc ``mallopt`` for each (parameter, value); False where malloc is not glibc's."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(fn(k, v) == 1 for k, v in settings.items())


def trim_host_heap(min_free_bytes: int = 0) -> bool:
    """Give the pages of freed heap memory back to the system (glibc ``malloc_trim``; a no-op
    elsewhere) when the heap holds at least ``min_free_bytes`` of freed memory (0: always).
    Returns whether it trimmed. glibc returns only the free top of the heap by itself: memory
    freed below a live allocation stays resident. Loading a model block by block leaves such
    holes (gigabytes at a 2B model's 40 layers: benchmarks/RESULTS.md, bench_scale), and so
    do the activations and gradients of a step on a CPU device. A trim is not free: it walks
    every arena and unmaps each free page, and the next step faults every page it reuses
    back in; so after a step the engine trims only past ``step_trim_bytes()`` of free heap
    (``trim_after_step``)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim
        except (OSError, AttributeError):
            _libc = False            # not glibc: nothing to trim
    if not _libc:
        return False
    if min_free_bytes > 0:
        free = free_heap_bytes()
        if free is not None and free < min_free_bytes:
            return False
    _libc.malloc_trim(0)
    global _step_rss_base
    _step_rss_base = None            # the steps settle anew from here (trim_after_step)
    return True


def free_heap_bytes() -> Optional[int]:
    """Bytes of freed memory glibc's heap keeps (``mallinfo2().fordblks``, every arena,
    the free top included; it locks every arena); None where unknown (not glibc, glibc < 2.33)."""
    global _mallinfo2
    if _mallinfo2 is None:
        class _Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
        try:
            fn = ctypes.CDLL("libc.so.6").mallinfo2
            fn.argtypes, fn.restype = [], _Info
            _mallinfo2 = fn
        except (OSError, AttributeError):
            _mallinfo2 = False
    return int(_mallinfo2().fordblks) if _mallinfo2 else None


DEFAULT_STEP_TRIM_BYTES = 256 << 20
STEP_TRIM_CHECK_S = 1.0       # the free heap is read at most this often after steps
_step_trim_checked = float("-inf")
_step_rss_base: Optional[int] = None    # RSS where the steps settled (trim_after_step); None: not yet
_step_rss_seen = 0                      # checks since the last trim that set the base
SETTLE_CHECKS = 2                       # the base is the highest RSS of this many checks after a trim


def trim_after_step() -> bool:
    """After a micro-step on a CPU device: ``trim_host_heap`` once the process's RSS has
    grown by more than ``step_trim_bytes()`` over where the steps settled (the highest RSS of
    the first ``SETTLE_CHECKS`` checks after the last trim: the first step after one faults
    its pages in again, and RSS between steps varies by some of a step's allocations) and
    the heap holds at least that much freed memory.

    Growth, not the heap's free bytes: a step frees its activations and gradients, which
    the next step allocates again; left resident they are reused warm (RSS between steps
    is the step's own peak, as with plain torch), trimmed they fault in again, page by page.
    A rule on the free heap's size trimmed a LoRA step of SmolLM2-135M after every step, and
    it faulted many more pages than plain PEFT's (benchmarks/RESULTS.md). What the trim is for is memory
    the steps do not reuse (freed memory accumulating in a hole of the heap, a larger
    micro-step once): that shows as growth.

    Throttled: at most one check every ``STEP_TRIM_CHECK_S`` (process-wide, as the heap is);
    ``mallinfo2`` locks every arena, inside ``step()`` beside the optimizer's threads. A
    threshold of 0 trims after every micro-step. Returns whether it trimmed."""
    global _step_trim_checked, _step_rss_base, _step_rss_seen
    limit = step_trim_bytes()
    if limit == 0:
        return trim_host_heap(0)
    import time
    now = time.monotonic()
    if now - _step_trim_checked < STEP_TRIM_CHECK_S:
        return False
    _step_trim_checked = now
    rss = _rss_bytes()
    if rss is None:                  # no /proc: the free heap alone decides
        return trim_host_heap(limit)
    if _step_rss_base is None or _step_rss_seen < SETTLE_CHECKS:
        _step_rss_seen = 1 if _step_rss_base is None else _step_rss_seen + 1
        _step_rss_base = max(rss, _step_rss_base or 0)
        return False
    return rss > _step_rss_base + limit and trim_host_heap(limit)


def _rss_bytes() -> Optional[int]:
    """The process's resident set in bytes (``/proc/self/statm``, a cheap read), None without it."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def step_trim_bytes() -> int:
    """The growth of RSS past which the engine trims the heap after a micro-step (``step()``
    call) on a CPU device (``trim_after_step``; ``OFFLOAD_STEP_TRIM_BYTES``, default 256 MiB;
    0 trims after every one), and the free heap past which it trims after each block it
    builds at ``initialize`` (any device: the load's copies are host memory). Below it the
    freed activations and gradients stay resident for the next micro-step, which reuses
    them: the peak RSS (inside a step, where they are live) is the same either way, and RSS
    between steps is at most this much above where the steps settled."""
    raw = os.environ.get("OFFLOAD_STEP_TRIM_BYTES", "").strip()
    if not raw:
        return DEFAULT_STEP_TRIM_BYTES
    if not raw.isdigit():
        raise ValueError(f"OFFLOAD_STEP_TRIM_BYTES={raw!r} is not valid: use a number of bytes "
                         f"(0 trims the heap after every step; default {DEFAULT_STEP_TRIM_BYTES})")
    return int(raw)


_libc = None
_mallinfo2 = None
