"""offload: a ZeRO-Offload engine for PyTorch.

    import offload
    engine = offload.initialize(model, {"offload_optimizer": {"device": "cpu"}})

Every error offload raises on purpose is an ``offload.OffloadError`` (and keeps its builtin
base, e.g. ``ConfigError`` is a ``ValueError``); the ones a caller catches are exported here.
"""
from offload._native import native_info
from offload.io.checkpoint import CheckpointError, CheckpointIOError, export_fp32
from offload.io.export import export_hf
from offload.io.gguf import GGUFError
from offload.io.safetensors import WeightsError
from offload.config import Config, ConfigError
from offload.engine.engine import Engine, initialize
from offload.core.blocks import ModelError
from offload.core.errors import BlockError, BlockIOError, BudgetError, InvariantError, OffloadError
from offload.dist.comm import CommError
from offload.engine.activations.handler import ActivationHostBudgetError
from offload.engine.holders import EngineClosedError, EngineInUseError
from offload.hf.data import DataError
from offload.hf.job import JobError
from offload.hf.versions import VersionError
from offload.params.budget import DeviceBudgetError
from offload.planner.estimate import EstimateError
from offload.storage.nvme import ChecksumError, NvmeIOError, NvmeSpaceError, StoreClosedError
from offload.storage.source import SourceChangedError
from offload.storage.pool import PoolBudgetError
from offload.storage.loan import TierIOError, TierTimeout

__all__ = ["initialize", "Engine", "Config", "export_fp32", "export_hf", "native_info",
           # the root of every error offload raises on purpose, then its families
           "OffloadError",
           "ConfigError", "ModelError", "WeightsError", "GGUFError", "DataError", "EstimateError", "VersionError",
           "BudgetError", "DeviceBudgetError", "ActivationHostBudgetError", "PoolBudgetError", "NvmeSpaceError",
           "BlockError", "BlockIOError", "CommError", "JobError",
           "CheckpointError", "CheckpointIOError", "SourceChangedError",
           "EngineClosedError", "EngineInUseError", "StoreClosedError",
           "TierTimeout", "TierIOError", "NvmeIOError", "ChecksumError",
           "InvariantError"]
__version__ = "0.1.0"
