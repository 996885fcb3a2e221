"""Hugging Face Accelerate on the engine (accelerate is an optional dependency: importing
``Accelerator`` checks it is installed in the supported range, offload/hf/versions.py).

    from offload.accelerate import Accelerator     # accelerate.Accelerator + offload_config=
"""
__all__ = ["Accelerator", "EngineOptimizer"]


def __getattr__(name):
    if name in __all__:
        from offload.accelerate import accelerator
        return getattr(accelerator, name)
    raise AttributeError(f"module 'offload.accelerate' has no attribute {name!r}")
