"""Sizing and planning: bytes per tier for each placement (estimate.py), and the measured
machine profile, step-time model and check harness (plan.py)."""
