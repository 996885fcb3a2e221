"""A PEFT LoRA Llama over a frozen bf16 base (nothing downloaded), for the tests of frozen
parameters offloaded or stored quantized: the model (``lora_llama``), its engine configs
(host or NVMe, ``qcfg`` quantized), the engine loop with an optional device-bytes probe, the
base saved as a checkpoint, and the dequantized copy of the base a plain PEFT reference runs on."""
import pytest
import torch
from torch import nn

import offload
from offload import quantize as qz
from offload.params import quantized
from _models import clone
from _probes import ParamBytesProbe

transformers = pytest.importorskip("transformers", reason="HF transformers is not installed")
peft = pytest.importorskip("peft", reason="peft is not installed")

MIN_NUMEL = 1024          # the test model's tensors are small: quantize every 2-D one of them


class LoraLM(nn.Module):
    """A PEFT LoRA Llama with the (x, y) -> loss interface of the reference loop."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, y=None):
        return self.m(input_ids=x, labels=x).loss


def lora_llama(layers=3, seed=0):
    conf = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(conf).to(torch.bfloat16)       # the frozen base: bf16
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(base, lcfg)                                # adapters: fp32
    with torch.no_grad():                                                   # B is zero at init: make
        for n, p in model.named_parameters():                              # step one move A too
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return LoraLM(model)


def lora_cfg(tmp_path, param, budget=None):
    return {"optimizer": {"lr": 1e-3, "weight_decay": 0.01},
            "offload_optimizer": {"device": "nvme" if param == "nvme" else "cpu",
                                  "nvme_path": str(tmp_path) if param == "nvme" else None},
            "offload_param": {"device": param, "nvme_path": str(tmp_path) if param == "nvme" else None,
                              "device_budget_bytes": budget}}


def engine_run(model, data, config, probe=False):
    """The engine on ``model`` over ``data``, closed at the end: (full state dict after every
    step, stats, the device parameter bytes' peak by ``ParamBytesProbe`` when ``probe``, losses)."""
    eng = offload.initialize(model, config)
    pr = ParamBytesProbe(model) if probe else None
    snaps, losses = [], []
    for x, y in data:
        loss = eng(x, y)
        losses.append(loss.item())
        eng.backward(loss)
        eng.step()
        snaps.append({k: v for k, v in eng.full_state_dict().items()})
    stats = eng.stats()
    if pr is not None:
        pr.remove()
    eng.close()
    return snaps, stats, (pr.peak if pr else None), losses


def save_base(model, path):
    """The bf16 base of ``lora_llama``'s model as save_pretrained writes it (several shards)."""
    model.m.base_model.model.save_pretrained(path, max_shard_size="60KB")
    return str(path)


def base_key_map(k):
    return "m.base_model.model." + k          # checkpoint keys -> the LoraLM wrapper's keys


def dequantized(t: torch.Tensor, fmt: str, double_quant: bool) -> torch.Tensor:
    """``t`` through offload.quantize and back, in its own dtype (the reference's weights)."""
    if fmt == "int8":
        return qz.dequantize_int8_rows(qz.quantize_int8_rows(t), t.dtype)
    return qz.dequantize_nf4(qz.quantize_nf4(t, double_quant=double_quant), t.dtype)


def dequantized_base(model, fmt: str, double_quant: bool = False, min_numel: int = MIN_NUMEL):
    """A copy of ``model`` whose frozen 2-D tensors of at least ``min_numel`` elements hold
    their quantized values dequantized: what the engine's forward sees."""
    model = clone(model)
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and quantized.quantizes(p.shape, p.dtype, fmt, min_numel):
                p.copy_(dequantized(p.data, fmt, double_quant))
    return model


def qcfg(tmp_path, param, fmt, double_quant=False, **extra):
    nvme = str(tmp_path) if param == "nvme" else None
    return {"optimizer": {"lr": 1e-3, "weight_decay": 0.01},
            "offload_optimizer": {"device": "nvme" if param == "nvme" else "cpu", "nvme_path": nvme},
            "offload_param": {"device": param, "nvme_path": nvme, "frozen_dtype": fmt,
                              "frozen_double_quant": double_quant, "frozen_quant_min_numel": MIN_NUMEL, **extra}}
