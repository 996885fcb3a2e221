"""Sizing and planning: bytes per tier for each placement (estimate.py), the measured
machine profile, step-time model and check harness (plan.py), the placement ``finetune``
picks (choose.py), and the precision that fits the compute device (precision.py)."""
