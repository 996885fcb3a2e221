"""``offload.hf.Trainer``: Hugging Face ``Trainer`` with the model trained by the engine.

    from offload.hf import Trainer
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                      offload_config={"offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/nvme"},
                                      "offload_param": {"device": "cpu"}})
    trainer.train()
    trainer.save_model("out")        # Hugging Face safetensors (a PEFT model: its adapter)

How it plugs in, the way transformers' DeepSpeed integration does:
- The engine is created where Trainer creates its optimizer (``create_optimizer``), with
  Trainer's parameter groups (weight decay on / off), or with the torch optimizer Trainer was
  given (``optimizers=``, ``optimizer_cls_and_kwargs``: its rule, groups and hyper-parameters,
  offload/optim/from_torch.py); ``self.optimizer`` is the engine's torch-facing optimizer
  (sharing a given optimizer's param groups), so Trainer's LR scheduler or the user's drives
  the engine.
- Trainer's accelerator is wrapped (``EngineAccelerator``): the model and the engine's
  optimizer are not prepared (no device move, no DDP, no autocast: the engine owns placement,
  precision and gradient communication); ``backward`` runs the engine's backward on the loss
  Trainer already scaled for accumulation (the engine does not divide again), with the
  accumulation boundary Trainer decided, then the engine's ``step()`` (a no-op inside the
  window); ``clip_grad_norm_`` returns the engine's own pre-clip norm (logged as grad_norm);
  an fp16 overflow skips the scheduler step as in Trainer.
- Checkpoints: Trainer's ``checkpoint-N`` folders hold the engine's checkpoint in
  ``offload/`` (weights, optimizer state, counters: resume is bit-exact) beside the model in
  Hugging Face layout, the scheduler, RNG and trainer state.
- The model is never moved to the device whole (``place_model_on_device`` off); with
  ``weights=`` it may be built on the meta device and is filled by the engine's streamed load.
- After ``train()`` / ``evaluate()`` / ``predict()`` the model holds its trained weights
  (``Engine.hand_back``) where they fit in host memory; ``load_best_model_at_end`` loads the
  best checkpoint's engine state. A Trainer whose engine another took over (a second Trainer
  on the model) or ``close()`` closed builds a new one when it is used again.

Other trainers built on ``transformers.Trainer`` (TRL's ``SFTTrainer``, ``DPOTrainer``, ...)
run on the engine with this class first in their method order, so that its methods wrap
theirs: ``on_engine(SFTTrainer)``, or ``class T(offload.hf.Trainer, SFTTrainer)``. The other
order would let their methods build Trainer's own optimizer around the engine: it is refused
when the class is defined.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch

from offload.hf import versions

versions.check("transformers", "accelerate")

import transformers  # noqa: E402
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from offload import ConfigError, DataError, ModelError  # noqa: E402
from offload.hf.config import engine_config, precision_asked  # noqa: E402
from offload.planner import precision  # noqa: E402
from offload.hf.weights import save_hf  # noqa: E402

ENGINE_DIR = "offload"    # the engine's checkpoint inside a Trainer checkpoint folder
logger = hf_logging.get_logger(__name__)


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class EngineAccelerator:
    """Trainer's ``accelerate.Accelerator`` as seen by a Trainer whose model the engine runs.
    Everything not listed here is the wrapped accelerator's (data loaders, gather, state)."""

    def __init__(self, inner, trainer: "Trainer"):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_skipped", False)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)

    def _engine_owned(self, obj) -> bool:
        t = self._trainer
        return obj is t.model or (t.engine is not None and obj is t.engine.optimizer)

    def prepare(self, *objs, device_placement=None):
        rest = [o for o in objs if not self._engine_owned(o)]
        if not rest:
            return objs[0] if len(objs) == 1 else objs
        done = self._inner.prepare(*rest, device_placement=device_placement)
        done = iter([done] if len(rest) == 1 else done)
        out = tuple(o if self._engine_owned(o) else next(done) for o in objs)
        return out[0] if len(out) == 1 else out

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if self._engine_owned(model):
            return model
        return self._inner.prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer, device_placement=None):
        if self._engine_owned(optimizer):
            return optimizer
        return self._inner.prepare_optimizer(optimizer, device_placement=device_placement)

    def backward(self, loss, **kwargs):
        """The loss comes scaled for accumulation by Trainer (num_items_in_batch, or divided
        by the window's micro-batches): the engine must not divide it again."""
        engine = self._trainer.engine
        boundary = bool(self._inner.sync_gradients)
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, scale_wrt_gas=False)
        stepped = engine.step()               # a no-op inside the window
        if boundary:
            object.__setattr__(self, "_skipped", not stepped)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The engine clipped at its step (gradient_clipping = max_grad_norm); this returns
        its pre-clip global norm, or None when it computed none (no clipping, not fp16)."""
        return self._trainer.engine.grad_norm()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return self._skipped


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that trains through the offload engine.

    ``offload_config``: the engine's config (dict, JSON path, ``offload.Config`` or a DeepSpeed
    config whose ``"auto"`` values are filled from ``TrainingArguments``); the arguments decide
    the learning rate, Adam betas / epsilon, weight decay, ``gradient_accumulation_steps``,
    ``max_grad_norm`` and bf16 / fp16 (see ``offload.hf.config``): fp32 when neither is set,
    saying why where bf16 is slow here, and an asked-for precision slow here gets a warning
    with the measured factor (``offload.planner.precision``). ``args.optim`` selects the
    engine's update rule (``offload.hf.config.OPTIM_RULES``: the AdamW names, ``sgd``,
    ``adagrad``, ``adafactor``, the Lion names, the 8-bit names with int8 state; an AdamW name
    leaves the choice to ``offload_config`` ``optimizer.type``); another name is an error
    naming it.
    ``weights``: a pretrained checkpoint (a Hugging Face model directory, safetensors, an index)
    streamed by the engine into the model block by block (``offload.initialize(weights=)``), so
    the model may be built on the meta device and never exist whole in host memory.
    ``optimizers=(optimizer, scheduler)`` / ``optimizer_cls_and_kwargs``: a torch optimizer whose
    update the engine has decides the rule and hyper-parameters instead (another is an error
    naming those it takes); the scheduler drives the engine's learning rate.
    ``engine`` is the live engine once training (or evaluation) started; ``close()`` frees its
    host buffers and swap files."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _check_method_order(cls)

    def __init__(self, *args, offload_config: Any = None, weights: Optional[str] = None, **kwargs):
        self.engine = None
        self.offload_weights = weights
        if _trl_base(type(self)) is not None:
            versions.check("trl")
        else:
            _point_to_trl(kwargs.get("args", args[1] if len(args) > 1 else None),
                          kwargs.get("train_dataset", args[3] if len(args) > 3 else None))
        super().__init__(*args, **kwargs)
        if _is_peft(self.model):
            versions.check("peft")
        self.place_model_on_device = False
        # a torch optimizer given (optimizers=) or described (optimizer_cls_and_kwargs) decides the
        # engine's rule and hyper-parameters, as it decides Trainer's; the engine runs the update
        self._user_optimizer = self.optimizer
        probe = self._user_optimizer if self._user_optimizer is not None else _probe(self.optimizer_cls_and_kwargs)
        if self.args.load_best_model_at_end and self.args.save_only_model:
            raise ConfigError("offload.hf.Trainer: load_best_model_at_end with save_only_model=True: the best weights "
                              "come back with the engine's checkpoint (weights, master copy and optimizer state), "
                              "which save_only_model leaves out; set save_only_model=False")
        self.offload_config = engine_config(offload_config, self.args, optimizer=probe)   # fails here, before training
        self._told_not_handed_back = False
        # fp32 unless asked for; an asked-for precision slow on this device, or fp32 chosen
        # where bf16 is slow, is told once (offload.planner.precision)
        asked = precision_asked(offload_config, self.args)
        choice = precision.decide(self.offload_config.precision if asked else None)
        precision.announce(choice)

    # ---- the accelerator and device placement -------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator = EngineAccelerator(self.accelerator, self)

    def _move_model_to_device(self, model, device) -> None:
        """Never move the whole model: the engine places each block on its tier."""
        return None

    # ---- the engine ------------------------------------------------------------------------
    def _live_engine(self):
        """The engine, while it is open (another engine may have taken the model over, or
        ``close()`` closed it: then a new one is built when needed)."""
        return self.engine if self.engine is not None and not self.engine.closed else None

    def create_optimizer(self, model=None):
        engine = self._live_engine()
        if engine is not None and engine.module is self.model and self.optimizer is engine.optimizer:
            return self.optimizer
        import offload
        model = self.model
        if engine is not None:             # model_init gave a new model: the old engine's buffers go
            engine.close()
        self.engine = None
        user = self._user_optimizer
        if user is None and self.optimizer_cls_and_kwargs is not None:
            self.optimizer = None
            user = super().create_optimizer()   # the class and its kwargs on Trainer's groups, as Trainer builds it
        if user is not None:
            groups = user                    # its rule, groups and hyper-parameters (offload/optim/from_torch.py)
        else:
            decay = set(self.get_decay_parameter_names(model))
            groups = [
                {"params": [p for n, p in model.named_parameters() if n in decay and p.requires_grad],
                 "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in model.named_parameters() if n not in decay and p.requires_grad],
                 "weight_decay": 0.0},
            ]
            groups = [g for g in groups if g["params"]]
            if not groups:
                raise ModelError("offload.hf.Trainer: the model has no parameter with requires_grad: nothing to train")
        self.engine = offload.initialize(model, self.offload_config, param_groups=groups, weights=self.offload_weights)
        self.optimizer = self.engine.optimizer
        return self.optimizer

    def train(self, *args, **kwargs):
        """Trainer's ``train()``; then the model holds its trained weights (``hand_back``)."""
        out = super().train(*args, **kwargs)
        self._hand_back()
        return out

    def evaluate(self, *args, **kwargs):
        if self._live_engine() is None:        # evaluation before training runs on the engine too
            self.create_optimizer()
        out = super().evaluate(*args, **kwargs)
        if not self.is_in_train:
            self._hand_back()
        return out

    def predict(self, *args, **kwargs):
        if self._live_engine() is None:
            self.create_optimizer()
        out = super().predict(*args, **kwargs)
        if not self.is_in_train:
            self._hand_back()
        return out

    def _hand_back(self) -> None:
        """After train() / evaluate() / predict(): ``trainer.model`` holds the trained weights
        (``Engine.hand_back``) where the offloaded parameters fit in host memory; else they stay
        with the engine (said once) and leave through ``save_model`` or checkpoints."""
        engine = self._live_engine()
        if engine is None or engine.hand_back():
            return
        if not self._told_not_handed_back:
            self._told_not_handed_back = True
            warnings.warn("offload.hf.Trainer: the model's offloaded parameters do not fit in host memory, so "
                          "trainer.model holds empty placeholders for them; the trained weights are the engine's: "
                          "save them with trainer.save_model(dir) (or a checkpoint) and load them from there",
                          UserWarning, stacklevel=3)

    def close(self) -> None:
        """Wait for updates in flight, then free the engine's host buffers and swap files; the
        model keeps its trained weights where they fit in host memory (``Engine.close``)."""
        if self.engine is not None:
            self.engine.close()

    # ---- saving and resuming --------------------------------------------------------------
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Hugging Face layout from the engine's trained weights (fp32 masters; sharded
        safetensors + config.json, ``offload.export_hf``), a PEFT model's adapter in PEFT's
        layout; the tokenizer / processor and the training arguments beside them, as Trainer
        writes them."""
        if self._live_engine() is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_hf(self.engine, output_dir, is_main=self.args.should_save)   # every rank: the checkpoint is per rank
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._live_engine() is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR))   # every rank writes its shard
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            try:        # the save's lock file: this checkpoint folder is the run's alone, and the save is over
                os.remove(os.path.join(output_dir, ENGINE_DIR + ".lock"))
            except FileNotFoundError:
                pass

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights come back with the engine's checkpoint (``_load_optimizer_and_scheduler``);
        here only check that the folder has one, before training starts: a path that is not a
        checkpoint gets Trainer's own message."""
        if not os.path.isdir(resume_from_checkpoint):
            raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}")
        path = os.path.join(resume_from_checkpoint, ENGINE_DIR)
        if not os.path.isdir(path):
            raise ValueError(f"{resume_from_checkpoint!r} has no engine checkpoint ({ENGINE_DIR}/): resume from a "
                             f"checkpoint folder written by offload.hf.Trainer, or train from its weights "
                             f"(from_pretrained) without resume_from_checkpoint")

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        if self._live_engine() is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self._load_from_checkpoint(checkpoint)
        self.engine.load_checkpoint(os.path.join(checkpoint, ENGINE_DIR))
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's engine state (weights, master copy,
        optimizer state and step counts, consistently) replaces the engine's, so training that
        goes on continues from it; the RNG states and the schedule stay as they are, as
        Trainer's own best-model load leaves them. The model gets the weights at the end of
        ``train()`` (``hand_back``)."""
        engine = self._live_engine()
        if engine is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        self._load_from_checkpoint(best)
        engine.load_checkpoint(os.path.join(best, ENGINE_DIR), rng=False)


def _probe(cls_and_kwargs):
    """The optimizer ``optimizer_cls_and_kwargs`` describes, on one placeholder parameter:
    what the engine's config needs (its class and defaults) before the model's groups exist."""
    if cls_and_kwargs is None:
        return None
    cls, kwargs = cls_and_kwargs
    return cls([torch.nn.Parameter(torch.zeros(1))], **dict(kwargs))


# ---- other trainers on the engine ------------------------------------------------------------
def _trl_base(cls):
    """The first class from TRL in ``cls``'s method order, or None."""
    return next((c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl"), None)


def _check_method_order(cls) -> None:
    """``Trainer`` must precede every other ``transformers.Trainer`` subclass in ``cls``'s
    method order: their ``__init__`` would run before ours (without ``offload_config``) and
    their overrides of the methods the engine replaces would run first."""
    mro = cls.__mro__
    before = [c for c in mro[:mro.index(Trainer)] if issubclass(c, transformers.Trainer) and not issubclass(c, Trainer)]
    if before:
        other = before[0].__name__
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        raise TypeError(f"class {cls.__name__}({bases}): {other} comes before offload.hf.Trainer in the method order, "
                        f"so {other}'s methods would run in place of the engine's: put offload.hf.Trainer first, "
                        f"class {cls.__name__}(offload.hf.Trainer, {other}), or use offload.hf.on_engine({other})")


_ON_ENGINE: dict = {}


def on_engine(trainer_cls: type) -> type:
    """``trainer_cls`` (a subclass of ``transformers.Trainer``: TRL's ``SFTTrainer``,
    ``DPOTrainer``, ...) trained through the engine: the class ``(Trainer, trainer_cls)``,
    which takes ``offload_config=`` and ``weights=`` beside trainer_cls's own arguments.
    The same class is returned for the same ``trainer_cls``."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(f"offload.hf.on_engine takes a subclass of transformers.Trainer, not {trainer_cls!r}")
    if issubclass(trainer_cls, Trainer):
        return trainer_cls
    if trainer_cls not in _ON_ENGINE:
        _ON_ENGINE[trainer_cls] = type(f"Offload{trainer_cls.__name__}", (Trainer, trainer_cls),
                                       {"__module__": __name__, "__doc__": f"{trainer_cls.__name__} on the offload engine."})
    return _ON_ENGINE[trainer_cls]


_TEXT_COLUMNS = ("text", "messages", "prompt", "chosen")


def _point_to_trl(args, train_dataset) -> None:
    """A TRL config (SFTConfig, DPOConfig, ...) or rows of text given to this class, which
    trains on token ids as transformers.Trainer does: say which TRL trainer takes them."""
    if args is not None and type(args).__module__.split(".")[0] == "trl":
        name = type(args).__name__
        tr = name[:-len("Config")] + "Trainer" if name.endswith("Config") else "the matching TRL trainer"
        raise TypeError(f"offload.hf.Trainer got TRL's {name}: TRL's trainers prepare its data and loss, "
                        f"offload.hf.Trainer takes TrainingArguments and token ids. Run {tr} on the engine: "
                        f"offload.hf.on_engine(trl.{tr})(model=..., args=..., offload_config=...)")
    try:
        row = train_dataset[0] if train_dataset is not None and len(train_dataset) else None
    except (TypeError, KeyError, IndexError, NotImplementedError):   # iterable or keyed datasets: not looked at
        return
    if isinstance(row, dict) and "input_ids" not in row and any(k in row for k in _TEXT_COLUMNS):
        kind = next(k for k in _TEXT_COLUMNS if k in row)
        tr = "DPOTrainer" if kind == "chosen" else "SFTTrainer"
        raise DataError(f"offload.hf.Trainer: the training rows hold {kind!r} without input_ids: tokenize them "
                        f"first, or let TRL's {tr} do it on the engine: offload.hf.on_engine(trl.{tr})(...)")
