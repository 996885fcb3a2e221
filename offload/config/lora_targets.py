"""LoRA targets: the names a user gives (``targets=q_proj,v_proj`` / ``--lora-targets``) as
PEFT's ``target_modules`` and ``target_parameters``.

Besides module names (``q_proj``: every module so named) and parameter names
(``experts.gate_up_proj``: a 3-D fused experts tensor, adapted through PEFT's
``target_parameters``), two keywords name a family of modules whatever the model calls them:

  attention   every linear layer inside an attention module (a module whose name contains
              ``attn`` or ``attention``: q/k/v/o, DeepSeek's q_a/q_b/kv_a/kv_b projections)
  experts     a mixture of experts' routed experts: the 3-D tensors of modules named
              ``experts`` (transformers' fused experts, PEFT ``target_parameters``) and the
              linear layers of a module list named ``experts`` (one module per expert)

Why keywords: the names differ between families (DeepSeek-V3 has no ``q_proj``), and the fused
experts are parameters, not modules, so a module name cannot reach them.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from offload.config.errors import ConfigError

KEYWORDS = ("attention", "experts")


class LoraTargetError(ConfigError):
    """A LoRA target that names nothing in the model; the message lists what it has."""


def _is_attention(path: str) -> bool:
    return any("attn" in part or "attention" in part for part in path.split(".")[:-1])


def _in_experts(path: str) -> bool:
    return "experts" in path.split(".")[:-1]


def _leaf_names(names: List[str], everything: List[str]) -> List[str]:
    """``names`` (full module paths) as the shortest names PEFT matches by suffix: the leaf
    name where no module outside ``names`` shares it, else the full path."""
    chosen = set(names)
    leaf_owners: Dict[str, set] = {}
    for n in everything:
        leaf_owners.setdefault(n.rsplit(".", 1)[-1], set()).add(n)
    out = []
    for n in names:
        leaf = n.rsplit(".", 1)[-1]
        pick = leaf if leaf_owners[leaf] <= chosen else n
        if pick not in out:
            out.append(pick)
    return out


def resolve(model, targets: Sequence[str]) -> Dict[str, List[str]]:
    """``{"target_modules": [...], "target_parameters": [...]}`` for ``peft.LoraConfig`` from
    ``targets`` (module names, parameter names, the keywords above); raises
    ``LoraTargetError`` naming a target that matches nothing, with the model's names."""
    import torch
    linear = [n for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]    # GPT-2's Conv1D
    modules = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n}
    fused = []                                        # "experts.<param>" of 3-D expert tensors
    for name, p in model.named_parameters():
        owner, _, pname = name.rpartition(".")
        if p.dim() == 3 and owner.rsplit(".", 1)[-1] == "experts":
            key = f"experts.{pname}"
            if key not in fused:
                fused.append(key)
    mods: List[str] = []
    params: List[str] = []
    for t in targets:
        if t == "attention":
            found = [n for n in linear if _is_attention(n)]
            if not found:
                raise LoraTargetError(f"LoRA target 'attention': the model has no linear layer inside an attention "
                                      f"module; its linear layers are named {', '.join(sorted(_leaves(linear)))}")
            mods += [n for n in _leaf_names(found, linear) if n not in mods]
        elif t == "experts":
            found = [n for n in linear if _in_experts(n)]
            if not found and not fused:
                raise LoraTargetError("LoRA target 'experts': the model has no mixture-of-experts experts "
                                      "(no module named 'experts')")
            mods += [n for n in _leaf_names(found, linear) if n not in mods]
            params += [k for k in fused if k not in params]
        elif t in modules:
            mods.append(t)
        elif any(k == t or k.endswith("." + t) or t.endswith(k) for k in fused):
            params.append(t)
        else:
            raise LoraTargetError(
                f"LoRA target {t!r} is not a module or expert tensor of this model: its linear layers are named "
                f"{', '.join(sorted(_leaves(linear)))}" + (f"; its fused experts {', '.join(fused)}" if fused else "")
                + f"; or use the keywords {', '.join(KEYWORDS)}")
    return {"target_modules": mods, "target_parameters": params}


def _leaves(names) -> set:
    return {n.rsplit(".", 1)[-1] for n in names}


def lora_config(model, targets: Sequence[str], **kw):
    """``peft.LoraConfig(**kw)`` adapting ``targets`` of ``model`` (``resolve``)."""
    import peft
    t = resolve(model, targets)
    extra = {"target_parameters": t["target_parameters"]} if t["target_parameters"] else {}
    return peft.LoraConfig(target_modules=t["target_modules"], **extra, **kw)
