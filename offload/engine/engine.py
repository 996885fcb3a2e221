"""The training engine: wraps a model, installs the hooks, sequences the step.

    engine = offload.initialize(model, config)
    loss = engine(inputs, targets)       # the model's forward
    engine.backward(loss)                # gradients leave the device block by block
    engine.step()                        # at the accumulation boundary

``step()`` is the commit point, as in torch: ``backward()`` only lands gradients; the
``step()`` that closes a window of ``gradient_accumulation_steps`` micro-steps commits the
update (engine/step_control.py states the window's contract). The commit queues every
block's update in forward order and returns without waiting: block k's next forward waits
for block k's update alone, so the CPU step runs under the next forward.

Per block (core/blocks.py lays it out; core/block.py's ``Block`` is the one object the engine
and every participant hold of it, in one list) the engine keeps the parameters (views into one flat device buffer, or offloaded: params/), the fp32
master and optimizer state on the configured tier, and a gradient buffer. Across ranks rank
r owns shard r of the optimizer state (ZeRO stage >= 1), of the gradients (>= 2) and of the
parameters (3); dist/ issues the collectives. ``close()`` leaves the model usable.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from offload.engine import holders
from offload import device as dev
from offload import dtypes
from offload.dist.comm import Comm
from offload.dist.grad_sync import GradSync
from offload.dist.param_gather import ParamGather
from offload.config import Config
from offload.core.hooks import Hooks
from offload.engine import build
from offload.engine.outside_reads import UpdateWaits
from offload.engine.loss_scale import LossScaler
from offload.engine.step_control import StepControl
from offload.engine.update_and_grads import UpdateAndGrads
from offload.core.block import Block
from offload.placement import Placement
from offload.optim.pipeline import Stage
from offload.optim.torch_face import make_optimizer
from offload.params import homes as ph
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

    ``config``: a dict, a JSON path (engine or DeepSpeed layout) or ``offload.Config``.
    ``param_groups``: torch-style groups (default: one group of every trainable parameter), or
    a torch optimizer whose rule (the config's ``optimizer.type`` must name it), groups and
    hyper-parameters the engine runs and shares, so an LR scheduler built on it drives the
    engine (optim/from_torch.py). ``weights``: a pretrained checkpoint streamed block by block
    into the model, which may be on the meta device; ``key_map`` / ``init_fn``: io/loader.py."""
    return Engine(model, Config.from_any(config), param_groups, weights=weights, key_map=key_map, init_fn=init_fn)


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
        # device (device.py): both free large host blocks every step; for parameters only while
        # loading (reuse_heap below), for saved activations while training too. Called here:
        # device.py's warning points at the user's initialize call (its stacklevel)
        acts_offloaded = config.offload_activations.placement is not Placement.DEVICE
        dev.return_freed_host_memory(bound_large_allocations=ph.home_device(config, self.stage) is not Placement.DEVICE
                                     or acts_offloaded, keep=acts_offloaded)
        if self.device.type == "cpu":
            dev.step_trim_bytes()     # OFFLOAD_STEP_TRIM_BYTES is checked here, not at the first step()
        self.dtype = dtypes.compute_dtype(config.precision)
        self.telemetry = Telemetry()
        self.rule = build.update_rule(config)
        self.state_dtype = config.optimizer.state_dtype
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
        # every block, in one list: the trained ones in forward order, then (parameter offload)
        # those holding frozen parameters only; each knows whether it trains (``Block.trains``)
        self.blocks: List[Block] = []
        self.hooks: Optional[Hooks] = None   # every module / parameter / saved-tensor hook
        self._closed = False
        self.scaler = LossScaler(config.loss_scaler, enabled=config.precision == "fp16")
        # the build order: blocks -> gradient sync -> optimizer pipeline -> the hook participants
        # (parameter and activation offload) -> the hook owner -> step control -> the engine's
        # own participant, joined with the others and installed: each is handed what it uses,
        # made before it, and nothing reads the engine later
        try:
            self._made = builder.build(self.resources, self._param_write_failed)
            self.blocks = self._made.blocks
            trained = [b for b in self.blocks if b.trains]
            self._master_params = self._made.master_params   # blocks whose parameters view the master
            # one rank, stages 0 and 1: nothing to reduce or move, so no dist/ on the step's path
            self.grad_sync = GradSync(self.comm, trained, self.stage, self.telemetry) \
                if self.comm.active or self.stage >= 2 else None
            self.pipeline = builder.pipeline(self._made, self.resources, self.grad_sync)
            # stages 1, 2 across ranks: the updated parameter shards all-gathered after each update
            self._gatherer = ParamGather(self.comm, self.telemetry, self.pipeline.record_failure) \
                if self.comm.active and self.stage in (1, 2) else None
            self.param_offload = builder.param_offload(self._made, self.pipeline)
            self.activations = builder.activation_offload(self.resources)
            self.hooks = Hooks(self.module, self.blocks)
            self.control = StepControl(
                blocks=trained, pipeline=self.pipeline, grad_sync=self.grad_sync, comm=self.comm,
                scaler=self.scaler, telemetry=self.telemetry, device=self.device, rule=self.rule,
                optimizer=self.optimizer, gatherer=self._gatherer, param_offload=self.param_offload,
                gradient_accumulation_steps=config.gradient_accumulation_steps,
                gradient_clipping=config.gradient_clipping, param_order=self._param_order,
                read_ahead=self.tier is Placement.NVME and config.overlap_step,
                update_ahead=config.offload_optimizer.update_ahead, wait_timeout_s=config.wait_timeout_s,
                on_block_complete=self.hooks.post_backward)   # every participant's post_backward
            self._install_hooks()
        except BaseException:
            self.resources.release()
            raise
        finally:
            self.weights.close()
        dev.trim_host_heap()          # loading block by block leaves freed holes in the heap
        dev.reuse_heap()              # training reuses its freed blocks (device.reuse_heap)
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
        it): recorded against its own block; raised from the user's next call. (Called only
        after construction: a write-back follows an update.)"""
        self.pipeline.record_failure(self.blocks[index], Stage.PARAM_WRITE_BACK, err)

    def _install_hooks(self) -> None:
        """One owner installs every hook (core/hooks.py); each feature joins as a participant:
        the engine's own part first, then the update waits for reads outside a block's modules
        (without parameter offload, whose materialize waits itself), parameter offload,
        activation offload."""
        self.hooks.join(UpdateAndGrads(self.control, self.telemetry, self.device))
        if self.param_offload is None:
            self.hooks.join(UpdateWaits([b for b in self.blocks if b.trains], self.telemetry))
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
        """Backward of ``loss`` into the accumulation window: gradients are summed in the
        window's buffers; weights, optimizer state and step counters never change here. The loss
        is divided by gradient_accumulation_steps (DeepSpeed's convention: pass the micro-batch's
        mean loss) unless ``scale_wrt_gas=False`` (the caller scaled it, as Hugging Face Trainer
        does), and scaled for fp16."""
        self._check_ok()
        self.control.backward(loss, scale_wrt_gas=scale_wrt_gas)
        self.hooks.end_backward()     # blocks without gradients (frozen only) end theirs

    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """Whether the next step() closes the window (True / False); None counts
        gradient_accumulation_steps again (DeepSpeed's name: a caller that decides the window, e.g.
        Trainer's shorter last window). Set it before the window's last backward()."""
        self._check_ok()
        self.control.set_boundary(is_boundary)

    def set_gradient_clipping(self, max_norm: float) -> None:
        """Clip the global gradient norm to ``max_norm`` (0: no clipping) from the next commit
        on, as ``gradient_clipping`` does; for loops that name the norm where they clip
        (Lightning Fabric's ``clip_gradients``). Set before the window's last backward(), the
        norms are computed while backward runs; set later, step() computes them."""
        self._check_open()
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0 \
                or max_norm == float("inf"):
            raise ValueError(f"max_norm={max_norm!r} must be a finite number >= 0 (0: no clipping)")
        self.control.clip = float(max_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the open window's gradients (every micro-step since the last commit);
        weights, optimizer state and counters stay at the last commit. (``set_to_none``: torch's
        signature.)"""
        self._check_open()
        self.control.zero_grad()

    def step(self) -> bool:
        """Close one micro-step; the one that closes a window of gradient_accumulation_steps
        commits the update. True when it committed (False inside the window, with no gradient, or
        after an fp16 overflow). With ``overlap_step`` it returns without waiting (each block's
        next forward waits for its update), else once every update is applied."""
        self._check_ok()
        if self.control.at_boundary() and self.param_offload is not None:
            self.param_offload.plan_write_through()   # before the updates are queued
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
        commit; an open window's gradients are discarded. ``rng=False`` keeps the current RNG
        states (e.g. a best checkpoint loaded at the end of a run)."""
        from offload.io import checkpoint
        self._check_open()
        self.control.zero_grad()
        self.synchronize()
        checkpoint.load(self._checkpoint_view(), path, rng=rng)

    def _checkpoint_view(self):
        """What io/checkpoint.py reads and writes of this engine, and nothing else."""
        from offload.engine.checkpoint_view import CheckpointView
        return CheckpointView(blocks=[b for b in self.blocks if b.trains], control=self.control, comm=self.comm,
                              telemetry=self.telemetry,
                              module=self.module, optimizer=self.optimizer, scaler=self.scaler,
                              config=self.config, rule=self.rule.name, state_dtype=self.state_dtype,
                              stage=self.stage, weights=self.weights, param_offload=self.param_offload)

    def stats(self) -> dict:
        """Telemetry and where the bytes are (engine/stats.py says what each key holds)."""
        from offload.engine.stats import engine_stats
        self._check_open()
        return engine_stats(self.telemetry.snapshot(), blocks=[b for b in self.blocks if b.trains],
                            master_params=self._master_params,
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
            raise holders.EngineClosedError("this engine is closed: create a new one with offload.initialize")

    def _check_ok(self) -> None:
        """Open, and no earlier failure (an update or a write on a worker): else raise it,
        naming its block and stage. The engine cannot go on after one: ``close()`` it."""
        self._check_open()
        self.pipeline.raise_failure()

    def hand_back(self, restore: Optional[bool] = None) -> bool:
        """Give the model its current weights while the engine stays open: after the updates
        in flight, each offloaded parameter views a copy of its current value on the device it was
        on at initialize, as after ``close()``; training goes on (the next forward takes each block
        back). The copies are the model's: writing them changes nothing the engine trains.
        ``restore`` as in ``close()``. Returns whether the model holds its weights now. A
        collective with ZeRO-3 across ranks."""
        self._check_ok()
        self.synchronize()
        if self.param_offload is None:
            return True
        if not holders.restore_wanted(self, restore):
            return False
        ph.hand_back_blocks(self.param_offload)
        return True

    def close(self, restore: Optional[bool] = None) -> None:
        """Wait for the updates in flight; remove every hook; release the buffers, swap files
        and process groups the engine made, at once (one ``gc.collect()``). The model stays usable:
        parameters not offloaded keep their trained values on the compute device; offloaded ones
        (``offload_param``, ZeRO-3) are brought back to the device they were on at initialize when
        ``restore`` is True, or (None) when they fit in half the available host memory, else left
        as empty placeholders (save before close()). Afterwards every engine method raises "this
        engine is closed"; counters, config, module, optimizer and telemetry stay readable. With
        ZeRO-3 across ranks restoring is a collective. An engine nobody holds is closed when
        collected (``restore`` None; a warning if placeholders are left)."""
        if self._closed:
            return
        self._closed = True
        holders.forget(self)
        try:
            holders.shut_down(self, restore)
        finally:
            holders.let_go(self, _StepCounters(self.control.global_step, self.control.micro_step))

    def __del__(self, _dropped=holders.dropped):
        _dropped(self)        # (bound at definition: module teardown may have cleared ``holders``)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
