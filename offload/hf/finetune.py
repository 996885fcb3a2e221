"""Fine-tune a Hugging Face model directory on a local file through ``offload.hf.Trainer``
(what ``offload finetune`` runs).

    result = finetune(FinetuneSpec(model_dir="base", data="notes.txt", out="out",
                                   lora=parse_lora("r=16,alpha=32,targets=q_proj,v_proj")),
                      offload_config={"offload_param": {"device": "nvme", "nvme_path": "/mnt/nvme"}})

The model directory holds ``config.json``, the weights (safetensors) and the tokenizer files.
The output directory receives the Hugging Face result: the full model (``config.json`` and
safetensors), or the LoRA adapter in PEFT's layout, or with ``merge`` the base with the
adapter merged in; the tokenizer is saved beside it either way. ``merged_out`` writes the merged
copy into a directory of its own beside the adapter, checked by loading it back. ``ask`` names
questions answered before and after training (``offload.hf.ask``).

Under ``torchrun`` every rank calls ``finetune`` and trains; rank 0 alone prints, asks, merges and
writes the files beside the weights, the others wait for it (``offload.hf.job``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from offload.hf import ask as ask_mod
from offload.hf import data as data_mod
from offload.hf import versions
from offload.hf.job import Job

versions.check("transformers", "accelerate")

from transformers import PrinterCallback, TrainerCallback  # noqa: E402

from offload.core.errors import OffloadError  # noqa: E402

LORA_KEYS = {"r": int, "alpha": float, "dropout": float, "targets": str}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple = ("q_proj", "v_proj")


def parse_lora(text: str) -> LoraSpec:
    """``"r=16,alpha=32,targets=q_proj,v_proj"`` (targets take the rest of the commas: module
    names, fused expert tensors, the keywords ``attention`` and ``experts``,
    offload/config/lora_targets.py)."""
    fields: Dict[str, Any] = {}
    key = None
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        k, sep, v = part.partition("=")
        if sep:
            key = k.strip()
            if key not in LORA_KEYS:
                raise FinetuneError(f"--lora key {key!r} is unknown: use {', '.join(LORA_KEYS)}, "
                                    "e.g. r=16,alpha=32,targets=q_proj,v_proj")
            fields.setdefault(key, []).append(v.strip())
        elif key == "targets":
            fields[key].append(part)
        else:
            raise FinetuneError(f"--lora {text!r}: {part!r} is not KEY=VALUE (only targets= takes a list)")
    out = {}
    for k, vals in fields.items():
        if k == "targets":
            out[k] = tuple(vals)
            continue
        try:
            out[k] = LORA_KEYS[k](vals[-1])
        except ValueError:
            raise FinetuneError(f"--lora {k}={vals[-1]!r} must be a number") from None
    spec = LoraSpec(**out)
    if spec.r < 1 or spec.alpha <= 0 or not 0.0 <= spec.dropout < 1.0 or not spec.targets:
        raise FinetuneError(f"--lora: need r >= 1, alpha > 0, 0 <= dropout < 1 and targets (got {spec})")
    return spec


@dataclasses.dataclass(frozen=True)
class FinetuneSpec:
    model_dir: str
    data: str
    out: str
    lora: Optional[LoraSpec] = None
    merge: bool = False              # LoRA: write the base with the adapter merged in
    merged_out: Optional[str] = None  # LoRA: also write the merged copy here (the adapter stays in out)
    eval_data: Optional[str] = None  # held-out examples from this file instead of a share of data
    ask: Optional[str] = None        # questions answered before and after training
    ask_tokens: int = 48             # new tokens per answer at most
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-4
    warmup: int = 10
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    precision: str = "fp32"
    eval_fraction: float = 0.05
    max_eval: int = 64               # held-out examples evaluated at most (the rest stay out of training)
    log_every: int = 10
    save_steps: int = 0              # 0: no intermediate checkpoints
    max_minutes: float = 0.0         # 0: no limit
    seed: int = 0


class FinetuneError(ValueError, OffloadError):
    """The model directory, data or options cannot be used; the message says which and why."""


def build_model(model_dir: str):
    """The model's structure on the meta device (no memory): the engine streams the weights
    from ``model_dir`` into it block by block (``Trainer(weights=model_dir)``)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)


def streams_from(model_dir: str, model) -> bool:
    """Whether the engine can stream ``model``'s weights from ``model_dir`` key by key: the
    checkpoint's tensor names are the model's own. Not so where transformers converts a
    checkpoint's layout while loading it (transformers 5 saves a mixture of experts' experts
    one by one, ``experts.0.gate_proj.weight``, and fuses them into ``experts.gate_up_proj``)."""
    import glob
    from safetensors import safe_open
    files = glob.glob(os.path.join(model_dir, "*.safetensors"))
    if not files:
        return True                       # .bin checkpoints: the loader's own checks apply
    keys = set()
    for f in files:
        with safe_open(f, "pt") as h:
            keys.update(h.keys())
    wanted = {k for k, _ in model.named_parameters()}
    return wanted <= keys | {k for k in wanted if k.endswith("lm_head.weight")}


def load_model(model_dir: str):
    """The whole model in host memory (fp32), for merging an adapter into it."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def check_model_dir(model_dir: str) -> None:
    if model_dir.lower().endswith(".gguf"):
        raise FinetuneError(f"{model_dir!r} is a GGUF file: convert it first (offload.io.gguf.convert(path) returns "
                            "the Hugging Face directory; offload finetune does it for you)")
    if not os.path.isdir(model_dir):
        raise FinetuneError(f"model directory {model_dir!r} does not exist: give a directory written by "
                            "save_pretrained (config.json, safetensors, tokenizer files)")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FinetuneError(f"{model_dir!r} has no config.json: give a Hugging Face model directory")
    if not any(f.endswith(".safetensors") or f.endswith(".bin") for f in os.listdir(model_dir)):
        raise FinetuneError(f"{model_dir!r} holds no weights (*.safetensors): give a directory written by save_pretrained")


def _lora_model(model, spec: LoraSpec):
    import peft
    versions.check("peft")
    from offload.config import lora_targets
    try:
        cfg = lora_targets.lora_config(model, list(spec.targets), r=spec.r, lora_alpha=spec.alpha,
                                       lora_dropout=spec.dropout, task_type="CAUSAL_LM")
    except lora_targets.LoraTargetError as exc:
        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        missing = [t for t in spec.targets if t not in names and t not in lora_targets.KEYWORDS]
        raise FinetuneError(f"--lora targets {missing or list(spec.targets)} are not modules of this model: "
                            f"choose from {exc}") from None
    return peft.get_peft_model(model, cfg)


class Deadline(TrainerCallback):
    """Stops training after ``minutes`` (the run is still evaluated and saved); every rank of
    the job stops at the same step, once any rank's clock is past the deadline."""

    def __init__(self, minutes: float, job: Optional[Job] = None):
        self.end = time.perf_counter() + minutes * 60
        self.job = job or Job()
        self.hit = False

    def on_step_end(self, args, state, control, **kw):
        late = self.job.any(time.perf_counter() > self.end, "the --max-minutes deadline")
        if late and state.global_step < state.max_steps:
            self.hit = True
            control.should_training_stop = True
            control.should_log = True        # the last step's loss, whatever --log-steps
        return control


def finetune(spec: FinetuneSpec, offload_config: Any = None, progress: Optional[Callable] = None,
             say=print, job: Optional[Job] = None) -> Dict[str, Any]:
    """Train and write the output; returns a summary (losses, eval losses, paths, engine stats).
    ``progress(trainer)``, when given, returns a TrainerCallback added to the trainer on rank 0
    (it may read ``trainer.engine``). ``job``: this process's rank of the job (default: started
    here from torchrun's environment, and closed at the end)."""
    own_job = job is None
    if own_job:
        job = Job.start(use_cpu=not torch.cuda.is_available())
    try:
        return _finetune(spec, offload_config, progress, say if job.is_main else _silent, job)
    finally:
        if own_job:
            job.close()


def _silent(*args, **kwargs) -> None:
    return None


def _finetune(spec: FinetuneSpec, offload_config: Any, progress: Optional[Callable], say, job: Job) -> Dict[str, Any]:
    from transformers import AutoTokenizer, TrainingArguments
    from offload.hf.trainer import Trainer
    check_model_dir(spec.model_dir)
    if (spec.merge or spec.merged_out) and spec.lora is None:
        raise FinetuneError(f"{'--merge' if spec.merge else '--merged-out'} needs --lora (a full fine-tune already "
                            "writes the whole model)")
    if spec.merge and spec.merged_out:
        raise FinetuneError("--merge writes the merged model in place of the adapter, --merged-out beside it: give one")
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
    except (OSError, ValueError) as exc:
        raise FinetuneError(f"cannot load the tokenizer of {spec.model_dir!r} ({exc}): the directory needs its "
                            "tokenizer files (tokenizer.json / tokenizer_config.json)") from None
    train, held, described = data_mod.load(spec.data, tokenizer, spec.seq_len, spec.eval_fraction, spec.seed,
                                           eval_path=spec.eval_data)
    questions = ask_mod.load(spec.ask, tokenizer) if spec.ask and job.is_main else []
    held = data_mod.Rows(held.rows[:spec.max_eval])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(spec.seed)
    model = build_model(spec.model_dir)
    streamed = streams_from(spec.model_dir, model)
    if not streamed:
        say(f"model {spec.model_dir}: its checkpoint stores tensors in another layout than the model (a mixture "
            "of experts' experts one by one, fused by transformers): loaded whole by transformers, not streamed")
        model = load_model(spec.model_dir)
    if spec.lora is not None:
        model = _lora_model(model, spec.lora)
    n_all = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(f"model {spec.model_dir}: {n_all / 1e6:.2f}M parameters, {n_train / 1e6:.3f}M trained"
        + (f" (LoRA r={spec.lora.r} alpha={spec.lora.alpha:g} on {','.join(spec.lora.targets)})" if spec.lora else
           " (full fine-tune)"))
    say(f"data {spec.data}: {described}")
    before = _answers(lambda: load_model(spec.model_dir), tokenizer, questions, spec, say, "before training (the base)")
    os.makedirs(spec.out, exist_ok=True)
    args = TrainingArguments(
        output_dir=spec.out, per_device_train_batch_size=spec.batch_size, per_device_eval_batch_size=spec.batch_size,
        gradient_accumulation_steps=spec.gradient_accumulation_steps, max_steps=spec.steps,
        learning_rate=spec.lr, lr_scheduler_type="cosine", warmup_steps=min(spec.warmup, spec.steps),
        weight_decay=spec.weight_decay, adam_beta1=spec.betas[0], adam_beta2=spec.betas[1], adam_epsilon=spec.eps,
        max_grad_norm=spec.max_grad_norm, logging_steps=spec.log_every,
        save_strategy="steps" if spec.save_steps else "no", save_steps=spec.save_steps or 500,
        report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available(), seed=spec.seed,
        bf16=spec.precision == "bf16", fp16=spec.precision == "fp16", optim="adamw_torch",
        remove_unused_columns=False, include_num_input_tokens_seen="non_padding", dataloader_num_workers=0,
        log_level="error")
    deadline = Deadline(spec.max_minutes, job) if spec.max_minutes > 0 else None
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=held,
                      data_collator=data_mod.PadCollator(pad), processing_class=tokenizer,
                      offload_config=offload_config, weights=spec.model_dir if streamed else None,
                      callbacks=[deadline] if deadline else None)
    if progress is not None:             # in place of Trainer's own printer of log dicts
        trainer.remove_callback(PrinterCallback)
        if job.is_main:
            trainer.add_callback(progress(trainer))
    try:
        eval_start = trainer.evaluate()["eval_loss"]
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
        eval_end = trainer.evaluate()["eval_loss"]
        stats = trainer.engine.stats()
        trainer.save_model(spec.out)
    finally:
        trainer.close()
    losses = [(l["step"], l["loss"]) for l in trainer.state.log_history if "loss" in l and "step" in l]
    summary = {"model_dir": spec.model_dir, "data": spec.data, "out": spec.out, "mode": _mode(spec),
               "steps": trainer.state.global_step, "train_seconds": train_s,
               "tokens": trainer.state.num_input_tokens_seen,
               "tokens_per_s": trainer.state.num_input_tokens_seen / train_s if train_s > 0 else 0.0,
               "losses": losses, "eval_loss_start": eval_start, "eval_loss_end": eval_end,
               "stopped_early": bool(deadline and deadline.hit), "written": [],
               "merged_out": spec.merged_out, "answers": [],
               "placement": {"optimizer": trainer.offload_config.offload_optimizer.device,
                             "param": trainer.offload_config.offload_param.device},
               "optimizer": {"type": trainer.offload_config.optimizer.type,
                             "state_dtype": trainer.offload_config.optimizer.state_dtype,
                             **trainer.offload_config.optimizer.hparams()},
               "stats": stats}

    def write() -> dict:
        """Rank 0: the merge, the answers after training, the summary file."""
        written = _finish_output(spec, tokenizer, say, trainer.offload_config.offload_param)
        after = _answers(lambda: _result_model(spec), tokenizer, questions, spec, None, "")
        if questions:
            say("held-out questions, greedy answers before -> after training:")
            for q, b, a in zip(questions, before, after):
                say(f"  Q: {ask_mod.one_line(q.text)}" + (f"   (expected: {ask_mod.one_line(q.expected)})" if q.expected else ""))
                say(f"     before: {ask_mod.one_line(b)}")
                say(f"     after:  {ask_mod.one_line(a)}")
        summary["written"] = written
        summary["answers"] = [{"question": q.text, "expected": q.expected, "before": b, "after": a}
                              for q, b, a in zip(questions, before, after)]
        with open(os.path.join(spec.out, "finetune_summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
        return {"written": summary["written"], "answers": summary["answers"]}
    summary.update(job.main_only("writing the output (merge, answers, tokenizer, summary)", write))
    return summary


def _mode(spec: FinetuneSpec) -> str:
    return "full" if spec.lora is None else ("lora-merged" if spec.merge else "lora-adapter")


def _finish_output(spec: FinetuneSpec, tokenizer, say, offload_param=None) -> List[str]:
    """The tokenizer beside the weights; with ``merge`` the adapter merged into a fresh copy of
    the base (written in place of the adapter), with ``merged_out`` that copy written there
    and loaded back to check it. A base trained over quantized (``offload_param.frozen_dtype``)
    is merged into as the engine held it: dequantized."""
    if spec.merge or spec.merged_out:
        import peft
        from transformers import AutoModelForCausalLM
        from offload.params import quantized
        base = load_model(spec.model_dir)
        n = quantized.round_trip_base_(base, offload_param) if offload_param is not None else 0
        if n:
            say(f"merge: the adapter is merged into the dequantized {offload_param.frozen_dtype} base the run "
                f"trained over ({n} tensors through the {offload_param.frozen_dtype} codec), not the original weights")
        model = peft.PeftModel.from_pretrained(base, spec.out)
        if spec.merged_out:
            probe = torch.tensor([tokenizer("The quick brown fox jumps over the lazy dog.",
                                            add_special_tokens=False)["input_ids"]])
            with torch.no_grad():
                expect = model(input_ids=probe).logits
        merged = model.merge_and_unload()
        dest = spec.out if spec.merge else spec.merged_out
        if spec.merge:
            for f in ("adapter_model.safetensors", "adapter_config.json"):
                if os.path.exists(os.path.join(spec.out, f)):
                    os.remove(os.path.join(spec.out, f))
        merged.save_pretrained(dest)
        tokenizer.save_pretrained(dest)
        del model, merged
        if spec.merged_out:        # what a user of the copy does: from_pretrained, then the same logits
            with torch.no_grad():
                got = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)(input_ids=probe).logits
            say(f"merged copy {dest}/: AutoModelForCausalLM.from_pretrained loads it; its logits differ from the "
                f"base + adapter's (PeftModel) by {float((got - expect).abs().max()):.1e} at most")
    tokenizer.save_pretrained(spec.out)
    return sorted(f for f in os.listdir(spec.out) if not f.startswith("checkpoint-"))


def _result_model(spec: FinetuneSpec):
    """The written result, loaded as a user would: the merged copy or the full model with
    from_pretrained, an adapter with PeftModel.from_pretrained on the base."""
    from transformers import AutoModelForCausalLM
    if spec.lora is None or spec.merge or spec.merged_out:
        return AutoModelForCausalLM.from_pretrained(spec.merged_out or spec.out, dtype=torch.float32)
    import peft
    return peft.PeftModel.from_pretrained(load_model(spec.model_dir), spec.out)


def _answers(load: Callable, tokenizer, questions, spec: FinetuneSpec, say, title: str) -> List[str]:
    """The greedy answers of the model ``load()`` returns (loaded only when there are
    questions, freed after); with ``say``, printed under ``title``."""
    if not questions:
        return []
    got = ask_mod.answers(load(), tokenizer, questions, spec.ask_tokens)
    if say:
        say(f"asked {len(got)} question(s) from {spec.ask} {title}:")
        for q, a in zip(questions, got):
            say(f"  Q: {ask_mod.one_line(q.text)}\n     A: {ask_mod.one_line(a)}")
    return got


def loss_fell(losses: Sequence[tuple], k: int = 3) -> Optional[tuple]:
    """(mean of the first k logged losses, mean of the last k); None when none was logged."""
    vals = [l for _, l in losses if math.isfinite(l)]
    if not vals:
        return None
    k = max(1, min(k, len(vals) // 2)) if vals else 1
    return sum(vals[:k]) / k, sum(vals[-k:]) / k
