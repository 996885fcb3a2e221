"""``OffloadFabricStrategy``: Lightning ``Fabric`` with the model trained by the engine, under
the user's own loop (the way LitGPT trains), on one process or several (torchrun, gloo / nccl).

    fabric = L.Fabric(strategy=OffloadFabricStrategy(offload_config={...}))   # or strategy="offload"
    fabric.launch()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for i, (x, y) in enumerate(loader):
        with fabric.no_backward_sync(model, enabled=(i + 1) % 4 != 0):   # accumulation
            fabric.backward(model(x, y) / 4)
        if (i + 1) % 4 == 0:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "scheduler": sched, "step": i})

What each call does here:
- ``fabric.setup(model, optimizer)`` builds the engine over the model with the optimizer's
  rule, groups and hyper-parameters (offload/optim/from_torch.py); the optimizer returned
  drives the engine and shares the groups, so a scheduler built on the user's optimizer
  drives the engine's learning rate. The model is not moved whole: the engine places it.
  With several ranks the engine partitions and reduces (ZeRO, ``zero_optimization.stage``)
  in place of DDP.
- ``fabric.backward(loss)``: the engine's backward of the loss as given (the loop divides it
  for accumulation, as for DDP). A backward inside ``no_backward_sync(model, enabled=True)``
  is a micro-step of an accumulation window; one outside it closes the window, so
  ``optimizer.step()`` commits after it (several backward calls outside it sum, as torch's do).
- ``fabric.clip_gradients(model, optimizer, max_norm=...)`` sets the norm the engine clips to
  at the commit; it returns None (the norm is computed at the commit: read it after
  ``optimizer.step()`` as ``strategy.engine.grad_norm()``). Clipping by value is refused.
- ``optimizer.step()`` commits; ``optimizer.zero_grad()`` discards an open window.
- ``fabric.save(path, state)`` / ``fabric.load(path, state)``: ``path`` is a directory holding
  the engine's checkpoint (the model's weights, master copy, optimizer state) and the rest
  of ``state`` (offload/lightning/checkpoint.py); the RNG states stay as they are on load,
  as with Fabric's own.
- The loop is the user's, so the end of training is too: ``strategy.engine.hand_back()`` gives
  the model its trained weights (offloaded parameters are placeholders until then), or
  ``strategy.engine.close()`` does and frees the engine's buffers and swap files.
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
from torch import nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading

from offload.config import ConfigError
from offload.lightning.checkpoint import engine_dir, load_rest, save_rest
from offload.lightning.config import engine_config, engine_precision, plugin_flag, precision_asked

_ENGINE_STATE = "<offload engine checkpoint>"    # in lightning.pt, under the model's and optimizer's keys


class _EngineWindow(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled)``: the backward inside, with ``enabled``, is a
    micro-step of the window (no reduction across ranks, no commit)."""

    def __init__(self, strategy: "OffloadFabricStrategy"):
        self._strategy = strategy

    @contextlib.contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool):
        before, self._strategy._accumulating = self._strategy._accumulating, bool(enabled)
        try:
            yield
        finally:
            self._strategy._accumulating = before


class OffloadFabricStrategy(DDPStrategy):
    """A Lightning ``Fabric`` strategy whose model the offload engine trains (the module
    docstring says what each Fabric call does).

    ``offload_config``: the engine's config (dict, JSON path, ``offload.Config``, or a DeepSpeed
    config); the optimizer and ``precision`` decide the rule, hyper-parameters and precision
    (offload/lightning/config.py). ``weights``: a pretrained checkpoint streamed into the model
    block by block. ``engine``: the live engine after ``fabric.setup``.

    Refused, naming the fix: a model set up without its optimizer, a second model, several
    optimizers, an optimizer class the engine has no rule for, clipping by value, a precision
    the engine does not run, a low precision with accumulation the config did not size."""

    strategy_name = "offload"

    def __init__(self, offload_config: Any = None, *, weights: Optional[str] = None, accelerator=None,
                 parallel_devices=None, cluster_environment=None, checkpoint_io=None, precision=None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout):
        self._engine_flag = "32-true"
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._backward_sync_control = _EngineWindow(self)
        self.offload_config = offload_config
        self.offload_weights = weights
        self.engine = None
        self._accumulating = False       # inside no_backward_sync(enabled=True)
        self._open_micro = False         # the last backward was a micro-step: step() would not commit

    # ---- precision ------------------------------------------------------------------------------
    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, plugin: Optional[Precision]) -> None:
        """Fabric's plugin for its ``precision`` flag is read for the flag (an error where the
        engine has no such precision) and replaced by a plain one: the engine owns the compute
        dtype (no autocast, no module conversion)."""
        if plugin is None:
            self._precision = None
            return
        self._engine_flag = flag = plugin_flag(plugin)     # raises where the engine has no such precision
        self._precision = Precision()
        self._precision.precision = flag

    # ---- setup ----------------------------------------------------------------------------------
    def _setup_distributed(self) -> None:
        """A process group across the ranks; none for one process (nothing crosses ranks, and
        the engine needs none: no group is left behind in the user's process)."""
        if self.num_processes * self.num_nodes > 1:
            return super()._setup_distributed()
        self._set_world_ranks()

    def module_to_device(self, module: nn.Module) -> None:
        """The engine places the blocks of the model it trains."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        raise ConfigError("offload strategy: fabric.setup(model) without its optimizer: the engine trains the "
                          "model with the optimizer's rule; call fabric.setup(model, optimizer)")

    def setup_optimizer(self, optimizer) -> Any:
        raise ConfigError("offload strategy: fabric.setup_optimizers(...) alone: the engine is built over the model "
                          "and its optimizer together; call fabric.setup(model, optimizer)")

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, scheduler=None):
        if self.engine is not None and not self.engine.closed:
            raise ConfigError("offload strategy: a second model set up: one engine trains one model per Fabric; "
                              "put both in one nn.Module (one optimizer over its parameters) or use a second Fabric")
        if len(optimizers) != 1:
            raise ConfigError(f"offload strategy: fabric.setup got {len(optimizers)} optimizers; the engine runs one "
                              f"optimizer over the model: pass one (param groups may set different hyper-parameters)")
        import offload
        from offload.planner import precision
        user = optimizers[0]
        prec = engine_precision(self._engine_flag)
        config = engine_config(self.offload_config, user, precision=prec, where="Fabric")
        if precision_asked(self.offload_config, prec):
            precision.announce(precision.decide(config.precision))
        self.engine = offload.initialize(module, config, param_groups=user, weights=self.offload_weights)
        return module, [self.engine.optimizer], scheduler

    # ---- backward, clipping, step ---------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args, **kwargs) -> None:
        engine = self._engine()
        micro = self._accumulating
        if micro and engine.config.gradient_accumulation_steps == 1 and engine.config.precision != "fp32":
            raise ConfigError(f"offload strategy: accumulation (no_backward_sync) in {engine.config.precision}, but "
                              f"the engine sized its gradient buffers for one micro-step (low-precision sums): set "
                              f"offload_config gradient_accumulation_steps to the window's length")
        engine.set_gradient_accumulation_boundary(not micro)
        engine.backward(tensor, scale_wrt_gas=False)
        if micro:
            engine.step()                # a micro-step: no commit
        self._open_micro = micro

    def optimizer_step(self, optimizer, **kwargs) -> Any:
        engine = self._engine()
        if kwargs.get("closure") is not None:
            raise ConfigError("offload strategy: optimizer.step(closure): the engine commits the gradients of the "
                              "backward before it; call fabric.backward(loss), then optimizer.step()")
        if self._open_micro:
            raise ConfigError("offload strategy: optimizer.step() after a backward inside no_backward_sync(model, "
                              "enabled=True): the engine reduces and commits at the backward that closes the window; "
                              "run the window's last backward with enabled=False")
        return engine.step()

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True) -> None:
        if float(norm_type) != 2.0:
            raise ConfigError(f"offload strategy: clip_gradients(norm_type={norm_type}): the engine clips the "
                              f"global 2-norm; use norm_type=2")
        self._engine().set_gradient_clipping(float(max_norm))
        return None

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        raise ConfigError("offload strategy: clip_gradients(clip_val=...): the engine clips the global gradient norm "
                          "at its step; use fabric.clip_gradients(model, optimizer, max_norm=...)")

    def _engine(self):
        if self.engine is None:
            raise ConfigError("offload strategy: no model set up: call fabric.setup(model, optimizer) first")
        return self.engine

    # ---- checkpoints ----------------------------------------------------------------------------
    def _engine_keys(self, state: dict) -> list:
        """The keys of ``state`` whose object is the engine's: its model, its optimizer."""
        e = self.engine
        if e is None or e.closed:
            return []
        return [k for k, v in state.items() if v is e.module or v is e.optimizer]

    def save_checkpoint(self, path, state: dict, storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        mine = self._engine_keys(state)
        if not mine:
            return super().save_checkpoint(path, state, storage_options, filter)
        if storage_options is not None:
            raise TypeError("offload strategy: fabric.save(storage_options=...) is not supported: the engine writes "
                            "its checkpoint itself")
        if filter and any(k in filter for k in mine):
            raise ConfigError(f"offload strategy: fabric.save(filter=) on {sorted(k for k in mine if k in filter)}: "
                              f"the engine saves the model and optimizer whole; filter the other entries only")
        self.engine.save_checkpoint(engine_dir(path))
        rest = self._convert_stateful_objects_in_state({k: v for k, v in state.items() if k not in mine},
                                                       filter=filter or {})
        rest.update({k: _ENGINE_STATE for k in mine})
        save_rest(self.checkpoint_io, rest, path, self.is_global_zero)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None) -> dict:
        mine = self._engine_keys(state) if isinstance(state, dict) else []
        if not mine:
            if isinstance(state, (nn.Module, torch.optim.Optimizer)) and self.engine is not None and \
                    state in (self.engine.module, self.engine.optimizer):
                raise ConfigError("offload strategy: fabric.load(path, model) / (path, optimizer): the engine loads "
                                  "them together: fabric.load(path, {'model': model, 'optimizer': optimizer, ...})")
            return super().load_checkpoint(path, state, strict, weights_only)
        rest = load_rest(self.checkpoint_io, path, weights_only)
        _validate_keys_for_strict_loading(state.keys(), rest.keys(), strict=strict)
        self.engine.load_checkpoint(engine_dir(path), rng=False)
        for k in mine:
            rest.pop(k, None)
        for name, obj in list(state.items()):
            if name in mine or name not in rest:
                continue
            if hasattr(obj, "load_state_dict") and hasattr(obj, "state_dict"):
                obj.load_state_dict(rest.pop(name))
            else:
                state[name] = rest.pop(name)
        return rest

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="the offload engine (ZeRO-Offload)")


if OffloadFabricStrategy.strategy_name not in STRATEGY_REGISTRY:
    OffloadFabricStrategy.register_strategies(STRATEGY_REGISTRY)
