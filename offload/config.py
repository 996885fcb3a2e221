"""Configuration: frozen dataclasses, passed down whole.

A config comes from a dict, a JSON file, command-line flags (``Config.from_flags``), an
``offload.Config``, or a DeepSpeed config
(``zero_optimization``, ``bf16``/``fp16``, ``optimizer.params`` ...), which is translated
and whose unsupported keys are named in one warning. Unknown or misspelled keys are errors
that name the nearest valid key; invalid values fail here, before any memory is allocated.

    cfg = Config.from_any({"optimizer": {"lr": 1e-4},
                           "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/nvme"}})
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import tempfile
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names it and the fix."""


TIER_DEVICES = ("none", "cpu", "nvme")


def _check_choice(where: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{where}={value!r} is not valid: use one of {', '.join(map(repr, choices))}")


def _check_positive(where: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}={value!r} must be a number")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{where}={value!r} must be {bound}")


def check_nvme_path(where: str, path: Optional[str]) -> None:
    """The path must exist, be a directory and accept a new file (root bypasses mode bits,
    so this really creates one; a read-only mount fails here)."""
    if not path:
        raise ConfigError(f"{where} is required when device is 'nvme': set it to a directory on a fast local disk")
    if not os.path.isdir(path):
        raise ConfigError(f"{where}={path!r} does not exist or is not a directory: create it or point to an existing one")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".offload-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{where}={path!r} is not writable ({exc.strerror}): choose a writable directory") from None


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "AdamW"
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        _check_choice("optimizer.type", self.type, ("AdamW", "Adam"))
        _check_positive("optimizer.lr", self.lr, allow_zero=True)
        _check_positive("optimizer.eps", self.eps)
        _check_positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)
        if (not isinstance(self.betas, (list, tuple)) or len(self.betas) != 2
                or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas)):
            raise ConfigError(f"optimizer.betas={self.betas!r} must be two numbers in [0, 1)")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """Where the fp32 master weights and Adam moments live."""
    device: str = "cpu"
    nvme_path: Optional[str] = None
    pin_memory: bool = True
    # Blocks whose state is read ahead of the CPU step (nvme only): bounds the pinned pool.
    buffer_count: int = 4

    def __post_init__(self):
        _check_choice("offload_optimizer.device", self.device, TIER_DEVICES)
        _check_positive("offload_optimizer.buffer_count", self.buffer_count)
        if self.device == "nvme":
            check_nvme_path("offload_optimizer.nvme_path", self.nvme_path)


@dataclass(frozen=True)
class OffloadParamConfig:
    """Where the parameters live between uses (ZeRO-3 style parameter offload)."""
    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = True
    # Peak bytes of offloaded parameters allowed on the device at once; None: two largest blocks.
    device_budget_bytes: Optional[int] = None

    def __post_init__(self):
        _check_choice("offload_param.device", self.device, TIER_DEVICES)
        _check_positive("offload_param.device_budget_bytes", self.device_budget_bytes)
        if self.device == "nvme":
            check_nvme_path("offload_param.nvme_path", self.nvme_path)


@dataclass(frozen=True)
class PrefetchConfig:
    """Bytes kept in flight ahead of use on each link; None derives them from the budgets."""
    enabled: bool = True
    device_lookahead_bytes: Optional[int] = None
    host_lookahead_bytes: Optional[int] = None

    def __post_init__(self):
        _check_positive("prefetch.device_lookahead_bytes", self.device_lookahead_bytes, allow_zero=True)
        _check_positive("prefetch.host_lookahead_bytes", self.host_lookahead_bytes, allow_zero=True)


@dataclass(frozen=True)
class AioConfig:
    """The NVMe I/O engine (names follow DeepSpeed's `aio` section where they overlap)."""
    backend: str = "native"
    # 4 MiB extents, 64 in flight: 1 MiB x 32 read at ~55% of the raw rate on a virtual disk
    block_size: int = 4 << 20
    queue_depth: int = 64
    thread_count: int = 4
    checksum: bool = True

    def __post_init__(self):
        _check_choice("aio.backend", self.backend, ("native", "portable"))
        for k in ("block_size", "queue_depth", "thread_count"):
            _check_positive(f"aio.{k}", getattr(self, k))
        if self.block_size % 4096:
            raise ConfigError(f"aio.block_size={self.block_size} must be a multiple of 4096")


@dataclass(frozen=True)
class LossScalerConfig:
    """Dynamic loss scaling for fp16: an overflow skips the step and lowers the scale."""
    initial_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0

    def __post_init__(self):
        _check_positive("loss_scaler.initial_scale", self.initial_scale)
        _check_positive("loss_scaler.growth_interval", self.growth_interval)
        _check_positive("loss_scaler.min_scale", self.min_scale)
        if not self.growth_factor > 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ConfigError("loss_scaler: growth_factor must be > 1 and backoff_factor in (0, 1)")


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO stage across data-parallel ranks (0 = plain data parallel)."""
    stage: int = 0
    # Seconds a collective may wait for the other ranks before failing with a clear error.
    timeout_s: float = 300.0

    def __post_init__(self):
        _check_choice("zero_optimization.stage", self.stage, (0, 1, 2, 3))
        _check_positive("zero_optimization.timeout_s", self.timeout_s)


@dataclass(frozen=True)
class Config:
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: str = "fp32"
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    # Module names (as in model.named_modules()) that each become one block; None: automatic.
    blocks: Optional[Tuple[str, ...]] = None
    # Optimizer worker threads (the native kernel has its own pool inside each call).
    optimizer_workers: int = 1
    # Step each block as soon as its gradients land (when nothing global is needed).
    overlap_step: bool = True

    def __post_init__(self):
        _check_choice("precision", self.precision, ("fp32", "bf16", "fp16"))
        if not isinstance(self.gradient_accumulation_steps, int) or self.gradient_accumulation_steps < 1:
            raise ConfigError(f"gradient_accumulation_steps={self.gradient_accumulation_steps!r} must be an integer >= 1")
        _check_positive("gradient_clipping", self.gradient_clipping, allow_zero=True)
        _check_positive("optimizer_workers", self.optimizer_workers)
        if self.blocks is not None:
            object.__setattr__(self, "blocks", tuple(self.blocks))

    # ---- constructors -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Config":
        """From the engine's own dict layout; a DeepSpeed-style dict is detected and translated."""
        if is_deepspeed_config(d):
            return from_deepspeed(d)
        return _build(cls, d, "")

    @classmethod
    def from_json(cls, path: str) -> "Config":
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"config file {path!r} is not valid JSON: {exc}") from None
        return cls.from_dict(d)

    @classmethod
    def from_flags(cls, argv) -> "Config":
        """From command-line flags (``offload train --help`` lists them)."""
        return from_flags(argv)

    @classmethod
    def from_any(cls, cfg: "Config | Mapping[str, Any] | str | os.PathLike | None") -> "Config":
        if cfg is None:
            return cls()
        if isinstance(cfg, Config):
            return cfg
        if isinstance(cfg, (str, os.PathLike)):
            return cls.from_json(os.fspath(cfg))
        if isinstance(cfg, Mapping):
            return cls.from_dict(cfg)
        raise ConfigError(f"config must be a dict, a path to a JSON file or offload.Config, not {type(cfg).__name__}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


def _build(cls, d: Mapping[str, Any], prefix: str):
    if not isinstance(d, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, not {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in d.items():
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"did you mean '{prefix}{near[0]}'?" if near else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{prefix}{key}': {hint}")
        sub = hints[key]
        if dataclasses.is_dataclass(sub):
            value = _build(sub, value, f"{prefix}{key}.")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a wrongly typed value inside a check
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {exc}") from None


# ---- DeepSpeed-style configs ----------------------------------------------------------------
_DS_MARKERS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "bf16", "fp16")
# Top-level keys of this engine's own layout that DeepSpeed does not have: their presence
# means "native", even next to `zero_optimization` (which both layouts share).
_NATIVE_ONLY = ("precision", "offload_optimizer", "offload_param", "prefetch", "loss_scaler",
                "blocks", "optimizer_workers", "overlap_step")
# Keys DeepSpeed knows that this engine ignores (named in the warning). An ignored key that is
# in none of these lists but close to a known one is a misspelling and fails instead.
_DS_KNOWN = {
    "": ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
         "optimizer", "scheduler", "fp16", "bf16", "amp", "gradient_clipping", "zero_optimization",
         "aio", "steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
         "gradient_predivide_factor", "sparse_gradients", "communication_data_type",
         "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
         "comms_logger", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
         "data_types", "checkpoint", "elasticity", "pipeline", "memory_breakdown", "autotuning",
         "compression_training", "data_efficiency", "curriculum_learning", "sparse_attention"),
    "zero_optimization.": ("stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
                           "allgather_partitions", "allgather_bucket_size", "overlap_comm",
                           "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
                           "offload_optimizer", "sub_group_size", "cpu_offload", "cpu_offload_params",
                           "cpu_offload_use_pin_memory", "stage3_max_live_parameters",
                           "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
                           "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
                           "stage3_gather_16bit_weights_on_model_save",
                           "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters",
                           "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights",
                           "zero_quantized_gradients", "mics_shard_size", "memory_efficient_linear"),
    "zero_optimization.offload_optimizer.": ("device", "nvme_path", "buffer_count", "pin_memory",
                                             "pipeline_read", "pipeline_write", "fast_init", "ratio"),
    "zero_optimization.offload_param.": ("device", "nvme_path", "buffer_count", "buffer_size",
                                         "max_in_cpu", "pin_memory"),
    "aio.": ("block_size", "queue_depth", "thread_count", "single_submit", "overlap_events",
             "intra_op_parallelism", "use_gds"),
    "fp16.": ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
              "hysteresis", "consecutive_hysteresis", "min_loss_scale"),
    "bf16.": ("enabled", "immediate_grad_update", "check_grad_overflow"),
    "optimizer.": ("type", "params"),
    "optimizer.params.": ("lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode",
                          "bias_correction", "amsgrad", "fused"),
}


def is_deepspeed_config(d: Mapping[str, Any]) -> bool:
    if any(k in d for k in _NATIVE_ONLY):
        return False
    if any(k in d for k in _DS_MARKERS):
        return True
    opt = d.get("optimizer")
    return isinstance(opt, Mapping) and "params" in opt


def from_deepspeed(ds: Mapping[str, Any]) -> Config:
    """Translate a DeepSpeed config; keys this engine does not use are named in one warning."""
    return _build(Config, translate_deepspeed(ds), "")


def translate_deepspeed(ds: Mapping[str, Any]) -> dict:
    """A DeepSpeed config as a dict in this engine's layout (not yet validated). Keys DeepSpeed
    knows but this engine does not use are named in one warning; a key DeepSpeed does not know
    either, but close to one it does, is a misspelling: ConfigError naming the nearest key."""
    ignored = []
    out: dict = {}

    def mapping(v, where: str) -> dict:
        if not isinstance(v, Mapping):
            raise ConfigError(f"{where} must be a mapping, not {type(v).__name__}")
        return dict(v)

    def take(src: Mapping, keys: Mapping[str, str], where: str) -> dict:
        got = {}
        for k, v in mapping(src, where.rstrip(".")).items():
            if k in keys:
                got[keys[k]] = v
            else:
                ignored.append(f"{where}{k}")
        return got

    for k, v in ds.items():
        if k == "zero_optimization":
            z = mapping(v, k)
            for tier in ("offload_optimizer", "offload_param"):
                if tier in z:
                    keys = {"device": "device", "nvme_path": "nvme_path", "pin_memory": "pin_memory"}
                    if tier == "offload_optimizer":
                        keys["buffer_count"] = "buffer_count"
                    out[tier] = take(z.pop(tier), keys, f"zero_optimization.{tier}.")
            out["zero_optimization"] = take(z, {"stage": "stage"}, "zero_optimization.")
        elif k == "aio":
            out["aio"] = take(v, {"block_size": "block_size", "queue_depth": "queue_depth",
                                  "thread_count": "thread_count"}, "aio.")
        elif k in ("bf16", "fp16"):
            sec = mapping(v, k)
            if sec.pop("enabled", False) in (True, "auto"):
                out["precision"] = k
            if k == "fp16":
                ls = {}
                if "initial_scale_power" in sec:
                    ls["initial_scale"] = 2.0 ** sec.pop("initial_scale_power")
                if "loss_scale_window" in sec:
                    ls["growth_interval"] = sec.pop("loss_scale_window")
                if "min_loss_scale" in sec:
                    ls["min_scale"] = sec.pop("min_loss_scale")
                if ls:
                    out["loss_scaler"] = ls
            ignored.extend(f"{k}.{x}" for x in sec)
        elif k == "optimizer":
            opt = mapping(v, k)
            o = take(opt.pop("params", {}), {"lr": "lr", "betas": "betas", "eps": "eps",
                                             "weight_decay": "weight_decay"}, "optimizer.params.")
            if "type" in opt:
                t = str(opt.pop("type"))
                o["type"] = {"adamw": "AdamW", "adam": "Adam", "cpuadam": "AdamW"}.get(t.lower(), t)
            ignored.extend(f"optimizer.{x}" for x in opt)
            out["optimizer"] = o
        elif k in ("gradient_clipping", "gradient_accumulation_steps"):
            out[k] = v
        else:
            ignored.append(k)
    for key in ignored:
        section, _, leaf = key.rpartition(".")
        section = section + "." if section else ""
        known = _DS_KNOWN.get(section, ())
        if leaf not in known:
            near = difflib.get_close_matches(leaf, known, n=1, cutoff=0.75)
            if near:
                raise ConfigError(f"unknown DeepSpeed config key '{key}': did you mean '{section}{near[0]}'?")
    if ignored:
        warnings.warn("DeepSpeed config keys not used by offload: " + ", ".join(ignored), stacklevel=4)
    return out


# ---- command-line flags -----------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: "str | int | float", where: str = "size") -> int:
    """``"24GiB"``, ``"1.5GB"``, ``"7e9"``, ``4096`` -> bytes (int). Negative sizes are errors."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        import re
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{where}={text!r} is not a size: write e.g. 4096, 7e9, 512MiB or 24GiB")
        value, unit = float(m.group(1)), m.group(2).lower()
    if value < 0:
        raise ConfigError(f"{where}={text!r} must be >= 0")
    return int(value * _UNITS[unit])


# (flag, dotted config key, type, help). Flags given on the command line override --config.
_FLAGS = (
    ("--precision", "precision", str, "fp32 | bf16 | fp16"),
    ("--optimizer", "optimizer.type", str, "AdamW | Adam"),
    ("--lr", "optimizer.lr", float, "learning rate"),
    ("--weight-decay", "optimizer.weight_decay", float, "decoupled weight decay"),
    ("--betas", "optimizer.betas", "pair", "Adam betas, e.g. 0.9,0.95"),
    ("--eps", "optimizer.eps", float, "Adam epsilon"),
    ("--gradient-accumulation-steps", "gradient_accumulation_steps", int, "micro-steps per step"),
    ("--gradient-clipping", "gradient_clipping", float, "max global grad norm (0: off)"),
    ("--offload-optimizer", "offload_optimizer.device", str, "none | cpu | nvme: where Adam state lives"),
    ("--offload-param", "offload_param.device", str, "none | cpu | nvme: where parameters live"),
    ("--nvme-path", "*.nvme_path", str, "directory for the NVMe swap files (both tiers)"),
    ("--buffer-count", "offload_optimizer.buffer_count", int, "optimizer blocks read ahead (nvme)"),
    ("--device-budget", "offload_param.device_budget_bytes", "bytes", "peak offloaded param bytes on device"),
    ("--aio-backend", "aio.backend", str, "native | portable"),
    ("--aio-block-size", "aio.block_size", "bytes", "I/O request size"),
    ("--aio-queue-depth", "aio.queue_depth", int, "I/O requests in flight"),
    ("--aio-thread-count", "aio.thread_count", int, "I/O threads"),
    ("--zero-stage", "zero_optimization.stage", int, "ZeRO stage across ranks (0-3)"),
    ("--optimizer-workers", "optimizer_workers", int, "CPU optimizer threads"),
)
_SWITCHES = (  # (flag, dotted key, value)
    ("--no-pin-memory", "*.pin_memory", False),
    ("--no-checksum", "aio.checksum", False),
    ("--no-overlap-step", "overlap_step", False),
    ("--no-prefetch", "prefetch.enabled", False),
)


def add_config_arguments(parser) -> None:
    """Add the config flags to an ``argparse`` parser (all default to "not given")."""
    import argparse
    g = parser.add_argument_group("engine config (override --config)")
    g.add_argument("--config", metavar="FILE", default=None,
                   help="JSON config: this engine's layout or a DeepSpeed config")
    for flag, key, _typ, help_ in _FLAGS:
        g.add_argument(flag, dest="cfg:" + key, default=argparse.SUPPRESS, metavar="V", help=help_)
    for flag, key, value in _SWITCHES:
        g.add_argument(flag, dest="cfg:" + key, action="store_const", const=value,
                       default=argparse.SUPPRESS)
    g.add_argument("--set", dest="cfg_set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, dotted, e.g. --set prefetch.host_lookahead_bytes=1e9")


def _convert(flag: str, typ, text):
    if typ is str:
        return text
    if typ == "bytes":
        return parse_bytes(text, flag)
    if typ == "pair":
        parts = [p for p in str(text).replace(",", " ").split() if p]
        try:
            return tuple(float(p) for p in parts)
        except ValueError:
            raise ConfigError(f"{flag}={text!r} must be two numbers, e.g. {flag} 0.9,0.95") from None
    try:
        return typ(text)
    except ValueError:
        raise ConfigError(f"{flag}={text!r} must be {'an integer' if typ is int else 'a number'}") from None


def _set_dotted(d: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        sub = d.setdefault(p, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"cannot set {key!r}: {p!r} is not a section")
        d = sub
    d[parts[-1]] = value


def flags_to_dict(ns, base: "Mapping[str, Any] | None" = None) -> dict:
    """The config dict (this engine's layout, not yet validated) from parsed flags:
    ``--config`` (translated when DeepSpeed), then the flags, then ``--set`` entries."""
    if base is not None:
        d = _plain(base)
    elif getattr(ns, "config", None):
        path = ns.config
        if not os.path.isfile(path):
            raise ConfigError(f"--config {path!r} does not exist: give a JSON config file")
        with open(path) as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--config {path!r} is not valid JSON: {exc}") from None
        if not isinstance(raw, Mapping):
            raise ConfigError(f"--config {path!r} must hold a JSON object")
        d = translate_deepspeed(raw) if is_deepspeed_config(raw) else _plain(raw)
    else:
        d = {}
    given = vars(ns)
    for flag, key, typ, _ in _FLAGS:
        if "cfg:" + key in given:
            value = _convert(flag, typ, given["cfg:" + key])
            for k in _expand(key):
                _set_dotted(d, k, value)
    for flag, key, value in _SWITCHES:
        if "cfg:" + key in given:
            for k in _expand(key):
                _set_dotted(d, k, value)
    for item in getattr(ns, "cfg_set", None) or ():
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} must be KEY=VALUE, e.g. --set optimizer.lr=3e-4")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text   # a bare string, e.g. --set offload_optimizer.device=nvme
        _set_dotted(d, key.strip(), value)
    return d


def _expand(key: str):
    if key.startswith("*."):
        return [f"offload_optimizer.{key[2:]}", f"offload_param.{key[2:]}"]
    return [key]


def _plain(m: Mapping) -> dict:
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in m.items()}


def build_config(d: Mapping[str, Any]) -> Config:
    """Validate a dict already in this engine's layout (as ``flags_to_dict`` returns it),
    without DeepSpeed detection."""
    return _build(Config, d, "")


def from_flags(argv) -> Config:
    """A Config from command-line flags, e.g. ``["--offload-optimizer", "nvme", "--nvme-path", d]``."""
    import argparse

    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ConfigError(message)

    parser = _Parser(prog="offload", add_help=False)
    add_config_arguments(parser)
    ns, extra = parser.parse_known_args(list(argv))
    if extra:
        raise ConfigError(unknown_flag_message(parser, extra[0]))
    return build_config(flags_to_dict(ns))


def unknown_flag_message(parser, arg: str) -> str:
    """'unknown flag --offload-optimzer: did you mean --offload-optimizer?'"""
    flag = arg.split("=", 1)[0]
    options = [o for a in parser._actions for o in a.option_strings]
    near = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
    if not flag.startswith("-"):
        return f"unexpected argument {arg!r}"
    return f"unknown flag {flag}: " + (f"did you mean {near[0]}?" if near else "see --help")
