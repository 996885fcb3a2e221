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
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from offload.engine import holders
from offload import device as dev
from offload import dtypes
from offload.dist.comm import Comm
from offload.dist.grad_sync import GradSync
from offload.config import Config
from offload.core.hooks import Hooks
from offload.engine import build
from offload.engine.outside_reads import UpdateWaits
from offload.engine.step_control import LossScaler, StepControl, UpdateAndGrads
from offload.optim.state import BlockShard, Tier
from offload.optim.pipeline import StepArgs, StepPipeline, hyperparams, make_optimizer
from offload.params import homes as ph
from offload.params.residency import ParamState, ParamWriteBack
from offload.storage.resources import Resources
from offload.core.telemetry import Telemetry


@dataclasses.dataclass
class _StepCounters:
    """A closed engine's counters (``Engine.global_step`` / ``micro_step`` stay readable)."""
    global_step: int
    micro_step: int


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
        home_device = ph.home_device(config, self.stage)
        # process-wide malloc tuning only where parameters or saved activations leave a CPU
        # device (device.py): both free large host blocks every step; for parameters only
        # while loading (reuse_heap below), for saved activations while training too
        acts_offloaded = config.offload_activations.device != "none"
        dev.return_freed_host_memory(bound_large_allocations=home_device != "none" or acts_offloaded,
                                     keep=acts_offloaded)
        if self.device.type == "cpu":
            dev.step_trim_bytes()     # OFFLOAD_STEP_TRIM_BYTES is checked here, not at the first step()
        self.dtype = dtypes.compute_dtype(config.precision)
        self.telemetry = Telemetry()
        from offload.optim import get_rule
        from offload.config import ConfigError
        self.rule = get_rule(config.optimizer.type)     # the update rule (offload/optim)
        self.state_dtype = config.optimizer.state_dtype
        refused = placement_refusal(config)
        if refused:
            raise ConfigError(refused)
        self.optimizer = make_optimizer(model, param_groups, config.optimizer, self.rule, self)
        builder = build.Builder(module=model, config=config, comm=self.comm, device=self.device, dtype=self.dtype,
                                rule=self.rule, state_dtype=self.state_dtype, optimizer=self.optimizer,
                                telemetry=self.telemetry)
        self.layouts, self.frozen = builder.layouts, builder.frozen
        self._codecs = builder.codecs     # id(frozen part) -> codec: the parts stored quantized
        from offload.io.loader import WeightLoader
        self.weights = WeightLoader(model, weights, key_map=key_map, init_fn=init_fn)   # checked before allocating
        self.plan = builder.plan_memory(self.weights)
        self.comm.check_same("model and config", builder.signature())
        self._param_order = {id(p): i for i, p in enumerate(model.parameters())}
        self.tier = builder.tier
        self.resources = Resources(self.plan, config.aio, config.wait_timeout_s)   # every pool and store
        self.param_offload = None
        self.activations = None           # ActivationOffload (offload_activations), engine/activations.py
        self.blocks: List[BlockShard] = []
        self.units = []                   # BlockParts per block that visits the device (param offload)
        self.hooks: Optional[Hooks] = None   # every module / parameter / saved-tensor hook
        self._closed = False
        try:
            self._made = builder.build(self.resources, self._param_write_failed)
            self.blocks, self.units = self._made.blocks, self._made.units
            self._master_params = self._made.master_params   # blocks whose parameters view the master
            self._start_param_offload()
            self._start_activation_offload()
            self._install_hooks()
        except BaseException:
            self.resources.release()
            raise
        finally:
            self.weights.close()
        dev.trim_host_heap()          # loading block by block leaves freed holes in the heap
        dev.reuse_heap()              # training reuses its freed blocks (device.reuse_heap)
        self.scaler = LossScaler(config.loss_scaler, enabled=config.precision == "fp16")
        # one rank, stages 0 and 1: nothing to reduce or move, so no dist/ on the step's path
        self.grad_sync = GradSync(self.comm, self.blocks, self.stage, self.telemetry) \
            if self.comm.active or self.stage >= 2 else None
        self._gatherer = None         # one thread: post-update parameter all-gathers (stages 1, 2)
        if self.comm.active and self.stage in (1, 2):
            self._gatherer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-gather")
        self.pipeline = StepPipeline(self.blocks, workers=config.optimizer_workers,
                                     slots=self._made.swap_slots, telemetry=self.telemetry,
                                     compute_device=self.device, grad_sync=self.grad_sync,
                                     wait_timeout_s=config.wait_timeout_s,
                                     params=ParamWriteBack(compute_device=self.device,
                                                           copy_param=self.dtype == torch.float32,
                                                           state_on_device=self.tier is Tier.DEVICE,
                                                           write_pool=self.resources.pool("offload-param-write"),
                                                           telemetry=self.telemetry,
                                                           wait_timeout_s=config.wait_timeout_s,
                                                           keep_staged=self._keeps_staged))
        self._d2h = dev.new_stream(self.device)
        self.control = StepControl(
            blocks=self.blocks, pipeline=self.pipeline, grad_sync=self.grad_sync, comm=self.comm,
            scaler=self.scaler, telemetry=self.telemetry,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            gradient_clipping=config.gradient_clipping, param_order=self._param_order,
            read_ahead=self.tier is Tier.NVME and config.overlap_step, submit=self._submit,
            ahead=self._submit_ahead if config.offload_optimizer.update_ahead else None,
            on_block_complete=self.hooks.post_backward)   # every participant's post_backward
        holders.register(self)
        self._ready = True            # fully built: close() (or __del__) has everything to release

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
    def _param_write_failed(self, index: int, err: BaseException) -> None:
        """A parameter write-back failed (found after its job returned, by whoever settled
        it): recorded against its own block; raised from the user's next call."""
        block = next(b for b in self.blocks if b.index == index)
        self.pipeline.record_failure(block, "parameter write-back", err)

    def _start_param_offload(self) -> None:
        from offload.params.offload import ParamOffload
        if self._made.homes is None:
            return
        self.param_offload = ParamOffload(self, self.units, budget=self._made.param_budget,
                                          device_lookahead=self._made.device_lookahead,
                                          host_lookahead=self._made.host_lookahead,
                                          prefetch=self.config.prefetch.enabled)
        offloaded = {id(s.param) for u in self.units for _, s in u.segments}
        self.param_offload.resident_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters()
                                                if id(p) not in offloaded)

    def _start_activation_offload(self) -> None:
        from offload.engine.activations import ActivationOffload
        ac = self.config.offload_activations
        if ac.device == "none":
            return
        store = self.resources.make_store("activations", ac.nvme_path) if ac.device == "nvme" else None
        # unpinned, it is trimmed every step (activations.py)
        pool = self.resources.make_pool("offload-activations", pin=ac.pin_memory and dev.can_pin(),
                                        huge_pages=True, arena=True)
        self.activations = ActivationOffload(model=self.module, device=self.device, tier=ac.device,
                                             min_bytes=ac.min_bytes, lookahead_bytes=ac.lookahead_bytes,
                                             pool=pool, store=store, telemetry=self.telemetry,
                                             wait_timeout_s=self.config.wait_timeout_s)

    def _install_hooks(self) -> None:
        """One owner installs every hook (core/hooks.py); each feature joins as a participant:
        the engine's own part first, then the update waits for reads outside a block's modules
        (without parameter offload, whose materialize waits itself), parameter offload,
        activation offload."""
        self.hooks = Hooks(self.module, self.layouts, self.units)
        self.hooks.join(UpdateAndGrads(self))
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
        self.control.backward(loss, scale_wrt_gas=scale_wrt_gas)
        self.hooks.end_backward()     # blocks without gradients (frozen only) end theirs

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

    def _submit(self, block: BlockShard, grad_scale: float) -> None:
        if not self.control.distributed and not block.grad.close_window(block.layout.segments):
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
            return                        # the block step() updates inline (build.py _ahead_slot)
        if block.ahead.out_lent and self.param_offload is not None:
            self.param_offload.release_before_update(block.index)
        if block.ahead.out_lent and block.params.state is not ParamState.WRITING:
            return                        # its home's staged copy is in use: step() updates it
        # (WRITING: the buffer comes back once the last write-back completes; the job waits)
        if not block.grad.close_window(block.layout.segments):
            return                        # no gradient: step() skips the block, as torch does
        self.pipeline.submit_ahead(block, StepArgs(step=block.stepped + 1, groups=hyperparams(self.optimizer), rule=self.rule))

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
            self._commit_inputs = (hyperparams(self.optimizer), dev.record_event(dev.current_stream(self.device)))
        committed = self.control.step()
        if committed:
            self.optimizer.step()
            if self.param_offload is not None:
                self.param_offload.after_step()
        if self.device.type == "cpu":
            dev.trim_after_step()     # each micro-step; trims only where RSS has grown (device.py)
        if committed and not self.config.overlap_step:
            self.synchronize()
        return committed

    def grad_norm(self):
        """The global gradient norm of the last commit, before clipping and after fp16
        unscaling (inf when an fp16 overflow skipped it), as clip_grad_norm_ returns it;
        None when the engine computes none (no clipping and not fp16)."""
        self._check_open()
        return self.control.last_grad_norm

    def synchronize(self) -> None:
        """Wait until every queued update is applied and every state write has completed."""
        self._check_open()
        self.pipeline.wait_all()
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
        return checkpoint.live_state_dict(self._checkpoint_view())

    def save_checkpoint(self, path: str) -> str:
        """Everything as of the last commit (an open window's gradients are not saved)."""
        from offload.io import checkpoint
        self._check_open()
        self.synchronize()
        return checkpoint.save(self._checkpoint_view(), path)

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
        checkpoint.load(self._checkpoint_view(), path, rng=rng)

    def _checkpoint_view(self):
        """What io/checkpoint.py reads and writes of this engine, and nothing else."""
        from offload.engine.checkpoint_view import CheckpointView
        return CheckpointView(blocks=self.blocks, control=self.control, comm=self.comm, telemetry=self.telemetry,
                              module=self.module, optimizer=self.optimizer, scaler=self.scaler,
                              config=self.config, rule=self.rule.name, state_dtype=self.state_dtype,
                              stage=self.stage, weights=self.weights, param_offload=self.param_offload)

    def stats(self) -> dict:
        """Telemetry and where the bytes are (engine/stats.py says what each key holds)."""
        from offload.engine.stats import engine_stats
        self._check_open()
        return engine_stats(self.telemetry.snapshot(), blocks=self.blocks, master_params=self._master_params,
                            tier=self.tier, param_offload=self.param_offload, activations=self.activations,
                            resources=self.resources, scaler=self.scaler, comm=self.comm, stage=self.stage,
                            module=self.module, counters=(self.global_step, self.micro_step),
                            grad_dtype=dtypes.grad_dtype(self.config.precision,
                                                         self.config.gradient_accumulation_steps),
                            dtype=self.dtype, codecs=self._codecs,
                            frozen_dtype=self.config.offload_param.frozen_dtype)

    def swap_dirs(self) -> Dict[str, str]:
        """The run directories of the NVMe swap stores in use ({"optimizer": ..., "params": ...})."""
        self._check_open()
        return {k: st.run_dir for k in ("optimizer", "params", "activations")
                if (st := self.resources.store(k)) is not None}

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
        ph.hand_back_blocks(self.param_offload, self._made.origin)
        return True

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
        if not self.__dict__.get("_ready") or self.__dict__.get("_closed", True) or sys.is_finalizing():
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
                    restored = ph.hand_back_blocks(self.param_offload, self._made.origin)
        finally:
            if self._gatherer is not None:
                self._gatherer.shutdown(wait=True)
            if self.hooks is not None:
                self.hooks.remove()
            if self.param_offload is not None:
                if restored is None:          # what close() leaves as placeholders (__del__ warns)
                    self._lost = ph.placeholders(self.param_offload)[:3]
                self.param_offload.close()
            if self.activations is not None:
                self.activations.close()
            build.own_master_params(self.blocks, self._master_params)
            self._master_params = []
            self.resources.release()
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
        leave (one ``gc.collect()``), so its memory goes now. The parts call back into the
        engine (hooks, pipeline callbacks) and into each other, so they sit in reference
        cycles that only Python's cyclic collector frees, on its own schedule, keeping the
        pools' mappings (each goes with its last tensor), device memory and, through the
        engine, the model alive until then: engines built and closed one after another (a
        sweep, Trainer's ``model_init``) would each keep theirs. Memory that a tensor the
        user holds views stays, as it must."""
        counters = _StepCounters(self.control.global_step, self.control.micro_step)
        kept = {k: self.__dict__[k] for k in self._KEPT_AFTER_CLOSE if k in self.__dict__}
        self.__dict__.clear()
        self.__dict__.update(kept, control=counters)
        gc.collect()

    def _restore_wanted(self, restore: Optional[bool]) -> bool:
        """``restore``, or (None) whether the offloaded parameters fit in half the available
        host memory (params/homes.py ``restore_fits``; a collective with ZeRO-3 across ranks)."""
        if restore is not None:
            return bool(restore)
        return ph.restore_fits(self.param_offload, self.comm, self.stage)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
