"""What ``Engine.stats()`` reports: the telemetry snapshot (spans, counters, bytes moved per
link, peaks) with the engine's counters and where its bytes are.

``tier_bytes``: model-state bytes on the device, in host pools and reserved on NVMe (every
store, activations included); ``host_pools``: capacity and peak per memory-plan pool;
``partitioned_bytes``: this rank's share of what ZeRO partitions; ``bytes`` / ``gbps``
``nvme_read`` / ``nvme_write``: from the stores themselves, bytes that reached the disk over
the time requests were in flight (the engine's own spans only see the waits).
"""
from __future__ import annotations

import torch

from offload.engine import build
from offload.placement import Placement


def engine_stats(snap: dict, *, blocks, master_params, tier, param_offload, activations, resources, scaler, comm,
                 stage: int, module, counters: tuple, grad_dtype: torch.dtype, dtype: torch.dtype,
                 codecs=None, frozen_dtype: str = "compute") -> dict:
    """``snap`` (a telemetry snapshot) completed with the engine's figures; ``counters``:
    (global_step, micro_step); ``master_params``: the blocks whose parameters are
    views of the fp32 master (host pool bytes, not counted on the device twice)."""
    resident = sum(b.param_flat.numel() * b.param_flat.element_size() for b in blocks if b.param_flat is not None)
    po = param_offload
    views = sum(b.param_flat.numel() * b.param_flat.element_size() for b in master_params)
    dev_bytes = resident - views + (po.prefetcher.device_bytes() if po is not None else 0)
    if tier is Placement.DEVICE:
        dev_bytes += sum(b.state.nbytes + b.grads.tensor.numel() * b.grads.tensor.element_size() for b in blocks)
    res = resources.stats()
    if "source_bytes" in res:         # frozen parts read in place: the checkpoint's bytes
        snap["source_bytes"] = res["source_bytes"]
    snap.update({
        "step": counters[0], "micro_step": counters[1],
        "tier_bytes": {"device": dev_bytes, "host": res["host"], "nvme": res["nvme"]},
        "loss_scale": scaler.scale if scaler.enabled else None,
        "skipped_steps": scaler.skipped,
        "device_param_bytes_peak": (po.device_param_bytes_peak() if po is not None
                                    else resident + sum(p.numel() * p.element_size()
                                                        for p in module.parameters() if not p.requires_grad)),
        "prefetch": {k: snap["counters"].get(f"prefetch_{k}", 0) for k in ("hits", "misses", "divergences",
                                                                               "retraces")},
        "param_budget_overruns": po.overruns if po is not None else 0,
        "world_size": comm.world, "rank": comm.rank, "zero_stage": stage,
        "partitioned_bytes": partitioned_bytes(blocks, stage, comm, grad_dtype, dtype),
        "comm_bytes": {k: comm.bytes.get(k, 0) for k in ("allreduce", "reduce_scatter", "allgather")},
    })
    snap["peaks"]["host_pool"] = res["host_peak"]
    if codecs:                       # frozen parts stored quantized: bytes and errors
        from offload.params import quantized
        snap["frozen_quant"] = quantized.stats(list(codecs.values()), frozen_dtype)
    # on a CPU-only machine untouched slots are not resident: the peaks are what offload
    # plan's RSS terms compare with
    snap["host_pools"] = res["host_pools"]
    if activations is not None:
        snap["activations"] = activations.stats()
    for d, (n, sec) in res["links"].items():
        if n:
            snap["bytes"][f"nvme_{d}"] = n
            snap["gbps"][f"nvme_{d}"] = n / sec / 1e9 if sec > 0 else 0.0
    return snap


def partitioned_bytes(blocks, stage: int, comm, grad_dtype: torch.dtype, dtype: torch.dtype) -> dict:
    """This rank's resident bytes of each kind ZeRO partitions: 1/world_size of the
    single-rank figure (plus padding) for the kinds the stage partitions."""
    esize = dtype.itemsize
    params = sum((b.trainable.home_numel if b.trainable is not None else b.param_flat.numel()) * esize for b in blocks)
    return {"optimizer_state": sum(b.state.nbytes for b in blocks),
            "gradients": sum(build.grad_numel(b.layout, stage, comm) * grad_dtype.itemsize for b in blocks),
            "parameters": params}
