"""Trained weights out of a live engine, for ``save_pretrained``.

One function, so the source can change in one place: today the engine's consolidated fp32
state_dict (``engine.full_state_dict()``: the fp32 master of every trained parameter, the
rest as the model holds it), with the keys of ``model.state_dict()``.
"""
from __future__ import annotations

from typing import Dict

import torch


def trained_state_dict(engine) -> Dict[str, torch.Tensor]:
    """The model's state_dict with the engine's trained values. With ZeRO stages >= 1 across
    ranks this is a collective: every rank must call it."""
    return engine.full_state_dict()
