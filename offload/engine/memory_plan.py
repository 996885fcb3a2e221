"""The memory plan: shards, pools and bytes per tier, from the blocks' sizes and the config.

Pure: no I/O, no allocation, no torch tensors. The engine sizes every pool it allocates from
``plan()``; ``offload estimate`` and ``offload plan`` call the same function on block sizes
derived from a model description, so the numbers they print are the engine's own.

What each host pool holds (names as in ``stats()`` and ``offload estimate``):

  offload-host         gradient buffers of every block (when they all stay in host memory)
                       and, with ``offload_optimizer.device: cpu``, the optimizer state
  offload-grads        gradient buffers lent per block while it collects gradients and
                       while its update reads them: ``offload_optimizer.grad_host_bytes``
                       (or max(buffer_count, workers + 2) buffers). Between uses (the window
                       stays open until step() commits it) a block's sum is parked on the
                       NVMe tier, ``b<i>.grad``, and comes back for the next landing or the
                       update
  offload-swap         optimizer state read ahead / written behind for NVMe (buffer_count)
  offload-param-home   parameter homes, trainable and frozen parts (offload_param.device: cpu)
  offload-param-stage  NVMe parameter parts staged for the device (offload_param.device: nvme):
                       the blocks that fit the device budget plus the host lookahead, plus one
  offload-param-write  one block's trainable part per optimizer worker, written back to NVMe

The optimizer state's size per parameter comes from ``state_bytes_per_param`` alone.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
import math
from typing import Dict, Optional, Sequence, Tuple

from offload.dist import sharding

PAGE = 4096
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _page(n: int) -> int:
    return -(-n // PAGE) * PAGE


def state_bytes_per_param(config, rule: Optional[str] = None, state_dtype: Optional[str] = None) -> float:
    """Bytes of optimizer state per trainable parameter on its tier: the fp32 master and the
    update rule's rows (AdamW / Adam: exp_avg and exp_avg_sq, fp32: 12). The one place the
    rule's footprint enters any byte count; ``rule`` / ``state_dtype`` ask another rule
    (offload/optim) for its own (the engine itself runs AdamW / Adam with fp32 state)."""
    if rule is None and state_dtype is None:
        return 12
    from offload.optim import get_rule
    return get_rule(rule or "AdamW").bytes_per_param("host", state_dtype or "fp32")


def grad_bytes_per_param(config) -> int:
    """Host gradient element size: the compute dtype crosses as is without accumulation in
    bf16, else gradients are summed in fp32 (as Engine._grad_dtype)."""
    if config.gradient_accumulation_steps == 1 and config.precision == "bf16":
        return 2
    return 4


class GradHome(enum.Enum):
    DEVICE = "device"        # offload_optimizer none: grads next to the state, on the device
    HOST = "host"            # every block's buffer in host memory (offload-host)
    SPILL = "spill"          # lent from offload-grads; parked on NVMe between uses


@dataclass(frozen=True)
class BlockSize:
    """One block as the plan sees it."""
    name: str
    numel: int                          # trainable parameters, unpadded (0: frozen only)
    frozen: Tuple[int, ...] = ()        # bytes of each frozen part as stored (padded)
    in_place: Tuple[bool, ...] = ()     # per frozen part: read in place from the checkpoint (no swap bytes)


@dataclass(frozen=True)
class Pool:
    name: str
    slots: Tuple[int, ...]              # bytes of each slot as asked (page rounding in nbytes)
    holds: str

    @property
    def nbytes(self) -> int:
        return sum(_page(s) for s in self.slots)


@dataclass(frozen=True)
class BlockPlan:
    shard: Tuple[int, int]              # this rank's [start, end) of the padded flat
    padded_numel: int
    grad_numel: int                     # the persistent gradient buffer (shard from stage 2)
    state_bytes: int                    # this rank's optimizer state
    param_bytes: int                    # trainable part on the device (compute dtype, full flat)
    home_bytes: int                     # trainable part at home (the shard with ZeRO-3)
    frozen: Tuple[int, ...]             # frozen parts, device bytes = home bytes

    @property
    def device_bytes(self) -> int:
        """Bytes of the whole block on the device when fetched (parameter offload)."""
        return (self.param_bytes if self.padded_numel else 0) + sum(self.frozen)


@dataclass(frozen=True)
class MemoryPlan:
    blocks: Tuple[BlockPlan, ...]
    pools: Tuple[Pool, ...]
    grad_home: GradHome
    grad_bytes: int                     # element size of host gradient buffers
    nvme: Dict[str, int]                # bytes reserved per store: optimizer, params, grads
    device: int                         # device bytes of model states (budget for parameters)
    param_budget: Optional[int]         # offload_param.device_budget_bytes in force

    def pool(self, name: str) -> Optional[Pool]:
        return next((p for p in self.pools if p.name == name), None)

    @property
    def host(self) -> int:
        return sum(p.nbytes for p in self.pools)

    @property
    def nvme_total(self) -> int:
        return sum(self.nvme.values())


def param_home_device(config) -> str:
    """ZeRO-3 keeps parameters as shards even without offload_param: at home on the host."""
    d = config.offload_param.device
    return "cpu" if d == "none" and config.zero_optimization.stage == 3 else d


def grad_home(config, grad_total: int, grad_largest: int) -> GradHome:
    """Where gradient buffers live; see the module docstring."""
    oc = config.offload_optimizer
    if oc.device == "none":
        return GradHome.DEVICE
    # step() commits the window: every block's gradients wait for it (and for the global
    # norm), so they either all stay in host memory or are parked on NVMe
    limit = getattr(oc, "grad_host_bytes", None)
    if limit is None:
        return GradHome.SPILL if oc.device == "nvme" else GradHome.HOST
    return GradHome.HOST if grad_total <= limit else GradHome.SPILL


def grad_pool_slots(config, n_blocks: int, grad_largest: int) -> int:
    """Buffers in offload-grads: the host budget's worth, else buffer_count + workers + 1."""
    oc = config.offload_optimizer
    floor = config.optimizer_workers + 2
    limit = getattr(oc, "grad_host_bytes", None)
    n = limit // max(grad_largest, 1) if limit is not None else max(oc.buffer_count, config.optimizer_workers + 2)
    return max(1, min(max(n, floor), n_blocks))


def plan(blocks: Sequence[BlockSize], config, world_size: int = 1, rank: int = 0,
         compute_bytes: Optional[int] = None, working_set: int = 0, *, rule: Optional[str] = None,
         state_dtype: Optional[str] = None) -> MemoryPlan:
    """The memory plan of ``blocks`` under ``config`` for one rank. Trained blocks come first
    (in block order), frozen-only blocks (numel 0) after them. ``working_set``: device bytes
    one forward needs at once (the default parameter budget: the larger of it and two
    largest blocks)."""
    stage = config.zero_optimization.stage
    p = compute_bytes or DTYPE_BYTES[config.precision]
    gb = grad_bytes_per_param(config)
    sbp = state_bytes_per_param(config, rule, state_dtype)
    bps = []
    for b in blocks:
        if b.numel:
            padded = sharding.padded_numel(b.numel, world_size)
            s0, s1 = (0, padded) if stage == 0 else sharding.shard_range(b.numel, world_size, rank)
        else:
            padded, s0, s1 = 0, 0, 0
        gn = (s1 - s0) if stage >= 2 else padded
        home = (s1 - s0) if stage == 3 else padded
        bps.append(BlockPlan((s0, s1), padded, gn, math.ceil(sbp * (s1 - s0)), padded * p, home * p, tuple(b.frozen)))
    trained = [b for b in bps if b.padded_numel]
    oc, pc = config.offload_optimizer, config.offload_param
    grad_sizes = [b.grad_numel * gb for b in trained]
    gh = grad_home(config, sum(grad_sizes), max(grad_sizes, default=0))
    if gh is GradHome.SPILL and (world_size > 1 or stage >= 2):
        gh = GradHome.HOST           # parking is single-rank, stages 0-1 (no collective on a parked sum)
    pools, nvme = [], {}
    host_slots = []
    if gh is GradHome.SPILL:
        n = grad_pool_slots(config, len(trained), max(grad_sizes))
        pools.append(Pool("offload-grads", (max(grad_sizes),) * n, "gradient buffers lent per block"))
        nvme["grads"] = sum(_page(n) for n in grad_sizes)
    elif gh is GradHome.HOST:
        host_slots += grad_sizes
    if oc.device == "cpu":
        host_slots += [b.state_bytes for b in trained]
    if host_slots:
        pools.append(Pool("offload-host", tuple(host_slots), "gradients of every block; cpu optimizer state"))
    swap_slots = max(oc.buffer_count, config.optimizer_workers + 1)
    if oc.device == "nvme":
        nvme["optimizer"] = sum(_page(b.state_bytes) for b in trained)
        pools.append(Pool("offload-swap", (max(b.state_bytes for b in trained),) * swap_slots,
                          "optimizer state read ahead / written behind"))
    device = 0
    if oc.device == "none":
        device += sum(b.state_bytes + b.grad_numel * 4 for b in trained)
    budget = None
    home = param_home_device(config)
    if home == "none":
        device += sum(b.param_bytes for b in trained)
    else:
        sizes = [b.device_bytes for b in bps]
        largest = max(sizes)
        budget = pc.device_budget_bytes or max(2 * largest, working_set)
        device += budget
        homes = [([b.home_bytes] if b.padded_numel else []) + list(b.frozen) for b in bps]
        if home == "cpu":
            pools.append(Pool("offload-param-home", tuple(h for hs in homes for h in hs),
                              "parameter homes (trainable and frozen parts)"))
        else:
            # frozen parts read in place live in the checkpoint's files, not in the swap file
            swapped = [([b.home_bytes] if b.padded_numel else [])
                       + [f for f, ip in zip(b.frozen, s.in_place or (False,) * len(b.frozen)) if not ip]
                       for b, s in zip(bps, blocks)]
            nvme["params"] = sum(_page(h) for hs in swapped for h in hs)
            pf = config.prefetch
            host_lookahead = pf.host_lookahead_bytes if pf.host_lookahead_bytes is not None else 2 * budget
            slots, total = [], 0
            for n, hs in sorted(zip(sizes, homes), key=lambda t: t[0], reverse=True):
                if total >= budget + host_lookahead + largest:
                    break
                slots += hs
                total += n
            spare = max(zip(sizes, homes), key=lambda t: t[0])[1]
            pools.append(Pool("offload-param-stage", tuple(slots + spare), "NVMe parameter parts staged for the device"))
            pools.append(Pool("offload-param-write", (max(b.home_bytes for b in trained),) * config.optimizer_workers,
                              "trainable parts written back to NVMe"))
    return MemoryPlan(tuple(bps), tuple(pools), gh, gb, nvme, device, budget)


def host_lookahead(config, budget: int) -> int:
    pf = config.prefetch
    return pf.host_lookahead_bytes if pf.host_lookahead_bytes is not None else 2 * budget


def device_lookahead(config, budget: int, largest: int) -> int:
    pf = config.prefetch
    return pf.device_lookahead_bytes if pf.device_lookahead_bytes is not None else budget - largest
