"""offload: a ZeRO-Offload engine for PyTorch.

    import offload
    engine = offload.initialize(model, {"offload_optimizer": {"device": "cpu"}})
"""
from offload._native import native_info
from offload.io.checkpoint import CheckpointError, export_fp32
from offload.io.export import export_hf
from offload.io.safetensors import WeightsError
from offload.config import Config, ConfigError
from offload.engine.engine import Engine, initialize
from offload.core.errors import BlockError, BlockIOError
from offload.engine.holders import EngineInUseError

__all__ = ["initialize", "Engine", "Config", "ConfigError", "export_fp32", "export_hf", "CheckpointError",
           "WeightsError", "native_info", "BlockError", "BlockIOError", "EngineInUseError"]
__version__ = "0.1.0"
