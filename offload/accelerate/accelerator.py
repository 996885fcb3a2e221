"""``offload.accelerate.Accelerator``: Hugging Face Accelerate's ``Accelerator`` with the model
trained by the engine, so that a loop written for Accelerate runs unchanged but for the import.

    from offload.accelerate import Accelerator
    accelerator = Accelerator(offload_config={"offload_optimizer": {"device": "cpu"}},
                              gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

How it plugs in, where Accelerate's DeepSpeed path plugs DeepSpeed in:
- ``prepare`` takes one model and its torch optimizer together (its class must be one whose
  update the engine has, offload/optim/from_torch.py), builds the engine on them
  (``offload.initialize``, the config from ``offload_config``, the optimizer and the
  Accelerator: offload/accelerate/config.py) and returns the model itself (the engine's hooks
  run its forward and backward; it is never moved to the device whole nor wrapped in DDP: the
  engine places each block and, across ranks, partitions with ZeRO) and an ``EngineOptimizer``.
  Data loaders and schedulers are Accelerate's own (a scheduler built on the user's optimizer
  drives the engine: they share the param groups).
- ``backward`` divides the loss by ``gradient_accumulation_steps`` as Accelerate does and runs
  the engine's backward, the window's boundary being Accelerate's ``sync_gradients``. At the
  boundary the update is committed by ``clip_grad_norm_`` (the engine clips at its commit and
  returns the pre-clip norm) or else by ``optimizer.step()``; ``optimizer.zero_grad()``
  discards an uncommitted window as torch would.
- ``save_state`` / ``load_state`` write and read the engine's checkpoint (weights, master
  copy, optimizer state, counters) in ``<dir>/offload`` beside Accelerate's own files (the
  schedulers, data loader samplers, RNG states, registered objects), so resuming is exact.
- ``get_state_dict`` is the engine's consolidated fp32 weights; ``unwrap_model`` the model,
  which holds its trained weights after ``end_training()`` / ``close()`` where they fit in
  host memory (``Engine.hand_back``).
What the engine cannot honour fails at ``prepare`` naming the fix: a second model, an
optimizer without its model, another optimizer class, fp8, DeepSpeed / FSDP / Megatron plugins.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Optional

import torch

from offload.hf import versions

versions.check("accelerate")

import accelerate  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

from offload.config import ConfigError  # noqa: E402

ENGINE_DIR = "offload"      # the engine's checkpoint inside a save_state folder
_ENGINE_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class EngineOptimizer(AcceleratedOptimizer):
    """The optimizer ``prepare`` returns: the user's torch optimizer's param groups (shared
    with the engine, so schedulers and ``param_groups`` edits drive it), with ``step`` and
    ``zero_grad`` doing the engine's work at Accelerate's accumulation boundary."""

    def __init__(self, optimizer: torch.optim.Optimizer, accelerator: "Accelerator"):
        # not AcceleratedOptimizer.__init__: no state to move, no GradScaler (the engine scales fp16)
        self.optimizer = optimizer
        self.scaler = None
        self.accelerator_state = AcceleratorState()
        self.gradient_state = GradientState()
        self.device_placement = False
        self._is_overflow = False
        self._accelerator = accelerator

    def step(self, closure=None):
        """Commit the window's update at the boundary (a no-op inside it, and after
        ``clip_grad_norm_`` committed it)."""
        if closure is not None:
            raise ValueError("EngineOptimizer.step(closure): the engine computes the loss once per backward; "
                             "call the closure yourself, then accelerator.backward(loss) and optimizer.step()")
        if self.gradient_state.sync_gradients:
            self._accelerator._commit()

    def zero_grad(self, set_to_none=None):
        if self.gradient_state.sync_gradients:
            self._accelerator._discard()

    def state_dict(self):
        raise RuntimeError("the engine holds the optimizer state (on its tier, per rank): save it with "
                           "accelerator.save_state(dir) and load it with accelerator.load_state(dir)")

    def load_state_dict(self, state_dict):
        raise RuntimeError("the engine holds the optimizer state: load it with accelerator.load_state(dir), "
                           "written by accelerator.save_state(dir)")


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose ``prepare`` puts the model on the offload engine.

    ``offload_config``: the engine's config (dict, JSON path, ``offload.Config`` or a DeepSpeed
    config without ``"auto"``); the prepared optimizer decides the update rule and its
    hyper-parameters, the Accelerator ``gradient_accumulation_steps`` and the precision
    (``mixed_precision``), the loop the clipping (offload/accelerate/config.py). Every other
    argument is Accelerate's. ``engine`` is the live engine after ``prepare``; ``close()`` (or
    ``end_training()``) hands the trained weights back to the model and frees the engine's
    host buffers and swap files."""

    def __init__(self, *args, offload_config: Any = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.offload_config = offload_config
        self.engine = None
        self._engine_optimizer: Optional[EngineOptimizer] = None
        self._pending = False          # a window's last backward ran; its update is not committed yet
        if self.distributed_type not in _ENGINE_TYPES:
            raise ConfigError(f"offload.accelerate.Accelerator runs on one process or data-parallel ranks "
                              f"(torchrun / accelerate launch); distributed_type {self.distributed_type} (a "
                              f"DeepSpeed, FSDP, Megatron-LM or XLA setup) would shard the model itself: drop that "
                              f"plugin or config, the engine partitions with ZeRO (offload_config zero_optimization)")

    # ---- prepare ----------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        """``prepare`` as Accelerate's, the model and its optimizer on the engine (the model
        and optimizer it returned before pass through unchanged)."""
        done = [a for a in args if isinstance(a, EngineOptimizer)
                or (self.engine is not None and a is self.engine.module)]
        models = [a for a in args if isinstance(a, torch.nn.Module) and not any(a is d for d in done)]
        optims = [a for a in args if isinstance(a, torch.optim.Optimizer) and not isinstance(a, EngineOptimizer)]
        if not models and not optims:
            return self._prepare_rest(args, done, device_placement)
        if len(models) > 1 or (models and self.engine is not None):
            raise ConfigError("offload.accelerate.Accelerator: a second model to prepare: the engine trains one "
                              "model per Accelerator; prepare the other with its own Accelerator, or combine them "
                              "in one nn.Module")
        if len(models) != 1 or len(optims) != 1 or self.engine is not None:
            raise ConfigError(f"offload.accelerate.Accelerator.prepare got {len(models)} new model(s) and "
                              f"{len(optims)} new optimizer(s): the engine is built on the model and its optimizer "
                              f"together: accelerator.prepare(model, optimizer, ...) with one of each, once")
        model, optimizer = models[0], optims[0]
        _check_owned(model, optimizer)
        import offload
        from offload.accelerate.config import engine_config
        from offload.planner import precision
        config = engine_config(self.offload_config, self, optimizer)
        asked = self.mixed_precision != "no" or _precision_in(self.offload_config)
        precision.announce(precision.decide(config.precision if asked else None))
        self.engine = offload.initialize(model, config, param_groups=optimizer)
        self._engine_optimizer = EngineOptimizer(optimizer, self)
        self._optimizers.append(self._engine_optimizer)
        args = tuple(self._engine_optimizer if a is optimizer else a for a in args)
        return self._prepare_rest(args, [model, self._engine_optimizer], device_placement)

    def _prepare_rest(self, args: tuple, engine_owned: list, device_placement):
        """Accelerate's ``prepare`` of everything in ``args`` but ``engine_owned``, in place."""
        out = list(args)
        rest = [(i, a) for i, a in enumerate(args) if not any(a is o for o in engine_owned)]
        if rest:
            places = None if device_placement is None else [device_placement[i] for i, _ in rest]
            done = super().prepare(*[a for _, a in rest], device_placement=places)
            done = [done] if len(rest) == 1 else list(done)
            for (i, _), d in zip(rest, done):
                out[i] = d
        return tuple(out) if len(out) > 1 else out[0]

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if self.engine is not None and model is self.engine.module:
            return model
        raise ConfigError("offload.accelerate.Accelerator.prepare_model: the engine is built on the model and its "
                          "optimizer together: accelerator.prepare(model, optimizer, ...)")

    def prepare_optimizer(self, optimizer, device_placement=None):
        if isinstance(optimizer, EngineOptimizer):
            return optimizer
        raise ConfigError("offload.accelerate.Accelerator.prepare_optimizer: the engine is built on the model and "
                          "its optimizer together: accelerator.prepare(model, optimizer, ...)")

    # ---- the step ------------------------------------------------------------------------------
    def backward(self, loss, **kwargs):
        """Accelerate's backward (the loss divided by gradient_accumulation_steps) into the
        engine's window; the boundary is ``sync_gradients``."""
        if self.engine is None:
            return super().backward(loss, **kwargs)
        if kwargs:
            raise ValueError(f"accelerator.backward: {sorted(kwargs)} are torch backward options the engine's "
                             f"backward does not take: call accelerator.backward(loss)")
        boundary = bool(self.sync_gradients)
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss / self.gradient_accumulation_steps, scale_wrt_gas=False)
        if boundary:
            self._pending = True          # committed by clip_grad_norm_ or optimizer.step()
        else:
            self.engine.step()            # closes the micro-step: a no-op inside the window

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Commit the window's update with its gradients clipped to ``max_norm`` (the global
        L2 norm of every trainable parameter's gradient, as torch computes it); returns
        that norm before clipping, as a tensor."""
        if self.engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type!r}): the engine clips the L2 norm: "
                             f"use norm_type=2")
        if not self._pending:
            raise RuntimeError("accelerator.clip_grad_norm_ outside an accumulation boundary: the engine clips "
                               "the window's summed gradients when it commits them; call it after "
                               "accelerator.backward(loss) when accelerator.sync_gradients is True")
        if self.engine.config.offload_optimizer.update_ahead:
            raise ConfigError("accelerator.clip_grad_norm_ with offload_optimizer.update_ahead: the engine steps each "
                              "block as its gradients come in, before the global norm is known; set update_ahead "
                              "to false to clip, or do not clip")
        _check_all_trainable(self.engine.module, parameters)
        self.engine.control.clip = float(max_norm)
        self._commit()
        norm = self.engine.grad_norm()
        return None if norm is None else torch.tensor(norm)

    def _commit(self) -> None:
        """The window's update (once per window), with the clipping asked for it, if any."""
        if not self._pending:
            return
        self._pending = False
        try:
            committed = self.engine.step()
        finally:
            self.engine.control.clip = self.engine.config.gradient_clipping
        # an fp16 overflow skipped the update: Accelerate's scheduler wrapper then skips its step
        self._engine_optimizer._is_overflow = not committed and self.engine.scaler.enabled

    def _discard(self) -> None:
        self._pending = False
        self.engine.zero_grad()

    @property
    def optimizer_step_was_skipped(self):
        if self._engine_optimizer is not None:
            return self._engine_optimizer.step_was_skipped
        return super().optimizer_step_was_skipped

    # ---- saving and resuming --------------------------------------------------------------------
    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs):
        """Accelerate's state (schedulers, data loader samplers, RNG, registered objects) and
        the engine's checkpoint in ``<dir>/offload``, every rank writing its shard."""
        if self.engine is None:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        with self._without_engine_objects():
            out = super().save_state(output_dir, safe_serialization, **kwargs)
        self.engine.save_checkpoint(os.path.join(out, ENGINE_DIR))
        self.wait_for_everyone()
        if self.is_main_process:
            try:        # the save's lock file: this folder is the run's alone, and the save is over
                os.remove(os.path.join(out, ENGINE_DIR + ".lock"))
            except FileNotFoundError:
                pass
        return out

    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **kwargs):
        """The engine's checkpoint (weights, master copy, optimizer state, counters), then
        Accelerate's state; an open window's gradients are discarded."""
        if self.engine is None:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        folder = self._state_dir(input_dir)
        path = os.path.join(folder, ENGINE_DIR)
        if not os.path.isdir(path):
            raise ValueError(f"{folder!r} has no engine checkpoint ({ENGINE_DIR}/): load a folder written by "
                             f"offload.accelerate.Accelerator.save_state")
        self._pending = False
        self.engine.load_checkpoint(path, rng=False)       # Accelerate's own files restore the RNG
        with self._without_engine_objects():
            return super().load_state(folder, load_kwargs, **kwargs)

    def _state_dir(self, input_dir: Optional[str]) -> str:
        """The folder load_state reads, found as Accelerate finds it."""
        if input_dir is not None:
            input_dir = os.path.expanduser(input_dir)
            if not os.path.isdir(input_dir):
                raise ValueError(f"Tried to find {input_dir} but folder does not exist")
            return input_dir
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        root = os.path.join(self.project_dir, "checkpoints")
        folders = sorted((os.path.join(root, f) for f in os.listdir(root)),
                         key=lambda f: [int(n) for n in re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)][0])
        return folders[-1]

    @contextlib.contextmanager
    def _without_engine_objects(self):
        """Accelerate's save / load without the engine's optimizer (the engine checkpoints it)."""
        saved = self._optimizers
        self._optimizers = [o for o in saved if not isinstance(o, EngineOptimizer)]
        try:
            yield
        finally:
            self._optimizers = saved

    # ---- the model ------------------------------------------------------------------------------
    def get_state_dict(self, model, unwrap=True):
        """The engine's consolidated fp32 weights (keys of ``model.state_dict()``, on the CPU;
        a collective across ranks: call it on every rank)."""
        if self.engine is not None and self.unwrap_model(model) is self.engine.module:
            self._check_committed("get_state_dict")
            return self.engine.full_state_dict()
        return super().get_state_dict(model, unwrap)

    def _check_committed(self, what: str) -> None:
        if self._pending:
            raise RuntimeError(f"accelerator.{what} between backward and optimizer.step(): the window's update is "
                               f"not committed yet; call optimizer.step() first")

    def end_training(self):
        self.close()                      # before the process group goes
        super().end_training()

    def close(self) -> None:
        """Wait for updates in flight, hand the trained weights back to the model where they
        fit in host memory, and free the engine's host buffers and swap files."""
        if self.engine is not None and not self.engine.closed:
            self.engine.close()

    def free_memory(self, *objects):
        self.close()
        self.engine, self._engine_optimizer, self._pending = None, None, False
        return super().free_memory(*objects)


def _precision_in(offload_config) -> bool:
    from offload.config import Config, is_deepspeed_config
    from offload.config.decided import raw_mapping
    if offload_config is None or isinstance(offload_config, Config):
        return False
    raw = raw_mapping(offload_config)
    return not is_deepspeed_config(raw) and raw.get("precision") is not None


def _check_owned(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every parameter the optimizer updates is the model's."""
    mine = {id(p) for p in model.parameters()}
    for gi, g in enumerate(optimizer.param_groups):
        if any(id(p) not in mine for p in g["params"]):
            raise ConfigError(f"the prepared optimizer's param_groups[{gi}] holds a parameter that is not the "
                              f"prepared model's: build the optimizer on model.parameters() of the model you prepare")


def _check_all_trainable(model: torch.nn.Module, parameters) -> None:
    """clip_grad_norm_ clips what the engine clips: every trainable parameter of the model."""
    given = {id(p) for p in (parameters if not isinstance(parameters, torch.Tensor) else [parameters])}
    params = list(model.parameters())
    if not {id(p) for p in params if p.requires_grad} <= given or not given <= {id(p) for p in params}:
        raise ValueError("accelerator.clip_grad_norm_ on other parameters than the prepared model's: the engine "
                         "clips the global norm of all its trainable parameters: pass model.parameters()")
