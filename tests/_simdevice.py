"""A simulated accelerator for the CPU test suite: the compute device is of another device type
than the host tiers, so that a host tensor meeting a device tensor fails here as it fails on a GPU.

Why: on a CPU compute device the engine's "device" and "host" tensors are the same kind, and
``host.add_(device_tensor)`` (a CUDA tensor added into pinned host memory: a RuntimeError on a
GPU) passes; a stream or event path that only runs on CUDA never runs. Here:

* device tensors are ``SimTensor``: a wrapper of a CPU tensor whose device is ``lazy:0`` (a
  device type every CPU build of torch links, with a device guard, so autograd runs on it; the
  lazy backend itself computes nothing here: every op is unwrapped and run on the CPU, so the
  numbers are the CPU's, bit for bit);
* every op checks its tensors' devices as CUDA's TensorIterator does: device tensors with host
  tensors of one or more dimensions raise "Expected all tensors to be on the same device", CPU
  scalars (0-dim) are allowed beside device tensors; ``copy_`` and ``to`` cross, as on CUDA;
* ``p.data = host_tensor`` for a device parameter raises (on CUDA the parameter would move to
  the host without a word, and the model's next forward would mix devices);
* factories with ``device=lazy`` (``torch.empty(n, device=engine.device)``) make device tensors,
  on any thread (a dispatch mode on the test's thread, autograd's and the engine's workers);
* ``offload.device`` is told the compute device is an accelerator with streams and events:
  ``is_cuda`` answers True for it, streams are ``SimStream`` and events ``SimEvent``, so every
  path written for CUDA streams and events runs (synchronously: the copies are done on return;
  ordering races are the CUDA tests' job), and an event waited on a stream that is None, or a
  stream asked of a device that is not the compute device, raises.

``sim_device(monkeypatch)`` turns it on for a test; ``to_sim(model)`` moves a model there.
"""
from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_map

SIM = torch.device("lazy", 0)
_HOST_OK = {                           # ops that take host and device tensors together on CUDA
    torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default, torch.ops.aten._copy_from.default,
    torch.ops.aten._copy_from_and_resize.default, torch.ops.aten.copy.default,
}
_ready = False
_lock = threading.Lock()


def _setup() -> None:
    global _ready
    with _lock:
        if not _ready:
            import torch._lazy.ts_backend
            torch._lazy.ts_backend.init()       # registers the lazy device guard (autograd needs one)
            _ready = True


def _is_sim(device) -> bool:
    return device is not None and torch.device(device).type == SIM.type


class SimTensor(torch.Tensor):
    """A tensor in simulated device memory: ``inner`` is a CPU tensor holding the bytes."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        if isinstance(inner, SimTensor):
            return inner
        r = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                device=SIM, requires_grad=inner.requires_grad)
        r._bytes = inner
        return r

    def __repr__(self):
        return f"SimTensor({self._bytes!r})"

    is_cuda = property(lambda self: True)     # an accelerator tensor to ``t.is_cuda`` tests

    def data_ptr(self):
        return self._bytes.data_ptr()           # for identity checks (the same device buffer?)

    def untyped_storage(self):
        return self._bytes.untyped_storage()    # the same: which buffer a view belongs to

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func == _DATA_SET:                  # ``p.data = t``: the wrapper takes t's bytes
            self, new = args
            if not isinstance(new, SimTensor):
                raise RuntimeError(f"p.data = a host tensor of shape {tuple(new.shape)} for a device parameter "
                                   f"(on CUDA the parameter silently moves to the host)")
            with torch._C.DisableTorchFunctionSubclass():
                _DATA_SET(self, new)
            self._bytes = new._bytes
            return None
        with torch._C.DisableTorchFunctionSubclass():   # no as_subclass of host results
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


_DATA_SET = torch.Tensor.data.__set__


def _leaves(args, kwargs):
    """The tensors among an op's arguments (one level of lists: aten's argument types)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, torch.Tensor):
                    yield t


def _unwrap(a):
    if isinstance(a, SimTensor):
        return a._bytes
    if isinstance(a, (list, tuple)) and any(isinstance(t, SimTensor) for t in a):
        return type(a)(t._bytes if isinstance(t, SimTensor) else t for t in a)
    return a


def _wrap(out):
    if isinstance(out, torch.Tensor):
        return out if isinstance(out, SimTensor) else SimTensor(out)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(t) for t in out)
    return out


def _run(func, args, kwargs):
    tensors = list(_leaves(args, kwargs))
    on_sim = any(isinstance(t, SimTensor) for t in tensors)
    if any(t.device.type == SIM.type and not isinstance(t, SimTensor) for t in tensors):
        raise RuntimeError(f"{func}: a tensor of the lazy backend itself, made outside the simulation")
    if on_sim and func not in _HOST_OK:
        for t in tensors:                      # CUDA's rule: device tensors and CPU scalars only
            if not isinstance(t, SimTensor) and t.dim() > 0 and t.device.type == "cpu":
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                   f"devices, {SIM} and cpu! ({func}: a host tensor of shape {tuple(t.shape)} "
                                   f"meets a device tensor)")
    dev = kwargs.get("device")
    if dev is not None:
        if _is_sim(dev):
            kwargs = dict(kwargs, device=torch.device("cpu"))
            on_sim = True
        elif torch.device(dev).type == "cpu":
            on_sim = False                     # .to("cpu"), .cpu(): the result is on the host
    if on_sim and func is torch.ops.aten._pin_memory.default:
        raise RuntimeError("cannot pin a device tensor")
    out = func(*[_unwrap(a) for a in args], **{k: _unwrap(v) for k, v in kwargs.items()})
    if func in _IN_PLACE or func is torch.ops.aten.copy_.default:
        return args[0]                         # in place: the caller's own tensor (host or device)
    return _wrap(out) if on_sim else out


def _in_place(func) -> bool:
    schema = func._schema
    return bool(schema.arguments and schema.arguments[0].alias_info is not None
                and schema.arguments[0].alias_info.is_write and schema.returns
                and schema.returns[0].alias_info is not None)


class _InPlace:
    """Ops that write their first argument and return it, found once per op."""

    def __init__(self):
        self._seen = {}

    def __contains__(self, func) -> bool:
        hit = self._seen.get(func)
        if hit is None:
            hit = self._seen[func] = _in_place(func)
        return hit


_IN_PLACE = _InPlace()


class _FactoryMode(TorchDispatchMode):
    """Ops with ``device=lazy`` and no device tensor among their inputs (factories,
    ``x.to(device)``) make device tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


class SimStream:
    """A stream of the simulated device: work is synchronous, so a stream only has to exist."""

    def __init__(self, device=None):
        self.device = device

    def wait_stream(self, other) -> None:
        _check_stream(other)

    def wait_event(self, event) -> None:
        if not isinstance(event, SimEvent):
            raise TypeError(f"a stream waits on an event, not {event!r}")


class SimEvent:
    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record(self, stream=None) -> None:
        _check_stream(stream)


def _check_stream(stream) -> None:
    if stream is not None and not isinstance(stream, SimStream):
        raise TypeError(f"not a stream of the simulated device: {stream!r}")


def _device_api(dev):
    """The replacements of ``offload.device``'s accelerator functions."""
    import contextlib

    def is_cuda(device) -> bool:
        return torch.device(device).type in ("cuda", SIM.type)

    def check(device):
        if device is None or not is_cuda(device):
            raise RuntimeError(f"a stream of device {device!r} asked for: streams exist on the compute device only")
        return device

    def new_stream(device):
        return SimStream(device) if is_cuda(device) else None

    def current_stream(device):
        return SimStream(check(device))

    def record_event(stream):
        if stream is None:
            return None
        _check_stream(stream)
        return SimEvent()

    def use_stream(stream):
        _check_stream(stream)
        return contextlib.nullcontext()

    def wait_event(stream, event):
        if event is not None and stream is None:
            raise RuntimeError("a device event waited on by no stream")
        if stream is not None and event is not None:
            stream.wait_event(event)

    def sync_event(event):
        if event is not None and not isinstance(event, SimEvent):
            raise TypeError(f"not an event: {event!r}")

    def copy_(dst, src, stream=None):
        _check_stream(stream)
        dst.copy_(src)
        return SimEvent() if stream is not None else None

    def copy_to_host_async(dst, src, stream):
        _check_stream(stream)
        if isinstance(dst, SimTensor):
            raise RuntimeError("copy_to_host_async into a device tensor")
        dst.copy_(src)
        return SimEvent() if stream is not None and isinstance(src, SimTensor) else None

    def empty_on(stream, numel, dtype, device):
        return torch.empty(numel, dtype=dtype, device=device)

    def mark_used(tensor, stream):
        _check_stream(stream)

    def link(src, dst):
        return dev._LINKS[is_cuda(src), is_cuda(dst)]

    return {"compute_device": lambda: SIM, "is_cuda": is_cuda, "device_name": lambda d: "sim" if is_cuda(d) else "cpu",
            "new_stream": new_stream, "current_stream": current_stream, "record_event": record_event,
            "use_stream": use_stream, "wait_event": wait_event, "sync_event": sync_event, "copy_": copy_,
            "copy_to_host_async": copy_to_host_async, "empty_on": empty_on, "mark_used": mark_used,
            "synchronize": lambda device: None, "memory_allocated": lambda device: 0, "link": link}


class _ThreadModes:
    """The factory mode entered on every thread that starts while the simulation is on
    (the engine's workers), and on the test's own thread."""

    def __init__(self):
        self._orig = threading.Thread.run

    def start(self):
        orig = self._orig

        def run(thread_self):
            if any(isinstance(m, _FactoryMode) for m in _get_current_dispatch_mode_stack()):
                return orig(thread_self)
            with _FactoryMode():
                return orig(thread_self)
        threading.Thread.run = run

    def stop(self):
        threading.Thread.run = self._orig


def sim_device(monkeypatch):
    """Turn the simulated accelerator on for the rest of the test (``monkeypatch`` undoes it)."""
    from offload import device as dev
    _setup()
    for name, fn in _device_api(dev).items():
        monkeypatch.setattr(dev, name, fn)
    real_stream = torch.cuda.stream

    def stream_context(stream):                # ``with torch.cuda.stream(s)`` outside device.py
        _check_stream(stream)
        return real_stream(None)
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    threads = _ThreadModes()
    threads.start()
    mode = _FactoryMode()
    mode.__enter__()
    # attention by its math kernel, on both devices: torch picks a fused CPU kernel for host
    # tensors and the math one for device tensors of a type it has no fused kernel for, and
    # their rounding differs; with one kernel a plain run on the CPU computes the same bits
    from torch.nn.attention import SDPBackend, sdpa_kernel
    math_attention = sdpa_kernel([SDPBackend.MATH])
    math_attention.__enter__()
    # torch.tensor(data, device=...) makes a host tensor and moves it by a dispatched copy
    # (otherwise it moves it below the dispatcher, into a real lazy tensor)
    lift = torch._C._only_lift_cpu_tensors()
    torch._C._set_only_lift_cpu_tensors(True)

    def stop():
        torch._C._set_only_lift_cpu_tensors(lift)
        math_attention.__exit__(None, None, None)
        mode.__exit__(None, None, None)
        threads.stop()
    monkeypatch.setattr(sim_device, "_stop", stop, raising=False)
    return stop


def to_sim(x):
    """A model (in place), a tensor or a nested structure of tensors, moved to the simulated device."""
    if isinstance(x, torch.nn.Module):
        # each tensor once, and every module holding it gets the same device tensor: tied
        # weights stay tied (Module.to makes one new Parameter per module for a tensor subclass)
        moved = {}
        with torch.no_grad():
            for m in x.modules():
                for table in (m._parameters, m._buffers):
                    for name, t in table.items():
                        if t is None or isinstance(t, SimTensor):
                            continue
                        if id(t) not in moved:
                            new = t.detach().to(SIM)
                            if isinstance(t, torch.nn.Parameter):
                                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                            moved[id(t)] = (t, new)
                        table[name] = moved[id(t)][1]
        return x
    return tree_map(lambda t: t.to(SIM) if isinstance(t, torch.Tensor) else t, x)


def to_host(x):
    return tree_map(lambda t: t._bytes.clone() if isinstance(t, SimTensor) else t, x)
