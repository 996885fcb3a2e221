"""``offload.hf.Trainer``: Hugging Face ``Trainer`` with the model trained by the engine.

    from offload.hf import Trainer
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                      offload_config={"offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/nvme"},
                                      "offload_param": {"device": "cpu"}})
    trainer.train()
    trainer.save_model("out")        # Hugging Face safetensors (a PEFT model: its adapter)

How it plugs in, the way transformers' DeepSpeed integration does:
- The engine is created where Trainer creates its optimizer (``create_optimizer``), with
  Trainer's parameter groups (weight decay on / off); ``self.optimizer`` is the engine's
  torch-facing optimizer, so Trainer's LR scheduler (warm-up, decay) drives the engine.
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

Other trainers built on ``transformers.Trainer`` (TRL's ``SFTTrainer``, ``DPOTrainer``, ...)
run on the engine with this class first in their method order, so that its methods wrap
theirs: ``on_engine(SFTTrainer)``, or ``class T(offload.hf.Trainer, SFTTrainer)``. The other
order would let their methods build Trainer's own optimizer around the engine: it is refused
when the class is defined.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from offload.hf import versions

versions.check("transformers", "accelerate")

import transformers  # noqa: E402
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME  # noqa: E402

from offload.hf.config import engine_config, precision_asked  # noqa: E402
from offload.planner import precision  # noqa: E402
from offload.hf.weights import save_hf  # noqa: E402

ENGINE_DIR = "offload"    # the engine's checkpoint inside a Trainer checkpoint folder


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
        opt, sched = kwargs.get("optimizers", (None, None))
        if opt is not None or sched is not None or kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError("offload.hf.Trainer: the engine runs the optimizer and Trainer's scheduler drives it: "
                             "leave optimizers / optimizer_cls_and_kwargs unset (choose the schedule with "
                             "lr_scheduler_type / warmup_steps)")
        if self.args.load_best_model_at_end:
            raise ValueError("offload.hf.Trainer: load_best_model_at_end is not supported (the best weights would "
                             "bypass the engine's master copy): pick the checkpoint from trainer_state.json and "
                             "resume_from_checkpoint or from_pretrained it")
        self.offload_config = engine_config(offload_config, self.args)   # fails here, before training
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
    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        import offload
        model = self.model
        if self.engine is not None:      # model_init gave a new model: the old engine's buffers go
            self.engine.close()
        decay = set(self.get_decay_parameter_names(model))
        groups = [
            {"params": [p for n, p in model.named_parameters() if n in decay and p.requires_grad],
             "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in model.named_parameters() if n not in decay and p.requires_grad],
             "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if not groups:
            raise ValueError("offload.hf.Trainer: the model has no parameter with requires_grad: nothing to train")
        self.engine = offload.initialize(model, self.offload_config, param_groups=groups, weights=self.offload_weights)
        self.optimizer = self.engine.optimizer
        return self.optimizer

    def evaluate(self, *args, **kwargs):
        if self.engine is None:        # evaluation before training runs on the engine too
            self.create_optimizer()
        return super().evaluate(*args, **kwargs)

    def close(self) -> None:
        """Wait for updates in flight, then free the engine's host buffers and swap files."""
        if self.engine is not None:
            self.engine.close()

    # ---- saving and resuming --------------------------------------------------------------
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Hugging Face layout from the engine's trained weights (fp32 masters; sharded
        safetensors + config.json, ``offload.export_hf``), a PEFT model's adapter in PEFT's
        layout; the tokenizer / processor and the training arguments beside them, as Trainer
        writes them."""
        if self.engine is None:
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
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR))   # every rank writes its shard
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights come back with the engine's checkpoint (``_load_optimizer_and_scheduler``);
        here only check that the folder has one, before training starts."""
        path = os.path.join(resume_from_checkpoint, ENGINE_DIR)
        if not os.path.isdir(path):
            raise ValueError(f"{resume_from_checkpoint!r} has no engine checkpoint ({ENGINE_DIR}/): resume from a "
                             f"checkpoint folder written by offload.hf.Trainer, or train from its weights "
                             f"(from_pretrained) without resume_from_checkpoint")

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        if self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self._load_from_checkpoint(checkpoint)
        self.engine.load_checkpoint(os.path.join(checkpoint, ENGINE_DIR))
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))


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
        raise ValueError(f"offload.hf.Trainer: the training rows hold {kind!r} without input_ids: tokenize them "
                         f"first, or let TRL's {tr} do it on the engine: offload.hf.on_engine(trl.{tr})(...)")
