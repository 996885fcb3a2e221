"""Sizing and planning: bytes per tier for each placement (estimate.py); the machine's measured
rates (measure.py), the step-time model (predict.py), the placements ranked (rank.py) and the
model checked against the engine (validate.py), re-exported together by plan.py; the placement
``finetune`` picks (choose.py); the precision that fits the compute device (precision.py)."""
