"""Building an engine's blocks from its memory plan.

``Builder`` is made with what the model and config say (layouts, frozen parts, the
optimizer's groups, the weights to load) and plans the memory at once (``plan``:
engine/memory_plan.py; the device working set first where parameters are offloaded, and
frozen parts read in place from the checkpoint). ``build(resources)`` then makes, block by
block in forward order, what the plan sized: the optimizer state on its tier, the gradient
home (device, host pool, or parked on NVMe), the parameter home (params/homes.py) or the
resident parameters, and the update-ahead slot, each block one ``Block`` (core/block.py);
then the frozen parts of parameter offload (blocks of frozen parameters only after the
trained ones) and the rest of the model on the device. Every pool and store comes from
``resources`` (storage/resources.py). It returns a ``Built``; the engine keeps that, not the
builder.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import torch
from torch import nn

from offload import device as dev
from offload import dtypes
from offload.core import blocks as blk
from offload.core import sharding
from offload.core.block import Block
from offload.engine.grad_landing import GradBuffer
from offload.engine.memory_plan import placement_refusal
from offload.optim.ahead import AheadSlot
from offload.optim.pipeline import StepPipeline
from offload.optim.state import OptimState, chunk_key
from offload.placement import Placement
from offload.params import homes as ph
from offload.params.write_back import ParamWriteBack
from offload.params.write_through import WriteThrough



def update_rule(config):
    """The config's update rule (offload/optim), or the ConfigError ``placement_refusal`` gives."""
    from offload.config import ConfigError
    from offload.optim import get_rule
    rule = get_rule(config.optimizer.type)
    refused = placement_refusal(config)
    if refused:
        raise ConfigError(refused)
    return rule


def shard_range(lay: blk.BlockLayout, stage: int, comm) -> tuple:
    """This rank's [start, end) of the block's padded flat: its optimizer state (stage >= 1)."""
    if stage == 0:
        return 0, lay.padded_numel
    return sharding.shard_range(lay.numel, comm.world, comm.rank)


def grad_numel(lay: blk.BlockLayout, stage: int, comm) -> int:
    """The persistent gradient buffer: the shard from stage 2 on, else the full flat."""
    s0, s1 = shard_range(lay, stage, comm)
    return s1 - s0 if stage >= 2 else lay.padded_numel


def state_key(lay: blk.BlockLayout) -> str:
    return f"b{lay.index}.state"


def grad_key(lay: blk.BlockLayout) -> str:
    return f"b{lay.index}.grad"


def own_master_params(blocks: List[Block]) -> None:
    """Parameters that were views of the fp32 master (``Builder._master_is_param``) get
    memory of their own, so the state's host buffer can go."""
    for b in blocks:
        b.param_flat = b.param_flat.clone()
        blk.bind_views(b.layout, b.param_flat)


def param_pieces(lay) -> tuple:
    """(offset, numel, shape, group) of each parameter of a block (a per-tensor rule's state
    needs the shapes: engine/memory_plan.py, optim/state.py)."""
    if lay is None:
        return ()
    return tuple((s.offset, s.numel, tuple(s.shape), s.group) for s in lay.segments)


@dataclasses.dataclass
class Built:
    """What ``Builder.build`` made, handed to the engine."""
    blocks: List[Block]                     # every block: the trained ones in forward order, then
                                            # those of frozen parameters only (parameter offload)
    master_params: List[Block]              # blocks whose parameters are views of the fp32 master
    swap_slots: int                         # NVMe state buffers the pipeline cycles through
    write_through: WriteThrough = dataclasses.field(default_factory=WriteThrough)
    homes: Optional[ph.ParamHomes] = None   # parameter offload: the homes, device budget, lookaheads
    param_budget: Optional[int] = None
    device_lookahead: int = 0
    host_lookahead: int = 0


class Builder:
    """Made with the model, config and optimizer (its groups place each parameter); lays out
    the blocks (``layouts``: trained; ``frozen``: (root name, root module, parts) per block
    root holding frozen parameters, offloaded with their blocks whenever parameters are)
    and, given the weights to load, plans the memory (``plan_memory``). ``build`` makes the rest."""

    def __init__(self, *, module: nn.Module, config, comm, device: torch.device, dtype: torch.dtype, rule,
                 state_dtype: str, optimizer, telemetry):
        from offload.optim import quant
        self.module, self.config, self.comm = module, config, comm
        self.stage = config.zero_optimization.stage
        self.device, self.dtype, self.rule, self.state_dtype = device, dtype, rule, state_dtype
        self.optimizer, self.telemetry = optimizer, telemetry
        self.tier = config.offload_optimizer.placement
        self.home_device = ph.home_device(config, self.stage)
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.layouts = blk.build_layouts(module, config.blocks, group_of, world_size=comm.world,
                                         param_align=quant.BLOCK if state_dtype == "int8" else 1)
        self.frozen = blk.frozen_parts(module, config.blocks, lambda p: ph.frozen_dtype(p, dtype)) \
            if self.home_device is not Placement.DEVICE else []
        from offload.params import quantized
        # id(frozen part) -> its codec, for the parts stored quantized (offload_param.frozen_dtype)
        self.codecs = quantized.codecs(self.frozen, config.offload_param, lambda p: ph.frozen_dtype(p, dtype))
        self.roots = ph.block_roots(self.layouts, self.frozen)   # per block: (name, module, layout, frozen parts)

    # ---- the plan ---------------------------------------------------------------------
    def plan_memory(self, weights):
        """The memory plan, with ``weights`` (io/loader.py WeightLoader) the checkpoint the
        blocks load from: frozen parts it stores as kept are read in place."""
        self.weights = weights
        self.in_place = self._plan_in_place()   # id(frozen part) -> file ranges read in place
        self.plan = self._plan()
        return self.plan

    def _plan(self):
        from offload.engine.memory_plan import BlockSize, plan as memory_plan
        config = self.config
        sizes = [BlockSize(name, lay.numel if lay is not None else 0,
                           tuple(ph.frozen_part_bytes(p, self.dtype) for p in parts), param_pieces(lay),
                           tuple(id(p) in self.in_place for p in parts),
                           tuple(self.codecs[id(p)].nbytes if id(p) in self.codecs
                                 else ph.frozen_part_bytes(p, self.dtype) for p in parts))
                 for name, _, lay, parts in self.roots]
        avail = None                  # sizes the cpu activation pool when host_bytes is not set
        if config.offload_activations.placement is Placement.HOST and config.offload_activations.host_bytes is None:
            import psutil
            avail = psutil.virtual_memory().available
        kw = {"host_available": avail}
        esize = self.dtype.itemsize
        plan = memory_plan(sizes, config, self.comm.world, self.comm.rank, esize, **kw)
        self._working_set = None
        if plan.param_budget is not None:     # the default budget covers the working set
            self._working_set = self._find_working_set([bp.device_bytes for bp in plan.blocks])
            plan = memory_plan(sizes, config, self.comm.world, self.comm.rank, esize,
                               working_set=self._working_set[0], **kw)
        return plan

    def _plan_in_place(self) -> dict:
        """Frozen parts whose home is the checkpoint itself (offload_param nvme, weights= a
        safetensors checkpoint, every parameter stored there in the dtype it is kept in):
        each part's layout becomes the file ranges covering its tensors, concatenated
        (storage/source.py ``in_place_layout``), so a staged part is read with O_DIRECT
        straight into its buffer. ``id(part) -> ranges``."""
        from offload.storage.source import in_place_layout
        if (self.home_device is not Placement.NVME or not self.config.offload_param.frozen_in_place
                or self.weights.files is None):
            return {}
        out = {}
        for _, _, parts in self.frozen:
            for part in parts:
                if id(part) in self.codecs:        # stored quantized: its own bytes, not the checkpoint's
                    continue
                dtype = ph.frozen_dtype(part.segments[0].param, self.dtype)
                exts = self.weights.in_place_extents([s.param for s in part.segments], dtype)
                if exts is None:
                    continue
                ranges, offsets, nbytes = in_place_layout(exts)
                esize = dtype.itemsize
                for s, off in zip(part.segments, offsets):
                    s.offset = off // esize
                part.padded_numel = nbytes // esize
                out[id(part)] = ranges
        return out

    def _find_working_set(self, block_bytes: List[int]) -> tuple:
        """(bytes, blocks): the largest set of blocks one module's forward needs on the
        device at once (see params/budget.py ``working_set``)."""
        from offload.params.budget import working_set
        owner = {}
        for i, (_, _, lay, parts) in enumerate(self.roots):
            for part in ([lay] if lay is not None else []) + parts:
                for sg in part.segments:
                    owner[id(sg.param)] = i
        return working_set(self.module, owner, [u[1] for u in self.roots], block_bytes)

    def _check_budget(self, budget: int, block_bytes: List[int]) -> None:
        """The device budget is a contract: it must hold the working set."""
        from offload.params.budget import DeviceBudgetError
        need, which = self._working_set
        if budget < need:
            names = ", ".join(repr(self.roots[i][0] or "<root>") for i in which)
            raise DeviceBudgetError(
                f"offload_param.device_budget_bytes={budget} ({budget / 2**30:.3f} GiB) cannot hold the "
                f"parameters one forward step needs at once: blocks {names} take {need} bytes "
                f"({need / 2**30:.3f} GiB). The smallest budget that works is {need}; "
                f"{need + max(block_bytes)} lets the next block arrive while one runs")

    def signature(self) -> dict:
        """What must be equal on every rank: the blocks and the config's essentials."""
        c = self.config
        return {"blocks": [(lay.name, lay.numel, [s.name for s in lay.segments]) for lay in self.layouts],
                "stage": c.zero_optimization.stage, "precision": c.precision,
                "gradient_accumulation_steps": c.gradient_accumulation_steps,
                "gradient_clipping": c.gradient_clipping, "optimizer": dataclasses.asdict(c.optimizer),
                "overlap_step": c.overlap_step, "offload_param": c.offload_param.placement is not Placement.DEVICE}

    # ---- building -----------------------------------------------------------------------
    def build(self, resources, on_param_write_failure: Callable[[int, BaseException], None]) -> Built:
        """Make every block in forward order, then parameter offload's frozen parts (and the
        blocks of frozen parameters only) and the rest of the model on the device. Pools and stores come from ``resources``; on an
        error the caller releases them."""
        cfg = self.config
        self._res = resources
        self._storage()
        built = Built([], [], swap_slots=max(cfg.offload_optimizer.buffer_count, cfg.optimizer_workers + 1))
        if self.home_device is not Placement.DEVICE:
            from offload.engine import memory_plan as mp
            sizes = [bp.device_bytes for bp in self.plan.blocks]
            budget = self.plan.param_budget
            self._check_budget(budget, sizes)
            built.param_budget = budget
            built.device_lookahead = mp.device_lookahead(cfg, budget, max(sizes))
            built.host_lookahead = mp.host_lookahead(cfg, budget)
            built.homes = ph.ParamHomes(config=cfg, stage=self.stage, comm=self.comm, dtype=self.dtype,
                                        device=self.device, telemetry=self.telemetry, weights=self.weights,
                                        plan=self.plan, roots=self.roots, in_place=self.in_place, codecs=self.codecs,
                                        resources=resources, on_write_failure=on_param_write_failure)
        self._homes = built.homes
        self._blocks(built)
        self._frozen_blocks(built)
        self._move_rest()
        return built

    def pipeline(self, built: Built, resources, grad_sync) -> StepPipeline:
        """The optimizer's block jobs over the trained blocks, writing each update's
        parameters back through a ``ParamWriteBack`` (which keeps the new copies staged that
        ``built.write_through`` names: params/write_through.py)."""
        cfg = self.config
        return StepPipeline([b for b in built.blocks if b.trains], workers=cfg.optimizer_workers, slots=built.swap_slots,
                            telemetry=self.telemetry, compute_device=self.device, grad_sync=grad_sync,
                            wait_timeout_s=cfg.wait_timeout_s,
                            params=ParamWriteBack(compute_device=self.device, copy_param=self.dtype == torch.float32,
                                                  state_on_device=self.tier is Placement.DEVICE,
                                                  write_pool=resources.pool("offload-param-write"),
                                                  telemetry=self.telemetry, wait_timeout_s=cfg.wait_timeout_s,
                                                  keep_staged=built.write_through.keeps_staged))

    def param_offload(self, built: Built, failures):
        """Parameter offload, the hook participant over the built blocks (None when no
        parameter is offloaded); ``failures``: the optimizer pipeline (its recorded failures
        are raised at every use)."""
        from offload.params.participant import ParamOffload
        if built.homes is None:
            return None
        offload = ParamOffload(built.blocks, failures=failures, telemetry=self.telemetry, device=self.device,
                               one_rank=not self.comm.active, deterministic=self.comm.active and self.stage == 3,
                               budget=built.param_budget, device_lookahead=built.device_lookahead,
                               host_lookahead=built.host_lookahead, prefetch=self.config.prefetch.enabled,
                               write_through=built.write_through)
        offloaded = {id(s.param) for b in built.blocks for _, s in b.segments}
        offload.resident_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters()
                                     if id(p) not in offloaded)
        return offload

    def activation_offload(self, resources):
        """Activation offload, the hook participant (None with ``offload_activations.device``
        none); its pool and store come from ``resources``."""
        from offload.engine.activations import ActivationOffload
        ac = self.config.offload_activations
        if ac.placement is Placement.DEVICE:
            return None
        store = resources.make_store("activations", ac.nvme_path) if ac.placement is Placement.NVME else None
        # unpinned, it is trimmed every step (activations.py)
        pool = resources.make_pool("offload-activations", pin=ac.pin_memory and dev.can_pin(),
                                   huge_pages=True, arena=True)
        return ActivationOffload(model=self.module, device=self.device, tier=ac.placement,
                                 min_bytes=ac.min_bytes, lookahead_bytes=ac.lookahead_bytes,
                                 pool=pool, store=store, telemetry=self.telemetry,
                                 wait_timeout_s=self.config.wait_timeout_s)

    def _storage(self) -> None:
        """The optimizer's host pools and NVMe store, and the gradients' NVMe tier."""
        cfg, plan, res = self.config, self.plan, self._res
        if cfg.offload_optimizer.update_ahead and self.comm.active:
            raise ValueError(f"offload_optimizer.update_ahead=True needs one rank ({self.comm.world} here): with "
                             "several, a block's update waits for its gradient collective and the all-gather "
                             "after it; set update_ahead to false")
        pin = cfg.offload_optimizer.pin_memory and dev.can_pin()
        # unpinned (a CPU device): on huge pages, see HostPool
        self._grad_pool = res.make_pool("offload-grads", pin=pin, huge_pages=True)
        self._host_pool = res.make_pool("offload-host", pin=pin, huge_pages=True)
        self._store = self._swap_pool = self._grad_tier = None
        if self.tier is Placement.NVME:
            self._store = res.make_store("optimizer", cfg.offload_optimizer.nvme_path)
            self._store.reserve({chunk_key(state_key(lay), k, len(bp.chunk_bytes)): nb
                                 for lay, bp in zip(self.layouts, plan.blocks) for k, nb in enumerate(bp.chunk_bytes)})
            self._swap_pool = res.make_pool("offload-swap", pin=pin, huge_pages=True)
            if plan.grad_home is Placement.NVME:   # gradients parked beside the optimizer state
                from offload.storage.tier import NvmeTier
                self._grad_tier = NvmeTier(self._store, self._grad_pool, wait_timeout_s=cfg.wait_timeout_s)
                self._grad_tier.reserve({grad_key(lay): bp.grad_numel * plan.grad_bytes
                                         for lay, bp in zip(self.layouts, plan.blocks)})
        elif plan.grad_home is Placement.NVME:
            raise ValueError("offload_optimizer.grad_host_bytes is smaller than the model's gradients, which "
                             "then go to the NVMe tier: set offload_optimizer.device to nvme (with nvme_path), "
                             "or raise grad_host_bytes")

    def _state_layout(self, lay, s0: int, s1: int):
        """This rank's shard [s0, s1) of the block's state as the rule lays it out."""
        from offload.optim.state import StateLayout
        groups = [{k: g[k] for k in self.optimizer.defaults} for g in self.optimizer.param_groups]
        return StateLayout.for_shard(self.rule, groups, s1 - s0, self.state_dtype,
                                     [(o - s0, n, shp, g) for o, n, shp, g in param_pieces(lay)])

    def _init_ranges(self, lay, s0: int, s1: int) -> list:
        """(initial value per row, a, b) of each group's range in the shard [s0, s1): rows
        that start at a group's value (Adagrad's initial_accumulator_value)."""
        out = []
        for g, a, b in lay.group_ranges:
            a, b = max(a, s0) - s0, min(b, s1) - s0
            group = self.optimizer.param_groups[g]
            values = {r.name: float(group[r.init]) for r in self.rule.rows(group) if r.init}
            if a < b and values:
                out.append((values, a, b))
        return out

    def _grad_home(self, lay, gn: int, grad_dtype: torch.dtype, blocks: List[Block]) -> GradBuffer:
        """The block's persistent gradient buffer: on the device (tier none), parked on the
        NVMe tier between uses, or in the host pool for the engine's lifetime (each gradient
        is copied in as it lands and autograd's tensor is freed at once, also on a CPU device)."""
        n = len(lay.segments)
        if self.tier is Placement.DEVICE:
            return GradBuffer(torch.zeros(gn, dtype=grad_dtype, device=self.device), n)
        if self._grad_tier is not None:
            def jobs_in_flight() -> bool:   # work in flight will give a buffer back (an update, a park)
                return any((b.update.future is not None and not b.update.future.done())
                           or (b.grads is not None and b.grads.parking) for b in blocks)
            return GradBuffer(None, n, numel=gn, dtype=grad_dtype, tier=self._grad_tier, has_jobs=jobs_in_flight,
                              key=grad_key(lay), what=f"gradients of block {lay.index} ({lay.name or '<root>'})",
                              gaps=blk.gaps(lay, gn))
        return GradBuffer(self._host_pool.acquire(gn * grad_dtype.itemsize).view(grad_dtype, gn), n)

    def _optim_state(self, lay, nbytes: int, layout):
        """(the block's optimizer state on its tier, the state's own memory or None)."""
        if self.tier is Placement.DEVICE:
            t = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            return OptimState(state_key(lay), layout, Placement.DEVICE, tensor=t), t
        if self.tier is Placement.HOST:
            t = self._host_pool.acquire(nbytes).view(torch.uint8, nbytes)
            return OptimState(state_key(lay), layout, Placement.HOST, tensor=t), t
        bp = self.plan.blocks[lay.index]
        state = OptimState(state_key(lay), layout, Placement.NVME, pool=self._swap_pool, store=self._store,
                           what=f"block {lay.index} ({lay.name or '<root>'})",
                           wait_timeout_s=self.config.wait_timeout_s, chunks=bp.state_chunks)
        if tuple(c.nbytes for c in state.chunks) != bp.chunk_bytes:
            raise RuntimeError(f"the memory plan and the state chunks of block {lay.index} disagree")
        return state, None

    def _blocks(self, built: Built) -> None:
        grad_dtype = dtypes.grad_dtype(self.config.precision, self.config.gradient_accumulation_steps)
        self.weights.schedule([[s.param for s in lay.segments] for lay in self.layouts] +
                              [[s.param for s in part.segments] for *_, parts in self.roots for part in parts])
        for lay in self.layouts:
            s0, s1 = shard_range(lay, self.stage, self.comm)
            first = lay.segments[0].param.device     # where close() brings offloaded params back
            origin = torch.device("cpu") if first.type == "meta" else first
            blk.materialize_meta(lay, self.weights)
            full = blk.gather_flat(lay, torch.float32, "cpu")    # from the original fp32 values
            master = full[s0:s1]
            layout = self._state_layout(lay, s0, s1)
            nbytes = layout.nbytes
            if nbytes > self.plan.blocks[lay.index].state_bytes:
                raise RuntimeError(f"the memory plan and the state layout of block {lay.index} disagree")
            grad = self._grad_home(lay, grad_numel(lay, self.stage, self.comm), grad_dtype, built.blocks)
            state, t = self._optim_state(lay, nbytes, layout)
            state.initialize(master, self._init_ranges(lay, s0, s1))   # chunk by chunk, on its tier
            params = self._homes.trainable_home(lay) if self._homes is not None else None
            master_views = False
            if params is None and self._master_is_param(s0, s1, lay):
                # the parameters are views of the fp32 master in the state buffer: the update
                # writes them in place, with no write-back copy (released at close())
                param_flat = state.views(t)[0]
                blk.bind_views(lay, param_flat)
                master_views = True
            elif params is None:
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
            ahead = self._ahead_slot(nbytes, s1 - s0, params)
            if params is not None:
                params.origin = origin
            block = Block(lay.index, lay.name, lay.module, self.device, layout=lay,
                          parts=[params] if params is not None else [], param_flat=param_flat, grads=grad,
                          landing=landing, state=state, shard=(s0, s1), ahead=ahead)
            built.blocks.append(block)
            if master_views:
                built.master_params.append(block)
            del full, master
            # this block's transient copies are freed: give their pages back now, so that the
            # load's peak RSS does not grow with depth (a heap left with free space by the
            # model's construction would otherwise keep them resident after free)
            dev.trim_host_heap(dev.step_trim_bytes())

    def _ahead_slot(self, nbytes: int, numel: int, params) -> Optional[AheadSlot]:
        """``offload_optimizer.update_ahead``: the block's second state buffer and, unless
        its parameters are resident fp32 (copied from the master), its staged parameters."""
        if not self.config.offload_optimizer.update_ahead:
            return None
        spare = self._host_pool.acquire(nbytes).view(torch.uint8, nbytes)
        out = out_buf = None
        if params is not None or self.dtype != torch.float32:
            esize = self.dtype.itemsize
            buf = self._host_pool.acquire(numel * esize)
            out = buf.view(self.dtype, numel)
            if params is not None and params.on_nvme and params.home_numel == numel and params.dtype == self.dtype:
                out_buf = buf             # lent to the home at the commit (optim/ahead.py)
        return AheadSlot(spare, out, out_buf)

    def _master_is_param(self, s0: int, s1: int, lay: blk.BlockLayout) -> bool:
        """Whether a block's device parameters can be the fp32 master itself: the compute
        device is the CPU (its memory is the host's), parameters are fp32, the state is a
        persistent buffer in that memory (offload_optimizer cpu, or none: the device's
        memory is the host's) and this rank steps the whole flat (ZeRO stage 0, or one
        rank), so nothing but the update ever writes them."""
        return (self.device.type == "cpu" and self.dtype == torch.float32 and self.tier in (Placement.HOST, Placement.DEVICE)
                and (s0, s1) == (0, lay.padded_numel))

    def _frozen_blocks(self, built: Built) -> None:
        """Parameter offload's frozen parts: each trained block gets those of its root, then
        each root holding only frozen parameters becomes a block of its own (indexed after
        the trained ones: it has no gradients, no state and no update)."""
        if self._homes is None:
            return
        for i, (name, module, lay, parts) in enumerate(self.roots):
            frozen = [self._homes.frozen_home(i, k, part) for k, part in enumerate(parts)]
            if lay is not None:
                origin = built.blocks[i].trainable.origin
                built.blocks[i].parts += frozen
            else:                          # a block of frozen parameters only: where close() brings it back
                first = parts[0].segments[0].param.device
                origin = torch.device("cpu") if first.type == "meta" else first
                built.blocks.append(Block(i, name, module, self.device, parts=frozen))
            for home in frozen:
                home.origin = origin
            if parts:
                dev.trim_host_heap(dev.step_trim_bytes())   # the frozen parts' copies (see _blocks)
        dev.trim_host_heap()     # before parameter offload's pools start (the bound was set at initialize)

    def _move_rest(self) -> None:
        """Frozen parameters that are not offloaded go to the device (in the dtype
        ``frozen_dtype`` gives), buffers in the compute dtype."""
        model = self.module
        bound = {id(s.param) for lay in self.layouts for s in lay.segments}
        bound |= {id(s.param) for _, _, parts in self.frozen for part in parts for s in part.segments}
        self.weights.load_rest(model, bound, self.device, self.dtype, groups=[lay.module for lay in self.layouts])
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if id(t) not in bound and t.is_meta:
                raise blk.ModelError(f"{name!r} is on the meta device but is not trainable block state: "
                                     f"materialize frozen parameters and buffers before offload.initialize")
        for m in model.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) not in bound:
                    p.data = p.data.to(device=self.device, dtype=ph.frozen_dtype(p, self.dtype))
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b.to(device=self.device, dtype=self.dtype if b.is_floating_point() else None)
