"""Data in and out of the engine: checkpoints (checkpoint.py)."""
