"""Every placement ranked: fitting ones first (estimate.py's bytes against the machine), each
group by predicted step time (predict.py), so the planner and ``finetune`` pick the fastest
placement that fits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from offload.planner.estimate import TIERS, Machine, ModelSpec, Placement, check_fit, placement_bytes
from offload.planner.measure import Compute, Profile
from offload.planner.predict import Prediction, predict


@dataclass(frozen=True)
class RankedPlacement:
    prediction: Prediction
    memory: Placement
    fit: Dict[str, Optional[bool]]

    @property
    def fits(self) -> bool:
        return self.memory.refused is None and all(v is not False for v in self.fit.values())


def rank(spec: ModelSpec, profile: Profile, compute: Compute, machine: Machine, precision: str = "fp32",
         gradient_accumulation_steps: int = 1, clipping: bool = False, world_size: int = 1,
         buffer_count: int = 4, placements: Optional[Sequence[Tuple[str, str]]] = None, *,
         rule: str = "AdamW", state_dtype: str = "fp32", device_budget_bytes: Optional[int] = None,
         host_lookahead_bytes: Optional[int] = None, update_ahead: bool = False) -> List[RankedPlacement]:
    """All placements, fitting ones first, each group fastest first (the optimizer state's
    bytes from ``rule`` / ``state_dtype``; ``update_ahead`` for the optimizer on cpu; a
    placement the engine refuses never fits)."""
    out = []
    for o, prm in placements or [(o, prm) for o in TIERS for prm in TIERS]:
        pred = predict(spec, o, prm, profile, compute, precision, gradient_accumulation_steps, clipping,
                       rule=rule, state_dtype=state_dtype, device_budget_bytes=device_budget_bytes,
                       update_ahead=update_ahead)
        mem = placement_bytes(spec, o, prm, precision, world_size, buffer_count, 1.0 if clipping else 0.0,
                              gradient_accumulation_steps, rule=rule, state_dtype=state_dtype,
                              device_budget_bytes=device_budget_bytes, host_lookahead_bytes=host_lookahead_bytes,
                              update_ahead=update_ahead)
        out.append(RankedPlacement(pred, mem, check_fit(mem, machine)))
    out.sort(key=lambda r: (not r.fits, r.prediction.step_s))
    return out


def fits_without_offload(ranked: Sequence[RankedPlacement]) -> Optional[RankedPlacement]:
    """The no-offload placement when it fits on every known tier (device capacity known)."""
    for r in ranked:
        if r.memory.optimizer == "none" and r.memory.param == "none":
            return r if r.fit["device"] is True and r.fits else None
    return None
