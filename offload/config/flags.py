"""Command-line flags and sizes: ``--offload-optimizer nvme``, ``--set KEY=VALUE``, ``"24GiB"``."""
from __future__ import annotations

import difflib
import json
from typing import Any, Mapping

from offload.config.deepspeed import is_deepspeed_config, translate_deepspeed
from offload.config.errors import ConfigError, read_json


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
    ("--optimizer", "optimizer.type", str,
     "AdamW | Adam | Lion | SGD | Adagrad | Adafactor | TransformersAdafactor"),
    ("--state-dtype", "optimizer.state_dtype", str, "fp32 | bf16 | int8: the optimizer's state rows (master stays fp32)"),
    ("--momentum", "optimizer.momentum", float, "SGD momentum"),
    ("--lr", "optimizer.lr", float, "learning rate"),
    ("--weight-decay", "optimizer.weight_decay", float, "weight decay (as the rule's torch optimizer applies it)"),
    ("--betas", "optimizer.betas", "pair", "Adam / Lion betas, e.g. 0.9,0.95"),
    ("--eps", "optimizer.eps", float, "Adam / Adagrad epsilon"),
    ("--gradient-accumulation-steps", "gradient_accumulation_steps", int, "micro-steps per step"),
    ("--gradient-clipping", "gradient_clipping", float, "max global grad norm (0: off)"),
    ("--offload-optimizer", "offload_optimizer.device", str, "none | cpu | nvme: where Adam state lives"),
    ("--offload-param", "offload_param.device", str, "none | cpu | nvme: where parameters live"),
    ("--offload-activations", "offload_activations.device", str,
     "none | cpu | nvme: where tensors saved for backward wait"),
    ("--nvme-path", "*.nvme_path", str, "directory for the NVMe swap files (every tier)"),
    ("--buffer-count", "offload_optimizer.buffer_count", int, "optimizer blocks read ahead (nvme)"),
    ("--state-chunk-bytes", "offload_optimizer.state_chunk_bytes", "bytes",
     "optimizer state of larger blocks moves in chunks of this size (nvme)"),
    ("--device-budget", "offload_param.device_budget_bytes", "bytes", "peak offloaded param bytes on device"),
    ("--frozen-dtype", "offload_param.frozen_dtype", str,
     "compute | int8 | nf4: frozen parameters stored quantized in their home (dequantized on use)"),
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
    ("--update-ahead", "offload_optimizer.update_ahead", True),
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
        raw = read_json(path, "--config", ": give a JSON config file")
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
        return [f"offload_optimizer.{key[2:]}", f"offload_param.{key[2:]}", f"offload_activations.{key[2:]}"]
    return [key]


def _plain(m: Mapping) -> dict:
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in m.items()}


def parse_flags(argv) -> dict:
    """The engine-layout dict of command-line flags (``Config.from_flags`` validates it)."""
    import argparse

    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ConfigError(message)

    parser = _Parser(prog="offload", add_help=False)
    add_config_arguments(parser)
    ns, extra = parser.parse_known_args(list(argv))
    if extra:
        raise ConfigError(unknown_flag_message(parser, extra[0]))
    return flags_to_dict(ns)


def unknown_flag_message(parser, arg: str) -> str:
    """'unknown flag --offload-optimzer: did you mean --offload-optimizer?'"""
    flag = arg.split("=", 1)[0]
    options = [o for a in parser._actions for o in a.option_strings]
    near = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
    if not flag.startswith("-"):
        return f"unexpected argument {arg!r}"
    return f"unknown flag {flag}: " + (f"did you mean {near[0]}?" if near else "see --help")
