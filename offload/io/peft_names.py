"""The state-dict key names PEFT writes, mapped to and from the model's own: the wrappers a
PEFT model adds around a key (``canonical_key``) and the key PEFT's ``save_pretrained``
writes for an adapter parameter (``peft_adapter_key``)."""
from __future__ import annotations

import re
from typing import Optional, Sequence

_PEFT_PREFIX = "base_model.model."


def canonical_key(key: str) -> str:
    """A model's state_dict key without the wrappers PEFT adds: ``base_model.model.`` in
    front, ``.base_layer.`` around a wrapped layer, ``.modules_to_save.<adapter>.`` around a
    trained copy."""
    if key.startswith(_PEFT_PREFIX):
        key = key[len(_PEFT_PREFIX):]
    key = key.replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", key)


def peft_adapter_key(key: str, adapter: str, layer_names: Sequence[str]) -> Optional[str]:
    """The key PEFT's ``save_pretrained`` writes for an adapter parameter (the adapter's name
    removed), or None when ``key`` is not a parameter of ``adapter``."""
    for ln in layer_names:
        tag = f".{ln}.{adapter}"
        if tag + "." in key or key.endswith(tag):
            return key.replace(tag, f".{ln}")
    return None
