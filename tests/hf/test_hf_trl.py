"""TRL's trainers on the engine (``offload.hf.on_engine``) against plain TRL on the same seed,
fp32, with TRL's own defaults (gradient checkpointing on): SFT full and LoRA (``peft_config``)
over a covering set of placements with chat and prompt/completion data; DPO with LoRA, whose
reference is the base with the adapter off, the base offloaded.

Every logged number (loss, grad_norm, learning rate, TRL's metrics) and the final weights are
compared against TRL with its default AdamW (torch's fused one). Tolerance: bitwise; where a
case is not bitwise equal, twice the distance between two plain TRL runs of that case that
differ only in torch's AdamW implementation (fused vs single-tensor), measured here, plus 1e-6."""
import functools
import os

import pytest
import torch

from _hf import snapshot, transformers
from _parity import max_diff, noise_bound

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # nothing downloaded, no telemetry
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

import offload.hf  # noqa: E402
from offload.hf.byte_llama import byte_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

TOK = byte_tokenizer()
TOK.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant: {% endif %}")

DATA = {
    "chat": [{"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                           {"role": "assistant", "content": f"{2 * i}"}]} for i in range(12)],
    "prompt-completion": [{"prompt": f"{i} + {i} = ", "completion": f"{2 * i}"} for i in range(12)],
    "preference": [{"prompt": f"{i} is ", "chosen": "even" if i % 2 == 0 else "odd",
                    "rejected": "odd" if i % 2 == 0 else "even"} for i in range(12)],
}


def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=TOK.pad_token_id, bos_token_id=TOK.bos_token_id,
                                   eos_token_id=TOK.eos_token_id)
    return transformers.LlamaForCausalLM(cfg)


def lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def config(kind, out, optim="adamw_torch_fused", **kw):
    """TRL's defaults (gradient checkpointing on) with fp32 (TRL's default is bf16), a short run
    with accumulation, every step logged."""
    cls = {"sft": trl.SFTConfig, "dpo": trl.DPOConfig}[kind]
    return cls(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
               learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True, bf16=False, seed=0,
               disable_tqdm=True, max_length=32, save_strategy="no", optim=optim, **kw)


def run(trainer_cls, kind, data, use_lora, out, optim="adamw_torch_fused", args_kw=None, **kw):
    """(per-step logs, final weights, the trainer) of one run."""
    train = {"sft": trl.SFTTrainer, "dpo": trl.DPOTrainer}[kind] if trainer_cls is None else trainer_cls
    t = train(model=tiny(), args=config(kind, out, optim, **(args_kw or {})),
              train_dataset=datasets.Dataset.from_list(DATA[data]), processing_class=TOK,
              peft_config=lora() if use_lora else None, **kw)
    t.train()
    base = t.model.get_base_model() if use_lora else t.model
    assert base.is_activation_checkpointing == (args_kw or {}).get("gradient_checkpointing", True)
    logs = [{k: v for k, v in l.items() if k != "epoch"} for l in t.state.log_history if "loss" in l]
    weights = t.engine.full_state_dict() if getattr(t, "engine", None) is not None else snapshot(t.model)
    return logs, weights, t


@functools.lru_cache(maxsize=None)
def plain(kind, data, use_lora, gc, optim):
    """Plain TRL's run of a case, once per test session."""
    import tempfile
    logs, weights, _ = run(None, kind, data, use_lora, tempfile.mkdtemp(prefix="trl-plain-"), optim,
                           args_kw=None if gc else {"gradient_checkpointing": False})
    return logs, weights


def assert_matches_plain(case, logs, weights):
    """``case``: (kind, data, use_lora, gradient checkpointing)."""
    ref_logs, ref_w = plain(*case, "adamw_torch_fused")
    assert len(logs) == len(ref_logs) == 3 and logs[0].keys() == ref_logs[0].keys()
    if logs == ref_logs and max_diff(ref_w, weights) == 0.0:
        return                                                   # bitwise
    other_logs, other_w = plain(*case, "adamw_torch")
    bound = noise_bound(ref_w, other_w)
    assert max_diff(ref_w, weights) <= bound, f"weights differ by {max_diff(ref_w, weights)} > {bound}"
    for r, f, g in zip(ref_logs, other_logs, logs):
        for k in r:
            b = noise_bound(r[k], f[k])
            assert abs(g[k] - r[k]) <= b, f"{k}: engine {g[k]} vs TRL {r[k]} (bound {b})"


def _placement(optimizer, param, tmp_path):
    cfg = {}
    for key, device in (("offload_optimizer", optimizer), ("offload_param", param)):
        cfg[key] = {"device": device}
        if device == "nvme":
            (tmp_path / key).mkdir()
            cfg[key]["nvme_path"] = str(tmp_path / key)
    return cfg


# A covering set: for full and for LoRA, each optimizer tier (none / cpu / nvme) and each
# parameter tier (none / cpu / nvme) appears at least once, and each kind of data with both.
# (hf_versions: the cell also runs against the lowest supported releases.)
SFT_CELLS = [
    ("full", "chat", "none", "none"),
    ("full", "prompt-completion", "cpu", "cpu"),
    ("full", "chat", "nvme", "nvme"),
    pytest.param("lora", "chat", "cpu", "none", marks=pytest.mark.hf_versions),
    ("lora", "prompt-completion", "nvme", "cpu"),
    ("lora", "chat", "none", "nvme"),
]


def _cell_id(c):
    return "-".join(c.values if hasattr(c, "values") else c)


@pytest.mark.parametrize("mode,data,optimizer,param", SFT_CELLS, ids=[_cell_id(c) for c in SFT_CELLS])
def test_sft_trainer_on_the_engine_matches_trl(mode, data, optimizer, param, tmp_path):
    use_lora = mode == "lora"
    logs, weights, t = run(offload.hf.on_engine(trl.SFTTrainer), "sft", data, use_lora, tmp_path / "out",
                           offload_config=_placement(optimizer, param, tmp_path))
    try:
        assert (t.offload_config.offload_optimizer.device, t.offload_config.offload_param.device) == (optimizer, param)
        if data == "prompt-completion":
            assert t.completion_only_loss                       # TRL's loss on the completion only
        assert_matches_plain(("sft", data, use_lora, True), logs, weights)
    finally:
        t.close()


@pytest.mark.parametrize("param,gc", [("cpu", True), ("nvme", False)], ids=["base-cpu", "base-nvme-no-checkpointing"])
def test_dpo_trainer_with_lora_on_the_engine_matches_trl(param, gc, tmp_path):
    """The reference log-probs come from the same (offloaded) base with the adapter disabled;
    with TRL's default checkpointing, and without it (the reference path on its own)."""
    logs, weights, t = run(offload.hf.on_engine(trl.DPOTrainer), "dpo", "preference", True, tmp_path / "out",
                           args_kw=None if gc else {"gradient_checkpointing": False},
                           offload_config=_placement("cpu", param, tmp_path))
    try:
        assert t.ref_model is None and t.offload_config.offload_param.device == param
        assert logs[0]["rewards/margins"] == 0.0 and any(l["rewards/margins"] != 0.0 for l in logs[1:])   # it learns
        assert_matches_plain(("dpo", "preference", True, gc), logs, weights)
    finally:
        t.close()


def test_wrong_class_order_names_the_right_one():
    with pytest.raises(TypeError, match=r"SFTTrainer comes before offload.hf.Trainer .* class T\(offload.hf.Trainer, "
                                        r"SFTTrainer\), or use offload.hf.on_engine\(SFTTrainer\)"):
        class T(trl.SFTTrainer, offload.hf.Trainer):
            pass

    class Mine(offload.hf.Trainer, trl.SFTTrainer):        # the documented order: accepted
        pass
    made = offload.hf.on_engine(trl.SFTTrainer)
    assert made is offload.hf.on_engine(trl.SFTTrainer) and made.__mro__[1:3] == (offload.hf.Trainer, trl.SFTTrainer)
    assert offload.hf.on_engine(made) is made
    with pytest.raises(TypeError, match="takes a subclass of transformers.Trainer"):
        offload.hf.on_engine(torch.nn.Module)


def test_trl_config_or_text_rows_point_to_the_trl_way(tmp_path):
    rows = datasets.Dataset.from_list(DATA["chat"])
    with pytest.raises(TypeError, match=r"got TRL's SFTConfig.*offload.hf.on_engine\(trl.SFTTrainer\)"):
        offload.hf.Trainer(model=tiny(), args=config("sft", tmp_path), train_dataset=rows, processing_class=TOK)
    with pytest.raises(ValueError, match=r"rows hold 'messages' without input_ids.*on_engine\(trl.SFTTrainer\)"):
        offload.hf.Trainer(model=tiny(), args=transformers.TrainingArguments(str(tmp_path), use_cpu=True,
                                                                             report_to="none"),
                           train_dataset=rows, processing_class=TOK)
