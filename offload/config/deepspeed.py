"""DeepSpeed configs: detected by their markers, translated into this engine's layout.

Keys DeepSpeed knows but this engine does not use are named in one warning; a key close to a
known one is a misspelling and fails with the nearest key."""
from __future__ import annotations

import difflib
import warnings
from typing import Any, Mapping

from offload.config.errors import ConfigError


# ----------------------------------------------------------------
_DS_MARKERS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "bf16", "fp16")
# Top-level keys of this engine's own layout that DeepSpeed does not have: their presence
# means "native", even next to `zero_optimization` (which both layouts share).
_NATIVE_ONLY = ("precision", "offload_optimizer", "offload_param", "offload_activations", "prefetch", "loss_scaler",
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
    "activation_checkpointing.": ("partition_activations", "contiguous_memory_optimization",
                                  "number_checkpoints", "synchronize_checkpoint_boundary", "profile",
                                  "cpu_checkpointing"),
    "aio.": ("block_size", "queue_depth", "thread_count", "single_submit", "overlap_events",
             "intra_op_parallelism", "use_gds"),
    "fp16.": ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
              "hysteresis", "consecutive_hysteresis", "min_loss_scale"),
    "bf16.": ("enabled", "immediate_grad_update", "check_grad_overflow"),
    "optimizer.": ("type", "params"),
    "optimizer.params.": ("lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode",
                          "bias_correction", "amsgrad", "fused", "momentum", "dampening", "nesterov",
                          "lr_decay", "initial_accumulator_value", "beta2_decay", "d", "maximize", "foreach"),
}


def is_deepspeed_config(d: Mapping[str, Any]) -> bool:
    if any(k in d for k in _NATIVE_ONLY):
        return False
    if any(k in d for k in _DS_MARKERS):
        return True
    opt = d.get("optimizer")
    return isinstance(opt, Mapping) and "params" in opt


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
            out["optimizer"] = _optimizer(mapping(v, k), mapping(v, k).get("params", {}), take, ignored)
        elif k == "activation_checkpointing":
            # cpu_checkpointing moves the saved activations to host memory; as in DeepSpeed it
            # does not turn checkpointing on (the model does that: torch.utils.checkpoint, or
            # Hugging Face's gradient_checkpointing_enable())
            ac = mapping(v, k)
            if ac.pop("cpu_checkpointing", False) is True:
                out["offload_activations"] = {"device": "cpu"}
            ignored.extend(f"activation_checkpointing.{x}" for x in ac)
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


# DeepSpeed's optimizer type names (case-insensitive; DeepSpeed also takes any torch.optim
# class by name) -> the rule that computes the same update. Types DeepSpeed has and offload
# does not are refused by name.
_DS_TYPES = {"adamw": "AdamW", "adam": "Adam", "cpuadam": "Adam", "fusedadam": "Adam", "deepspeedcpuadam": "Adam",
             "lion": "Lion", "cpulion": "Lion", "fusedlion": "Lion", "deepspeedcpulion": "Lion",
             "adagrad": "Adagrad", "cpuadagrad": "Adagrad", "deepspeedcpuadagrad": "Adagrad",
             "sgd": "SGD", "adafactor": "Adafactor"}
_DS_UNSUPPORTED = ("onebitadam", "zerooneadam", "onebitlamb", "lamb", "fusedlamb", "muadam", "muadamw", "musgd")
# The hyper-parameters each rule takes from DeepSpeed's optimizer.params (torch's names).
_RULE_PARAMS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "lr_decay",
                "initial_accumulator_value", "beta2_decay", "d")


def _optimizer(opt: dict, params, take, ignored: list) -> dict:
    """DeepSpeed's optimizer section as DeepSpeed reads it. ``Adam`` follows ``adam_w_mode``
    (default true: decoupled weight decay, i.e. AdamW; false: L2 added to the gradient), and
    ``AdamW`` is decoupled whatever it says. Options that change the arithmetic and that this
    engine does not implement (``amsgrad: true``, ``bias_correction: false``) fail instead of
    being dropped; implementation choices (``torch_adam``, ``fused``) are named in the warning.
    Lion, Adagrad, SGD and Adafactor (DeepSpeed's CPU / fused names included) map to their
    rules; DeepSpeed types offload does not implement (Lamb, OneBitAdam, ...) fail by name."""
    params = dict(params) if isinstance(params, Mapping) else params
    name = None
    if "type" in opt:
        t = str(opt.pop("type"))
        if t.lower() in _DS_UNSUPPORTED:
            raise ConfigError(f"optimizer.type={t!r} (DeepSpeed) is not supported by offload: use one of AdamW, "
                              f"Adam, Lion, SGD, Adagrad, Adafactor")
        name = _DS_TYPES.get(t.lower(), t)
    adam = name in (None, "Adam", "AdamW")
    mode = params.pop("adam_w_mode", True) if isinstance(params, dict) and adam else True
    for key, unsupported in (("amsgrad", True), ("bias_correction", False)):
        if not adam:
            break
        if isinstance(params, dict) and key in params and bool(params[key]) is unsupported:
            raise ConfigError(f"optimizer.params.{key}={params[key]!r} is not supported by offload's Adam: "
                              f"remove it (offload implements Adam with bias correction, without AMSGrad)")
        if isinstance(params, dict) and key in params:
            params.pop(key)       # the default behaviour, stated explicitly: nothing to warn about
    if isinstance(params, dict) and params.get("maximize") is True:
        raise ConfigError("optimizer.params.maximize=True is not supported by offload: remove it (negate the loss)")
    if isinstance(params, dict) and isinstance(params.get("eps"), list):
        params["eps"] = tuple(params["eps"])    # Adafactor's pair
    o = take(params, {k: k for k in _RULE_PARAMS}, "optimizer.params.")
    opt.pop("params", None)
    if name is not None:
        if name == "Adam" and bool(mode):
            name = "AdamW"        # DeepSpeed's Adam defaults to adam_w_mode=True
        o["type"] = name
    ignored.extend(f"optimizer.{x}" for x in opt)
    return o
