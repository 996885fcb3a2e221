"""The training engine: wraps a model, installs the hooks, runs the step.

    engine = offload.initialize(model, config)
    loss = engine(inputs, targets)       # the model's forward
    engine.backward(loss)                # gradients leave the device block by block
    engine.step()                        # at the accumulation boundary

Per block (see blocks.py) the engine keeps the parameters as views into one flat device
buffer, the fp32 master and Adam moments on the configured tier (device, pinned host, NVMe)
and a host gradient buffer. A parameter's gradient is moved off the device by its
post-accumulate-grad hook; when all of a block's parameters have landed, the block is
complete. With no global dependency (no clipping, not fp16) the block's update is queued at
once, so the CPU step overlaps the rest of backward; otherwise ``step()`` computes the global
norm / overflow and queues every block in forward order. Either way ``step()`` returns
without waiting: a forward pre-hook makes each block wait only for its own update.

Across ranks (``torch.distributed``, ``zero_optimization.stage``; one rank is the same path
with no collectives): each block's flat is split into world_size shards and rank r owns
shard r of the optimizer state (stage >= 1), of the gradients (>= 2, reduce-scattered per
block in backward) and of the parameters (3, all-gathered before use). Gradient
collectives are issued in one fixed block order (grad_sync.py); stages 1 and 2 all-gather
the updated parameter shards on one thread in submission order; comm.py owns the groups,
timeouts, errors and byte accounting. The global norm is all-reduced from local shards,
so clipping and fp16 overflow decisions agree on every rank.
"""
from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from offload.engine import blocks as blk
from offload import device as dev
from offload.dist import sharding
from offload.engine.block_shard import BlockShard
from offload.dist.comm import Comm
from offload.dist.grad_sync import GradSync
from offload.config import Config
from offload.engine.grads import GradBuffer
from offload.engine.memory_plan import GradHome
from offload.engine.loss_scaler import LossScaler
from offload.optim.state import OptimState, Tier
from offload.optim.pipeline import StepArgs, StepPipeline
from offload.engine.telemetry import Telemetry

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _fill_flat(flat: torch.Tensor, part: blk.BlockLayout) -> None:
    """Write a part's parameter values into ``flat`` (padding zeroed), converting dtypes."""
    with torch.no_grad():
        flat.zero_()
        for sg in part.segments:
            flat[sg.offset:sg.offset + sg.numel].copy_(sg.param.detach().reshape(-1))


class _ParamGroups(torch.optim.Optimizer):
    """The engine's optimizer as torch sees it: param groups and their hyper-parameters, so
    torch LR schedulers work. The update itself is the engine's; ``step()`` is bookkeeping."""

    def __init__(self, groups, defaults):
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # called by Engine.step(); the scheduler tracks the call
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # the engine owns gradient buffers


def initialize(model: nn.Module, config: Any = None, param_groups: Optional[Sequence[dict]] = None) -> "Engine":
    """Wrap ``model`` for training with offloaded optimizer state.

    ``config``: a dict, a path to a JSON file (engine or DeepSpeed layout) or ``offload.Config``.
    ``param_groups``: optional torch-style groups (``[{"params": [...], "lr": ...}, ...]``);
    by default one group of all parameters with ``requires_grad``."""
    return Engine(model, Config.from_any(config), param_groups)


class Engine:
    def __init__(self, model: nn.Module, config: Config, param_groups=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"offload.initialize needs an nn.Module, not {type(model).__name__}")
        self.config = config
        self.comm = Comm(config.zero_optimization.timeout_s)
        self.stage = config.zero_optimization.stage
        self.module = model
        self.device = dev.compute_device()
        dev.return_freed_host_memory()
        self.dtype = _DTYPES[config.precision]
        self.telemetry = Telemetry()
        self.optimizer = self._make_optimizer(model, param_groups)
        group_of = {id(p): gi for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        self.layouts = blk.build_layouts(model, config.blocks, group_of, world_size=self.comm.world)
        # Frozen parameters are offloaded with their blocks whenever parameters are:
        # (root name, root module, parts) per block root holding any
        self.frozen = blk.frozen_parts(model, config.blocks, self._frozen_dtype) \
            if self._param_home_device() != "none" else []
        from offload.engine.memory_plan import plan as memory_plan
        sizes = self._block_sizes()
        esize = torch.empty((), dtype=self.dtype).element_size()
        self.plan = memory_plan(sizes, config, self.comm.world, self.comm.rank, esize)
        if self.plan.param_budget is not None:     # the default budget covers the working set
            self._working_set = self._find_working_set([bp.device_bytes for bp in self.plan.blocks])
            self.plan = memory_plan(sizes, config, self.comm.world, self.comm.rank, esize,
                                    working_set=self._working_set[0])
        self.comm.check_same("model and config", self._signature())
        self._param_order = {id(p): i for i, p in enumerate(model.parameters())}
        self.tier = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}[config.offload_optimizer.device]
        self._store = None
        self._host_pool = None
        self._swap_pool = None
        self._param_store = None          # parameter home tier (offload_param), see _build_param_homes
        self._param_home_pool = None
        self._param_stage_pool = None
        self._param_write_pool = None
        self.param_offload = None
        self.units = []                   # BlockParts per block that visits the device (param offload)
        self.blocks: List[BlockShard] = []
        self._hooks = []
        self._closed = False
        try:
            self._build_storage()
            self._build_param_homes()
            self._build_blocks()
            self._move_rest(model)
            self._install_hooks()
            self._start_param_offload()
        except BaseException:
            self._release_storage()
            raise
        self.scaler = LossScaler(config.loss_scaler, enabled=config.precision == "fp16")
        self._overlap = self._overlap_possible()
        self.grad_sync = GradSync(self.comm, self.blocks, self.stage, self.telemetry)
        self._gatherer = None         # one thread: post-update parameter all-gathers (stages 1, 2)
        if self.comm.active and self.stage in (1, 2):
            self._gatherer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-gather")
        self.pipeline = StepPipeline(self.blocks, workers=config.optimizer_workers,
                                     slots=self._swap_slots, telemetry=self.telemetry,
                                     compute_device=self.device, copy_param=self.dtype == torch.float32,
                                     param_write_pool=self._param_write_pool, grad_sync=self.grad_sync)
        self._d2h = dev.new_stream(self.device)
        self.global_step = 0      # optimizer steps taken (skipped fp16 steps excluded)
        self.micro_step = 0       # backward calls
        self._boundary = False    # the current backward closes an accumulation window
        self._window_submitted = False
        self._completion: List[int] = []       # block completion order in the last backward
        self._arrival: List[int] = []
        self._norms: list = []                  # futures of per-block gradient norms (clipping, fp16)
        self._last_order: Optional[List[int]] = None

    # ---- construction ---------------------------------------------------------------------
    def _signature(self) -> dict:
        """What must be equal on every rank: the blocks and the config's essentials."""
        c = self.config
        return {"blocks": [(lay.name, lay.numel, [s.name for s in lay.segments]) for lay in self.layouts],
                "stage": c.zero_optimization.stage, "precision": c.precision,
                "gradient_accumulation_steps": c.gradient_accumulation_steps,
                "gradient_clipping": c.gradient_clipping, "optimizer": dataclasses.asdict(c.optimizer),
                "overlap_step": c.overlap_step, "offload_param": c.offload_param.device != "none"}

    def _shard(self, lay: blk.BlockLayout) -> tuple:
        """This rank's [start, end) of the block's padded flat: its optimizer state (stage >= 1)."""
        if self.stage == 0:
            return 0, lay.padded_numel
        return sharding.shard_range(lay.numel, self.comm.world, self.comm.rank)

    def _grad_numel(self, lay: blk.BlockLayout) -> int:
        """The persistent gradient buffer: the shard from stage 2 on, else the full flat."""
        s0, s1 = self._shard(lay)
        return s1 - s0 if self.stage >= 2 else lay.padded_numel

    def _make_optimizer(self, model, param_groups) -> _ParamGroups:
        o = self.config.optimizer
        defaults = {"lr": o.lr, "betas": o.betas, "eps": o.eps, "weight_decay": o.weight_decay}
        if param_groups is None:
            param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        groups = []
        for g in param_groups:
            g = dict(g)
            g["params"] = [p for p in g["params"] if p.requires_grad]
            unknown = set(g) - set(defaults) - {"params", "name"}
            if unknown:
                raise ValueError(f"param group keys {sorted(unknown)} are not used by offload: "
                                 f"use lr, betas, eps, weight_decay")
            groups.append(g)
        return _ParamGroups(groups, defaults)

    def _block_sizes(self) -> list:
        """The blocks as the memory plan sees them (trained blocks first, then frozen-only)."""
        from offload.engine.memory_plan import BlockSize
        return [BlockSize(name, lay.numel if lay is not None else 0,
                          tuple(self._frozen_part_bytes(p) for p in parts))
                for name, _, lay, parts in self._unit_parts()]

    def _build_storage(self) -> None:
        """Host pools and NVMe stores, sized by the memory plan (engine/memory_plan.py says
        what each pool holds)."""
        from offload.engine.memory_plan import GradHome
        from offload.storage.pinned_pool import HostPool
        cfg, plan = self.config, self.plan
        pin = cfg.offload_optimizer.pin_memory and dev.can_pin()

        def pool(name):
            pl = plan.pool(name)
            return HostPool(list(pl.slots), pin=pin, name=name) if pl is not None else None
        self._grad_pool = pool("offload-grads")
        self._host_pool = pool("offload-host")
        self._swap_slots = max(cfg.offload_optimizer.buffer_count, cfg.optimizer_workers + 1)
        if self.tier is Tier.NVME:
            from offload.storage.nvme import NvmeStore
            a = cfg.aio
            self._store = NvmeStore(cfg.offload_optimizer.nvme_path, backend=a.backend, block_size=a.block_size,
                                    queue_depth=a.queue_depth, threads=a.thread_count, checksum=a.checksum,
                                    name="optimizer")
            self._store.reserve({self._state_key(lay): bp.state_bytes for lay, bp in zip(self.layouts, plan.blocks)})
            self._swap_pool = pool("offload-swap")
            if plan.grad_home is GradHome.SPILL:   # gradients parked beside the optimizer state
                self._store.reserve({f"b{lay.index}.grad": bp.grad_numel * plan.grad_bytes
                                     for lay, bp in zip(self.layouts, plan.blocks)})
        elif plan.grad_home is GradHome.SPILL:
            raise ValueError("offload_optimizer.grad_host_bytes is smaller than the model's gradients, which "
                             "then go to the NVMe tier: set offload_optimizer.device to nvme (with nvme_path), "
                             "or raise grad_host_bytes")

    # ---- parameter offload ------------------------------------------------------------------
    def _home_numel(self, lay: blk.BlockLayout) -> int:
        """Elements of a block's parameter home: the shard with ZeRO-3, else the full flat."""
        s0, s1 = self._shard(lay)
        return s1 - s0 if self.stage == 3 else lay.padded_numel

    def _home_bytes(self, lay: blk.BlockLayout) -> int:
        return self._home_numel(lay) * torch.empty((), dtype=self.dtype).element_size()

    def _param_home_device(self) -> str:
        """ZeRO-3 keeps parameters as shards even without offload_param: at home on the host."""
        pc = self.config.offload_param
        return "cpu" if pc.device == "none" and self.stage == 3 else pc.device

    def _frozen_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype a frozen parameter is kept in: its own, or the compute dtype when that is
        narrower (an fp32 frozen weight in a bf16 run); a bf16 base beside fp32 training
        stays bf16. Integer parameters keep theirs."""
        if not p.is_floating_point():
            return p.dtype
        own, comp = p.element_size(), torch.empty((), dtype=self.dtype).element_size()
        return self.dtype if comp < own else p.dtype

    def _unit_parts(self) -> list:
        """(name, module, trainable layout or None, frozen part layouts) per block that
        visits the device: the trained blocks in order, then blocks holding only frozen
        parameters."""
        frozen = {name: (mod, parts) for name, mod, parts in self.frozen}
        units = [(lay.name, lay.module, lay, frozen.pop(lay.name, (None, []))[1]) for lay in self.layouts]
        units += [(name, mod, None, parts) for name, (mod, parts) in frozen.items()]
        return units

    def _frozen_part_bytes(self, part: blk.BlockLayout) -> int:
        return part.padded_numel * torch.empty((), dtype=self._frozen_dtype(part.segments[0].param)).element_size()

    def _find_working_set(self, unit_bytes: List[int]) -> tuple:
        """(bytes, blocks): the largest set of blocks one module's forward needs on the
        device at once (see params/offload.py ``working_set``)."""
        from offload.params.offload import working_set
        owner = {}
        units = self._unit_parts()
        for i, (_, _, lay, parts) in enumerate(units):
            for part in ([lay] if lay is not None else []) + parts:
                for sg in part.segments:
                    owner[id(sg.param)] = i
        return working_set(self.module, owner, [u[1] for u in units], unit_bytes)

    def _check_budget(self, budget: int, unit_bytes: List[int]) -> None:
        """The device budget is a contract: it must hold the working set."""
        from offload.params.offload import DeviceBudgetError
        units = self._unit_parts()
        need, which = self._working_set
        if budget < need:
            names = ", ".join(repr(units[i][0] or "<root>") for i in which)
            raise DeviceBudgetError(
                f"offload_param.device_budget_bytes={budget} ({budget / 2**30:.3f} GiB) cannot hold the "
                f"parameters one forward step needs at once: blocks {names} take {need} bytes "
                f"({need / 2**30:.3f} GiB). The smallest budget that works is {need}; "
                f"{need + max(unit_bytes)} lets the next block arrive while one runs")

    def _build_param_homes(self) -> None:
        """Host or NVMe homes for the parameter copies (trainable and frozen parts) when
        offload_param asks for them; pools sized by the memory plan."""
        from offload.engine import memory_plan as mp
        from offload.storage.pinned_pool import HostPool
        pc = self.config.offload_param
        home_device = self._param_home_device()
        if home_device == "none":
            return
        units, plan = self._unit_parts(), self.plan
        sizes = [bp.device_bytes for bp in plan.blocks]
        largest = max(sizes)
        budget = plan.param_budget
        self._check_budget(budget, sizes)
        self._param_budget = budget
        self._device_lookahead = mp.device_lookahead(self.config, budget, largest)
        self._host_lookahead = mp.host_lookahead(self.config, budget)
        pin = pc.pin_memory and dev.can_pin()

        def pool(name):
            return HostPool(list(plan.pool(name).slots), pin=pin, name=name)
        if home_device == "cpu":
            self._param_home_pool = pool("offload-param-home")
            return
        from offload.storage.nvme import NvmeStore
        a = self.config.aio
        self._param_store = NvmeStore(pc.nvme_path, backend=a.backend, block_size=a.block_size,
                                      queue_depth=a.queue_depth, threads=a.thread_count, checksum=a.checksum,
                                      name="params")
        homes = [([bp.home_bytes] if bp.padded_numel else []) + list(bp.frozen) for bp in plan.blocks]
        self._param_store.reserve({key: n for i, hs in enumerate(homes)
                                   for key, n in zip(self._part_keys(i, units[i]), hs)})
        self._param_stage_pool = pool("offload-param-stage")
        self._param_write_pool = pool("offload-param-write")

    @staticmethod
    def _part_keys(i: int, unit) -> List[str]:
        """NVMe keys of block i's parts: the trainable part keeps today's key."""
        _, _, lay, parts = unit
        return ([f"b{i}.param"] if lay is not None else []) + [f"b{i}.frozen{k}" for k in range(len(parts))]

    def _frozen_home(self, i: int, k: int, part: blk.BlockLayout):
        """The BlockParams of frozen part ``k`` of block ``i``, its values written home from
        the parameters (materialized from the meta device block by block when needed),
        whose original memory then goes."""
        from offload.params.residency import BlockParams
        blk.materialize_meta(part)
        dtype = self._frozen_dtype(part.segments[0].param)
        n, nbytes = part.padded_numel, self._frozen_part_bytes(part)
        if self._param_home_device() == "cpu":
            home = self._param_home_pool.acquire(nbytes).view(dtype, n)
            _fill_flat(home, part)
            bp = BlockParams(part, dtype, self.device, home_buf=home)
        else:
            bp = BlockParams(part, dtype, self.device, store=self._param_store, pool=self._param_stage_pool,
                             key=f"b{i}.frozen{k}")
            with self._param_stage_pool.acquire(nbytes) as loan:   # page-aligned: O_DIRECT
                flat = loan.view(dtype, n)
                _fill_flat(flat, part)
                bp.write_home(flat)
        bp.release_initial()
        return bp

    def _param_home(self, lay: blk.BlockLayout):
        from offload.params.residency import BlockParams
        home_device = self._param_home_device()
        if home_device == "none":
            return None
        n = self._home_numel(lay)
        gather = None
        if self.stage == 3 and self.comm.active:
            what = f"param allgather of block {lay.index} ({lay.name or '<root>'})"

            def gather(full, shard, what=what):
                with self.telemetry.span("offload::param_allgather"):
                    return self.comm.all_gather(full, shard, what, async_op=True)
        kw = {"home_numel": n, "gather": gather}
        if home_device == "cpu":
            home = self._param_home_pool.acquire(self._home_bytes(lay)).view(self.dtype, n)
            return BlockParams(lay, self.dtype, self.device, home_buf=home, **kw)
        return BlockParams(lay, self.dtype, self.device, store=self._param_store, pool=self._param_stage_pool,
                           write_pool=self._param_write_pool, key=f"b{lay.index}.param", **kw)

    def _start_param_offload(self) -> None:
        from offload.params.offload import ParamOffload
        if self._param_home_device() == "none":
            return
        self.param_offload = ParamOffload(self, self.units, budget=self._param_budget,
                                          device_lookahead=self._device_lookahead,
                                          host_lookahead=self._host_lookahead,
                                          prefetch=self.config.prefetch.enabled)
        offloaded = {id(s.param) for u in self.units for _, s in u.segments}
        self.param_offload.resident_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters()
                                                if id(p) not in offloaded)

    def _overlap_possible(self) -> bool:
        c = self.config
        return c.overlap_step and c.gradient_clipping == 0.0 and c.precision != "fp16"

    def _jobs_in_flight(self) -> bool:
        """Whether work in flight will give a gradient buffer back (an update, or a park)."""
        return any((b.pending is not None and not b.pending.done()) or b.grad.parking for b in self.blocks)

    def _grad_dtype(self) -> torch.dtype:
        # Without accumulation the gradient crosses to the host in the compute dtype and the
        # kernel reads it directly; with accumulation the host sums in fp32.
        if self.config.gradient_accumulation_steps == 1 and self.config.precision == "bf16":
            return self.dtype
        return torch.float32

    @staticmethod
    def _state_key(lay: blk.BlockLayout) -> str:
        return f"b{lay.index}.state"

    def _build_blocks(self) -> None:
        grad_dtype = self._grad_dtype()
        for lay in self.layouts:
            s0, s1 = self._shard(lay)
            n, gn = s1 - s0, self._grad_numel(lay)
            blk.materialize_meta(lay)
            full = blk.gather_flat(lay, torch.float32, "cpu")    # from the original fp32 values
            master = full[s0:s1]
            if self.tier is Tier.DEVICE:
                state = OptimState(self._state_key(lay), n, Tier.DEVICE,
                                   tensor=torch.zeros(3 * n, dtype=torch.float32, device=self.device))
                grad = GradBuffer(torch.zeros(gn, dtype=grad_dtype, device=self.device), len(lay.segments))
            else:
                if self._grad_pool is not None:
                    spill = self._store if self.plan.grad_home is GradHome.SPILL else None
                    grad = GradBuffer(None, len(lay.segments), numel=gn, dtype=grad_dtype, pool=self._grad_pool,
                                      has_jobs=self._jobs_in_flight, spill=spill, key=f"b{lay.index}.grad")
                else:
                    nb = gn * torch.empty((), dtype=grad_dtype).element_size()
                    grad = GradBuffer(self._host_pool.acquire(nb).view(grad_dtype, gn), len(lay.segments))
                if self.tier is Tier.HOST:
                    t = self._host_pool.acquire(3 * n * 4).view(torch.float32, 3 * n)
                    state = OptimState(self._state_key(lay), n, Tier.HOST, tensor=t)
                else:
                    state = OptimState(self._state_key(lay), n, Tier.NVME, pool=self._swap_pool, store=self._store)

            def fill(t, master=master):
                t[0].copy_(master)
                t[1:].zero_()
            state.overwrite(fill)
            state.reclaim(block=True)
            params = self._param_home(lay)
            if params is None:
                param_flat = full.to(device=self.device, dtype=self.dtype)
                blk.bind_views(lay, param_flat)
            else:                          # offloaded: written home, never whole on the device
                param_flat = None
                home = full if params.home_numel == full.numel() else master
                params.write_home(home.to(self.dtype))
                params.release_initial()
            landing = None
            if self.stage >= 2:            # full-size, lives only until reduce-scattered
                landing = GradBuffer(None, len(lay.segments), numel=lay.padded_numel, dtype=grad_dtype,
                                     device=self.device)
            self.blocks.append(BlockShard(lay, param_flat, state, grad, (s0, s1), params=params,
                                          landing=landing))
            del full, master
        self._build_units()

    def _build_units(self) -> None:
        """The BlockParts of parameter offload: each trained block's part with the frozen
        parts of the same root, then blocks holding only frozen parameters."""
        from offload.params.parts import BlockParts
        if self._param_home_device() == "none":
            return
        for i, (name, module, lay, parts) in enumerate(self._unit_parts()):
            frozen = [self._frozen_home(i, k, part) for k, part in enumerate(parts)]
            trainable = self.blocks[i].params if lay is not None else None
            self.units.append(BlockParts(i, name, module, trainable, frozen))
        dev.return_freed_host_memory()

    def _move_rest(self, model: nn.Module) -> None:
        """Frozen parameters that are not offloaded go to the device (in the dtype
        ``_frozen_dtype`` gives), buffers in the compute dtype."""
        bound = {id(s.param) for lay in self.layouts for s in lay.segments}
        bound |= {id(s.param) for _, _, parts in self.frozen for part in parts for s in part.segments}
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if id(t) not in bound and t.is_meta:
                raise blk.ModelError(f"{name!r} is on the meta device but is not trainable block state: "
                                     f"materialize frozen parameters and buffers before offload.initialize")
        for m in model.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) not in bound:
                    p.data = p.data.to(device=self.device, dtype=self._frozen_dtype(p))
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b.to(device=self.device, dtype=self.dtype if b.is_floating_point() else None)

    def _install_hooks(self) -> None:
        # Each block's update must land before any module that reads its parameters runs:
        # its own module, and modules that share a parameter with it (tied weights).
        owner = {id(s.param): b for b in self.blocks for s in b.layout.segments}
        for m in self.module.modules():
            waits = {owner[id(p)].index: owner[id(p)] for p in m.parameters(recurse=False) if id(p) in owner}
            for b in self.blocks:
                if b.layout.module is m:
                    waits[b.index] = b
            if waits:
                self._hooks.append(m.register_forward_pre_hook(self._make_wait_hook(list(waits.values()))))
        for b in self.blocks:
            for i, s in enumerate(b.layout.segments):
                self._hooks.append(s.param.register_post_accumulate_grad_hook(self._make_grad_hook(b, i, s)))

    def _make_wait_hook(self, blocks: List[BlockShard]):
        def hook(module, args):
            for b in blocks:
                if b.pending is not None or b.update_event is not None:
                    with self.telemetry.span("offload::wait_update"):
                        b.wait_update()
        return hook

    def _make_grad_hook(self, block: BlockShard, index: int, seg: blk.Segment):
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            buf = block.landing or block.grad    # full-size either way: land at the flat offset
            with self.telemetry.span("offload::grad_d2h", "d2h", grad.numel() * grad.element_size()):
                buf.land(index, seg.offset, grad, self._d2h)
            param.grad = None   # device gradient memory is freed (the D2H holds it via record_stream)
            if buf.complete:
                self._on_block_complete(block)
        return hook

    # ---- training -------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        with self.telemetry.span("offload::forward"):
            return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def parameters(self):
        return self.module.parameters()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` averaged over the accumulation window (divided by
        gradient_accumulation_steps, as DeepSpeed does), scaled for fp16."""
        self._check_open()
        gas = self.config.gradient_accumulation_steps
        self._boundary = (self.micro_step + 1) % gas == 0
        self._window_submitted = False
        self._completion = []             # blocks in the order their collectives were issued
        self._arrival = []                # ... in the order their gradients completed
        self.grad_sync.begin(self._boundary)
        if self._boundary:
            self._norms = []
        for b in self.blocks:
            (b.landing or b.grad).begin_backward()
            if b.pending is not None:     # the grads of this window go into buffers the
                b.wait_update()           # previous update may still read
        if self._boundary and self._overlap and self.tier is Tier.NVME:
            self.pipeline.set_order(self._last_order or [b.index for b in reversed(self.blocks)])
        scaled = loss / gas if gas > 1 else loss
        if self.scaler.enabled:
            scaled = scaled * self.scaler.scale
        with self.telemetry.span("offload::backward"):
            scaled.backward()
        self.micro_step += 1
        for b in self.blocks:             # parameters that took no part in this backward
            buf = b.landing or b.grad
            if not buf.complete:
                buf.arrived = buf.num_segments
                self._on_block_complete(b)
        if self._boundary:
            self._last_order = list(self._completion)
        else:
            self.grad_sync.wait_all()     # accumulated in place before the next backward lands

    def _on_block_complete(self, block: BlockShard) -> None:
        self._arrival.append(block.index)
        if self.param_offload is not None:
            self.param_offload.on_grads_complete(block.index)
        for b in self.grad_sync.ready(block):    # collectives issued in the fixed block order
            self._completion.append(b.index)
            if self._boundary and self._overlap:
                self._submit(b, grad_scale=1.0)
                continue
            # the global norm needs every block: compute this block's share now, on a
            # worker, while backward goes on
            norm = self._boundary and self._needs_norm() and not self.comm.active
            if b.grad.spills:             # the sum waits for the next micro-step or step():
                fut = b.grad.start_park(self.pipeline.run,        # on NVMe, after its norm
                                        (lambda b=b: self._block_norms(b)) if norm else None)
                if norm:
                    self._norms.append(fut)
            elif norm:
                self._norms.append(self.pipeline.run(self._block_norms, b))

    def _submit(self, block: BlockShard, grad_scale: float) -> None:
        if not self.comm.active and not block.grad.close_window(block.layout.segments):
            block.grad.reset_window()     # no gradient at all: torch skips such parameters
            return
        groups = tuple((g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"])
                       for g in self.optimizer.param_groups)
        args = StepArgs(step=block.stepped + 1, groups=groups, adamw=self.config.optimizer.type == "AdamW",
                        grad_scale=grad_scale, compute_done=dev.record_event(dev.current_stream(self.device)))
        fut = self.pipeline.submit(block, args)
        if self._gatherer is not None:    # then every rank's updated shard to every rank
            block.pending = self._gatherer.submit(self._gather_params, block, fut)

    def _gather_params(self, block: BlockShard, job) -> None:
        """On the gather thread, in submission order (the same on every rank): wait for the
        block's update, then all-gather the updated shards into the full parameter buffer."""
        job.result()
        s0, s1 = block.shard
        with self.telemetry.span("offload::param_allgather"):
            shard = block.param_flat[s0:s1].clone()   # the input must not alias the output
            self.comm.all_gather(block.param_flat, shard, f"param allgather of block {block.index} ({block.name})",
                                 group="side")

    def step(self) -> bool:
        """Apply the optimizer at an accumulation boundary (a no-op between boundaries).
        Returns False when an fp16 overflow skipped the step. Does not wait for the update:
        the next forward of each block waits for that block alone."""
        self._check_open()
        if not self._boundary or self._window_submitted:
            return False
        self._window_submitted = True
        self._boundary = False
        self.comm.step = self.global_step + 1
        if self.comm.active:              # the ranks took the same path through the model
            self.comm.check_same("block order of backward", self._arrival)
        if not self._overlap:
            self.grad_sync.wait_all()
            coef, overflow = 1.0, False
            if self._needs_norm():
                with self.telemetry.span("offload::grad_norm"):
                    coef, overflow = self._unscale_clip_coef()
            if overflow:
                self.scaler.update(True)
                for b in self.blocks:
                    b.grad.reset_window()
                self.telemetry.count("skipped_steps")
                return False
            self.scaler.update(False)
            if self.tier is Tier.NVME:
                self.pipeline.set_order([b.index for b in self.blocks])
            for b in self.blocks:
                self._submit(b, coef)
        self.global_step += 1
        self.optimizer.step()
        if self.param_offload is not None:
            self.param_offload.after_step()
        return True

    def _needs_norm(self) -> bool:
        return self.config.gradient_clipping > 0 or self.scaler.enabled

    def _block_norms(self, block: BlockShard):
        """(parameter order, norm) of each parameter of ``block`` that got a gradient in
        this window, as torch.nn.utils.clip_grad_norm_ computes them (it skips grad None)."""
        self.grad_sync.wait(block)
        block.grad.wait_landed()
        g = block.grad_shard()
        items = [(self._param_order.get(id(s.param), 0), g[s.offset - block.shard[0]:][:s.numel])
                 for i, s in enumerate(block.layout.segments) if block.grad.seen(i)]
        if not items:
            return []
        norms = torch._foreach_norm([g for _, g in items], 2.0)
        return [(o, n) for (o, _), n in zip(items, norms)]

    def _unscale_clip_coef(self):
        """(grad_scale for the kernel, overflow) from the global gradient norm, computed as
        torch.nn.utils.clip_grad_norm_ does: per-parameter norms (parameters without a
        gradient skipped), stacked in model.parameters() order, then the norm of those."""
        if not self.comm.active:          # per-block norms were computed during backward
            per_param = [item for fut in self._norms for item in fut.result()]
            self._norms = []
            per_param.sort(key=lambda t: t[0])
            norms = [n for _, n in per_param]
        else:
            per_param = []
            partitioned = self.stage >= 1   # each rank holds the grads of its shard
            for b in self.blocks:
                b.grad.wait_landed()
                s0, s1 = b.shard
                g = b.grad_shard()
                for s in b.layout.segments:
                    r = sharding.clip_range(s.offset, s.offset + s.numel, s0, s1) if partitioned \
                        else (s.offset, s.offset + s.numel)
                    if r is not None:
                        per_param.append((self._param_order.get(id(s.param), 0), g[r[0] - s0:r[1] - s0]))
            per_param.sort(key=lambda t: t[0])
            norms = torch._foreach_norm([g for _, g in per_param], 2.0)
        total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0) if len(norms) \
            else torch.zeros(())
        if self.comm.active and self.stage >= 1:   # sqrt of the sum over ranks of the local squares
            sq = (total.double() ** 2).reshape(1)
            self.comm.all_reduce(sq, "gradient norm")
            total = sq.sqrt()[0].float()
        inv_scale = 1.0 / self.scaler.scale
        if not math.isfinite(total.item()):
            return 1.0, True
        coef = inv_scale
        clip = self.config.gradient_clipping
        if clip > 0:
            unscaled = total * inv_scale if self.scaler.enabled else total
            c = torch.clamp(clip / (unscaled + 1e-6), max=1.0)
            coef = c.item() * inv_scale if self.scaler.enabled else c.item()
        return coef, False

    def synchronize(self) -> None:
        """Wait until every queued update is applied and every state write has completed."""
        self.pipeline.wait_all()
        dev.synchronize(self.device)

    # ---- state ----------------------------------------------------------------------------
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Consolidated fp32 weights with the keys of ``model.state_dict()`` (on the CPU)."""
        from offload.io import checkpoint
        self.synchronize()
        return checkpoint.live_state_dict(self)

    def save_checkpoint(self, path: str) -> str:
        from offload.io import checkpoint
        self._check_open()
        self.synchronize()
        return checkpoint.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        from offload.io import checkpoint
        self._check_open()
        self.synchronize()
        checkpoint.load(self, path)

    def stats(self) -> dict:
        snap = self.telemetry.snapshot()
        resident = sum(b.param_flat.numel() * b.param_flat.element_size() for b in self.blocks
                       if b.param_flat is not None)
        po = self.param_offload
        dev_bytes = resident + (po.prefetcher.device_bytes() if po is not None else 0)
        if self.tier is Tier.DEVICE:
            dev_bytes += sum(b.state.nbytes + b.grad.tensor.numel() * b.grad.tensor.element_size()
                             for b in self.blocks)
        pools = [p for p in (self._host_pool, self._swap_pool, self._param_home_pool, self._param_stage_pool,
                             self._param_write_pool, self._grad_pool) if p is not None]
        host = sum(p.stats()["capacity_bytes"] for p in pools)
        host_peak = sum(p.stats()["peak_bytes"] for p in pools)
        nvme = sum(st.stats().get("reserved_bytes", 0) for st in (self._store, self._param_store) if st is not None)
        snap.update({
            "step": self.global_step, "micro_step": self.micro_step,
            "tier_bytes": {"device": dev_bytes, "host": host, "nvme": nvme},
            "loss_scale": self.scaler.scale if self.scaler.enabled else None,
            "skipped_steps": self.scaler.skipped,
            "device_param_bytes_peak": (po.device_param_bytes_peak() if po is not None
                                        else resident + sum(p.numel() * p.element_size()
                                                            for p in self.module.parameters() if not p.requires_grad)),
            "prefetch": {k: snap["counters"].get(f"prefetch_{k}", 0) for k in ("hits", "misses", "divergences",
                                                                                   "retraces")},
            "param_budget_overruns": po.overruns if po is not None else 0,
            "world_size": self.comm.world, "rank": self.comm.rank, "zero_stage": self.stage,
            "partitioned_bytes": self._partitioned_bytes(),
            "comm_bytes": {k: self.comm.bytes.get(k, 0) for k in ("allreduce", "reduce_scatter", "allgather")},
        })
        snap["peaks"]["host_pool"] = host_peak
        # NVMe links from the stores themselves: bytes that reached the disk over the time
        # requests were in flight (the engine's own spans only see the waits)
        for d, key in (("read", "bytes_read"), ("write", "bytes_written")):
            stores = [st.stats() for st in (self._store, self._param_store) if st is not None]
            n, sec = sum(x[key] for x in stores), sum(x[f"{d}_seconds"] for x in stores)
            if n:
                snap["bytes"][f"nvme_{d}"] = n
                snap["gbps"][f"nvme_{d}"] = n / sec / 1e9 if sec > 0 else 0.0
        return snap

    def _partitioned_bytes(self) -> dict:
        """This rank's resident bytes of each kind ZeRO partitions: 1/world_size of the
        single-rank figure (plus padding) for the kinds the stage partitions."""
        gsize = torch.empty((), dtype=self._grad_dtype()).element_size()
        esize = torch.empty((), dtype=self.dtype).element_size()
        params = 0
        for b in self.blocks:
            params += (b.params.home_numel if b.params is not None else b.param_flat.numel()) * esize
        return {"optimizer_state": sum(b.state.nbytes for b in self.blocks),
                "gradients": sum(self._grad_numel(b.layout) * gsize for b in self.blocks),
                "parameters": params}

    def swap_dirs(self) -> Dict[str, str]:
        """The run directories of the NVMe swap stores in use ({"optimizer": ..., "params": ...})."""
        return {k: st.run_dir for k, st in (("optimizer", self._store), ("params", self._param_store))
                if st is not None}

    # ---- teardown -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed: create a new one with offload.initialize")

    def close(self) -> None:
        """Wait for updates in flight, remove hooks, release host buffers and swap files.
        The model keeps its current parameter values (on the device)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.pipeline.close()
        finally:
            if self._gatherer is not None:
                self._gatherer.shutdown(wait=True)
            if self.param_offload is not None:
                self.param_offload.close()
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            self._release_storage()

    def _release_storage(self) -> None:
        for r in (self._store, self._swap_pool, self._host_pool, self._param_store, self._param_home_pool,
                  self._param_stage_pool, self._param_write_pool, getattr(self, "_grad_pool", None)):
            if r is not None:
                r.close()
        self._store = self._swap_pool = self._host_pool = self._param_store = None
        self._param_home_pool = self._param_stage_pool = self._param_write_pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
