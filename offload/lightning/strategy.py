"""``OffloadStrategy``: Lightning's ``Trainer`` with the model trained by the engine.

    import lightning as L
    from offload.lightning import OffloadStrategy
    trainer = L.Trainer(strategy=OffloadStrategy(offload_config={"offload_optimizer": {"device": "cpu"}}),
                        accumulate_grad_batches=2, gradient_clip_val=1.0)
    trainer.fit(module)                     # or Trainer(strategy="offload") with the defaults

How it plugs in, the way Lightning's DeepSpeed strategy does:
- The engine is created where Lightning creates the optimizers (``configure_optimizers``):
  one torch optimizer whose update the engine has (offload/optim/from_torch.py) decides the
  rule, hyper-parameters and param groups, which the engine's optimizer shares, so the LR
  schedulers Lightning steps drive the engine. The model is not moved to the device whole:
  the engine places each block on its tier.
- Backward is the engine's, on the loss Lightning already divided for accumulation; the
  backward run by the optimizer step's closure closes the window (``accumulate_grad_batches``
  and the shorter last window of an epoch are Lightning's decision), the others are
  micro-steps. The step is the engine's commit, after ``on_before_optimizer_step``; the engine
  clips at its commit (``gradient_clip_val`` by norm), so Lightning's own clipping is not run.
  The gradients stay in the engine's buffers: ``p.grad`` is None in Lightning's hooks.
- Checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``) are directories: the engine's
  checkpoint in ``offload/`` (weights, fp32 master and optimizer state, restored exactly; the
  RNG states are not, as Lightning does not restore them)
  and the rest of Lightning's checkpoint (loops, callbacks, LR schedulers, hyper-parameters)
  in ``lightning.pt``; ``fit(ckpt_path=...)``, ``"last"`` included, resumes from them.
- After ``fit`` the model holds its trained weights (``Engine.hand_back``) where they fit in
  host memory; ``strategy.engine`` stays open for validation, testing and saving.

- Several ranks (``torchrun``, ``Trainer(devices=N)``, ``num_nodes``): a process group as
  Lightning's DDP starts one, and the engine partitions and reduces across it (ZeRO,
  ``zero_optimization.stage``) in place of DDP; each rank reads its share of the data
  through the distributed sampler plain DDP uses. One process starts no group and keeps its
  data loader as it is (no distributed sampler), as Lightning's single-device strategy.
"""
from __future__ import annotations

import contextlib
import warnings
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from offload import device as dev
from offload.config import ConfigError
from offload.lightning.checkpoint import engine_dir, load_rest, save_rest
from offload.lightning.config import engine_config, engine_precision, plugin_flag, precision_asked


class EnginePrecision(Precision):
    """Lightning's precision plugin for a model the engine runs: the engine owns the compute
    dtype (no autocast, no module conversion), the backward, the clipping and the step.
    ``precision`` keeps Lightning's flag (it is what the run asked for)."""

    def __init__(self, strategy: "OffloadStrategy", flag: str):
        super().__init__()
        self.precision = flag
        self._strategy = strategy

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        self._strategy.engine_backward(tensor)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs) -> Any:
        """The closure (training_step, backward) closes the window; then Lightning's
        ``on_before_optimizer_step`` hooks; then the engine's commit."""
        with self._strategy.closing_window():
            closure()
        self._after_closure(model, optimizer)
        return self._strategy.engine.step()

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        """The engine clipped at its commit (``gradient_clipping`` = ``gradient_clip_val``)."""


class OffloadStrategy(ParallelStrategy):
    """A Lightning ``Trainer`` strategy whose model the offload engine trains, in one process or
    on several ranks.

    ``offload_config``: the engine's config (dict, JSON path, ``offload.Config``, or a DeepSpeed
    config) for what Lightning does not decide: tiers, NVMe path, prefetch, ZeRO stage, ... (see
    offload/lightning/config.py for what Lightning decides; a config that contradicts it is an
    error naming both). ``weights``: a pretrained checkpoint streamed into the model block by
    block (``offload.initialize(weights=)``). ``engine``: the live engine once ``fit`` set it up.
    ``process_group_backend`` / ``timeout``: the process group's, with several ranks, as for
    Lightning's DDP (the backend defaults to the device's: gloo on CPU, nccl on CUDA).

    A parallel strategy that is distributed only with several ranks (``is_distributed``): one
    process keeps the single-device behaviour (no group, no distributed sampler), so its data
    order is plain Lightning's on one device.

    Refused at setup, naming the fix: manual optimization (so one optimizer), an optimizer
    class the engine has no rule for, clipping by value, a ``configure_gradient_clipping``
    override, a precision the engine does not run."""

    strategy_name = "offload"

    def __init__(self, offload_config: Any = None, *, weights: Optional[str] = None, accelerator=None,
                 parallel_devices=None, cluster_environment=None, checkpoint_io=None, precision_plugin=None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout):
        self._engine_flag = "32-true"
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.offload_config = offload_config
        self.offload_weights = weights
        self.engine = None
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._told_not_handed_back = False
        self._closing = False          # inside the optimizer step's closure: its backward closes the window

    # ---- ranks: Lightning's DDP conventions, without its DDP wrapper ------------------------------
    @property
    def root_device(self) -> torch.device:
        """This rank's device among Lightning's ``devices``; the engine's device before the
        Trainer set them."""
        if self.parallel_devices:
            return self.parallel_devices[self.local_rank]
        return dev.compute_device()

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Several ranks: Lightning then gives each its share of the data (distributed sampler)
        and reduces logged values across them; one process is not distributed."""
        return self.world_size > 1

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        """The ranks of ``num_nodes`` x ``devices``, as Lightning's DDP numbers them."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        """Lightning starts the other ranks' processes (``python train.py`` with ``devices=N``)
        unless a launcher (torchrun, SLURM) did; one process starts none."""
        several = self.num_processes * self.num_nodes > 1
        if several and self.cluster_environment is not None and \
                not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"):
        """A logged tensor reduced across the ranks (``self.log(..., sync_dist=True)``); itself
        in one process."""
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ---- precision: Lightning's flag, the engine's work ------------------------------------------
    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else EnginePrecision(self, "32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        """Lightning's plugin for its ``precision`` flag is read for the flag (an error where the
        engine has no such precision) and replaced by the engine's own."""
        if plugin is None or isinstance(plugin, EnginePrecision):
            self._precision_plugin = plugin
            return
        self._engine_flag = flag = plugin_flag(plugin)     # raises where the engine has no such precision
        self._precision_plugin = EnginePrecision(self, flag)

    # ---- setup ----------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        want = dev.compute_device().type
        acc = type(self.accelerator).__name__ if self.accelerator is not None else None
        if acc is not None and ("CUDA" in acc) != (want == "cuda"):
            raise ConfigError(f"offload strategy: Trainer(accelerator) chose {acc}, but the engine computes on "
                              f"{want}: use accelerator={'gpu' if want == 'cuda' else 'cpu'!r} (or leave it 'auto')")
        super().setup_environment()
        if self.is_distributed:
            self._setup_distributed()

    def _setup_distributed(self) -> None:
        """The process group across the ranks, as Lightning's DDP starts it (the seed reset from
        ``seed_everything``'s, the device's default backend); the engine builds its own groups
        on it."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              device_id=device_id)

    def setup(self, trainer) -> None:
        module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_module(module, trainer)
        super().setup(trainer)

    def _check_module(self, module: LightningModule, trainer) -> None:
        if not module.automatic_optimization:
            raise ConfigError("offload strategy: manual optimization (automatic_optimization=False) steps the "
                              "optimizer itself, but the engine runs the backward, window and step: use automatic "
                              "optimization, or drive the engine from your own loop with Lightning Fabric "
                              "(offload.lightning.OffloadFabricStrategy)")
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE and trainer.gradient_clip_val:
            raise ConfigError("offload strategy: gradient_clip_algorithm='value': the engine clips the global "
                              "gradient norm at its step; use gradient_clip_algorithm='norm'")
        if is_overridden("configure_gradient_clipping", module, LightningModule):
            raise ConfigError(f"offload strategy: {type(module).__name__}.configure_gradient_clipping is "
                              "overridden, but the engine clips at its own step with Trainer(gradient_clip_val=...) "
                              "by norm and the gradients never reach .grad: remove the override and set "
                              "gradient_clip_val")

    def model_to_device(self) -> None:
        """The engine places the blocks of a model it trains; a model without one (evaluation
        before any fit) goes to the device whole, as Lightning's own strategy does."""
        if not self._engine_open():
            self.model.to(self.root_device)

    def setup_optimizers(self, trainer) -> None:
        """``configure_optimizers``' one torch optimizer becomes the engine's: the engine is built
        here, with its rule, groups and hyper-parameters; the schedulers stay Lightning's."""
        super().setup_optimizers(trainer)      # several optimizers: Lightning's own error (automatic optimization)
        user = self.optimizers[0]
        if type(user).__name__ == "_MockOptimizer":
            raise ConfigError("offload strategy: configure_optimizers returned None: the engine needs the torch "
                              "optimizer it should run (e.g. torch.optim.AdamW(self.parameters(), lr=...))")
        self.engine = self._build_engine(trainer, user)
        self.optimizers = [self.engine.optimizer]

    def _build_engine(self, trainer, user: torch.optim.Optimizer):
        import offload
        from offload.planner import precision
        prec = engine_precision(self._engine_flag)
        config = engine_config(self.offload_config, user, precision=prec, where="Trainer",
                               accumulate=trainer.accumulate_grad_batches,
                               clip=float(trainer.gradient_clip_val or 0.0))
        if precision_asked(self.offload_config, prec):
            precision.announce(precision.decide(config.precision))
        return offload.initialize(self.lightning_module, config, param_groups=user, weights=self.offload_weights)

    def _engine_open(self) -> bool:
        return self.engine is not None and not self.engine.closed

    # ---- the step -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def closing_window(self):
        """Context of the optimizer step's closure: its backward closes the window."""
        self._closing = True
        try:
            yield
        finally:
            self._closing = False

    def engine_backward(self, loss: torch.Tensor) -> None:
        """The engine's backward of a loss Lightning divided for accumulation; a backward
        outside the optimizer step is a micro-step of the window (its step() a no-op)."""
        engine = self.engine
        boundary = self._closing
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, scale_wrt_gas=False)
        if not boundary:
            engine.step()

    def optimizer_state(self, optimizer) -> dict:
        """The optimizer state is the engine's, saved with its checkpoint."""
        return {}

    # ---- checkpoints ----------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True            # the engine exists, to load into, after setup

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        """``filepath`` becomes a directory: the engine's checkpoint and Lightning's other state."""
        if not self._engine_open():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("offload strategy: save_checkpoint(storage_options=...) is not supported: the engine "
                            "writes its checkpoint itself")
        self.engine.save_checkpoint(engine_dir(filepath))
        # its state_dict and optimizer state are empty here (the engine's checkpoint holds them)
        save_rest(self.checkpoint_io, checkpoint, filepath, self.is_global_zero)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        """The engine's state (weights, master copy, optimizer state, counters; not the RNG
        states, which Lightning does not restore either), and Lightning's rest."""
        if not self._engine_open():
            raise ConfigError(f"offload strategy: {checkpoint_path} holds the engine's checkpoint, which loads into "
                              f"a model the engine trains: resume with trainer.fit(module, ckpt_path=...)")
        rest = load_rest(self.checkpoint_io, checkpoint_path, weights_only)
        self.engine.load_checkpoint(engine_dir(checkpoint_path), rng=False)
        return rest

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The weights came back with the engine's checkpoint."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The optimizer state came back with the engine's checkpoint."""

    def lightning_module_state_dict(self) -> dict:
        """Empty while the engine trains the model: the weights go to the engine's checkpoint
        (``offload.export_fp32(dir + "/offload")`` reads them as one state dict), so a
        checkpoint does not gather them a second time."""
        if self._engine_open():
            return {}
        return super().lightning_module_state_dict()

    # ---- teardown -------------------------------------------------------------------------------
    def teardown(self) -> None:
        """The model gets its trained weights (``Engine.hand_back``) and stays where the engine
        placed it; the engine stays open (validation, testing, saving after ``fit``)."""
        if self._engine_open():
            if not self.engine.hand_back() and not self._told_not_handed_back:
                self._told_not_handed_back = True
                warnings.warn("offload strategy: the model's offloaded parameters do not fit in host memory, so the "
                              "module holds empty placeholders for them; the trained weights are the engine's: save "
                              "them with trainer.save_checkpoint(path) (offload.export_fp32(path + '/offload') reads "
                              "them as a state dict)", UserWarning, stacklevel=2)
            if self.is_distributed:
                self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        if self.is_distributed:
            return super().teardown()          # ParallelStrategy's: the cluster environment's too
        super(ParallelStrategy, self).teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="the offload engine (ZeRO-Offload)")


if OffloadStrategy.strategy_name not in StrategyRegistry:
    OffloadStrategy.register_strategies(StrategyRegistry)
