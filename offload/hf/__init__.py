"""Hugging Face integration (transformers, peft and accelerate are optional dependencies of
the package: importing this module checks that they are installed in the tested range).

    from offload.hf import Trainer     # transformers.Trainer + offload_config=
"""
from offload.hf.versions import TESTED, VersionError

__all__ = ["Trainer", "EngineAccelerator", "TESTED", "VersionError"]


def __getattr__(name):
    if name in ("Trainer", "EngineAccelerator"):
        from offload.hf import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module 'offload.hf' has no attribute {name!r}")
