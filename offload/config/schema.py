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
import math
import os
import tempfile
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

from offload.config import deepspeed, flags
from offload.config.errors import ConfigError, read_json  # noqa: F401 (read_json: offload.config.schema.read_json)
from offload.dtypes import PRECISIONS, STATE_DTYPES
from offload.placement import Placement


TIER_DEVICES = ("none", "cpu", "nvme")
FROZEN_DTYPES = ("compute", "int8", "nf4")   # offload_param.frozen_dtype


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


def _check_finite(section, where: str) -> None:
    """Every float of a config section (a float field, or a float inside a tuple field) must
    be finite: a NaN passes every ``<`` / ``>`` range check and inf breaks the first update,
    so this runs before the range checks. Generic over the fields, so keys added to a
    section later are covered too."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        items = value if isinstance(value, (list, tuple)) else (value,)
        for x in items:
            if isinstance(x, float) and not math.isfinite(x):
                raise ConfigError(f"{where}{f.name}={value!r} must be a finite number")


def _require_nvme_path(where: str, path: Optional[str]) -> None:
    if not path:
        raise ConfigError(f"{where} is required when device is 'nvme': set it to a directory on a fast local disk")


def check_nvme_path(where: str, path: Optional[str]) -> None:
    """The path must exist, be a directory and accept a new file (root bypasses mode bits,
    so this really creates one; a read-only mount fails here). Touches the disk: called by
    ``Config.check_paths`` (at ``initialize`` and by the command line), never while a
    Config is built."""
    _require_nvme_path(where, path)
    if not os.path.isdir(path):
        raise ConfigError(f"{where}={path!r} does not exist or is not a directory: create it or point to an existing one")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".offload-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{where}={path!r} is not writable ({exc.strerror}): choose a writable directory") from None


# The hyper-parameter fields of OptimizerConfig: the union of every update rule's (torch's
# names). A field left None takes the rule's default (offload/optim/<rule>.py ``defaults``).
OPTIMIZER_HPARAMS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "lr_decay",
                     "initial_accumulator_value", "beta2_decay", "d", "clip_threshold", "decay_rate", "beta1",
                     "scale_parameter", "relative_step", "warmup_init")
OPTIMIZER_TYPES = ("AdamW", "Adam", "Lion", "SGD", "Adagrad", "Adafactor", "TransformersAdafactor")
_FACTORED = ("Adafactor", "TransformersAdafactor")     # eps is a pair; the factored rows stay fp32


@dataclass(frozen=True)
class OptimizerConfig:
    """The update rule (``type``), its hyper-parameters with torch's names, and the dtype
    of its state rows (``state_dtype``: fp32 | bf16 | int8; the fp32 master stays fp32).

    A hyper-parameter left unset takes the rule's default (torch's: AdamW ``lr`` 1e-3,
    ``betas`` (0.9, 0.999), ``eps`` 1e-8, ``weight_decay`` 1e-2; SGD ``momentum`` 0, ...);
    after construction every hyper-parameter of the rule has a value and the others are
    None. A key the rule does not take (``momentum`` for AdamW) is an error naming the rule
    that takes it. Values are checked by the rule (``UpdateRule.validate``)."""
    type: str = "AdamW"
    lr: Optional[float] = None
    betas: Optional[Tuple[float, float]] = None
    eps: Any = None                    # a number; Adafactor: the pair (eps1 or None, eps2)
    weight_decay: Optional[float] = None
    momentum: Optional[float] = None   # SGD
    dampening: Optional[float] = None  # SGD
    nesterov: Optional[bool] = None    # SGD
    lr_decay: Optional[float] = None   # Adagrad
    initial_accumulator_value: Optional[float] = None   # Adagrad
    beta2_decay: Optional[float] = None  # Adafactor
    d: Optional[float] = None          # Adafactor (clipping threshold)
    clip_threshold: Optional[float] = None   # TransformersAdafactor (transformers' Adafactor)
    decay_rate: Optional[float] = None       # TransformersAdafactor
    beta1: Optional[float] = None            # TransformersAdafactor (None: no first moment)
    scale_parameter: Optional[bool] = None   # TransformersAdafactor
    relative_step: Optional[bool] = None     # TransformersAdafactor (with lr None: its own step size)
    warmup_init: Optional[bool] = None       # TransformersAdafactor
    state_dtype: str = "fp32"

    def __post_init__(self):
        from offload.optim import get_rule
        _check_finite(self, "optimizer.")
        _check_choice("optimizer.type", self.type, OPTIMIZER_TYPES)
        _check_choice("optimizer.state_dtype", self.state_dtype, STATE_DTYPES)
        rule = get_rule(self.type)
        for key in OPTIMIZER_HPARAMS:
            value = getattr(self, key)
            if key not in rule.defaults:
                if value is not None:
                    takes = [t for t in OPTIMIZER_TYPES if key in get_rule(t).defaults]
                    raise ConfigError(f"optimizer.{key}={value!r} is not a hyper-parameter of {self.type}: remove "
                                      f"it" + (f", or use optimizer.type {' / '.join(takes)}" if takes else ""))
                continue
            if value is None:
                object.__setattr__(self, key, rule.defaults[key])
        _check_positive("optimizer.lr", self.lr, allow_zero=True)
        if self.weight_decay is not None:
            _check_positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)
        if self.betas is not None:
            if (not isinstance(self.betas, (list, tuple)) or len(self.betas) != 2
                    or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in self.betas)):
                raise ConfigError(f"optimizer.betas={self.betas!r} must be two numbers in [0, 1)")
            object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.type in _FACTORED:
            if not isinstance(self.eps, (list, tuple)) or len(self.eps) != 2:
                raise ConfigError(f"optimizer.eps={self.eps!r}: {self.type}'s eps is a pair (eps1 or null, eps2), "
                                  f"e.g. [null, 0.001]")
            object.__setattr__(self, "eps", tuple(self.eps))
            if self.state_dtype != "fp32":
                raise ConfigError(f"optimizer.state_dtype={self.state_dtype!r}: {self.type} keeps its factored "
                                  f"second moment in fp32 (a few bytes per row and column): use state_dtype fp32")
        elif self.eps is not None:
            _check_positive("optimizer.eps", self.eps)
        try:
            rule.validate(self.hparams())
        except (ValueError, TypeError) as exc:
            msg = str(exc)
            raise ConfigError("optimizer." + msg.split(": ", 1)[1] if msg.startswith(self.type + ": ") else
                              f"optimizer: {msg}") from None

    def hparams(self) -> dict:
        """The rule's hyper-parameters (torch's names) as a param group holds them."""
        from offload.optim import get_rule
        return {k: getattr(self, k) for k in get_rule(self.type).defaults}


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """Where the fp32 master weights and Adam moments live."""
    device: str = "cpu"
    nvme_path: Optional[str] = None
    pin_memory: bool = True
    # Blocks whose state is read ahead of the CPU step (nvme only): bounds the pinned pool.
    buffer_count: int = 4
    # Host bytes for gradient buffers (pool offload-grads). None: with nvme, buffer_count
    # buffers (at least workers + 2) and gradients that wait (clipping, fp16, accumulation)
    # go to NVMe; with cpu, every block's gradients stay in host memory. A number: the
    # gradients stay in host memory if they fit, else a pool of this size and NVMe.
    grad_host_bytes: Optional[int] = None
    # nvme: a block shard whose optimizer state is larger is read, stepped and written in
    # chunks of at most this many bytes, so each of the buffer_count swap buffers holds a
    # chunk, not the largest block (an embedding). None: whole blocks.
    state_chunk_bytes: Optional[int] = 256 << 20
    # cpu: compute each block's update while backward goes on, as soon as the block's
    # gradients are in, into a second state buffer and a staged parameter copy; step()
    # commits them (swaps the buffers, writes the parameters back), so the next forward waits
    # for write-backs, not for the optimizer. Backward still changes nothing a checkpoint
    # records. Costs a second copy of the optimizer state and one of the trainable
    # parameters in host memory (pool offload-host). Needs one rank, no clipping, no fp16
    # loss scaling and every gradient in host memory: each of those waits for the whole
    # backward before any update.
    update_ahead: bool = False

    @property
    def placement(self) -> Placement:
        """``device`` as a Placement (offload/placement.py): what everything below the config uses."""
        return Placement.from_config(self.device)

    def __post_init__(self):
        _check_finite(self, "offload_optimizer.")
        _check_choice("offload_optimizer.device", self.device, TIER_DEVICES)
        _check_positive("offload_optimizer.buffer_count", self.buffer_count)
        _check_positive("offload_optimizer.grad_host_bytes", self.grad_host_bytes)
        _check_positive("offload_optimizer.state_chunk_bytes", self.state_chunk_bytes)
        if not isinstance(self.update_ahead, bool):
            raise ConfigError(f"offload_optimizer.update_ahead={self.update_ahead!r} must be true or false")
        if self.device == "nvme":
            _require_nvme_path("offload_optimizer.nvme_path", self.nvme_path)


@dataclass(frozen=True)
class OffloadParamConfig:
    """Where the parameters live between uses (ZeRO-3 style parameter offload)."""
    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = True
    # Peak bytes of offloaded parameters allowed on the device at once; None: two largest blocks.
    device_budget_bytes: Optional[int] = None
    # With device nvme and weights= safetensors: frozen parameters stored in their kept dtype
    # are read in place from the checkpoint's own files (verified, never written) instead of
    # being copied to the swap file; false copies them.
    frozen_in_place: bool = True
    # How frozen parameters are stored in their home: "compute" (the kept dtype), or quantized
    # ("int8" per row, "nf4" blocks of 64 as QLoRA) and dequantized into the compute dtype when
    # their block visits the device (offload/params/quantized.py). Only 2-D frozen tensors and
    # 3-D ones (a MoE's fused experts, quantized per expert) of at least frozen_quant_min_numel
    # elements are quantized: norms, biases, small tensors and every trainable parameter stay in
    # the compute dtype.
    frozen_dtype: str = "compute"
    frozen_double_quant: bool = False   # nf4: the block scales themselves 8-bit (QLoRA's double quant)
    frozen_quant_min_numel: int = 1 << 16

    @property
    def placement(self) -> Placement:
        """``device`` as a Placement (offload/placement.py): what everything below the config uses."""
        return Placement.from_config(self.device)

    def __post_init__(self):
        _check_finite(self, "offload_param.")
        _check_choice("offload_param.device", self.device, TIER_DEVICES)
        _check_positive("offload_param.device_budget_bytes", self.device_budget_bytes)
        _check_choice("offload_param.frozen_dtype", self.frozen_dtype, FROZEN_DTYPES)
        if not isinstance(self.frozen_double_quant, bool):
            raise ConfigError(f"offload_param.frozen_double_quant={self.frozen_double_quant!r} must be true or false")
        if self.frozen_double_quant and self.frozen_dtype != "nf4":
            raise ConfigError(f"offload_param.frozen_double_quant quantizes nf4's block scales: set "
                              f"offload_param.frozen_dtype to 'nf4' (it is {self.frozen_dtype!r}) or drop it")
        if isinstance(self.frozen_quant_min_numel, bool) or not isinstance(self.frozen_quant_min_numel, int) \
                or self.frozen_quant_min_numel < 0:
            raise ConfigError(f"offload_param.frozen_quant_min_numel={self.frozen_quant_min_numel!r} must be an "
                              f"integer >= 0 (elements below which a frozen tensor stays in the compute dtype)")
        if self.frozen_dtype != "compute" and self.device == "none":
            raise ConfigError(f"offload_param.frozen_dtype={self.frozen_dtype!r} stores frozen parameters quantized "
                              f"in their offload home: set offload_param.device to 'cpu' or 'nvme'")
        if self.device == "nvme":
            _require_nvme_path("offload_param.nvme_path", self.nvme_path)


@dataclass(frozen=True)
class OffloadActivationsConfig:
    """Where tensors saved for backward wait between their forward and their backward use.

    ``none`` keeps them on the device; ``cpu`` copies each saved tensor of at least
    ``min_bytes`` to host memory during forward (a side stream on CUDA) and brings it back
    ahead of its use in backward; ``nvme`` moves it on to a swap file under ``nvme_path``.
    ``lookahead_bytes`` bounds the bytes brought back ahead of use and the bytes in flight to
    NVMe. Parameters (and views of them) are never copied; a tensor saved twice moves once.

    ``host_bytes`` is the host pool the host copies draw on (``offload-activations``, counted
    with every other host pool): with ``nvme`` a copy lives there only until its write is
    durable (and, on CUDA, around its read and copy back), and a full pool waits for the
    oldest write; with ``cpu`` every copy of a forward stays there until its backward, and a
    forward whose copies do not fit is an error naming this key. None: ``nvme`` takes twice
    ``lookahead_bytes``, ``cpu`` half the host memory available at initialize."""
    device: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = True
    min_bytes: int = 1 << 20
    lookahead_bytes: int = 256 << 20
    host_bytes: Optional[int] = None

    @property
    def placement(self) -> Placement:
        """``device`` as a Placement (offload/placement.py): what everything below the config uses."""
        return Placement.from_config(self.device)

    def __post_init__(self):
        _check_finite(self, "offload_activations.")
        _check_choice("offload_activations.device", self.device, TIER_DEVICES)
        _check_positive("offload_activations.min_bytes", self.min_bytes, allow_zero=True)
        _check_positive("offload_activations.lookahead_bytes", self.lookahead_bytes, allow_zero=True)
        _check_positive("offload_activations.host_bytes", self.host_bytes)
        if self.host_bytes is not None:
            object.__setattr__(self, "host_bytes", int(self.host_bytes))
        if self.host_bytes is not None and self.host_bytes < 4096:
            raise ConfigError(f"offload_activations.host_bytes={self.host_bytes} holds no 4096-byte page: give at "
                              "least the largest saved tensor's bytes, or leave it unset")
        if self.device == "nvme":
            _require_nvme_path("offload_activations.nvme_path", self.nvme_path)


@dataclass(frozen=True)
class PrefetchConfig:
    """Bytes kept in flight ahead of use on each link; None derives them from the budgets."""
    enabled: bool = True
    device_lookahead_bytes: Optional[int] = None
    host_lookahead_bytes: Optional[int] = None

    def __post_init__(self):
        _check_finite(self, "prefetch.")
        _check_positive("prefetch.device_lookahead_bytes", self.device_lookahead_bytes, allow_zero=True)
        _check_positive("prefetch.host_lookahead_bytes", self.host_lookahead_bytes, allow_zero=True)


@dataclass(frozen=True)
class AioConfig:
    """The NVMe I/O engine (names follow DeepSpeed's `aio` section where they overlap)."""
    backend: str = "native"
    # large extents, many in flight: smaller requests, fewer in flight, fell well short of the
    # disk's raw rate (benchmarks/bench_io.py)
    block_size: int = 4 << 20
    queue_depth: int = 64
    thread_count: int = 4
    checksum: bool = True

    def __post_init__(self):
        _check_finite(self, "aio.")
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
        _check_finite(self, "loss_scaler.")
        _check_positive("loss_scaler.initial_scale", self.initial_scale)
        _check_positive("loss_scaler.growth_interval", self.growth_interval)
        _check_positive("loss_scaler.min_scale", self.min_scale)
        if not self.growth_factor > 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ConfigError("loss_scaler: growth_factor must be > 1 and backoff_factor in (0, 1)")
        if self.min_scale > self.initial_scale:
            raise ConfigError(f"loss_scaler.min_scale={self.min_scale!r} is above loss_scaler.initial_scale="
                              f"{self.initial_scale!r}: lower min_scale or raise initial_scale")


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO stage across data-parallel ranks (0 = plain data parallel)."""
    stage: int = 0
    # Seconds a collective may wait for the other ranks before failing with a clear error.
    timeout_s: float = 300.0

    def __post_init__(self):
        _check_finite(self, "zero_optimization.")
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
    offload_activations: OffloadActivationsConfig = field(default_factory=OffloadActivationsConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    # Module names (as in model.named_modules()) that each become one block; None: automatic.
    blocks: Optional[Tuple[str, ...]] = None
    # Optimizer worker threads (the native kernel has its own pool inside each call).
    optimizer_workers: int = 1
    # step() returns at once and the next forward trails the updates (False: step() waits for them).
    overlap_step: bool = True
    # Seconds any single internal wait (a host buffer, an NVMe read or write, an update in
    # flight) may take before it fails with an error naming the block and the stage.
    wait_timeout_s: float = 600.0

    def __post_init__(self):
        _check_finite(self, "")
        _check_choice("precision", self.precision, PRECISIONS)
        if not isinstance(self.gradient_accumulation_steps, int) or self.gradient_accumulation_steps < 1:
            raise ConfigError(f"gradient_accumulation_steps={self.gradient_accumulation_steps!r} must be an integer >= 1")
        _check_positive("gradient_clipping", self.gradient_clipping, allow_zero=True)
        _check_positive("optimizer_workers", self.optimizer_workers)
        _check_positive("wait_timeout_s", self.wait_timeout_s)
        if self.offload_optimizer.update_ahead:
            _check_update_ahead(self)
        if self.blocks is not None:
            object.__setattr__(self, "blocks", tuple(self.blocks))

    # ---- constructors -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Config":
        """From the engine's own dict layout; a DeepSpeed-style dict is detected and translated."""
        if deepspeed.is_deepspeed_config(d):
            return from_deepspeed(d)
        return _build(cls, d, "")

    @classmethod
    def from_json(cls, path: str) -> "Config":
        return cls.from_dict(read_json(path, "config file"))

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

    def check_paths(self) -> None:
        """Check the directories this config names (exist, are directories, accept a new
        file). Touches the disk, so construction never calls it: ``initialize`` does, and
        the command line before it starts anything."""
        for tier in ("offload_optimizer", "offload_param", "offload_activations"):
            sec = getattr(self, tier)
            if sec.device == "nvme":
                check_nvme_path(f"{tier}.nvme_path", sec.nvme_path)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


def _check_update_ahead(cfg: "Config") -> None:
    """``offload_optimizer.update_ahead`` steps each block as its gradients come in: refused
    where the update needs something only the whole backward gives."""
    why = []
    if cfg.offload_optimizer.device != "cpu":
        why.append(f"offload_optimizer.device={cfg.offload_optimizer.device!r} (it needs 'cpu': the second "
                   "state buffer lives in host memory)")
    if cfg.gradient_clipping > 0:
        why.append(f"gradient_clipping={cfg.gradient_clipping} (the clip needs the global norm, known only "
                   "after the whole backward)")
    if cfg.precision == "fp16":
        why.append("precision='fp16' (the loss scale's overflow check needs every gradient)")
    if why:
        raise ConfigError("offload_optimizer.update_ahead=True cannot be used with " + "; ".join(why)
                          + ": set update_ahead to false, or change those keys")


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


def from_deepspeed(ds: Mapping[str, Any]) -> Config:
    """A Config from a DeepSpeed-style config dict (config/deepspeed.py translates it)."""
    return _build(Config, deepspeed.translate_deepspeed(ds), "")


def build_config(d: Mapping[str, Any]) -> Config:
    """Validate a dict already in this engine's layout (as ``flags.flags_to_dict`` returns
    it), without DeepSpeed detection."""
    return _build(Config, d, "")


def from_flags(argv) -> Config:
    """A Config from command-line flags, e.g. ``["--offload-optimizer", "nvme", "--nvme-path", d]``."""
    return build_config(flags.parse_flags(argv))
