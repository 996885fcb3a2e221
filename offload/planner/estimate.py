"""Memory estimator: bytes per tier for every placement of optimizer state and parameters.

A model is described by a ``ModelSpec`` (parameter count, largest layer, largest block), made
from plain numbers, a Hugging Face ``config.json`` (GPT-2 and Llama-style families counted
from the config's fields, no ``transformers`` needed) or a ``module:callable`` built on the
meta device. ``estimate()`` gives, for each placement (offload_optimizer x offload_param, each
none | cpu | nvme), the bytes needed on each tier, per the formulas below, and ``check_fit()``
compares them with this machine's free memory and disk.

Formulas (model states only; activations come on top, on the device). P parameters, W ranks,
p bytes per parameter at the compute precision (4 fp32, 2 bf16/fp16), B the largest block
(the engine's unit of residency and I/O: a transformer layer, the embedding), P' = P / W,
S = ``memory_plan.state_bytes_per_param`` (12 for Adam: fp32 master + two moments):

  device   params: p*P on the device, or a window of 2 blocks (in use + prefetched) when offloaded
           grads : p*P (no offload), p*P' (params offloaded, optimizer on device: ZeRO-3
                   reduce-scatter), or a window of 2 blocks (streamed out to the host)
           state : S*P' (S-4 in fp32, where the parameter is the master) when the optimizer
                   stays on the device (ZeRO-1/2 sharding)
           A model with frozen parameters (LoRA) counts its memory plan's blocks instead: the
           parameter window is the plan's device budget (``--device-budget-bytes``, default two
           blocks) plus its largest quantized frozen part (held while it is dequantized), the
           gradient window two blocks' trainable parts
  pinned   2 blocks at p bytes per link direction (H2D params, D2H grads) whenever something is
           offloaded (frozen parts at their home bytes, quantized ones quantized), plus every host pool of the engine's memory plan (engine/memory_plan.py:
           optimizer state on cpu, gradient buffers -- the whole model's, or a pool when they
           are consumed at once or parked on NVMe --, NVMe swap slots, parameter homes and
           staging); ``host`` (pageable) is 0: the engine allocates nothing else per parameter
  nvme     S*P' optimizer state, p*P' parameters, and parked gradients (4*P', or 2*P' in bf16
           without accumulation) when clipping, fp16 or accumulation make them wait

Host and NVMe figures are per node (all W ranks on this node), device figures per rank. These
are DeepSpeed's ``estimate_zero2/zero3_model_states_mem_needs`` accountings made specific to
this engine (pinned buffers, swap slots and NVMe space added; no 1.5x "buffer factor": the
engine's buffers are counted one by one); ``deepspeed_reference()`` gives DeepSpeed's own figures.
"""
from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import psutil

TIERS = ("none", "cpu", "nvme")
from offload.dtypes import BYTES_PER_PARAM  # noqa: F401 (offload estimate's p; planner/rss.py reads it here)
from offload.core.errors import OffloadError
from offload.units import round_up


class EstimateError(ValueError, OffloadError):
    """A model description that cannot be used; the message says what to give instead."""


@dataclass(frozen=True)
class ModelSpec:
    params: int                 # unique parameters (tied weights counted once)
    largest_layer: int          # most parameters held directly by one module (DeepSpeed's term)
    largest_block: int          # most parameters in one block (a transformer layer or the embedding)
    name: str = "model"
    n_blocks: int = 1           # blocks the engine would build (pipeline depth of the step)
    exact: bool = True          # False when the counts are approximations
    blocks: tuple = ()          # parameters of each block, when known (built from a module)
    trainable: Optional[int] = None     # parameters that train (None: all); the rest are frozen
    plan_blocks: tuple = ()     # the memory plan's BlockSize of each block (trainable part and
                                # frozen parts), when known from a module with frozen parameters
    precision: Optional[str] = None     # the compute dtype ``plan_blocks``' frozen bytes assume
    frozen_dtype: str = "compute"       # offload_param.frozen_dtype: how frozen parts are stored at home
    active: Optional[int] = None        # parameters one token runs through (a MoE: its top-k experts
                                        # of each layer, shared experts, dense layers); None: all

    @property
    def trained(self) -> int:
        return self.params if self.trainable is None else self.trainable

    @property
    def computed(self) -> int:
        """Parameters whose matmuls run per token: the compute is priced on these."""
        return self.params if self.active is None else self.active

    def describe(self) -> str:
        approx = "" if self.exact else " (approximate)"
        frozen = "" if self.trainable is None else f" ({human_count(self.trainable)} trainable, the rest frozen)"
        moe = "" if self.active is None else f", {human_count(self.active)} active per token"
        return (f"{self.name}: {human_count(self.params)} parameters{approx}{moe}{frozen}, largest layer "
                f"{human_count(self.largest_layer)}, largest block {human_count(self.largest_block)}, "
                f"{self.n_blocks} blocks")


def human_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


# ---- model descriptions -----------------------------------------------------------------------
def spec_from_counts(params: float, largest_layer: Optional[float] = None,
                     n_blocks: Optional[int] = None) -> ModelSpec:
    """From numbers. Without ``largest_layer`` a transformer-like 1/12 of the model is assumed."""
    if params is None or params <= 0:
        raise EstimateError(f"--params={params!r} must be > 0, e.g. --params 7e9")
    exact = largest_layer is not None
    if largest_layer is None:
        largest_layer = params / 12
    if largest_layer <= 0 or largest_layer > params:
        raise EstimateError(f"--largest-layer={largest_layer!r} must be > 0 and <= --params")
    blocks = n_blocks or max(1, int(round(params / largest_layer)))
    return ModelSpec(int(params), int(largest_layer), int(largest_layer), "model", blocks, exact)


def spec_from_module(model, name: str = "model", precision: str = "bf16", frozen_in_place: bool = False,
                     frozen_dtype: str = "compute") -> ModelSpec:
    """From a built module (the meta device is fine), blocked the way the engine blocks it
    (``offload.core.blocks.auto_block_roots``); a tied parameter is counted once, in its first block.
    A module with frozen parameters (``requires_grad`` False: a LoRA model's base) gets its
    trainable count and the memory plan's blocks as the engine groups them
    (``blocks_of_module`` at ``precision``; ``frozen_in_place``: read in place from the checkpoint;
    ``frozen_dtype``: int8 / nf4 homes sized as the engine stores them)."""
    from offload.core.blocks import auto_block_roots
    modules = dict(model.named_modules())
    claimed = set()
    blocks = []
    for root in auto_block_roots(model):
        n = 0
        for p in modules[root].parameters():
            if id(p) not in claimed:
                claimed.add(id(p))
                n += p.numel()
        blocks.append(n)
    rest = sum(p.numel() for p in model.parameters() if id(p) not in claimed)
    if rest:
        blocks.append(rest)
    blocks = [b for b in blocks if b]
    if not blocks:
        raise EstimateError(f"{name} has no parameters")
    largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    trainable = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    active = active_params(model)
    if trainable == sum(blocks):
        return ModelSpec(sum(blocks), largest_layer, max(blocks), name, len(blocks), True, tuple(blocks),
                         active=active)
    if not trainable:
        raise EstimateError(f"{name} has no trainable parameters (every requires_grad is False)")
    return ModelSpec(sum(blocks), largest_layer, max(blocks), name, len(blocks), True, tuple(blocks),
                     trainable, tuple(blocks_of_module(model, precision, frozen_in_place, frozen_dtype)), precision,
                     frozen_dtype, active)


_TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k")


def active_params(model) -> Optional[int]:
    """Parameters one token runs through in a mixture-of-experts ``model`` (None: not a MoE,
    or its top-k unknown): every parameter but the routed experts, of which top-k / E count.
    Routed experts are a module list named ``experts`` (one module per expert) or the 3-D
    tensors of a module named ``experts`` (transformers' fused [E, ...] experts); top-k is the
    config's ``num_experts_per_tok`` (or a family's other name for it). Shared experts and
    dense layers are not under ``experts`` and count whole."""
    import torch
    config = next((m.config for m in model.modules() if hasattr(m, "config")), None)   # a PEFT model's too
    if config is not None and not hasattr(config, _TOP_K[0]) and hasattr(config, "text_config"):
        config = config.text_config
    k = next((getattr(config, a) for a in _TOP_K if isinstance(getattr(config, a, None), int)), None)
    if not k:
        return None
    seen, total, idle = set(), 0, 0.0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    done = set()
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        if isinstance(m, torch.nn.ModuleList) and len(m) > k:
            n = sum(p.numel() for p in m.parameters() if id(p) not in done)
            done.update(id(p) for p in m.parameters())
            idle += n * (1 - k / len(m))
            continue
        for p in m.parameters():
            if p.dim() >= 2 and id(p) not in done and p.shape[0] > k:
                done.add(id(p))
                idle += p.numel() * (1 - k / p.shape[0])
    return int(total - idle) if done else None


def with_trainable(spec: ModelSpec, trainable: float, precision: str = "bf16") -> ModelSpec:
    """``spec`` with only ``trainable`` of its parameters training (``--trainable-params``):
    each block trains its share, the rest of it is a frozen part in the compute dtype."""
    if trainable is None or not 0 < trainable <= spec.params:
        raise EstimateError(f"--trainable-params={trainable!r} must be > 0 and <= the model's "
                            f"{spec.params} parameters")
    import dataclasses
    return dataclasses.replace(spec, trainable=int(trainable), plan_blocks=(), precision=precision)


def hf_model_on_meta(path: str):
    """The Hugging Face causal LM of a config.json (or its directory), built on the meta
    device (no memory, no weights): needs ``transformers``."""
    import torch
    try:
        import transformers
    except ImportError:
        raise EstimateError("--lora-rank with --hf-config builds the model on the meta device, which needs "
                            "transformers (pip install transformers), or give --trainable-params N") from None
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        conf = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise EstimateError(f"--hf-config {path!r}: transformers cannot read it ({exc})") from None
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(conf)


def apply_lora(model, rank: int, targets: Sequence[str], name: str = "model"):
    """``model`` with PEFT LoRA adapters of ``rank`` on ``targets`` (module names, fused expert
    tensors, the keywords ``attention`` / ``experts``: offload/config/lora_targets.py), the base
    frozen, as ``peft.get_peft_model`` leaves it: needs ``peft``."""
    if rank is None or rank < 1:
        raise EstimateError(f"--lora-rank={rank!r} must be >= 1, e.g. --lora-rank 8")
    try:
        import peft
    except ImportError:
        raise EstimateError("--lora-rank needs peft (pip install peft), or give --trainable-params N") from None
    from offload.config import lora_targets
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    try:
        cfg = lora_targets.lora_config(model, list(targets), r=rank, lora_alpha=2 * rank, lora_dropout=0.0)
    except lora_targets.LoraTargetError as exc:
        missing = [t for t in targets if t not in names and t not in lora_targets.KEYWORDS]
        raise EstimateError(f"--lora-targets {','.join(missing) or ','.join(targets)}: {name} has no module of that "
                            f"name ({exc})") from None
    return peft.get_peft_model(model, cfg)


def _linear_names(model) -> set:
    import torch
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def spec_from_callable(target: str, precision: str = "bf16", frozen_in_place: bool = False,
                       frozen_dtype: str = "compute") -> ModelSpec:
    """``pkg.mod:fn`` -> fn() built on the meta device (no memory, no weights); frozen
    parameters as in ``spec_from_module``."""
    return spec_from_module(module_from_callable(target), target, precision, frozen_in_place, frozen_dtype)


def module_from_callable(target: str):
    """``pkg.mod:fn`` -> the module fn() builds on the meta device."""
    import torch
    mod_name, sep, fn_name = target.partition(":")
    if not sep or not mod_name or not fn_name:
        raise EstimateError(f"--model {target!r} must be module:callable, e.g. offload.models.gpt:gpt2_small")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise EstimateError(f"--model {target!r}: cannot import {mod_name!r} ({exc})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise EstimateError(f"--model {target!r}: {mod_name} has no callable {fn_name!r}")
    with torch.device("meta"):
        model = fn()
    if not isinstance(model, torch.nn.Module):
        raise EstimateError(f"--model {target!r} returned {type(model).__name__}, not an nn.Module")
    return model


def spec_from_hf_config(path: str) -> ModelSpec:
    """Parameter counts from a Hugging Face config.json: GPT-2 style (n_embd, n_layer) and
    Llama style (hidden_size, intermediate_size, num_hidden_layers, ...: Llama, Mistral,
    Mixtral, Qwen2, Gemma ...). Other families are approximated as 12*d^2 per layer."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    from offload.config.schema import read_json
    c = read_json(path, "--hf-config", ": give a config.json or its directory", error=EstimateError)
    if isinstance(c.get("text_config"), dict):      # multimodal wrappers: count the language model
        c = {**c["text_config"], "model_type": c["text_config"].get("model_type", c.get("model_type"))}
    name = str(c.get("_name_or_path") or c.get("model_type") or os.path.basename(os.path.dirname(os.path.abspath(path))))
    if "n_embd" in c and "n_layer" in c:
        return _gpt2_counts(c, name)
    if "hidden_size" in c and "num_hidden_layers" in c:
        return _llama_counts(c, name)
    raise EstimateError(f"--hf-config {path!r}: no n_embd/n_layer or hidden_size/num_hidden_layers "
                        "fields; give --params and --largest-layer instead")


def _gpt2_counts(c: dict, name: str) -> ModelSpec:
    d, L, V = int(c["n_embd"]), int(c["n_layer"]), int(c.get("vocab_size", 50257))
    pos = int(c.get("n_positions", c.get("n_ctx", 1024)))
    inner = int(c.get("n_inner") or 4 * d)
    per_layer = (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (2 * d) + (d * inner + inner) + (inner * d + d)
    embed = V * d
    tied = c.get("tie_word_embeddings", True)
    total = embed + pos * d + L * per_layer + 2 * d + (0 if tied else embed)
    largest_layer = max(embed, d * inner, 3 * d * d)
    return ModelSpec(total, largest_layer, max(per_layer, embed), name, L + 2, True)


def _llama_counts(c: dict, name: str) -> ModelSpec:
    d, L, V = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c.get("vocab_size", 32000))
    heads = int(c.get("num_attention_heads", max(d // 128, 1)))
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or d // heads)
    exact = "intermediate_size" in c
    inter = int(c.get("intermediate_size") or 4 * d)
    bias = bool(c.get("attention_bias", c.get("model_type") in ("qwen2", "qwen2_moe")))
    attn = d * heads * hd + 2 * d * kv * hd + heads * hd * d
    if bias:
        attn += heads * hd + 2 * kv * hd
    # mixture of experts: routed experts of moe_intermediate_size (else intermediate_size),
    # shared experts, the first layers dense (first_k_dense_replace), top-k active per token
    experts = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 1)
    top_k = int(next((c[a] for a in _TOP_K if isinstance(c.get(a), int)), experts))
    moe_inter = int(c.get("moe_intermediate_size") or inter)
    n_shared = int(c.get("n_shared_experts") or (1 if str(c.get("model_type", "")).startswith("llama4") else 0))
    shared = n_shared * 3 * d * moe_inter                  # Llama 4: one shared expert in every MoE layer
    dense_layers = min(L, int(c.get("first_k_dense_replace") or 0)) if experts > 1 else L
    dense_mlp = 3 * d * (int(c.get("intermediate_size_mlp") or inter) if dense_layers < L else inter)
    moe_mlp = 3 * d * moe_inter * experts + d * experts + shared
    moe_active = 3 * d * moe_inter * top_k + d * experts + shared
    embed = V * d
    tied = bool(c.get("tie_word_embeddings", False))
    moe_layers = L - dense_layers
    per_layer = max(attn + dense_mlp + 2 * d if dense_layers else 0, attn + moe_mlp + 2 * d if moe_layers else 0)
    body = dense_layers * (attn + dense_mlp + 2 * d) + moe_layers * (attn + moe_mlp + 2 * d)
    total = embed + body + d + (0 if tied else embed)
    active = None
    if experts > 1 and moe_layers:
        active = total - moe_layers * (moe_mlp - moe_active)
    largest_layer = max(embed, d * inter, d * heads * hd, 2 * d * moe_inter * experts if experts > 1 else 0)
    return ModelSpec(total, largest_layer, max(per_layer, embed), name, L + (2 if tied else 3), exact,
                     active=active)


# ---- the estimate ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    optimizer: str              # offload_optimizer.device
    param: str                  # offload_param.device
    device: int                 # bytes per rank
    pinned: int                 # bytes per node (page-locked host memory)
    host: int                   # bytes per node (pageable host memory)
    nvme: int                   # bytes per node
    refused: Optional[str] = None   # why initialize refuses this placement (None: the engine runs it)

    @property
    def host_total(self) -> int:
        return self.pinned + self.host

    @property
    def label(self) -> str:
        return f"optimizer={self.optimizer} param={self.param}"


def spec_blocks(spec: ModelSpec, precision: str = "bf16") -> list:
    """The spec as the memory plan's blocks: its own (``plan_blocks``) when known, else its
    blocks' sizes (or its largest block, the rest spread evenly), each training its share of
    ``spec.trainable`` with the rest as one frozen part in ``precision``."""
    from offload.engine.memory_plan import BlockSize
    if spec.plan_blocks:
        if spec.precision not in (None, precision):
            raise EstimateError(f"{spec.name}'s frozen parts were counted at {spec.precision}, not {precision}")
        return list(spec.plan_blocks)
    if spec.blocks:
        sizes = list(spec.blocks)
    else:
        n = max(spec.n_blocks, 1)
        rest = max(spec.params - spec.largest_block, n - 1)
        sizes = [spec.params] if n == 1 else [spec.largest_block] + \
            [rest // (n - 1) + (1 if i <= rest % (n - 1) else 0) for i in range(1, n)]
    if spec.trainable is None or spec.trainable >= spec.params:
        return [BlockSize(f"block{i}", n) for i, n in enumerate(sizes)]
    p, total = BYTES_PER_PARAM[precision], sum(sizes)
    out = []
    for i, n in enumerate(sizes):
        t = max(1, n * spec.trainable // total)
        dev = (round_up((n - t) * p),) if n > t else ()
        out.append(BlockSize(f"block{i}", t, dev, frozen_home=tuple(_quantized_home(n - t, spec.frozen_dtype, d)
                                                                   for d in dev)))
    return out


def _quantized_home(numel: int, frozen_dtype: str, compute_bytes: int) -> int:
    """Home bytes of a frozen part of ``numel`` elements known only by its count: quantized
    as square-ish matrices (int8's row scales a small term), else its compute bytes."""
    from offload.params import quantized
    if frozen_dtype not in quantized.FORMATS:
        return compute_bytes
    rows = max(1, int(numel ** 0.5))
    return round_up(quantized.tensor_bytes((rows, -(-numel // rows)), frozen_dtype))


def blocks_of_module(model, precision: str = "bf16", frozen_in_place: bool = False,
                     frozen_dtype: str = "compute") -> list:
    """A built module (the meta device is fine) as the memory plan's blocks, grouped the way
    the engine groups it (``core/blocks.py``): each block root's trainable parameters, and
    its frozen ones as one part per storage dtype (their own, or the compute dtype when that
    is narrower), trained blocks first, then roots holding only frozen parameters.
    ``frozen_in_place``: frozen parts are read in place from the checkpoint (no swap bytes);
    ``frozen_dtype`` int8 / nf4: parts with a quantized tensor have the home bytes of their
    codec (params/quantized.py, the config's default threshold) and are never read in place."""
    import torch
    from offload.core import blocks as blk
    from offload.engine.memory_plan import BlockSize
    from offload import dtypes
    comp = dtypes.compute_dtype(precision)

    def kept(p):
        return dtypes.kept_dtype(p.dtype, comp)
    group_of = {id(p): 0 for p in model.parameters() if p.requires_grad}
    layouts = blk.build_layouts(model, None, group_of) if group_of else []
    frozen = {name: parts for name, _, parts in blk.frozen_parts(model, None, kept)}

    def nbytes(part):
        return part.padded_numel * kept(part.segments[0].param).itemsize
    from offload.config.schema import OffloadParamConfig
    from offload.params import quantized
    codecs = quantized.codecs([("", None, ps) for ps in frozen.values()],
                              OffloadParamConfig(device="cpu", frozen_dtype=frozen_dtype), kept) \
        if frozen_dtype in quantized.FORMATS else {}

    def sizes(parts) -> dict:
        return dict(frozen=tuple(nbytes(q) for q in parts),
                    in_place=tuple(frozen_in_place and id(q) not in codecs for q in parts),
                    frozen_home=tuple(codecs[id(q)].nbytes if id(q) in codecs else nbytes(q) for q in parts))
    out = []
    for lay in layouts:
        parts = frozen.pop(lay.name, [])
        out.append(BlockSize(lay.name, lay.numel,
                             params=tuple((sg.offset, sg.numel, tuple(sg.shape), sg.group) for sg in lay.segments),
                             **sizes(parts)))
    for name, parts in frozen.items():
        out.append(BlockSize(name, 0, **sizes(parts)))
    return out


def plan_config(optimizer: str, param: str, precision: str = "bf16", buffer_count: int = 4,
                gradient_clipping: float = 0.0, gradient_accumulation_steps: int = 1,
                grad_host_bytes: Optional[int] = None, device_budget_bytes: Optional[int] = None,
                world_size: int = 1, activations: str = "none", activation_host_bytes: Optional[int] = None,
                host_lookahead_bytes: Optional[int] = None, rule: Optional[str] = None,
                state_dtype: Optional[str] = None, update_ahead: bool = False, frozen_dtype: str = "compute"):
    """The engine config of one placement (NVMe paths point at the temp dir: the plan reads
    no files). Several ranks shard with ZeRO: stage 3 when parameters are offloaded, else 2.
    ``update_ahead`` applies to the placements with the optimizer on cpu (the only ones that
    take it). A rule / state dtype the engine refuses for every placement raises EstimateError."""
    from offload.config import Config, ConfigError
    tmp = tempfile.gettempdir()
    stage = 0 if world_size == 1 else (3 if param != "none" else 2)
    d = {"zero_optimization": {"stage": stage}, "optimizer": {"type": rule or "AdamW", "state_dtype": state_dtype or "fp32"},
         "precision": precision, "gradient_clipping": gradient_clipping,
         "gradient_accumulation_steps": gradient_accumulation_steps,
         "offload_optimizer": {"device": optimizer, "nvme_path": tmp if optimizer == "nvme" else None,
                               "buffer_count": buffer_count, "grad_host_bytes": grad_host_bytes,
                               "update_ahead": update_ahead and optimizer == "cpu"},
         "offload_param": {"device": param, "nvme_path": tmp if param == "nvme" else None,
                           "device_budget_bytes": device_budget_bytes,
                           "frozen_dtype": frozen_dtype if param != "none" else "compute"},
         "offload_activations": {"device": activations, "nvme_path": tmp if activations == "nvme" else None,
                                 "host_bytes": activation_host_bytes},
         "prefetch": {"host_lookahead_bytes": host_lookahead_bytes}}
    try:
        return Config.from_dict(d)
    except ConfigError as exc:
        raise EstimateError(str(exc)) from None


def placement_bytes(spec: ModelSpec, optimizer: str, param: str, precision: str = "bf16",
                    world_size: int = 1, buffer_count: int = 4, gradient_clipping: float = 0.0,
                    gradient_accumulation_steps: int = 1, grad_host_bytes: Optional[int] = None, *,
                    rule: Optional[str] = None, state_dtype: Optional[str] = None, activations: str = "none",
                    activation_host_bytes: Optional[int] = None, host_available: Optional[int] = None,
                    device_budget_bytes: Optional[int] = None, host_lookahead_bytes: Optional[int] = None,
                    update_ahead: bool = False) -> Placement:
    """Bytes per tier for one placement (see the module docstring for the formulas): host
    pools and NVMe from the engine's own memory plan (engine/memory_plan.py), so the host
    budget keys (buffer_count, grad_host_bytes) and clipping / accumulation count as the
    engine counts them (the activation pool too: ``activations`` cpu / nvme with
    ``activation_host_bytes``, or for cpu half of ``host_available``). The optimizer's bytes per parameter come from the update rule
    (``rule`` / ``state_dtype``: offload/optim; default AdamW with fp32 state, 12 bytes)."""
    from offload.engine import memory_plan as mp
    if optimizer not in TIERS or param not in TIERS:
        raise EstimateError(f"placement optimizer={optimizer!r} param={param!r}: use none, cpu or nvme")
    if precision not in BYTES_PER_PARAM:
        raise EstimateError(f"--precision={precision!r} is not valid: use fp32, bf16 or fp16")
    if world_size < 1:
        raise EstimateError(f"--world-size={world_size!r} must be >= 1")
    p = BYTES_PER_PARAM[precision]
    P, B, W, Pt = spec.params, spec.largest_block, world_size, spec.trained
    cfg = plan_config(optimizer, param, precision, buffer_count, gradient_clipping, gradient_accumulation_steps,
                      grad_host_bytes, device_budget_bytes, world_size=W, activations=activations,
                      activation_host_bytes=activation_host_bytes, host_lookahead_bytes=host_lookahead_bytes,
                      rule=rule, state_dtype=state_dtype, update_ahead=update_ahead, frozen_dtype=spec.frozen_dtype)
    from offload.engine.memory_plan import placement_refusal
    plan = mp.plan(spec_blocks(spec, precision), cfg, world_size=W, rank=0, rule=rule, state_dtype=state_dtype,
                   host_available=host_available)
    shard = -(-Pt // W)                     # P' = ceil(P / W), of the trainable parameters
    sbp = mp.state_bytes_per_param(cfg, rule, state_dtype)
    state = sbp if p < 4 else sbp - 4       # on-device optimizer: in fp32 the parameter is the master
    window = 2 * B * p                      # two blocks in flight on the device
    h2d = d2h = window                      # two blocks per link direction
    params_window, blob = window, 0
    if spec.trainable is not None and plan.blocks:
        h2d, d2h, blob = link_bytes(plan)
        params_window = plan.param_budget or window

    params_dev = P * p if param == "none" else params_window + blob
    if optimizer == "none":
        grads_dev = Pt * p if param == "none" else shard * p
        state_dev = state * shard
    else:
        grads_dev, state_dev = d2h, 0
    device = params_dev + grads_dev + state_dev

    offloaded = optimizer != "none" or param != "none"
    pinned = (h2d + d2h if offloaded else 0) + plan.host    # link staging + the engine's pools
    refused = placement_refusal(cfg)
    largest_dev = max((b.device_bytes for b in plan.blocks), default=0)
    if refused is None and param != "none" and device_budget_bytes and device_budget_bytes < largest_dev:
        refused = (f"offload_param.device_budget_bytes={device_budget_bytes} is below the largest block's "
                   f"{largest_dev} device bytes: initialize raises DeviceBudgetError")
    return Placement(optimizer, param, int(device), int(pinned * W), 0, int(plan.nvme_total * W), refused)


def link_bytes(plan) -> tuple:
    """(h2d, d2h, blob) of a model with frozen parts (LoRA, a partly frozen model), from the
    memory plan's blocks: two blocks per link direction, each as it travels (h2d: its
    trainable part in the compute dtype and its frozen parts as stored at home, quantized ones
    at their quantized bytes; d2h: the trainable part's gradients), and ``blob``, the largest
    quantized frozen part, which a CUDA device holds beside its dequantized flat while it
    dequantizes (params/quantized.py ``materialize``)."""
    def trained(b):
        return b.param_bytes if b.padded_numel else 0
    h2d = 2 * max(trained(b) + sum(b.frozen_home or b.frozen) for b in plan.blocks)
    d2h = 2 * max(trained(b) for b in plan.blocks)
    blob = max((h for b in plan.blocks for h, f in zip(b.frozen_home, b.frozen) if h < f), default=0)
    return h2d, d2h, blob


def estimate(spec: ModelSpec, precision: str = "bf16", world_size: int = 1, buffer_count: int = 4,
             gradient_clipping: float = 0.0, gradient_accumulation_steps: int = 1,
             grad_host_bytes: Optional[int] = None, *, rule: Optional[str] = None,
             state_dtype: Optional[str] = None, activations: str = "none",
             activation_host_bytes: Optional[int] = None, host_available: Optional[int] = None,
             device_budget_bytes: Optional[int] = None, host_lookahead_bytes: Optional[int] = None,
             update_ahead: bool = False) -> List[Placement]:
    """All nine placements, least offload first (the optimizer's bytes from ``rule`` /
    ``state_dtype``: default AdamW, fp32 state; ``update_ahead`` for the optimizer on cpu)."""
    return [placement_bytes(spec, o, p, precision, world_size, buffer_count, gradient_clipping,
                            gradient_accumulation_steps, grad_host_bytes, rule=rule, state_dtype=state_dtype,
                            activations=activations, activation_host_bytes=activation_host_bytes,
                            host_available=host_available, device_budget_bytes=device_budget_bytes,
                            host_lookahead_bytes=host_lookahead_bytes, update_ahead=update_ahead)
            for o in TIERS for p in TIERS]


def deepspeed_reference(spec: ModelSpec, world_size: int = 1) -> Dict[str, Dict[str, int]]:
    """DeepSpeed's own figures (fp16/bf16 mixed precision, one node, zero_init, buffer factor 1.5):
    ``estimate_zero2_model_states_mem_needs`` and ``estimate_zero3_model_states_mem_needs``."""
    P, LL, W, f = spec.params, spec.largest_layer, world_size, 1.5
    return {
        "zero2 optimizer=cpu": {"device": 2 * P, "host": int(P * max(4 * W, 16) * f)},
        "zero2 optimizer=none": {"device": 4 * P + int(16 * P / W), "host": int(P * 4 * W * f)},
        "zero3 optimizer=cpu param=cpu": {"device": 4 * LL, "host": int(P * 18 * f)},
        "zero3 optimizer=cpu param=none": {"device": 4 * LL + int(2 * P / W), "host": int(P * 16 * f)},
        "zero3 optimizer=none param=none": {"device": 4 * LL + int(18 * P / W), "host": int(LL * 4 * W * f)},
    }


# ---- this machine ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    device_bytes: Optional[int]     # free accelerator memory per rank; None: unknown
    device_name: str
    host_available: int             # psutil available
    nvme_free: int                  # free bytes at nvme_path
    nvme_path: str


def this_machine(nvme_path: Optional[str] = None, device_memory: Optional[int] = None) -> Machine:
    import torch
    name = "cpu (no accelerator)"
    if device_memory is None and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info()
        device_memory, name = free, torch.cuda.get_device_name()
    elif device_memory is not None:
        name = "given (--device-memory)"
    path = nvme_path or tempfile.gettempdir()
    if not os.path.isdir(path):
        raise EstimateError(f"--nvme-path {path!r} does not exist: give an existing directory")
    return Machine(device_memory, name, psutil.virtual_memory().available, shutil.disk_usage(path).free, path)


# Margins: a tier "fits" when the need stays under this share of what is free.
DEVICE_MARGIN, HOST_MARGIN, NVME_MARGIN = 0.9, 0.8, 0.95


def check_fit(pl: Placement, m: Machine) -> Dict[str, Optional[bool]]:
    """Per tier: True / False, or None where the free amount is unknown (no accelerator). A
    placement the engine refuses (``Placement.refused``) fits nowhere: see ``fits``."""
    dev = None if m.device_bytes is None else pl.device <= DEVICE_MARGIN * m.device_bytes
    return {"device": dev,
            "host": pl.host_total <= HOST_MARGIN * m.host_available,
            "nvme": pl.nvme <= NVME_MARGIN * m.nvme_free}


def fits(pl: Placement, m: Machine) -> bool:
    """The engine runs it, and it fits on every tier whose capacity is known."""
    return pl.refused is None and all(v is not False for v in check_fit(pl, m).values())
