"""A checkpoint out to the Hugging Face layout, one block in memory at a time.

    offload.export_hf("ckpt", "out")                 # model.safetensors (or shards + index) + config.json
    offload.export_hf("ckpt", "out", peft="merged")  # a PEFT model: the adapter merged into the base

Full model (or ``peft="merged"``): safetensors with the model's own key names (PEFT's
wrappers removed), laid out as ``save_pretrained`` lays them out (``model.safetensors``, or
shards of ``max_shard_bytes`` beside ``model.safetensors.index.json``; an earlier save's
weight files in ``out_dir`` are removed), the recorded ``config.json`` and the
tokenizer / generation files of the source directory; ``from_pretrained(out)`` loads it. Tied
parameters are written once (under their first key), as ``save_pretrained`` does.
``peft="adapter"`` (a PEFT model's default): ``adapter_model.safetensors`` and
``adapter_config.json`` per adapter, in PEFT's own layout (``PeftModel.from_pretrained`` loads
it; adapters other than "default" go to ``out/<name>``).

Memory: each shard's header is planned from the checkpoint's meta.json, then tensors are
produced in file order: a block's fp32 master is read once (its shard files streamed in
chunks, CRC-checked), a frozen base tensor straight from the base file (checksum-verified).
``dtype=None`` keeps each tensor's training dtype (fp32 master for trainable parameters, the
stored dtype for frozen ones and buffers); a dtype converts every floating-point tensor.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from offload.io import checkpoint, origin
from offload.params import quantized
from offload.io.peft_names import canonical_key, peft_adapter_key
from offload.io.safetensors import (INDEX_FILE, TensorSpec, WeightsError, plan_shards, read_header, shard_names,
                                    stale_weight_files, write_safetensors)

LORA_LAYERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


class _Source:
    """Values of a checkpoint's state_dict keys, produced in block order."""

    def __init__(self, path: str):
        self.path = checkpoint.resolve(path)
        self.meta = checkpoint.read_meta(self.path)
        origin.check_files(self.meta, self.path)
        self._extra = None
        self._block: Tuple[int, Optional[torch.Tensor]] = (-1, None)
        self._headers: dict = {}

    @property
    def extra(self) -> Dict[str, torch.Tensor]:
        if self._extra is None:
            f = os.path.join(self.path, "extra.pt")
            self._extra = checkpoint.extra_tensors(torch.load(f, map_location="cpu", weights_only=False, mmap=True))
        return self._extra

    def spec(self, key: str) -> Tuple[torch.dtype, Tuple[int, ...]]:
        loc = self.meta["keys"][key]
        if "block" in loc:
            return torch.float32, tuple(loc["shape"])
        if loc.get("base"):
            ref = self.meta["base"]["tensors"][key]
            if ref["file"] not in self._headers:
                self._headers[ref["file"]] = read_header(ref["file"])[0]
            e = self._headers[ref["file"]][ref["key"]]
            return e.dtype, tuple(e.shape)
        t = self.extra[key]
        return t.dtype, tuple(t.shape)

    def identity(self, key: str):
        """Keys with the same identity hold the same tensor (tied parameters)."""
        loc = self.meta["keys"][key]
        if "block" in loc:
            return ("block", loc["block"], loc["offset"])
        if loc.get("base"):
            ref = self.meta["base"]["tensors"][key]
            return ("base", ref["file"], ref["key"])
        return ("extra", key)

    def value(self, key: str) -> torch.Tensor:
        loc = self.meta["keys"][key]
        if "block" in loc:
            bi = loc["block"]
            if self._block[0] != bi:        # one block's master in memory at a time
                self._block = (-1, None)
                self._block = (bi, checkpoint.block_master(self.path, self.meta["blocks"][bi]))
            n = math.prod(loc["shape"])
            return self._block[1][loc["offset"]:loc["offset"] + n].view(loc["shape"])
        if loc.get("base"):
            return origin.read_base_tensor(self.meta, key, self._headers)
        return self.extra[key]

    def order(self) -> List[str]:
        """state_dict keys in the order their values are cheapest to produce: by block, then
        the rest in state_dict order."""
        keys = list(self.meta["keys"])
        rank = {k: i for i, k in enumerate(keys)}
        return sorted(keys, key=lambda k: ((0, self.meta["keys"][k]["block"], self.meta["keys"][k]["offset"])
                                           if "block" in self.meta["keys"][k] else (1, rank[k], 0)))


def _cast(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def export_hf(checkpoint_dir: str, out_dir: str, max_shard_bytes: int = 5 * 10**9,
              dtype: Optional[torch.dtype] = None, peft: str = "adapter") -> str:
    """Write checkpoint ``checkpoint_dir`` to ``out_dir`` in the Hugging Face layout (see the
    module docstring). ``peft``: "adapter" or "merged", for checkpoints of PEFT models.
    Returns ``out_dir``."""
    if peft not in ("adapter", "merged"):
        raise ValueError(f"peft={peft!r}: use 'adapter' (PEFT's own layout) or 'merged' (into the base)")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    if isinstance(dtype, str):
        from offload import dtypes
        dtype = dtypes.compute_dtype(dtype) if dtype in dtypes.PRECISIONS else getattr(torch, dtype)
    checkpoint_dir, out_dir = os.fspath(checkpoint_dir), os.fspath(out_dir)
    src = _Source(checkpoint_dir)
    hf = src.meta.get("hf") or {}
    os.makedirs(out_dir, exist_ok=True)
    if hf.get("peft") and peft == "adapter":
        _export_adapters(src, out_dir, dtype)
    else:
        _export_model(src, out_dir, max_shard_bytes, dtype, merge=bool(hf.get("peft")))
    aux = origin.aux_files(src.meta)
    for f in aux:
        if os.path.isfile(f):
            shutil.copy2(f, os.path.join(out_dir, os.path.basename(f)))
        else:
            warnings.warn(f"{f} (recorded beside the source weights) no longer exists: not copied to {out_dir}")
    generation = hf.get("generation_config")
    if generation is not None and not (hf.get("peft") and peft == "adapter") \
            and "generation_config.json" not in {os.path.basename(f) for f in aux}:
        _write_json(os.path.join(out_dir, "generation_config.json"), generation)   # as save_pretrained does
    return out_dir


def _export_model(src: _Source, out_dir: str, max_shard_bytes: int, dtype, merge: bool) -> None:
    meta = src.meta
    peft_cfg = (meta.get("hf") or {}).get("peft") or {}
    if merge and len(peft_cfg) > 1:
        raise WeightsError(f"the checkpoint holds {len(peft_cfg)} adapters ({', '.join(peft_cfg)}): merging "
                           f"exports one; export them with peft='adapter'")
    adapter = next(iter(peft_cfg), None)
    lora: Dict[str, Dict[str, str]] = {}     # base weight key -> {"A": key, "B": key, "module": name}
    names: Dict[str, str] = {}               # output name -> state_dict key
    seen = set()
    for k in src.order():
        if merge and peft_adapter_key(k, adapter, LORA_LAYERS) is not None:
            m = re.match(r"(.*)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\."
                         + re.escape(adapter) + r"\.?(.*)$", k)
            if m.group(2) not in ("lora_A", "lora_B") or m.group(3) not in ("weight",):
                raise WeightsError(f"{k}: only LoRA on linear layers (lora_A / lora_B weights) can be merged on "
                                   f"export; export this adapter with peft='adapter'")
            lora.setdefault(f"{m.group(1)}.base_layer.weight", {"module": m.group(1)})[m.group(2)] = k
            continue
        if merge and re.search(r"\.original_module\.", k):
            continue                          # replaced by its trained modules_to_save copy
        ident = src.identity(k)
        if ident in seen:
            continue                          # tied: written once, under its first key
        seen.add(ident)
        out = canonical_key(k) if merge else k
        names[out] = k
    unmerged = sorted(v["module"] for b, v in lora.items() if b not in names.values())
    if unmerged:          # PEFT target_parameters (fused MoE experts): no base_layer.weight to merge into
        raise WeightsError(f"{unmerged[0]}: its LoRA adapts parameters (PEFT target_parameters, e.g. fused "
                           f"experts), which export_hf cannot merge; export with peft='adapter' and merge with "
                           f"PEFT's merge_and_unload (offload finetune --merge does)")
    specs = []
    for out, k in names.items():
        dt, shape = src.spec(k)
        specs.append(TensorSpec(out, dtype if (dtype is not None and dt.is_floating_point) else dt, shape))
    cfg = peft_cfg.get(adapter) or {}
    base = quantized_base(meta) if merge else None

    def produce(spec: TensorSpec) -> torch.Tensor:
        k = names[spec.key]
        t = src.value(k)
        # a base tensor read from the original files: as it trained (the checkpoint's own
        # copies of a quantized base are its dequantized values already)
        if base is not None and meta["keys"][k].get("base") and ".modules_to_save." not in k \
                and quantized.quantizes(t.shape, t.dtype, base.frozen_dtype, base.frozen_quant_min_numel):
            t = quantized.round_trip(t, base.frozen_dtype, base.frozen_double_quant)
        if k in lora:
            t = _merge(t, src, lora[k], cfg)
        return _cast(t, spec.dtype if t.is_floating_point() else None)

    shards = plan_shards(specs, max_shard_bytes) or [[]]
    files = shard_names(len(shards))
    for f in stale_weight_files(out_dir, files + ([INDEX_FILE] if len(files) > 1 else [])):
        os.remove(f)
    weight_map, total = {}, 0
    for fname, shard in zip(files, shards):
        write_safetensors(os.path.join(out_dir, fname), shard, produce)
        for s in shard:
            weight_map[s.key] = fname
            total += s.nbytes
    if len(files) > 1:                        # one shard: model.safetensors alone, as save_pretrained writes it
        _write_json(os.path.join(out_dir, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
    config = (meta.get("hf") or {}).get("config")
    if config is not None:
        config = dict(config)
        if (meta.get("hf") or {}).get("architectures"):
            config["architectures"] = meta["hf"]["architectures"]
        _write_json(os.path.join(out_dir, "config.json"), config)


def quantized_base(meta: dict):
    """The offload_param section of a checkpoint whose PEFT base trained stored quantized
    (``frozen_dtype`` int8 / nf4), else None: a merge goes into that base dequantized, the
    weights the adapter was trained against (params/quantized.py ``round_trip``)."""
    from offload.config.schema import OffloadParamConfig
    sec = dict((meta.get("config") or {}).get("offload_param") or {})
    if sec.get("frozen_dtype", "compute") not in quantized.FORMATS:
        return None
    sec["device"], sec["nvme_path"] = "cpu", None
    return OffloadParamConfig(**sec)


def merged_base_note(checkpoint_dir: str) -> Optional[str]:
    """What ``export_hf(peft="merged")`` merged into, in words, when not the original base."""
    base = quantized_base(_Source(os.fspath(checkpoint_dir)).meta)
    if base is None:
        return None
    return (f"the adapter is merged into the dequantized {base.frozen_dtype} base it trained over "
            f"(frozen_dtype {base.frozen_dtype}), not the original weights")


def _merge(w: torch.Tensor, src: _Source, lo: dict, cfg: dict) -> torch.Tensor:
    """W + scaling * B @ A, as PEFT's merge_and_unload computes it (fp32)."""
    if "lora_A" not in lo or "lora_B" not in lo:
        raise WeightsError(f"{lo['module']}: the checkpoint holds only one of lora_A / lora_B")
    a = src.value(lo["lora_A"]).float().clone()
    b = src.value(lo["lora_B"]).float().clone()
    r = a.shape[0]
    name = canonical_key(lo["module"] + ".x")[:-2]
    alpha = cfg.get("lora_alpha", r)
    for pat, val in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pat})$", name):
            alpha = val
    if cfg.get("use_dora"):
        raise WeightsError(f"{lo['module']}: DoRA adapters cannot be merged on export; use peft='adapter'")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    delta = (b @ a) * scaling
    if cfg.get("fan_in_fan_out"):
        delta = delta.T
    return (w.float() + delta).to(w.dtype)


def _export_adapters(src: _Source, out_dir: str, dtype) -> None:
    meta = src.meta
    hf = meta.get("hf") or {}
    for adapter, cfg in hf["peft"].items():
        d = out_dir if adapter == "default" else os.path.join(out_dir, adapter)
        os.makedirs(d, exist_ok=True)
        names = {}
        for k in src.order():
            out = peft_adapter_key(k, adapter, LORA_LAYERS)
            if out is not None:
                names[out] = k
            elif f".modules_to_save.{adapter}." in k:
                raise WeightsError(f"{k}: modules_to_save are not exported in the adapter layout; "
                                   f"use peft='merged'")
        if not names:
            raise WeightsError(f"the checkpoint holds no parameters of adapter {adapter!r}")
        specs = []
        for out, k in names.items():
            dt, shape = src.spec(k)
            specs.append(TensorSpec(out, dtype if (dtype is not None and dt.is_floating_point) else dt, shape))
        write_safetensors(os.path.join(d, "adapter_model.safetensors"), specs,
                          lambda s: _cast(src.value(names[s.key]), s.dtype))
        cfg = dict(cfg)
        if hf.get("source") and not cfg.get("base_model_name_or_path"):
            cfg["base_model_name_or_path"] = os.path.dirname(hf["source"]) if os.path.isfile(hf["source"]) \
                else hf["source"]
        _write_json(os.path.join(d, "adapter_config.json"), cfg)


def _write_json(fname: str, obj) -> None:
    tmp = fname + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, fname)
