"""A tiny Llama built from a config (nothing downloaded) and Trainer runs with and without
the engine, for tests/test_hf_*.py."""
import copy
import tempfile

import torch

transformers = __import__("pytest").importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB, SEQ = 64, 16


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2 * SEQ)
    return LlamaForCausalLM(cfg)


def dataset(n: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": x, "labels": x.clone()} for x in torch.randint(0, VOCAB, (n, SEQ), generator=g)]


def args(out=None, **kw) -> TrainingArguments:
    """fp32, accumulation 4, clipping that bites (the norms here are ~0.7-1.0), linear warm-up."""
    d = dict(output_dir=out or tempfile.mkdtemp(prefix="hf-test-"), per_device_train_batch_size=2,
             gradient_accumulation_steps=4, max_steps=6, learning_rate=1e-2, warmup_steps=2, max_grad_norm=0.5,
             weight_decay=0.01, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
             disable_tqdm=True, seed=0, optim="adamw_torch")
    d.update(kw)
    return TrainingArguments(**d)


def train_logs(trainer):
    return [dict(loss=l["loss"], grad_norm=l.get("grad_norm"), learning_rate=l["learning_rate"])
            for l in trainer.state.log_history if "loss" in l]


def snapshot(model):
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


def clone(model):
    return copy.deepcopy(model)
