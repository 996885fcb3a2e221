"""The training engine: the facade users call (engine.py) and what it sequences: build.py
(blocks and buffers from the config), step_control.py (gradient landing, the accumulation
window and its commit), activations/ (saved-activation offload)."""
from offload.engine.engine import Engine, initialize

__all__ = ["Engine", "initialize"]
