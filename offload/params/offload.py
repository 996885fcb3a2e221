"""Parameter offload: blocks live on their home tier and visit the device around each use.

Uses are found three ways, all ending in ``materialize(block)``:
  * a forward pre-hook on every module that owns (or shares, for tied weights) a block's
    parameters; its forward post-hook releases the block unless the trace uses it again soon;
  * saved-tensor hooks: autograd does not keep a device parameter (or a view of one) from
    forward to backward; it keeps a handle, and backward materializes the block again;
  * a torch-function mode active during the forward, which catches a parameter read outside
    its module's forward (``F.linear(x, self.embed.weight)`` in a parent's forward).
In backward a block is released once all its gradients have landed (``on_grads_complete``),
and activation-checkpoint recomputation (a forward inside backward) keeps its blocks until
then. The device budget bounds the bytes of offloaded parameters on the device, prefetches
in flight included; blocks not in use are evicted furthest-next-use first.
"""
from __future__ import annotations

import math
import warnings
from typing import Dict, List, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from offload import device as dev
from offload.params.residency import BlockParams, ParamState
from offload.params.prefetch import Prefetcher

_HANDLE = object()   # marks a packed parameter reference in saved tensors


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _OutsideReads(TorchFunctionMode):
    """Materializes a released block when one of its parameters reaches a torch function."""

    def __init__(self, offload: "ParamOffload"):
        super().__init__()
        self.offload = offload

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        po = self.offload
        if not po.busy:
            for a in args:
                if isinstance(a, nn.Parameter):
                    po.touch(a)
                elif isinstance(a, (list, tuple)):
                    for x in a:
                        if isinstance(x, nn.Parameter):
                            po.touch(x)
            for a in kwargs.values():
                if isinstance(a, nn.Parameter):
                    po.touch(a)
        return func(*args, **kwargs)


class ParamOffload:
    def __init__(self, engine, params: List[Optional[BlockParams]], *, budget: int, device_lookahead: int,
                 host_lookahead: int, prefetch: bool):
        self.engine = engine
        self.params = params
        self.budget = budget
        self.busy = False
        self._h2d = dev.new_stream(engine.device)
        self._owner: Dict[int, int] = {id(s.param): i for i, bp in enumerate(params) if bp is not None
                                       for s in bp.layout.segments}
        self.prefetcher = Prefetcher(params, budget=budget, device_lookahead=device_lookahead,
                                     host_lookahead=host_lookahead, enabled=prefetch,
                                     telemetry=engine.telemetry, h2d_stream=self._h2d,
                                     blocked=self._update_in_flight,
                                     deterministic=engine.comm.active and engine.stage == 3)
        self.resident_bytes = 0          # parameters that always stay on the device
        self.peak_step = 0               # peak device parameter bytes in the current step
        self.peak_last = 0               # ... in the last completed step
        self._saved_hooks = None
        self._mode = None
        self.overruns = 0
        self._hooks = []
        self._by_storage: Dict[int, List[int]] = {}   # storage address -> blocks bound in it
        self._install()

    # ---- hooks ------------------------------------------------------------------------------
    def _install(self) -> None:
        model = self.engine.module
        for m in model.modules():
            used = sorted({self._owner[id(p)] for p in m.parameters(recurse=False) if id(p) in self._owner}
                          | {i for i, bp in enumerate(self.params)
                             if bp is not None and bp.layout.module is m})
            if used:
                self._hooks.append(m.register_forward_pre_hook(self._make_pre(used)))
                self._hooks.append(m.register_forward_hook(self._make_post(used), always_call=True))
        # AccumulateGrad lays a new gradient out like its parameter, so while it runs a
        # released parameter wears a shape-only stub (stride-0, one element); right after,
        # it is the empty placeholder again.
        for i, bp in enumerate(self.params):
            if bp is None:
                continue
            for s in bp.layout.segments:
                self._hooks.append(s.param.register_hook(self._make_shape_stub(bp, s)))
                self._hooks.append(s.param.register_post_accumulate_grad_hook(self._make_unstub(bp)))
        self._hooks.append(model.register_forward_pre_hook(self._enter_forward, prepend=True))
        self._hooks.append(model.register_forward_hook(self._exit_forward, always_call=True))

    def _enter_forward(self, module, args) -> None:
        if self._saved_hooks is not None:
            return                            # re-entrant call of the root module
        if not _in_backward():
            self.rewind()
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        self._mode = _OutsideReads(self)
        self._mode.__enter__()

    def _exit_forward(self, module, args, output) -> None:
        if self._saved_hooks is None:
            return
        mode, self._mode = self._mode, None
        hooks, self._saved_hooks = self._saved_hooks, None
        mode.__exit__(None, None, None)
        hooks.__exit__(None, None, None)

    def _make_pre(self, used: List[int]):
        def pre(module, args):
            for i in used:
                self.materialize(i)
                self.params[i].users += 1
        return pre

    def _make_post(self, used: List[int]):
        def post(module, args, output):
            for i in used:
                bp = self.params[i]
                bp.users = max(0, bp.users - 1)
                if bp.users == 0 and not _in_backward() and \
                        not self.prefetcher.next_use_within(i, self.prefetcher.device_lookahead):
                    self._release(i)
        return post

    @staticmethod
    def _make_shape_stub(bp: BlockParams, seg):
        def hook(grad):
            if bp.state is not ParamState.ON_DEVICE:
                seg.param.data = torch.zeros((), dtype=bp.dtype, device=bp.device).expand(seg.shape)
            return grad
        return hook

    @staticmethod
    def _make_unstub(bp: BlockParams):
        def hook(param):
            if bp.state is not ParamState.ON_DEVICE:
                param.data = bp.placeholder
        return hook

    def _pack(self, t: torch.Tensor):
        if not self.params or t.layout is not torch.strided or t.device.type == "meta":
            return t
        ptr = t.untyped_storage().data_ptr()
        for i in self._by_storage.get(ptr, ()):       # blocks materialized in this storage
            bp = self.params[i]
            if bp.device_buf is not None and \
                    bp.device_buf.untyped_storage().data_ptr() == ptr and bp.device_buf.dtype == t.dtype:
                rel = t.storage_offset() - bp.device_buf.storage_offset()
                if 0 <= rel < bp.numel:
                    return (_HANDLE, i, rel, tuple(t.shape), tuple(t.stride()), t.requires_grad)
        return t

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and len(packed) == 6 and packed[0] is _HANDLE):
            return packed
        _, i, rel, shape, stride, _rg = packed
        buf = self.materialize(i)
        return buf.as_strided(shape, stride, buf.storage_offset() + rel)

    def touch(self, p: nn.Parameter) -> None:
        i = self._owner.get(id(p))
        if i is not None and self.params[i].state is not ParamState.ON_DEVICE:
            self.telemetry.count("param_reads_outside_forward")
            self.materialize(i)

    @property
    def telemetry(self):
        return self.engine.telemetry

    # ---- residency ----------------------------------------------------------------------------
    def _update_in_flight(self, i: int) -> bool:
        fut = self.engine.blocks[i].pending
        if self.prefetcher.deterministic:      # queued, whether or not done: timing-free
            return fut is not None
        return fut is not None and not fut.done()

    def materialize(self, i: int) -> torch.Tensor:
        """Block ``i`` on the device, current (waits for its update and its copies)."""
        self.busy = True
        try:
            bp = self.params[i]
            self.prefetcher.request(i)
            block = self.engine.blocks[i]
            if block.pending is not None:
                with self.telemetry.span("offload::wait_update"):
                    block.wait_update()
            if bp.stale:
                self._release(i)             # the optimizer wrote the home copy since
            if bp.state is not ParamState.ON_DEVICE:
                if bp.device_bytes == 0:
                    self._make_room(i, bp.nbytes)
                with self.telemetry.span("offload::param_fetch", "h2d", bp.nbytes):
                    buf = bp.ensure(self._h2d)
                holders = self._by_storage.setdefault(buf.untyped_storage().data_ptr(), [])
                if i not in holders:
                    holders.append(i)          # for _pack; entries are checked on use
            else:
                buf = bp.device_buf
            self.prefetcher.issue()
            self._note_peak()
            return buf
        finally:
            self.busy = False

    def _make_room(self, want: int, nbytes: int) -> None:
        """Evict unused blocks, furthest next use first, until ``want`` fits in the device
        budget and (NVMe home) a host staging buffer is free for it."""
        bp_want = self.params[want]
        while True:
            over = self.prefetcher.device_bytes() + nbytes > self.budget
            no_slot = bp_want.on_nvme and bp_want.state is ParamState.HOME and not bp_want.slot_free()
            if not over and not no_slot:
                return
            upcoming = self.prefetcher.upcoming()
            victims = [j for j, bp in enumerate(self.params)
                       if bp is not None and j != want and bp.users == 0 and bp.state is not ParamState.HOME
                       and (bp.device_bytes > 0 or not over)]
            if not victims:
                if no_slot:
                    raise RuntimeError(
                        f"no host staging buffer is free for block {bp_want.layout.name!r}: every buffer holds a "
                        f"block in use; raise offload_param.device_budget_bytes or prefetch.host_lookahead_bytes")
                self.overruns += 1
                if self.overruns == 1:
                    warnings.warn("offload_param.device_budget_bytes is smaller than the blocks in use at once; "
                                  "it is exceeded (counted in stats()['param_budget_overruns'])", stacklevel=3)
                return

            def next_use(j):
                return upcoming.index(j) if j in upcoming else math.inf
            self._release(max(victims, key=next_use))

    def _release(self, i: int) -> None:
        self.busy = True
        try:
            buf = self.params[i].device_buf
            if buf is not None:
                holders = self._by_storage.get(buf.untyped_storage().data_ptr())
                if holders and i in holders:
                    holders.remove(i)
            self.params[i].release()
        finally:
            self.busy = False

    def _note_peak(self) -> None:
        now = self.prefetcher.device_bytes() + self.resident_bytes
        if now > self.peak_step:
            self.peak_step = now

    # ---- step boundaries --------------------------------------------------------------------------
    def on_grads_complete(self, i: int) -> None:
        bp = self.params[i]
        if bp is not None and bp.users == 0:
            self._release(i)

    def rewind(self) -> None:
        """A new forward starts: close the last step's accounting, restart the trace."""
        if self.peak_step:
            self.peak_last = self.peak_step
        self.peak_step = 0
        self._note_peak()
        self.prefetcher.rewind()

    def after_step(self) -> None:
        """Updates are queued: drop device copies they make stale, prefetch the next forward."""
        for i, bp in enumerate(self.params):
            if bp is not None and bp.users == 0 and bp.device_bytes and self.engine.blocks[i].pending is not None:
                self._release(i)
        self.prefetcher.rewind()
        self.prefetcher.issue()

    def device_param_bytes_peak(self) -> int:
        return self.peak_last or self.peak_step

    def release_all(self) -> None:
        for i, bp in enumerate(self.params):
            if bp is not None:
                self._release(i)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for i, bp in enumerate(self.params):
            if bp is not None:
                bp.release()
