"""The training engine: wraps a model, installs the hooks, runs the step.

    engine = offload.initialize(model, config)
    loss = engine(inputs, targets)       # the model's forward
    engine.backward(loss)                # gradients leave the device block by block
    engine.step()                        # at the accumulation boundary

``step()`` is the commit point, as in torch: ``backward()`` only lands gradients; it never
changes the weights, the optimizer state or the counters a checkpoint records. Several
``backward()`` calls before one ``step()`` sum into one micro-step; the ``step()`` that closes
a window of ``gradient_accumulation_steps`` micro-steps commits the update (global norm,
clipping, fp16 loss scale: step_control.py). A window abandoned before its ``step()``
leaves everything at the last commit; ``zero_grad()`` discards its gradients. The same
holds with and without clipping, in fp32, bf16 and fp16, on every tier.

Per block (see blocks.py) the engine keeps the parameters as views into one flat device
buffer, the fp32 master and Adam moments on the configured tier (device, pinned host, NVMe)
and a host gradient buffer. A parameter's gradient is moved off the device by its
post-accumulate-grad hook. The commit queues every block's update in forward order and
``step()`` returns without waiting: the next forward of block k waits only for block k's
update (a forward pre-hook on the modules that hold its parameters, and for a parameter
read elsewhere in the forward, outside_reads.py), so the CPU step runs under the next
forward. In the backward that is expected to close the window, the optimizer state is
read back from NVMe ahead and the per-block gradient norms are computed as blocks land;
with ``offload_optimizer.update_ahead`` each block's update itself is computed then, into a
second state buffer that the commit swaps in (optim/ahead.py).
``close()`` leaves the model usable (see its docstring).

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
import gc
import sys
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.optim import optimizer as _torch_optimizer

from offload.core import blocks as blk
from offload.engine import holders
from offload import device as dev
from offload import dtypes
from offload.core import sharding
from offload.core.block_shard import BlockShard
from offload.dist.comm import Comm
from offload.dist.grad_sync import GradSync
from offload.config import Config
from offload.engine.grads import GradBuffer
from offload.core.hooks import Hooks
from offload.engine.memory_plan import GradHome
from offload.engine.landing_copier import LandingCopier
from offload.engine.loss_scaler import LossScaler
from offload.engine.outside_reads import UpdateWaits
from offload.engine.step_control import StepControl
from offload.optim.ahead import AheadSlot
from offload.optim.state import OptimState, Tier, chunk_key
from offload.optim.pipeline import StepArgs, StepPipeline
from offload.params.residency import ParamState
from offload.params.writeback import ParamWriteBack
from offload.core.telemetry import Telemetry, profiler_range



@dataclasses.dataclass
class _StepCounters:
    """A closed engine's counters (``Engine.global_step`` / ``micro_step`` stay readable)."""
    global_step: int
    micro_step: int


class _UpdateAndGrads:
    """The engine's part of each block's lifecycle (a participant of core/hooks.py): a
    block's update lands before any module reads its parameters (its own module and modules
    sharing a tied parameter); each parameter's gradient leaves the device as it accumulates,
    and a block whose gradients are all in is complete (StepControl is told; it tells the hook
    owner's post_backward)."""

    def __init__(self, engine: "Engine"):
        self.engine = engine

    def pre_forward(self, i: int) -> None:
        if i >= len(self.engine.blocks):
            return                           # a block of frozen parameters only: no update
        self.engine.blocks[i].wait_update_before_use(self.engine.telemetry)
        self.engine.pipeline.settle_threads()   # all of torch's threads once no update runs

    def grad_accumulated(self, i: int, k: int, param: torch.Tensor) -> None:
        e = self.engine
        block = e.blocks[i]
        seg = block.layout.segments[k]
        grad = param.grad
        buf = block.landing or block.grad    # full-size either way: land at the flat offset
        # d2h from an accelerator; h2h on a CPU device, whose landing is a copy within host memory
        with e.telemetry.span("offload::grad_d2h", dev.link(grad.device, buf.device),
                              grad.numel() * grad.element_size()):
            buf.land(k, seg.offset, grad, e._d2h, e._landing)
        param.grad = None   # device gradient memory is freed (the D2H holds it: record_stream, LandingEvent)
        if buf.complete:
            e.control.on_block_complete(block)


def _fill_flat(flat: torch.Tensor, part: blk.BlockLayout) -> None:
    """Write a part's parameter values into ``flat`` (padding zeroed), converting dtypes."""
    with torch.no_grad():
        flat.zero_()
        for sg in part.segments:
            flat[sg.offset:sg.offset + sg.numel].copy_(sg.param.detach().reshape(-1))


class _ParamGroups(torch.optim.Optimizer):
    """The engine's optimizer as torch sees it: param groups and their hyper-parameters, so
    torch LR schedulers work. The update itself is the engine's; ``step()`` is bookkeeping;
    ``zero_grad()`` is the engine's (it discards the open window's gradients, which the
    engine holds in its own buffers). Built from a user's torch optimizer (``shared``), it
    shares that optimizer's ``param_groups`` list: the groups are one set of dicts, so a
    scheduler built on either drives the engine's learning rate."""

    def __init__(self, groups, defaults, engine: "Engine", shared: Optional[torch.optim.Optimizer] = None):
        super().__init__(groups, defaults)
        self._engine = weakref.ref(engine)     # the engine owns this object, not the reverse
        self._shared = shared
        if shared is not None:
            self.param_groups = shared.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        """Called by Engine.step() after each committed update (the LR scheduler tracks the
        call). Runs the optimizer step hooks registered with torch, global and this
        optimizer's, pre then post, as torch's own step wrapper does, and its
        ``Optimizer.step#_ParamGroups.step`` profiler range only while a profiler records:
        torch's wrapper enters that range at every call, two dispatcher calls that release
        the GIL right after the commit handed the blocks to the optimizer workers, and
        taking it back cost the main thread 0.07-4 ms of ``step()``."""
        args = (self,) if closure is None else (self, closure)
        if self._shared is not None:
            # the user's optimizer counts as stepped: torch's schedulers built on it check this
            # flag (set by their wrapper of its step(), which the engine never calls)
            self._shared._opt_called = True
        with profiler_range(f"Optimizer.step#{type(self).__name__}.step"):
            for hook in (*_torch_step_hooks("pre"), *self._optimizer_step_pre_hooks.values()):
                if hook(self, args, {}) is not None:
                    raise RuntimeError("an optimizer step pre-hook returned new arguments: the engine's "
                                       "step() takes none")
            for hook in (*self._optimizer_step_post_hooks.values(), *_torch_step_hooks("post")):
                hook(self, args, {})

    step.hooked = True       # torch wraps an unmarked step() in its profiling wrapper

    def zero_grad(self, set_to_none: bool = True) -> None:
        engine = self._engine()
        if engine is not None:
            engine.zero_grad(set_to_none)


def _torch_step_hooks(kind: str) -> tuple:
    """The optimizer step hooks registered for every optimizer (torch.optim.optimizer's
    register_optimizer_step_{pre,post}_hook), or none where a torch version keeps them
    elsewhere. torch registers and removes them in place in one dict per kind, looked up once
    (an import inside step() ran cold right after the commit's kernels: ~30 us a step)."""
    return tuple(_TORCH_STEP_HOOKS[kind].values())


_TORCH_STEP_HOOKS = {kind: getattr(_torch_optimizer, f"_global_optimizer_{kind}_hooks", {})
                     for kind in ("pre", "post")}


def _check_group(where: str, group: dict, rule, defaults: dict) -> None:
    """A param group's hyper-parameters pass the same checks as the config's optimizer
    section (finite, in range: the rule's ``validate``); the error names the group and the key."""
    import math
    from offload.config import ConfigError
    hp = dict(defaults, **{k: v for k, v in group.items() if k in defaults})
    for k, v in hp.items():
        for x in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(x, float) and not math.isfinite(x):
                raise ConfigError(f"{where}.{k}={v!r} must be a finite number")
    if isinstance(hp.get("eps"), (int, float)) and not hp["eps"] > 0:    # as the config's optimizer.eps
        raise ConfigError(f"{where}.eps={hp['eps']!r} must be > 0")
    try:
        rule.validate(hp)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        raise ConfigError(f"{where}." + msg.split(": ", 1)[1] if msg.startswith(rule.name + ": ")
                          else f"{where}: {msg}") from None


def initialize(model: nn.Module, config: Any = None, param_groups: Optional[Sequence[dict]] = None, *,
               weights=None, key_map=None, init_fn=None) -> "Engine":
    """Wrap ``model`` for training with offloaded optimizer state.

    ``config``: a dict, a path to a JSON file (engine or DeepSpeed layout) or ``offload.Config``.
    ``param_groups``: optional torch-style groups (``[{"params": [...], "lr": ...}, ...]``);
    by default one group of all parameters with ``requires_grad``. Or a torch optimizer
    (``torch.optim.SGD(model.parameters(), lr=..., momentum=...)``, ``AdamW``, ``Adam``,
    ``Adagrad``, ``Adafactor``; ``offload/optim/from_torch.py``): the engine runs its rule
    (the config's ``optimizer.type`` must name the same one) with its groups
    and hyper-parameters, and shares its ``param_groups``, so a learning-rate scheduler built
    on it drives the engine; the optimizer itself never steps.
    ``weights``: a pretrained checkpoint (a .safetensors file, a model.safetensors.index.json,
    a Hugging Face model directory or a torch state-dict file) streamed block by block into
    the model, which may be built on the meta device; ``key_map(checkpoint_key)`` returns the
    model key (None: skip it); ``init_fn(module)`` initialises what the checkpoint does not
    hold (default: the model's own initialisation). See ``offload/io/loader.py``."""
    return Engine(model, Config.from_any(config), param_groups, weights=weights, key_map=key_map, init_fn=init_fn)



def placement_refusal(config) -> Optional[str]:
    """Why ``initialize`` refuses this config's optimizer placement (None: it runs it); what
    ``offload estimate`` marks a placement with."""
    if config.optimizer.state_dtype == "int8" and config.offload_optimizer.device == "none":
        return ("optimizer.state_dtype='int8' needs the optimizer state on the CPU: int8 state is "
                "quantized inside the CPU kernel. Set offload_optimizer.device to cpu or nvme, or use "
                "state_dtype bf16 with offload_optimizer.device none")
    return None

class Engine:
    def __init__(self, model: nn.Module, config: Config, param_groups=None, *, weights=None, key_map=None,
                 init_fn=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"offload.initialize needs an nn.Module, not {type(model).__name__}")
        config.check_paths()       # Config construction does no I/O: the directories are checked here
        holders.take_over(model)
        self.config = config
        self.comm = Comm(config.zero_optimization.timeout_s)
        self.stage = config.zero_optimization.stage
        self.module = model
        self.device = dev.compute_device()
        # process-wide malloc tuning only where parameters or saved activations leave a CPU
        # device (device.py): both free large host blocks every step; for parameters only
        # while loading (reuse_heap below), for saved activations while training too
        acts_offloaded = config.offload_activations.device != "none"
        dev.return_freed_host_memory(bound_large_allocations=self._param_home_device() != "none"
                                     or acts_offloaded, keep=acts_offloaded)
        if self.device.type == "cpu":
            dev.step_trim_bytes()     # OFFLOAD_STEP_TRIM_BYTES is checked here, not at the first step()
        self.dtype = dtypes.compute_dtype(config.precision)
        self.telemetry = Telemetry()
        from offload.optim import get_rule, quant
        self.rule = get_rule(config.optimizer.type)     # the update rule (offload/optim)
        self.state_dtype = config.optimizer.state_dtype
        self.optimizer = self._make_optimizer(model, param_groups)
        group_of = {id(p): gi for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        self.layouts = blk.build_layouts(model, config.blocks, group_of, world_size=self.comm.world,
                                         param_align=quant.BLOCK if self.state_dtype == "int8" else 1)
        # Frozen parameters are offloaded with their blocks whenever parameters are:
        # (root name, root module, parts) per block root holding any
        self.frozen = blk.frozen_parts(model, config.blocks, self._frozen_dtype) \
            if self._param_home_device() != "none" else []
        from offload.params import quantized
        self._codecs = quantized.codecs(self.frozen, config.offload_param, self._frozen_dtype)  # id(part) -> codec
        from offload.io.loader import WeightLoader
        self.weights = WeightLoader(model, weights, key_map=key_map, init_fn=init_fn)   # checked before allocating
        self._in_place = self._plan_in_place()   # id(frozen part) -> file ranges read in place
        from offload.engine.memory_plan import plan as memory_plan
        sizes = self._block_sizes()
        esize = self.dtype.itemsize
        avail = None                  # sizes the cpu activation pool when host_bytes is not set
        if config.offload_activations.device == "cpu" and config.offload_activations.host_bytes is None:
            import psutil
            avail = psutil.virtual_memory().available
        inline_first = self.device.type == "cpu" and not self.comm.active   # pipeline.submitting
        self.plan = memory_plan(sizes, config, self.comm.world, self.comm.rank, esize, host_available=avail,
                                inline_first=inline_first)
        if self.plan.param_budget is not None:     # the default budget covers the working set
            self._working_set = self._find_working_set([bp.device_bytes for bp in self.plan.blocks])
            self.plan = memory_plan(sizes, config, self.comm.world, self.comm.rank, esize,
                                    working_set=self._working_set[0], host_available=avail,
                                    inline_first=inline_first)
        self.comm.check_same("model and config", self._signature())
        self._param_order = {id(p): i for i, p in enumerate(model.parameters())}
        self.tier = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}[config.offload_optimizer.device]
        self._store = None
        self._host_pool = None
        self._swap_pool = None
        self._param_store = None          # parameter home tier (offload_param), see _build_param_homes
        self._source_store = None         # frozen parts read in place from the checkpoint (storage/source.py)
        self._param_home_pool = None
        self._param_stage_pool = None
        self._param_write_pool = None
        self._grad_pool = None
        self._grad_tier = None            # NvmeTier of parked gradients (offload-grads pool), engine/grads.py
        self.param_offload = None
        self.activations = None           # ActivationOffload (offload_activations), engine/activations.py
        self._act_store = None
        self._act_pool = None             # HostArena offload-activations: the host copies' budget
        self.units = []                   # BlockParts per block that visits the device (param offload)
        self.blocks: List[BlockShard] = []
        self._origin: List[torch.device] = []   # per block: its parameters' device at initialize
        self._master_params: List[int] = []     # blocks whose parameters are views of the master
        self.hooks: Optional[Hooks] = None   # every module / parameter / saved-tensor hook
        self._closed = False
        try:
            self._build_storage()
            self._build_param_homes()
            self._build_blocks()
            self._move_rest(model)
            self._start_param_offload()
            self._start_activation_offload()
            self._install_hooks()
        except BaseException:
            self._release_storage()
            raise
        finally:
            self.weights.close()
        dev.trim_host_heap()          # loading block by block leaves freed holes in the heap
        dev.reuse_heap()              # training reuses its freed blocks (device.reuse_heap)
        self.scaler = LossScaler(config.loss_scaler, enabled=config.precision == "fp16")
        self.grad_sync = GradSync(self.comm, self.blocks, self.stage, self.telemetry)
        self._gatherer = None         # one thread: post-update parameter all-gathers (stages 1, 2)
        if self.comm.active and self.stage in (1, 2):
            self._gatherer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-gather")
        self.pipeline = StepPipeline(self.blocks, workers=config.optimizer_workers,
                                     slots=self._swap_slots, telemetry=self.telemetry,
                                     compute_device=self.device, grad_sync=self.grad_sync,
                                     wait_timeout_s=config.wait_timeout_s, split_threads=config.overlap_step,
                                     params=ParamWriteBack(compute_device=self.device,
                                                           copy_param=self.dtype == torch.float32,
                                                           state_on_device=self.tier is Tier.DEVICE,
                                                           write_pool=self._param_write_pool,
                                                           telemetry=self.telemetry,
                                                           wait_timeout_s=config.wait_timeout_s,
                                                           keep_staged=self._keeps_staged))
        self._d2h = dev.new_stream(self.device)
        # a CPU device's landings: copied off the backward's thread (engine/landing_copier.py)
        self._landing = LandingCopier() if self.device.type == "cpu" else None
        self.control = StepControl(
            blocks=self.blocks, pipeline=self.pipeline, grad_sync=self.grad_sync, comm=self.comm,
            scaler=self.scaler, telemetry=self.telemetry,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            gradient_clipping=config.gradient_clipping, param_order=self._param_order,
            read_ahead=self.tier is Tier.NVME and config.overlap_step, submit=self._submit,
            ahead=self._submit_ahead if config.offload_optimizer.update_ahead else None,
            on_block_complete=self.hooks.post_backward)   # every participant's post_backward
        holders.register(self)
        self._built = True            # fully built: close() (or __del__) has everything to release

    # The counters a checkpoint records (StepControl owns them; they move at step() only).
    @property
    def global_step(self) -> int:
        """Optimizer updates committed (fp16 overflow skips excluded)."""
        return self.control.global_step

    @global_step.setter
    def global_step(self, n: int) -> None:
        self.control.global_step = n

    @property
    def micro_step(self) -> int:
        """step() calls (micro-steps); the window closes every gradient_accumulation_steps."""
        return self.control.micro_step

    @micro_step.setter
    def micro_step(self, n: int) -> None:
        self.control.micro_step = n

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
        """torch-style param groups carrying the update rule's hyper-parameters (torch's
        names), defaults from the config's optimizer section; each group is checked by the
        rule (``UpdateRule.validate``) and must keep the same state rows as the config."""
        from offload.config import ConfigError
        o = self.config.optimizer
        refused = placement_refusal(self.config)
        if refused:
            raise ConfigError(refused)
        defaults = o.hparams()
        rule = self.rule
        rows = [r.name for r in rule.rows(defaults)]
        shared = None
        if isinstance(param_groups, torch.optim.Optimizer):
            from offload.optim import from_torch
            name = from_torch.rule_name(param_groups)
            if name != rule.name:
                raise ConfigError(f"param_groups is a {type(param_groups).__name__}, whose update is {name}, but the "
                                  f"config's optimizer.type is {rule.name!r}: set optimizer.type={name!r}")
            shared, param_groups = param_groups, from_torch.param_groups(param_groups, rule)
        if param_groups is None:
            param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        groups = []
        for g in param_groups:
            g = dict(g)
            where = f"param_groups[{len(groups)}]"
            g["params"] = [p for p in g["params"] if p.requires_grad]
            unknown = set(g) - set(defaults) - {"params", "name"}
            if unknown:
                raise ConfigError(f"{where} keys {sorted(unknown)} are not hyper-parameters of {o.type}: "
                                  f"use {', '.join(defaults)}")
            _check_group(where, g, rule, defaults)
            if [r.name for r in rule.rows(dict(defaults, **g))] != rows:
                raise ConfigError(f"{where} changes the state {o.type} keeps ({rows} for the config's optimizer "
                                  f"section): every group keeps the same rows; set it in the optimizer section")
            groups.append(g)
        return _ParamGroups(groups, defaults, self, shared=shared)

    def _block_sizes(self) -> list:
        """The blocks as the memory plan sees them (trained blocks first, then frozen-only)."""
        from offload.engine.memory_plan import BlockSize
        return [BlockSize(name, lay.numel if lay is not None else 0,
                          tuple(self._frozen_part_bytes(p) for p in parts), self._param_pieces(lay),
                          tuple(id(p) in self._in_place for p in parts),
                          tuple(self._codecs[id(p)].nbytes if id(p) in self._codecs else self._frozen_part_bytes(p)
                                for p in parts))
                for name, _, lay, parts in self._unit_parts()]

    @staticmethod
    def _param_pieces(lay) -> tuple:
        """(offset, numel, shape, group) of each parameter of a block (a per-tensor rule's
        state needs the shapes: engine/memory_plan.py, optim/state_layout.py)."""
        if lay is None:
            return ()
        return tuple((s.offset, s.numel, tuple(s.shape), s.group) for s in lay.segments)

    def _state_layout(self, lay, s0: int, s1: int):
        """This rank's shard [s0, s1) of the block's state as the rule lays it out."""
        from offload.optim.state_layout import StateLayout
        groups = [{k: g[k] for k in self.optimizer.defaults} for g in self.optimizer.param_groups]
        return StateLayout.for_shard(self.rule, groups, s1 - s0, self.state_dtype,
                                     [(o - s0, n, shp, g) for o, n, shp, g in self._param_pieces(lay)])

    def _plan_in_place(self) -> dict:
        """Frozen parts whose home is the checkpoint itself (offload_param nvme, weights= a
        safetensors checkpoint, every parameter stored there in the dtype it is kept in):
        each part's layout becomes the file ranges covering its tensors, concatenated
        (storage/source.py ``in_place_layout``), so a staged part is read with O_DIRECT
        straight into its buffer. ``id(part) -> ranges``."""
        from offload.storage.source import in_place_layout
        pc = self.config.offload_param
        if self._param_home_device() != "nvme" or not pc.frozen_in_place or self.weights.files is None:
            return {}
        out = {}
        for _, _, parts in self.frozen:
            for part in parts:
                if id(part) in self._codecs:       # stored quantized: its own bytes, not the checkpoint's
                    continue
                dtype = self._frozen_dtype(part.segments[0].param)
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

    def _build_storage(self) -> None:
        """Host pools and NVMe stores, sized by the memory plan (engine/memory_plan.py says
        what each pool holds)."""
        from offload.storage.pinned_pool import HostPool
        cfg, plan = self.config, self.plan
        if cfg.offload_optimizer.update_ahead and self.comm.active:
            raise ValueError(f"offload_optimizer.update_ahead=True needs one rank ({self.comm.world} here): with "
                             "several, a block's update waits for its gradient collective and the all-gather "
                             "after it; set update_ahead to false")
        pin = cfg.offload_optimizer.pin_memory and dev.can_pin()

        def pool(name):       # unpinned (a CPU device): on huge pages, see HostPool
            pl = plan.pool(name)
            return HostPool(list(pl.slots), pin=pin, name=name, huge_pages=True) if pl is not None else None
        self._grad_pool = pool("offload-grads")
        self._host_pool = pool("offload-host")
        self._swap_slots = max(cfg.offload_optimizer.buffer_count, cfg.optimizer_workers + 1)
        if self.tier is Tier.NVME:
            from offload.storage.nvme import NvmeStore
            a = cfg.aio
            self._store = NvmeStore(cfg.offload_optimizer.nvme_path, backend=a.backend, block_size=a.block_size,
                                    queue_depth=a.queue_depth, threads=a.thread_count, checksum=a.checksum,
                                    name="optimizer")
            self._store.reserve({chunk_key(self._state_key(lay), k, len(bp.chunk_bytes)): nb
                                 for lay, bp in zip(self.layouts, plan.blocks) for k, nb in enumerate(bp.chunk_bytes)})
            self._swap_pool = pool("offload-swap")
            if plan.grad_home is GradHome.SPILL:   # gradients parked beside the optimizer state
                from offload.storage.tier import NvmeTier
                self._grad_tier = NvmeTier(self._store, self._grad_pool, wait_timeout_s=cfg.wait_timeout_s)
                self._grad_tier.reserve({self._grad_key(lay): bp.grad_numel * plan.grad_bytes
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
        return self._home_numel(lay) * self.dtype.itemsize

    def _param_home_device(self) -> str:
        """ZeRO-3 keeps parameters as shards even without offload_param: at home on the host."""
        pc = self.config.offload_param
        return "cpu" if pc.device == "none" and self.stage == 3 else pc.device

    def _frozen_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype a frozen parameter is kept in: its own, or the compute dtype when that is
        narrower (an fp32 frozen weight in a bf16 run); a bf16 base beside fp32 training
        stays bf16. Integer parameters keep theirs."""
        return dtypes.kept_dtype(p.dtype, self.dtype)

    def _unit_parts(self) -> list:
        """(name, module, trainable layout or None, frozen part layouts) per block that
        visits the device: the trained blocks in order, then blocks holding only frozen
        parameters."""
        frozen = {name: (mod, parts) for name, mod, parts in self.frozen}
        units = [(lay.name, lay.module, lay, frozen.pop(lay.name, (None, []))[1]) for lay in self.layouts]
        units += [(name, mod, None, parts) for name, (mod, parts) in frozen.items()]
        return units

    def _frozen_part_bytes(self, part: blk.BlockLayout) -> int:
        return part.padded_numel * self._frozen_dtype(part.segments[0].param).itemsize

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
        swapped = {}                       # NVMe key -> bytes; frozen parts read in place have none
        for i, (unit, bp) in enumerate(zip(units, plan.blocks)):
            _, _, lay, parts = unit
            homes = ([(lay, bp.home_bytes)] if lay is not None else []) + list(zip(parts, bp.frozen_home))
            for key, (part, n) in zip(self._part_keys(i, unit), homes):
                if id(part) not in self._in_place:
                    swapped[key] = n
        self._param_store.reserve(swapped)
        if self._in_place:
            from offload.io.hf import read_range
            from offload.io.loader import checksum
            from offload.storage.source import SourceStore
            self._source_store = SourceStore(lambda b: checksum(b)[1], read_range, threads=2)
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
        part.index = i                     # errors name the block it visits the device with
        dtype = self._frozen_dtype(part.segments[0].param)
        if id(part) in self._in_place:     # home: the checkpoint's own byte ranges, nothing copied
            return self._source_home(i, k, part, dtype)
        # from the checkpoint (remembered as the base's origin, so checkpoints refer to it),
        # or the model's own initialisation for a meta part
        self.weights.load([s.param for s in part.segments], frozen_reference=True)
        n, nbytes = part.padded_numel, self._frozen_part_bytes(part)
        codec = self._codecs.get(id(part))     # stored quantized (params/quantized.py): its blob's bytes
        nbytes = codec.nbytes if codec is not None else nbytes

        def fill(buf):
            if codec is not None:
                return codec.fill(buf.view(torch.uint8, nbytes))
            flat = buf.view(dtype, n)
            _fill_flat(flat, part)
            return flat
        if self._param_home_device() == "cpu":
            home = fill(self._param_home_pool.acquire(nbytes))
            bp = BlockParams(part, dtype, self.device, home_buf=home, codec=codec)
        else:
            bp = BlockParams(part, dtype, self.device, store=self._param_store, pool=self._param_stage_pool,
                             key=f"b{i}.frozen{k}", codec=codec)
            with self._param_stage_pool.acquire(nbytes) as loan:   # page-aligned: O_DIRECT
                bp.write_home(fill(loan))
        bp.release_initial()
        return bp

    def _source_home(self, i: int, k: int, part: blk.BlockLayout, dtype: torch.dtype):
        """The BlockParams of a frozen part read in place: its tensors are read once now for
        their checksums (recorded as the base's origin, and checked on every later read)."""
        from offload.params.residency import BlockParams
        from offload.storage.source import SourceTensor
        crcs = self.weights.refer_all([s.param for s in part.segments])
        esize = dtype.itemsize
        key = f"b{i}.frozen{k}"
        self._source_store.add(key, self._in_place[id(part)],
                               [SourceTensor(s.name, s.offset * esize, s.numel * esize, crcs[id(s.param)])
                                for s in part.segments])
        bp = BlockParams(part, dtype, self.device, store=self._source_store, pool=self._param_stage_pool, key=key,
                         wait_timeout_s=self.config.wait_timeout_s)
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

            def allgather(full, shard, what=what):
                with self.telemetry.span("offload::param_allgather"):
                    return self.comm.all_gather(full, shard, what, async_op=True)
            gather = allgather
        kw = {"home_numel": n, "gather": gather}
        if home_device == "cpu":
            home = self._param_home_pool.acquire(self._home_bytes(lay)).view(self.dtype, n)
            return BlockParams(lay, self.dtype, self.device, home_buf=home, **kw)
        return BlockParams(lay, self.dtype, self.device, store=self._param_store, pool=self._param_stage_pool,
                           write_pool=self._param_write_pool, key=f"b{lay.index}.param",
                           wait_timeout_s=self.config.wait_timeout_s, on_failure=self._param_write_failed, **kw)

    def _param_write_failed(self, index: int, err: BaseException) -> None:
        """A parameter write-back failed (found after its job returned, by whoever settled
        it): recorded against its own block; raised from the user's next call."""
        block = next(b for b in self.blocks if b.index == index)
        self.pipeline.record_failure(block, "parameter write-back", err)

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

    def _jobs_in_flight(self) -> bool:
        """Whether work in flight will give a gradient buffer back (an update, or a park)."""
        return any((b.pending is not None and not b.pending.done()) or b.grad.parking for b in self.blocks)

    def _start_activation_offload(self) -> None:
        from offload.engine.activations import ActivationOffload
        ac = self.config.offload_activations
        if ac.device == "none":
            return
        if ac.device == "nvme":
            from offload.storage.nvme import NvmeStore
            a = self.config.aio
            self._act_store = NvmeStore(ac.nvme_path, backend=a.backend, block_size=a.block_size,
                                        queue_depth=a.queue_depth, threads=a.thread_count, checksum=a.checksum,
                                        name="activations")
        from offload.storage.pinned_pool import HostArena
        pool = self.plan.pool("offload-activations")
        self._act_pool = HostArena(pool.nbytes, pin=ac.pin_memory and dev.can_pin(), name=pool.name,
                                   huge_pages=True)      # unpinned, it is trimmed every step (activations.py)
        self.activations = ActivationOffload(model=self.module, device=self.device, tier=ac.device,
                                             min_bytes=ac.min_bytes, lookahead_bytes=ac.lookahead_bytes,
                                             pool=self._act_pool, store=self._act_store, telemetry=self.telemetry,
                                             wait_timeout_s=self.config.wait_timeout_s)

    def _grad_dtype(self) -> torch.dtype:
        return dtypes.grad_dtype(self.config.precision, self.config.gradient_accumulation_steps)

    @staticmethod
    def _state_key(lay: blk.BlockLayout) -> str:
        return f"b{lay.index}.state"

    @staticmethod
    def _grad_key(lay: blk.BlockLayout) -> str:
        return f"b{lay.index}.grad"

    def _build_blocks(self) -> None:
        grad_dtype = self._grad_dtype()
        self.weights.schedule([[s.param for s in lay.segments] for lay in self.layouts] +
                              [[s.param for s in part.segments] for *_, parts in self._unit_parts() for part in parts])
        for lay in self.layouts:
            s0, s1 = self._shard(lay)
            gn = self._grad_numel(lay)
            first = lay.segments[0].param.device     # where close() brings offloaded params back
            self._origin.append(torch.device("cpu") if first.type == "meta" else first)
            blk.materialize_meta(lay, self.weights)
            full = blk.gather_flat(lay, torch.float32, "cpu")    # from the original fp32 values
            master = full[s0:s1]
            layout = self._state_layout(lay, s0, s1)
            nbytes = layout.nbytes
            assert nbytes <= self.plan.blocks[lay.index].state_bytes, "the memory plan and the state layout disagree"
            t = None                       # the state's own memory (device and host tiers)
            if self.tier is Tier.DEVICE:
                t = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
                state = OptimState(self._state_key(lay), layout, Tier.DEVICE, tensor=t)
                grad = GradBuffer(torch.zeros(gn, dtype=grad_dtype, device=self.device), len(lay.segments))
            else:
                if self._grad_tier is not None:
                    grad = GradBuffer(None, len(lay.segments), numel=gn, dtype=grad_dtype, tier=self._grad_tier,
                                      has_jobs=self._jobs_in_flight, key=self._grad_key(lay),
                                      what=f"gradients of block {lay.index} ({lay.name or '<root>'})",
                                      gaps=blk.gaps(lay, gn))
                else:
                    # kept for the engine's lifetime, in the host pool (counted in its budget):
                    # each gradient is copied in as it lands and autograd's tensor is freed at
                    # once, also on a CPU device. Holding autograd's tensors until the update
                    # instead kept one fresh allocation per parameter alive through the step;
                    # glibc grew the heap for them in every backward and trimmed it when the
                    # updates freed them (1,000-5,000 page faults a backward, ~1 ms), while a
                    # freed gradient's memory is what autograd's next one reuses, still in cache
                    nb = gn * grad_dtype.itemsize
                    grad = GradBuffer(self._host_pool.acquire(nb).view(grad_dtype, gn), len(lay.segments))
                if self.tier is Tier.HOST:
                    t = self._host_pool.acquire(nbytes).view(torch.uint8, nbytes)
                    state = OptimState(self._state_key(lay), layout, Tier.HOST, tensor=t)
                else:
                    bp = self.plan.blocks[lay.index]
                    state = OptimState(self._state_key(lay), layout, Tier.NVME, pool=self._swap_pool,
                                       store=self._store, what=f"block {lay.index} ({lay.name or '<root>'})",
                                       wait_timeout_s=self.config.wait_timeout_s, chunks=bp.state_chunks)
                    assert tuple(c.nbytes for c in state.chunks) == bp.chunk_bytes, \
                        "the memory plan and the state chunks disagree"
            state.initialize(master, self._init_ranges(lay, s0, s1))   # chunk by chunk, on its tier
            params = self._param_home(lay)
            if params is None and self._master_is_param(s0, s1, lay):
                # the parameters are views of the fp32 master in the state buffer: the update
                # writes them in place, with no write-back copy (released at close())
                param_flat = state.views(t)[0]
                blk.bind_views(lay, param_flat)
                self._master_params.append(lay.index)
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
            self.blocks.append(BlockShard(lay, param_flat, state, grad, (s0, s1), params=params,
                                          landing=landing, ahead=self._ahead_slot(nbytes, s1 - s0, params)))
            del full, master
            # this block's transient copies are freed: give their pages back now. A heap left
            # with free space by the model's construction (accelerate's init_empty_weights
            # allocates every layer's weights, then drops them: 2.1-2.7 GB at 40 layers of a
            # 2B Llama) serves them from that space, where they would stay resident after
            # free; one block after another they made the load's peak RSS grow with depth
            dev.trim_host_heap(dev.step_trim_bytes())
        self._build_units()

    def _ahead_slot(self, nbytes: int, numel: int, params) -> Optional[AheadSlot]:
        """``offload_optimizer.update_ahead``: the block's second state buffer and, unless
        its parameters are resident fp32 (copied from the master), its staged parameters."""
        if not self.config.offload_optimizer.update_ahead:
            return None
        if self.plan.inline_first and not self.blocks:
            # the first block: step() updates it inline, on every core (pipeline.submitting),
            # as soon as its gradients, the last of backward, are in; computed ahead on one
            # worker it took 7.3 ms that step() waited for, against 3.2-3.9 ms inline
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
        return (self.device.type == "cpu" and self.dtype == torch.float32 and self.tier in (Tier.HOST, Tier.DEVICE)
                and (s0, s1) == (0, lay.padded_numel))

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
            if parts:
                dev.trim_host_heap(dev.step_trim_bytes())   # the frozen parts' copies (see _build_blocks)
        dev.trim_host_heap()     # before parameter offload's pools start (the bound was set at __init__'s top)

    def _move_rest(self, model: nn.Module) -> None:
        """Frozen parameters that are not offloaded go to the device (in the dtype
        ``_frozen_dtype`` gives), buffers in the compute dtype."""
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
                    p.data = p.data.to(device=self.device, dtype=self._frozen_dtype(p))
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b.to(device=self.device, dtype=self.dtype if b.is_floating_point() else None)

    def _install_hooks(self) -> None:
        """One owner installs every hook (core/hooks.py); each feature joins as a participant:
        the engine's own part first, then the update waits for reads outside a block's modules
        (without parameter offload, whose materialize waits itself), parameter offload,
        activation offload."""
        self.hooks = Hooks(self.module, self.layouts, self.units)
        self.hooks.join(_UpdateAndGrads(self))
        if self.param_offload is None:
            self.hooks.join(UpdateWaits(self.blocks, self.telemetry))
        else:
            self.hooks.join(self.param_offload)
        if self.activations is not None:      # after parameter offload: parameters are its handles
            self.hooks.join(self.activations)
        self.hooks.install()

    # ---- training -------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self._check_ok()
        with self.telemetry.span("offload::forward"):
            return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> "Engine":
        self._check_open()
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def parameters(self):
        self._check_open()
        return self.module.parameters()

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Backward of ``loss`` into the accumulation window: gradients leave the device block
        by block and are summed in the window's buffers. The loss is divided by
        gradient_accumulation_steps (DeepSpeed's convention: pass the micro-batch's mean
        loss) and scaled for fp16. Never changes the weights, the optimizer state or the
        step counters; several calls before one step() sum into one micro-step.
        ``scale_wrt_gas=False``: the caller already scaled the loss for accumulation (as
        Hugging Face Trainer does), so it is not divided again (DeepSpeed's argument)."""
        self._check_ok()
        self.pipeline.settle_threads(force=True)
        if self._landing is not None:
            self._landing.backward_begins()
        try:
            self.control.backward(loss, scale_wrt_gas=scale_wrt_gas)
            self.hooks.end_backward()     # blocks without gradients (frozen only) end theirs
        finally:
            if self._landing is not None:
                self._landing.drain()     # no gradient of autograd's outlives backward()
                self._landing.measure()

    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """Whether the next step() closes the accumulation window (True) or not (False),
        whatever the micro-step count; ``None`` returns to counting
        gradient_accumulation_steps. For a caller that decides the window itself, e.g.
        Hugging Face Trainer, whose last window of an epoch may be shorter (DeepSpeed's name).
        Set it before the window's last backward(), which prepares the commit."""
        self._check_ok()
        self.control.set_boundary(is_boundary)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients of the open accumulation window (every micro-step since the
        last commit), e.g. after an interrupted backward. Weights, optimizer state and
        counters stay at the last commit. Not needed in a normal loop: a commit starts an
        empty window. (``set_to_none`` is accepted for torch's signature.)"""
        self._check_open()
        self.control.zero_grad()

    def _groups(self) -> tuple:
        keys = self.optimizer.defaults     # the rule's hyper-parameters, as each group holds them now
        return tuple({k: g[k] for k in keys} for g in self.optimizer.param_groups)

    def _submit(self, block: BlockShard, grad_scale: float) -> None:
        if not self.comm.active and not block.grad.close_window(block.layout.segments):
            block.grad.reset_window()     # no gradient at all: torch skips such parameters
            return                        # (nor was an update computed ahead: _submit_ahead)
        groups, done = self._commit_inputs
        args = StepArgs(step=block.stepped + 1, groups=groups, rule=self.rule, grad_scale=grad_scale,
                        compute_done=done)
        if block.ahead is not None and block.ahead.pending_for(args.step, args.groups) is None:
            # an update computed ahead that failed (since step() began: an earlier failure is
            # raised before the commit) is raised as it is, not met again by a second try
            self.pipeline.raise_failure()
            # computed ahead with other hyper-parameters (set between backward and step):
            # dropped, and the update runs now
            block.ahead.drop(self.config.wait_timeout_s, block.name)
        fut = self.pipeline.submit(block, args)
        if self._gatherer is not None:    # then every rank's updated shard to every rank
            block.pending = self._gatherer.submit(self._gather_params, block, fut)

    def _submit_ahead(self, block: BlockShard) -> None:
        """``offload_optimizer.update_ahead``: ``block``'s gradients of the window's last
        backward are in; its update starts now, into its ahead slot (optim/ahead.py)."""
        if block.ahead is None:
            return                        # the block step() updates inline (_ahead_slot)
        if block.ahead.out_lent and self.param_offload is not None:
            self.param_offload.release_before_update(block.index)
        if block.ahead.out_lent and block.params.state is not ParamState.WRITING:
            return                        # its home's staged copy is in use: step() updates it
        # (WRITING: the buffer comes back once the last write-back completes; the job waits)
        if not block.grad.close_window(block.layout.segments):
            return                        # no gradient: step() skips the block, as torch does
        self.pipeline.submit_ahead(block, StepArgs(step=block.stepped + 1, groups=self._groups(), rule=self.rule))

    def _gather_params(self, block: BlockShard, job) -> None:
        """On the gather thread, in submission order (the same on every rank): wait for the
        block's update, then all-gather the updated shards into the full parameter buffer."""
        job.result()
        s0, s1 = block.shard
        try:
            with self.telemetry.span("offload::param_allgather"):
                shard = block.param_flat[s0:s1].clone()   # the input must not alias the output
                self.comm.all_gather(block.param_flat, shard,
                                     f"param allgather of block {block.index} ({block.name})", group="side")
        except BaseException as exc:
            raise self.pipeline.record_failure(block, "parameter all-gather", exc) from exc

    def _keeps_staged(self, index: int) -> bool:
        """Whether block ``index``'s new parameters stay staged after their write-back (NVMe
        homes next used soon; params/offload.py ``plan_write_through``)."""
        return self.param_offload is not None and self.param_offload.keeps_staged(index)

    def step(self) -> bool:
        """Close one micro-step; the step() that closes a window of gradient_accumulation_steps
        micro-steps commits the update (global norm, clipping, fp16 unscale, every block
        queued in forward order). Returns True when it committed an update (False inside
        the window, when the window holds no gradient, and when an fp16 overflow skipped
        the update). With ``overlap_step`` (default) it returns without waiting: the next
        forward of each block waits for that block's update alone; otherwise it returns
        once every update is applied."""
        self._check_ok()
        if self.control.at_boundary():
            if self.param_offload is not None:
                self.param_offload.plan_write_through()   # before the updates are queued
            # what every block's update of this commit shares (_submit): the hyper-parameters
            # as the groups hold them now, and the point of the compute stream after backward
            self._commit_inputs = (self._groups(), dev.record_event(dev.current_stream(self.device)))
        if not self.control.step():
            if self.device.type == "cpu":
                # inside the window too: a heap with free space (the model's construction can
                # leave gigabytes) serves each micro-step's activations and gradients from it,
                # resident after free until the next trim; at most a micro-step's worth then
                dev.trim_after_step()
            return False
        self.optimizer.step()
        if self.param_offload is not None:
            self.param_offload.after_step()
        if self.device.type == "cpu":
            # the step's freed activations and gradients ("device" memory), once they add up
            dev.trim_after_step()
        if not self.config.overlap_step:
            self.synchronize()
        return True

    def grad_norm(self):
        """The global gradient norm of the last commit, before clipping and after fp16
        unscaling (inf when an fp16 overflow skipped it), as clip_grad_norm_ returns it;
        None when the engine computes none (no clipping and not fp16)."""
        self._check_open()
        return self.control.last_grad_norm

    def synchronize(self) -> None:
        """Wait until every queued update is applied and every state write has completed."""
        self._check_open()
        try:
            self.pipeline.wait_all()
        finally:
            self.pipeline.settle_threads(force=True)
        if self.param_offload is not None:
            self.param_offload.wait_writes()    # every parameter write-back durable (or failed)
            self.pipeline.raise_failure()
        dev.synchronize(self.device)

    # ---- state ----------------------------------------------------------------------------
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Consolidated fp32 weights with the keys of ``model.state_dict()`` (on the CPU)."""
        from offload.io import checkpoint
        self._check_open()
        self.synchronize()
        return checkpoint.live_state_dict(self)

    def save_checkpoint(self, path: str) -> str:
        """Everything as of the last commit (an open window's gradients are not saved)."""
        from offload.io import checkpoint
        self._check_open()
        self.synchronize()
        return checkpoint.save(self, path)

    def load_checkpoint(self, path: str, *, rng: bool = True) -> None:
        """Weights, optimizer state, counters and loss scale as of the checkpoint's last
        commit; the gradients of an open accumulation window are discarded. Buffers and
        frozen parameters that stay with the model come back through the model's own
        ``load_state_dict``. ``rng=False`` leaves the RNG states as they are (a best
        checkpoint loaded at the end of a run) instead of restoring the checkpoint's."""
        from offload.io import checkpoint
        self._check_open()
        self.control.zero_grad()
        self.synchronize()
        checkpoint.load(self, path, rng=rng)

    def stats(self) -> dict:
        self._check_open()
        snap = self.telemetry.snapshot()
        resident = sum(b.param_flat.numel() * b.param_flat.element_size() for b in self.blocks
                       if b.param_flat is not None)
        po = self.param_offload
        # parameters that are views of the fp32 master (CPU device) are the host pool's bytes:
        # counted there, not twice
        views = sum(self.blocks[i].param_flat.numel() * self.blocks[i].param_flat.element_size()
                    for i in self._master_params)
        dev_bytes = resident - views + (po.prefetcher.device_bytes() if po is not None else 0)
        if self.tier is Tier.DEVICE:
            dev_bytes += sum(b.state.nbytes + b.grad.tensor.numel() * b.grad.tensor.element_size()
                             for b in self.blocks)
        pools = [p for p in (self._host_pool, self._swap_pool, self._param_home_pool, self._param_stage_pool,
                             self._param_write_pool, self._grad_pool, self._act_pool) if p is not None]
        host = sum(p.stats()["capacity_bytes"] for p in pools)
        host_peak = sum(p.stats()["peak_bytes"] for p in pools)
        nvme = sum(st.stats().get("reserved_bytes", 0) for st in (self._store, self._param_store) if st is not None)
        if self._source_store is not None:     # frozen parts read in place: the checkpoint's bytes
            snap["source_bytes"] = self._source_store.stats()["source_bytes"]
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
        if self._codecs:                       # frozen parts stored quantized: bytes and errors
            from offload.params import quantized
            snap["frozen_quant"] = quantized.stats(list(self._codecs.values()), self.config.offload_param.frozen_dtype)
        # each pool by its memory-plan name: capacity, and the most bytes lent at once (on a
        # CPU-only machine untouched slots are not resident: what offload plan's RSS terms compare with)
        snap["host_pools"] = {p.name: {k: p.stats()[k] for k in ("capacity_bytes", "peak_bytes")} for p in pools}
        if self.activations is not None:
            snap["activations"] = self.activations.stats()
        # NVMe links from the stores themselves: bytes that reached the disk over the time
        # requests were in flight (the engine's own spans only see the waits)
        for d, key in (("read", "bytes_read"), ("write", "bytes_written")):
            stores = [st.stats() for st in (self._store, self._param_store, self._source_store) if st is not None]
            n, sec = sum(x[key] for x in stores), sum(x[f"{d}_seconds"] for x in stores)
            if n:
                snap["bytes"][f"nvme_{d}"] = n
                snap["gbps"][f"nvme_{d}"] = n / sec / 1e9 if sec > 0 else 0.0
        return snap

    def _partitioned_bytes(self) -> dict:
        """This rank's resident bytes of each kind ZeRO partitions: 1/world_size of the
        single-rank figure (plus padding) for the kinds the stage partitions."""
        gsize = self._grad_dtype().itemsize
        esize = self.dtype.itemsize
        params = 0
        for b in self.blocks:
            params += (b.params.home_numel if b.params is not None else b.param_flat.numel()) * esize
        return {"optimizer_state": sum(b.state.nbytes for b in self.blocks),
                "gradients": sum(self._grad_numel(b.layout) * gsize for b in self.blocks),
                "parameters": params}

    def swap_dirs(self) -> Dict[str, str]:
        """The run directories of the NVMe swap stores in use ({"optimizer": ..., "params": ...})."""
        self._check_open()
        return {k: st.run_dir for k, st in (("optimizer", self._store), ("params", self._param_store),
                                            ("activations", self._act_store)) if st is not None}

    # ---- teardown -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether ``close()`` ran (also when a newer engine took the model over)."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed: create a new one with offload.initialize")

    def _check_ok(self) -> None:
        """Open, and no earlier failure (an update or a write on a worker): else raise it,
        naming its block and stage. The engine cannot go on after one: ``close()`` it."""
        self._check_open()
        self.pipeline.raise_failure()

    def hand_back(self, restore: Optional[bool] = None) -> bool:
        """Give the model its current weights while the engine stays open: after waiting for
        the updates in flight, every offloaded parameter (``offload_param`` cpu / nvme,
        ZeRO-3) views a copy of its current value, in the compute dtype, on the device it was
        on at initialize (the CPU for a model built on the meta device), so ``state_dict()``,
        ``save_pretrained`` and attribute reads see the trained weights, as after ``close()``.
        Parameters that are not offloaded hold them already. The engine keeps its master copy
        and optimizer state: its next forward takes each block back (the copy goes as the
        block visits the device) and training goes on from where it was. The copies are the
        model's, not the engine's: writing into them changes nothing the engine trains (its
        ``load_checkpoint`` does). ``restore`` as in ``close()``: None hands back when the
        offloaded parameters fit in host memory (at most half of what is available now).
        Returns whether the model holds its weights now. With ZeRO-3 across ranks this is a
        collective: every rank calls it."""
        self._check_ok()
        self.synchronize()
        if self.param_offload is None:
            return True
        if not self._restore_wanted(restore):
            return False
        self._hand_back_blocks()
        return True

    def _offloaded_bytes(self) -> int:
        return sum(bp.nbytes for bp in self.param_offload.params if bp is not None)

    def _hand_back_blocks(self) -> list:
        """Every offloaded block's parameters bound to host copies (``BlockParams.hand_back``)
        of their current values, on the device each block was on at initialize; blocks handed
        back already keep theirs. Returns (segment, tensor) of every offloaded parameter."""
        po, out = self.param_offload, []
        for i, bp in enumerate(po.params):
            if bp is None:
                continue
            origin = self._origin[i] if i < len(self._origin) else torch.device("cpu")
            todo = [part for part in bp.parts if part.handed_back is None]
            if todo:
                if all(part.home_numel == part.numel for part in todo):   # homes hold whole flats: read them
                    po._release(i)
                    flats = [part.read_home().to(origin) for part in todo]
                else:                          # shards (ZeRO-3): gathered on the device
                    po.materialize(i)
                    flats = [part.device_buf.detach().to(origin, copy=True) for part in todo]
                    po._release(i)
                for part, flat in zip(todo, flats):
                    part.hand_back(flat)
            for part in bp.parts:              # the trainable part and each frozen part
                flat = part.handed_back
                out += [(s, flat[s.offset:s.offset + s.numel].view(s.shape)) for s in part.layout.segments]
        return out

    def close(self, restore: Optional[bool] = None) -> None:
        """Wait for the updates in flight, remove every hook, release host buffers and swap
        files, and destroy the process groups the engine made (the user's default group stays
        theirs to destroy). The memory goes back at once (one ``gc.collect()``), not when
        Python's cyclic collector next runs: the closed engine keeps only its counters
        (``global_step``, ``micro_step``), ``config``, ``module``, ``optimizer``,
        ``telemetry`` and what describes it (``rule``, ``plan``, ``tier``, dtypes).
        Afterwards every engine method (the forward included) raises "this engine is
        closed"; the model itself stays usable, with its buffers untouched:

        * parameters that were not offloaded (``offload_param.device: none``, ZeRO stages
          0-2) stay on the compute device, in the compute dtype, holding the trained values;
        * offloaded parameters (``offload_param`` cpu / nvme, and ZeRO-3, whose parameters
          live as shards) are brought back, in the compute dtype, to the device they were on
          at initialize (the CPU for a model built on the meta device) when ``restore`` is
          True, as ``hand_back`` does. Frozen parameters and buffers stay on the compute
          device: ``model.to()`` puts the whole model in one place. Default (None): restore
          when they fit, i.e. their bytes are at most half the host memory available now. A
          model larger than that (built on the meta device to train from NVMe, larger than
          RAM) keeps its offloaded parameters released: each is an empty placeholder and the
          trained weights leave only through ``full_state_dict()``, ``save_checkpoint()`` or
          the exports, called before close(). ``restore=False`` always releases. With ZeRO-3
          across ranks restoring all-gathers every block: every rank calls close().

        An engine nobody holds any more (its model's hooks hold it weakly) is closed when
        Python collects it, with ``restore`` None (False with ZeRO-3 across ranks, where
        restoring is a collective), and a warning where the model is left with placeholders.
        """
        if self._closed:
            return
        self._closed = True
        holders.forget(self)
        try:
            self._shut_down(restore)
        finally:
            self._let_go()

    def __del__(self):
        if not self.__dict__.get("_built") or self.__dict__.get("_closed", True) or sys.is_finalizing():
            return                   # (at interpreter exit the process lets everything go)
        collective = self.comm.active and self.stage == 3
        try:
            self.close(restore=False if collective else None)
            lost = self.__dict__.get("_lost") or []
        except Exception as exc:     # nothing to raise to: say it
            warnings.warn(f"offload: an engine dropped without close() failed to close: {exc!r}", RuntimeWarning)
            return
        if lost:
            warnings.warn(f"offload: an engine was dropped without close() and its model's offloaded parameters "
                          f"({', '.join(lost)}, ...) did not fit in host memory to be restored: they are empty "
                          f"placeholders now. Keep the engine (or its Trainer) until its weights are saved, and "
                          f"close() it", RuntimeWarning)

    def _shut_down(self, restore: Optional[bool]) -> None:
        """close()'s work: the updates and writes waited for, every hook, thread, buffer and
        swap file released, the offloaded parameters restored when wanted."""
        restored = None
        prior = self.pipeline.failure()
        told = prior is not None and prior.reported      # an earlier call raised it already
        try:
            try:
                self.pipeline.close()
                if self.param_offload is not None:
                    self.param_offload.wait_writes()
                    self.pipeline.raise_failure()
            except Exception as exc:
                if not (told and exc is prior):
                    raise
            else:
                if self.param_offload is not None and self._restore_wanted(restore):
                    restored = self._hand_back_blocks()
        finally:
            self.pipeline.settle_threads(force=True)
            if getattr(self, "_landing", None) is not None:
                self._landing.close()         # after the updates: none reads a landing now
            if self._gatherer is not None:
                self._gatherer.shutdown(wait=True)
            if self.hooks is not None:
                self.hooks.remove()
            if self.param_offload is not None:
                if restored is None:          # what close() leaves as placeholders (__del__ warns)
                    self._lost = [s.name for bp in self.param_offload.params if bp is not None
                                  for part in bp.parts if part.handed_back is None for s in part.layout.segments][:3]
                self.param_offload.close()
            if self.activations is not None:
                self.activations.close()
            self._own_master_params()
            self._release_storage()
            self.comm.close()
        for seg, t in restored or ():
            seg.param.data = t

    # What a closed engine keeps: its flag, the counters (``_StepCounters``), what the user
    # reaches through it (the model, the optimizer that LR schedulers hold, the config, the
    # telemetry for a trace written after training) and what describes it (its rule, tiers,
    # dtypes, memory plan): no buffer, nothing that holds one.
    _KEPT_AFTER_CLOSE = ("_closed", "module", "optimizer", "config", "telemetry", "rule", "plan", "tier",
                         "state_dtype", "device", "dtype", "stage", "_lost")

    def _let_go(self) -> None:
        """Drop everything else the closed engine holds, and collect the cycles its parts
        leave (one ``gc.collect()``, 0.1-0.2 s), so its memory goes now. The parts call back
        into the engine (hooks, pipeline callbacks) and into each other, so they sit in
        reference cycles that only Python's cyclic collector frees, on its own schedule,
        keeping the pools' mappings (each goes with its last tensor), device memory and,
        through the engine, the model alive until then: engines built and closed one after
        another (a sweep, Trainer's ``model_init``) kept about 3 GiB each for 0.5 GiB of
        parameters (measured). Memory that a tensor the user holds views stays, as it must."""
        counters = _StepCounters(self.control.global_step, self.control.micro_step)
        kept = {k: self.__dict__[k] for k in self._KEPT_AFTER_CLOSE if k in self.__dict__}
        self.__dict__.clear()
        self.__dict__.update(kept, control=counters)
        gc.collect()

    def _own_master_params(self) -> None:
        """Parameters that were views of the master (``_master_is_param``) get memory of
        their own, so the state's host buffer can go."""
        for i in self._master_params:
            b = self.blocks[i]
            b.param_flat = b.param_flat.clone()
            blk.bind_views(b.layout, b.param_flat)
        self._master_params = []

    def _restore_wanted(self, restore: Optional[bool]) -> bool:
        """``restore``, or (None) whether the offloaded parameters fit in half the available
        host memory. With ZeRO-3 across ranks, where handing back all-gathers every block,
        the ranks decide together (it fits on all of them): a collective."""
        if restore is not None:
            return bool(restore)
        import psutil
        held = sum(part.handed_back.numel() * part.handed_back.element_size()
                   for bp in self.param_offload.params if bp is not None for part in bp.parts
                   if part.handed_back is not None)   # copies that exist already cost nothing more
        fits = self._offloaded_bytes() - held <= psutil.virtual_memory().available // 2
        if self.comm.active and self.stage == 3:
            fits = all(self.comm.gather_objects(fits, "hand back: whether the parameters fit on every rank"))
        return fits

    def _release_storage(self) -> None:
        clean = True
        for r in (self._store, self._param_store, self._source_store, self._act_store):
            if r is not None:             # I/O stuck on a stalled disk is left behind, not waited for
                clean = r.close(timeout=self.config.wait_timeout_s) and clean
        pools = [r for r in (self._swap_pool, self._host_pool, self._param_home_pool, self._param_stage_pool,
                             self._param_write_pool, self._grad_pool, self._act_pool) if r is not None]
        if clean:
            for r in pools:
                r.close()
        else:                             # a stuck request may still write into a pool buffer
            from offload.storage import nvme
            nvme.keep_alive(pools)
        self._act_store = self._act_pool = self._source_store = None
        self._store = self._swap_pool = self._host_pool = self._param_store = self._grad_pool = None
        self._param_home_pool = self._param_stage_pool = self._param_write_pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
