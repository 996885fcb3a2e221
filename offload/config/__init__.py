"""Configuration: frozen dataclasses (schema.py), DeepSpeed translation (deepspeed.py),
command-line flags (flags.py) and their shared error and JSON reader (errors.py). ``Config.from_any`` takes a dict, a JSON path, a Config or a
DeepSpeed config."""
from offload.config.deepspeed import is_deepspeed_config, translate_deepspeed
from offload.config.errors import ConfigError
from offload.config.flags import add_config_arguments, flags_to_dict, parse_bytes, unknown_flag_message
from offload.config.schema import (TIER_DEVICES, AioConfig, Config, LossScalerConfig, OffloadOptimizerConfig,
                                   OffloadParamConfig, OptimizerConfig, PrefetchConfig, ZeroConfig, build_config,
                                   check_nvme_path, from_deepspeed, from_flags)

__all__ = ["Config", "ConfigError", "OptimizerConfig", "OffloadOptimizerConfig", "OffloadParamConfig",
           "PrefetchConfig", "AioConfig", "LossScalerConfig", "ZeroConfig", "TIER_DEVICES", "check_nvme_path",
           "from_deepspeed", "is_deepspeed_config", "translate_deepspeed", "add_config_arguments", "build_config",
           "flags_to_dict", "from_flags", "parse_bytes", "unknown_flag_message"]
