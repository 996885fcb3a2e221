"""The fp16 loss scale (``LossScaler``), owned by the accumulation window's commit."""
from __future__ import annotations

from offload.config import LossScalerConfig


class LossScaler:
    """Dynamic loss scaling for fp16: an overflow skips the step and lowers the scale; after
    ``growth_interval`` clean steps the scale grows (the same rule as torch.amp.GradScaler).
    Owned by the window's commit; inert (scale 1) in fp32 and bf16."""

    def __init__(self, cfg: LossScalerConfig, enabled: bool):
        self.cfg = cfg
        self.enabled = enabled
        self.scale = float(cfg.initial_scale) if enabled else 1.0
        self.clean_steps = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_scale)
            self.clean_steps = 0
            self.skipped += 1
        else:
            self.clean_steps += 1
            if self.clean_steps % self.cfg.growth_interval == 0:
                self.scale *= self.cfg.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, d: dict) -> None:
        self.scale = float(d["scale"])
        self.clean_steps = int(d["clean_steps"])
        self.skipped = int(d["skipped"])
