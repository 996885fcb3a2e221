"""Hugging Face integration (transformers, peft, accelerate and trl are optional dependencies of
the package: importing this module checks that they are installed in the supported range).

    from offload.hf import Trainer     # transformers.Trainer + offload_config=
    from offload.hf import on_engine   # on_engine(trl.SFTTrainer): another Trainer subclass on the engine
"""
from offload.hf.versions import TESTED, UntestedVersionWarning, VersionError

__all__ = ["Trainer", "EngineAccelerator", "on_engine", "TESTED", "VersionError", "UntestedVersionWarning"]


def __getattr__(name):
    if name in ("Trainer", "EngineAccelerator", "on_engine"):
        from offload.hf import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module 'offload.hf' has no attribute {name!r}")
