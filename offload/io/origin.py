"""Where a model came from, as a checkpoint records it: what an export to the Hugging Face
layout needs, and the reference to a frozen base that checkpoints do not copy.

Fields this module adds to a checkpoint's meta.json::

    "hf":   {"config": {...config.json...} | null,          the Hugging Face model's config
             "architectures": ["LlamaForCausalLM"] | null,
             "peft": {"default": {...adapter_config...}} | null,
             "source": "/models/llama" | null,               the weights= path given to initialize
             "files": ["/models/llama/tokenizer.json", ...]} tokenizer / generation files beside it
    "base": {"files": {"/models/llama/model-00001-of-00002.safetensors": {"size": N}, ...},
             "tensors": {state_dict key: {"file": path, "key": checkpoint key, "crc32c": C}}}

A frozen parameter loaded from a safetensors file never changes, so the checkpoint lists it
under "base" (its key map entry is ``{"base": true}``) instead of writing its bytes. Loading
verifies each referenced file's size and each tensor's checksum: against the checksums the
engine computed while loading those same bytes (no re-read), else by reading the tensor
again, which then also becomes the parameter's value.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

import torch

from offload.io.safetensors import WeightsError, read_header

AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
             "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
             "chat_template.json", "generation_config.json", "preprocessor_config.json")


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))


def hf_model(model: torch.nn.Module):
    """The outermost Hugging Face model inside ``model`` (the model itself, or a PEFT
    wrapper's base model), or None."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if hasattr(cfg, "to_json_string") and callable(getattr(m, "_init_weights", None)):
            return m
    return None


def _can_generate(model) -> bool:
    try:
        return bool(model.can_generate())
    except Exception:                      # a model class without the method, or one that cannot say
        return False


def record(subject) -> dict:
    """The "hf" and "base" fields of a checkpoint of ``subject`` (io/checkpoint.py ``Subject``)."""
    model = subject.module
    hf = hf_model(model)
    config = json.loads(hf.config.to_json_string(use_diff=False)) if hf is not None else None
    gen = getattr(hf, "generation_config", None) if hf is not None and _can_generate(hf) else None
    generation = json.loads(gen.to_json_string()) if gen is not None else None     # as save_pretrained writes it
    peft = None
    for m in model.modules():
        pc = getattr(m, "peft_config", None)
        if isinstance(pc, dict) and pc:
            peft = {name: _jsonable(c.to_dict() if hasattr(c, "to_dict") else dict(vars(c))) for name, c in pc.items()}
            break
    loader = subject.weights
    source = loader.files.path if loader.files is not None else None
    aux = []
    if loader.files is not None:
        aux = [os.path.join(loader.files.source_dir, f) for f in AUX_FILES
               if os.path.isfile(os.path.join(loader.files.source_dir, f))]
    refs = loader.base_reference()
    files = {f: {"size": os.path.getsize(f)} for f in sorted({r["file"] for r in refs.values()})}
    return {"hf": {"config": config, "architectures": [type(hf).__name__] if hf is not None else None,
                   "peft": peft, "source": source, "files": aux, "generation_config": generation},
            "base": {"files": files, "tensors": refs}}


def base_keys(subject) -> set:
    """state_dict keys a checkpoint of ``subject`` refers to instead of copying."""
    return set(subject.weights.base_reference())


def _checksum_key(ref: dict) -> str:
    return "crc32c" if "crc32c" in ref else "crc32"


def check_files(meta: dict, path: str) -> None:
    """Every base file a checkpoint refers to exists with its recorded size."""
    for f, info in (meta.get("base") or {}).get("files", {}).items():
        if not os.path.isfile(f):
            raise WeightsError(f"checkpoint {path} refers to base weights file {f}, which does not exist: "
                               f"restore it (the checkpoint holds only the trained state)")
        if os.path.getsize(f) != info["size"]:
            raise WeightsError(f"checkpoint {path} refers to base weights file {f} of {info['size']} bytes, "
                               f"which now holds {os.path.getsize(f)}: it was replaced since the checkpoint was saved")


def read_base_tensor(meta: dict, key: str, _headers: Optional[dict] = None) -> torch.Tensor:
    """The referenced base value of state_dict ``key`` (file dtype, CPU), checksum-verified."""
    from offload.io.loader import checksum
    ref = meta["base"]["tensors"][key]
    headers = _headers if _headers is not None else {}
    if ref["file"] not in headers:
        headers[ref["file"]] = read_header(ref["file"])[0]
    ext = headers[ref["file"]].get(ref["key"])
    if ext is None:
        raise WeightsError(f"base weights file {ref['file']} no longer holds {ref['key']!r}")
    with open(ref["file"], "rb") as f:
        f.seek(ext.offset)
        data = bytearray(f.read(ext.length))
    t = torch.frombuffer(data, dtype=torch.uint8).view(ext.dtype).view(ext.shape) if ext.length else \
        torch.empty(ext.shape, dtype=ext.dtype)
    algo = _checksum_key(ref)
    got = checksum(t)
    if got[0] != algo:
        import zlib
        got = (algo, zlib.crc32(bytes(data)))
    if got[1] != ref[algo]:
        raise WeightsError(f"base weights file {ref['file']}: tensor {ref['key']!r} fails its {algo} check: "
                           f"the file changed since the checkpoint was saved")
    return t


def restore_base(subject, meta: dict, path: str) -> None:
    """On load: verify the base a checkpoint refers to and give ``subject``'s frozen
    parameters its values (no read when the engine loaded the same bytes)."""
    refs = (meta.get("base") or {}).get("tensors", {})
    if not refs:
        return
    check_files(meta, path)
    mine = subject.weights.base_reference()
    sd = subject.module.state_dict(keep_vars=True)
    po = subject.param_offload
    offloaded = po.frozen_io.ids() if po is not None else set()
    headers: dict = {}
    homes = {}                            # offloaded frozen parameters: written to their homes
    for k, ref in refs.items():
        have = mine.get(k)
        algo = _checksum_key(ref)
        if have is not None and have.get(algo) == ref[algo] and have["key"] == ref["key"]:
            continue                      # the engine holds exactly these bytes already
        if k not in sd:
            raise WeightsError(f"checkpoint {path} refers to base tensor {k!r}, which the model does not have")
        if id(sd[k]) in offloaded:
            homes[id(sd[k])] = read_base_tensor(meta, k, headers)
            continue
        with torch.no_grad():
            sd[k].copy_(read_base_tensor(meta, k, headers))
    if homes:
        po.frozen_io.write(homes)


def aux_files(meta: dict) -> List[str]:
    return list((meta.get("hf") or {}).get("files") or [])
