"""The training engine: the facade users call (engine.py) and what it sequences: build.py
(blocks and buffers from the config), update_and_grads.py (the hook participant: update
waits, gradients leaving the device), grad_landing.py (gradient buffers, NVMe parking),
step_control.py (the accumulation window and its commit), loss_scale.py, sigint.py,
activations/ (saved-activation offload)."""
from offload.engine.engine import Engine, initialize

__all__ = ["Engine", "initialize"]
