"""``offload finetune MODEL --data FILE --out DIR``: fine-tune a Hugging Face model
directory (config.json, safetensors, tokenizer files) or a GGUF file (converted once into a
cache, ``offload.io.gguf``) on a local text or JSONL file through ``offload.hf.Trainer``, full
or LoRA, and write the result in Hugging Face layout.

Under ``torchrun --nproc_per_node N -m offload.cli finetune ...`` the N ranks train together
(the engine shares the work across them; ``--batch-size`` is per rank) and rank 0 alone prints,
converts, plans, merges and writes the shared files, the others waiting for it (``offload.hf.job``)."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from offload import config as config_mod
from offload import dtypes
from offload.cli.common import CLIError, activations_tier, format_summary, prefer_huge_pages
from offload.cli.progress import Progress

# engine keys that TrainingArguments owns: (dotted key, FinetuneSpec field, rules it owns them for)
_ALL = None
_OWNED = (("optimizer.lr", "lr", _ALL), ("precision", "precision", _ALL),
          ("gradient_accumulation_steps", "gradient_accumulation_steps", _ALL),
          ("gradient_clipping", "max_grad_norm", _ALL), ("optimizer.weight_decay", "weight_decay", _ALL),
          ("optimizer.betas", "betas", ("AdamW", "Adam", "Lion")), ("optimizer.eps", "eps", ("AdamW", "Adam")))
_PLACEMENT = ("offload_optimizer", "offload_param")


def _pop(d: dict, dotted: str):
    parts = dotted.split(".")
    for p in parts[:-1]:
        d = d.get(p)
        if not isinstance(d, dict):
            return None
    return d.pop(parts[-1], None)


def progress_callback(log_every_s: float):
    """A factory for ``finetune(progress=...)``: a tqdm bar with the loss, tokens/s and
    bytes per tier, and one line per logged loss. Trainer logs a step's loss after the step's
    end, so a step that logs is drawn at its log, with its own loss."""
    from transformers import TrainerCallback

    class ProgressCallback(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer
            self.bar = None
            self.loss = None
            self.t0 = None

        def on_train_begin(self, args, state, control, **kw):
            self.bar = Progress(state.max_steps, interval=log_every_s)
            self.t0 = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if self.bar is None or not logs or "loss" not in logs:
                return
            self.loss = logs["loss"]
            self.bar.write(f"  step {state.global_step:>5}: loss {logs['loss']:.4f}  lr {logs['learning_rate']:.3g}"
                           + (f"  grad_norm {logs['grad_norm']:.3f}" if logs.get("grad_norm") is not None else ""))
            self._draw(state)

        def on_step_end(self, args, state, control, **kw):
            if self.bar is not None and not control.should_log:   # else drawn at on_log, with this step's loss
                self._draw(state)

        def _draw(self, state):
            if not self.bar.due(state.global_step):
                return
            elapsed = max(time.perf_counter() - self.t0, 1e-9)
            engine = self.trainer.engine
            self.bar.update(state.global_step, loss=self.loss, tok_s=state.num_input_tokens_seen / elapsed,
                            tiers=engine.stats()["tier_bytes"] if engine is not None else None)

        def on_train_end(self, args, state, control, **kw):
            if self.bar is not None:
                self.bar.close()
    return ProgressCallback


def _placement(d: dict, args, spec_fields: dict, job) -> tuple:
    """(engine config dict, temporary NVMe dir or None): the user's placement, or the
    planner's when none is given (rank 0 measures and plans; every rank takes its choice)."""
    tmp = None
    frozen = (d.get("offload_param") or {}).get("frozen_dtype", "compute")   # --frozen-dtype: not a placement
    if not args.config and not any((d.get(k) or {}).get("device") for k in _PLACEMENT):
        def plan() -> tuple:
            from transformers import AutoConfig, AutoModelForCausalLM
            import torch
            from offload.planner.choose import choose
            job.say("placement: none given, asking the planner (measures this machine, a few seconds) ...")
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_dir))
            opt = d.get("optimizer") or {}
            c = choose(model, tokens=args.batch_size * args.seq_len, precision=spec_fields.get("precision", "fp32"),
                       rule=opt.get("type", "AdamW"), state_dtype=opt.get("state_dtype", "fp32"),
                       gradient_accumulation_steps=spec_fields.get("gradient_accumulation_steps", 1),
                       clipping=spec_fields.get("max_grad_norm", 1.0) > 0, nvme_path=args.nvme_path_for_plan,
                       name=os.path.basename(os.path.normpath(args.model_dir)), frozen_dtype=frozen)
            return c.optimizer, c.param, c.reason
        optimizer, param, reason = job.main_only("planning the placement", plan)
        job.say(f"placement (planner): --offload-optimizer {optimizer} --offload-param {param}: {reason}")
        d["offload_optimizer"] = {"device": optimizer}
        d["offload_param"] = dict(d.get("offload_param") or {}, device=param)
    for tier in _PLACEMENT:
        sec = d.get(tier) or {}
        if sec.get("device") == "nvme" and not sec.get("nvme_path"):
            if tmp is None:
                tmp = tempfile.mkdtemp(prefix="nvme-tier-")
            sec["nvme_path"] = tmp
    return d, tmp


def quiet_hf() -> None:
    """The command's own bar and lines only: no progress bars for loading / saving weights, no
    deprecation warnings raised inside peft / transformers."""
    import warnings
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\.")


def cmd_finetune(args) -> int:
    from offload.hf import data as data_mod
    from offload.hf import finetune as ft
    from offload.hf.job import Job, JobError
    from offload.hf.versions import VersionError
    from offload import device
    from offload.planner import precision
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2 or args.ask_tokens < 1:
        raise CLIError("--steps, --batch-size and --ask-tokens must be >= 1 and --seq-len >= 2")
    d = config_mod.flags_to_dict(args)
    rule = (d.get("optimizer") or {}).get("type") or "AdamW"
    fields = {}
    for key, field, rules in _OWNED:
        if rules is not _ALL and rule not in rules:
            continue                       # the rule's own key (or not one of its keys): the config checks it
        v = _pop(d, key)
        if v is not None:
            fields[field] = tuple(v) if field == "betas" else v
    if d.get("optimizer") == {}:
        d.pop("optimizer")
    args.nvme_path_for_plan = (d.get("offload_optimizer") or {}).get("nvme_path") or args.plan_nvme_path
    try:
        lora = ft.parse_lora(args.lora) if args.lora is not None else None
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    quiet_hf()
    import torch
    job = Job.start(use_cpu=not torch.cuda.is_available())    # under torchrun: this rank of the job
    if ((d.get("offload_activations") or {}).get("device") or "none") != "none":
        device.prefer_huge_pages()     # before any tensor (the precision probe's, a GGUF conversion's)
    if fields.get("precision") not in (None, *dtypes.PRECISIONS):
        raise CLIError(f"--precision {fields['precision']!r} is not valid: use fp32, bf16 or fp16")
    try:
        # the precision: asked for, or fp32 (rank 0 measures the compute rate per dtype)
        choice = job.main_only("measuring the compute rate per dtype",
                               lambda: precision.decide(fields.get("precision")))
        precision.announce(choice, say=job.say)
        fields["precision"] = choice.precision
        # a GGUF file is converted (or found in the cache) by rank 0, the others wait for its path
        model_dir = job.main_only("converting the GGUF model",
                                  lambda: _model_dir(args, choice.precision, job.say))
        args.model_dir = model_dir
        spec = ft.FinetuneSpec(model_dir=model_dir, data=args.data, out=args.out, lora=lora, merge=args.merge,
                               merged_out=args.merged_out, eval_data=args.eval_data, ask=args.ask,
                               ask_tokens=args.ask_tokens,
                               steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                               warmup=args.warmup, eval_fraction=args.eval_fraction, log_every=args.log_steps,
                               save_steps=args.save_steps, max_minutes=args.max_minutes, seed=args.seed,
                               **{"lr": 2e-4, **fields})
        return _run(args, spec, d, fields, job)
    except (ft.FinetuneError, data_mod.DataError, VersionError, JobError) as exc:
        raise CLIError(str(exc)) from None
    finally:
        job.close()


def _run(args, spec, d: dict, fields: dict, job) -> int:
    from offload.hf import finetune as ft
    say = job.say
    ft.check_model_dir(spec.model_dir)
    d, tmp = _placement(d, args, fields, job)
    try:
        cfg = config_mod.build_config(d)   # validated before any model memory is allocated
        huge = prefer_huge_pages(cfg)      # before the model's tensors
        say(f"tiers: optimizer state -> {cfg.offload_optimizer.device}, parameters -> {cfg.offload_param.device}"
            + activations_tier(cfg, huge) + (f", nvme path {tmp} (temporary)" if tmp else "")
            + f"; precision {spec.precision}"
            + (f"; {job.world} ranks (torchrun), rank 0 prints and writes the shared files" if job.world > 1 else ""))
        s = ft.finetune(spec, offload_config=d, progress=progress_callback(args.log_every), say=say, job=job)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    fell = ft.loss_fell(s["losses"])
    say((f"loss {fell[0]:.3f} -> {fell[1]:.3f} (first / last logged)" if fell else "no training loss logged")
        + f"; held-out {s['eval_loss_start']:.3f} -> "
        f"{s['eval_loss_end']:.3f}; {s['train_seconds']:.1f} s, {s['tokens_per_s']:,.0f} tokens/s"
        + ("; stopped early: --max-minutes reached" if s["stopped_early"] else ""))
    for line in format_summary(s["stats"]):
        say(line)
    what = {"full": "the fine-tuned model", "lora-adapter": "the LoRA adapter (PEFT layout)",
            "lora-merged": "the base with the LoRA adapter merged in"}[s["mode"]]
    say(f"wrote {spec.out}/: {what}: {', '.join(s['written'])}"
        + (f"; and {spec.merged_out}/: the base with the adapter merged in" if spec.merged_out else ""))
    return 0


def _model_dir(args, precision: str, say) -> str:
    """MODEL as a Hugging Face directory: itself, or the GGUF file's converted copy (in the
    dtype of ``precision``, from the cache when converted before)."""
    import torch
    from offload.io import gguf
    try:
        if gguf.find(args.model_dir) is None:
            return args.model_dir
        dtype = dtypes.compute_dtype(precision) if precision in dtypes.PRECISIONS else torch.float32
        return str(gguf.convert(args.model_dir, cache_dir=args.gguf_cache, dtype=dtype, say=say))
    except gguf.GGUFError as exc:
        raise CLIError(str(exc)) from None


def register(sub) -> None:
    f = sub.add_parser("finetune", help="fine-tune a Hugging Face model directory or a GGUF file on a local text "
                                        "or JSONL file",
                       description="Fine-tune MODEL (a Hugging Face directory: config.json, safetensors, tokenizer "
                                   "files; or a .gguf file) through the engine with Hugging Face Trainer; full or "
                                   "LoRA; Hugging Face output. On several processes: torchrun --nproc_per_node N -m "
                                   "offload.cli finetune MODEL ... (--batch-size per rank; rank 0 alone prints, "
                                   "plans, merges and writes the shared files).")
    f.set_defaults(func=cmd_finetune, _parser=f)
    f.add_argument("model_dir", metavar="MODEL",
                   help="a directory written by save_pretrained, or a .gguf file (or a directory holding one): "
                        "converted once to safetensors in the training precision, into --gguf-cache")
    f.add_argument("--data", required=True, metavar="FILE",
                   help="a text file (packed into --seq-len rows) or JSONL (told by its content, whatever the name) with {\"text\"} or "
                        "{\"prompt\", \"completion\"} per line (loss on the completion only) or {\"messages\": "
                        "[{\"role\", \"content\"}, ...]} in the tokenizer's chat template (loss on the last "
                        "assistant turn)")
    f.add_argument("--eval-data", metavar="FILE", default=None,
                   help="held-out examples from FILE (the formats of --data) instead of an --eval-fraction share of "
                        "--data, which then trains whole")
    f.add_argument("--out", required=True, metavar="DIR", help="output directory (Hugging Face layout)")
    f.add_argument("--lora", metavar="SPEC", help="LoRA instead of a full fine-tune, e.g. r=16,alpha=32,targets=q_proj,v_proj; targets also take "
                   "fused expert tensors (experts.gate_up_proj) and the keywords attention and experts")
    f.add_argument("--merge", action="store_true", help="with --lora: write the base with the adapter merged in")
    f.add_argument("--merged-out", metavar="DIR", default=None,
                   help="with --lora: also write the base with the adapter merged in to DIR (the adapter stays in "
                        "--out); loaded back with from_pretrained to check it")
    f.add_argument("--ask", metavar="FILE", default=None,
                   help="answer these questions before and after training, greedily with the chat template, and print "
                        "both: JSONL chat lines (a final assistant turn is shown as the expected answer) or a text "
                        "file, one question a line; the model answering is loaded whole in host memory")
    f.add_argument("--ask-tokens", type=int, default=48, metavar="N", help="new tokens per --ask answer at most")
    f.add_argument("--gguf-cache", metavar="DIR", default=None,
                   help="where a GGUF MODEL's converted copy is kept and found again (default: $OFFLOAD_CACHE/gguf "
                        "or ~/.cache/offload/gguf)")
    f.add_argument("--steps", type=int, default=100, help="optimizer steps")
    f.add_argument("--batch-size", type=int, default=8, help="sequences per micro-step")
    f.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    f.add_argument("--warmup", type=int, default=10, help="LR warm-up steps (then cosine decay)")
    f.add_argument("--eval-fraction", type=float, default=0.05, help="share of the data held out for evaluation")
    f.add_argument("--log-steps", type=int, default=10, help="steps between logged losses")
    f.add_argument("--log-every", type=float, default=10.0, metavar="S",
                   help="seconds between progress lines when stdout is not a terminal")
    f.add_argument("--save-steps", type=int, default=0, help="write a resumable checkpoint every N steps (0: none)")
    f.add_argument("--max-minutes", type=float, default=0.0, help="stop after this long (0: no limit); still saved")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--plan-nvme-path", metavar="DIR", default=None,
                   help="where the planner measures the disk when no placement is given (default: the temp dir)")
    config_mod.add_config_arguments(f)
