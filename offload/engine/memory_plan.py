"""The memory plan: shards, pools and bytes per tier, from the blocks' sizes and the config.

Pure: no I/O, no allocation, no torch tensors. The engine sizes every pool it allocates from
``plan()``; ``offload estimate`` and ``offload plan`` call the same function on block sizes
derived from a model description, so the numbers they print are the engine's own.

What each host pool holds (names as in ``stats()`` and ``offload estimate``):

  offload-host         gradient buffers of every block (when they all stay in host memory)
                       and, with ``offload_optimizer.device: cpu``, the optimizer state
                       (with ``update_ahead``, twice, and the trainable parameters staged)
  offload-grads        gradient buffers lent per block while it collects gradients and
                       while its update reads them: ``offload_optimizer.grad_host_bytes``
                       (or max(buffer_count, workers + 2) buffers). Between uses (the window
                       stays open until step() commits it) a block's sum is parked on the
                       NVMe tier, ``b<i>.grad`` (a Loan, as the optimizer state), and comes
                       back for the next landing or the update
  offload-swap         optimizer state read ahead / written behind for NVMe (buffer_count)
  offload-param-home   parameter homes, trainable and frozen parts (offload_param.device: cpu)
  offload-param-stage  NVMe parameter parts staged for the device (offload_param.device: nvme):
                       the blocks that fit the device budget plus the host lookahead, plus one
  offload-param-write  one block's trainable part per optimizer worker, written back to NVMe
  offload-activations  host copies of saved activations (offload_activations cpu / nvme): one
                       budget of bytes lent in ranges (tensor sizes are known only at run
                       time), ``activation_host_bytes``

The optimizer state's bytes come from the update rule and ``optimizer.state_dtype``, here
only: ``shard_state_bytes`` (one shard's ``StateLayout``: the fp32 master, the rule's rows at
the state dtype, int8 scales; a per-tensor rule's rows from the parameters' shapes) and
``state_bytes_per_param`` (the same per parameter, for a model known by its size only).
"""
from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Dict, Optional, Sequence, Tuple

from offload import budgets, dtypes
from offload.core import sharding
from offload.placement import Placement
from offload.units import PAGE

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _page(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _rule_of(config, rule: Optional[str], state_dtype: Optional[str]) -> tuple:
    """(UpdateRule, state_dtype, hparams): the config's optimizer unless ``rule`` /
    ``state_dtype`` ask for another (``offload estimate --optimizer``)."""
    from offload.optim import get_rule
    opt = getattr(config, "optimizer", None)
    name = rule or (opt.type if opt is not None else "AdamW")
    hp = opt.hparams() if opt is not None and opt.type == name else {}
    r = get_rule(name)
    return r, state_dtype or (opt.state_dtype if opt is not None else "fp32"), dict(r.defaults, **hp)


def state_bytes_per_param(config, rule: Optional[str] = None, state_dtype: Optional[str] = None) -> float:
    """Bytes of optimizer state per trainable parameter on its tier: the fp32 master and the
    update rule's rows at ``optimizer.state_dtype`` (AdamW fp32: 12; int8: 6.03; SGD without
    momentum: 4; Adafactor: its unfactored worst case, 8). ``rule`` / ``state_dtype`` ask
    another rule or dtype than the config's."""
    r, sd, hp = _rule_of(config, rule, state_dtype)
    return r.bytes_per_param("host", sd, hp)


def shard_state_bytes(config, numel: int, params: Sequence[tuple] = (), rule: Optional[str] = None,
                      state_dtype: Optional[str] = None) -> int:
    """Bytes of one shard's optimizer state buffer (its ``StateLayout``, what a host-pool
    slot, an NVMe extent and the device tensor hold). ``params``: (start, numel, shape,
    group) of each parameter in shard coordinates, needed by a per-tensor rule
    (Adafactor); without them such a rule counts its unfactored worst case."""
    from offload.optim.state import StateLayout
    r, sd, hp = _rule_of(config, rule, state_dtype)
    if r.per_tensor and not params:
        return _page(math.ceil(r.bytes_per_param("host", sd, hp) * numel))
    groups = [hp] * (1 + max((p[3] for p in params), default=0))
    return StateLayout.for_shard(r, groups, numel, sd, params).nbytes


CHUNK_ALIGN = 4096     # elements: chunk starts are multiples (of the int8 scale block, 256, too)


def state_chunks(config, numel: int, params: Sequence[tuple] = (), rule: Optional[str] = None,
                 state_dtype: Optional[str] = None) -> Tuple[Tuple[int, int], ...]:
    """The element ranges ``[a, b)`` in which one shard's optimizer state is read, stepped and
    written (optim/state.py's chunks): one range ``[0, numel)`` unless the state is on NVMe
    and its bytes exceed ``offload_optimizer.state_chunk_bytes``; then equal ranges (the last
    shorter), starts a multiple of ``CHUNK_ALIGN`` elements, each chunk's own layout at most
    ``state_chunk_bytes``. Never chunked: a rule whose rows are per tensor (Adafactor: its
    factored rows need the whole tensor's gradient, and a tensor may be larger than a
    chunk), and ``state_chunk_bytes: null``."""
    from offload.optim.state import StateLayout
    whole = ((0, numel),)
    oc = config.offload_optimizer
    limit = getattr(oc, "state_chunk_bytes", None)
    if oc.placement is not Placement.NVME or limit is None or numel <= CHUNK_ALIGN:
        return whole
    r, sd, hp = _rule_of(config, rule, state_dtype)
    if r.per_tensor or shard_state_bytes(config, numel, params, rule, state_dtype) <= limit:
        return whole
    rows = r.rows(hp)
    most = int(limit // r.bytes_per_param("host", sd, hp)) // CHUNK_ALIGN * CHUNK_ALIGN
    while most > 0 and StateLayout(rows, most, sd).nbytes > limit:
        most -= CHUNK_ALIGN
    if most <= 0:
        raise ValueError(f"offload_optimizer.state_chunk_bytes={limit} cannot hold {CHUNK_ALIGN} elements of "
                         f"{r.name} state ({sd}): raise it to at least "
                         f"{StateLayout(rows, CHUNK_ALIGN, sd).nbytes} bytes")
    k = -(-numel // most)                                     # chunks, then balanced
    n = -(-(-(-numel // k)) // CHUNK_ALIGN) * CHUNK_ALIGN     # <= most (a multiple of CHUNK_ALIGN)
    return tuple((a, min(a + n, numel)) for a in range(0, numel, n))


def chunk_state_bytes(config, numel: int, chunks: Sequence[tuple], params: Sequence[tuple] = (),
                      rule: Optional[str] = None, state_dtype: Optional[str] = None) -> Tuple[int, ...]:
    """Bytes of each chunk's state buffer (a swap-pool slot and a swap-file key hold one)."""
    if len(chunks) == 1:
        return (shard_state_bytes(config, numel, params, rule, state_dtype),)
    return tuple(shard_state_bytes(config, b - a, (), rule, state_dtype) for a, b in chunks)


def grad_bytes_per_param(config) -> int:
    """Host gradient element size (offload/dtypes.py ``grad_dtype``)."""
    return dtypes.grad_bytes(config.precision, config.gradient_accumulation_steps)


@dataclass(frozen=True)
class BlockSize:
    """One block as the plan sees it."""
    name: str
    numel: int                          # trainable parameters, unpadded (0: frozen only)
    frozen: Tuple[int, ...] = ()        # bytes of each frozen part as stored (padded)
    params: Tuple[tuple, ...] = ()      # (offset, numel, shape, group) per parameter in the
                                        # block's flat (a per-tensor rule's state needs shapes)
    in_place: Tuple[bool, ...] = ()     # per frozen part: read in place from the checkpoint (no swap bytes)
    frozen_home: Tuple[int, ...] = ()   # bytes of each frozen part at home when stored quantized
                                        # (offload_param.frozen_dtype); empty: as ``frozen``


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
    frozen: Tuple[int, ...]             # frozen parts on the device (compute dtype)
    state_chunks: Tuple[Tuple[int, int], ...] = ()   # element ranges of the state's chunks (state_chunks)
    chunk_bytes: Tuple[int, ...] = ()   # bytes of each chunk's state (one: state_bytes)
    frozen_home: Tuple[int, ...] = ()   # frozen parts at home (quantized ones smaller than on the device)

    @property
    def device_bytes(self) -> int:
        """Bytes of the whole block on the device when fetched (parameter offload)."""
        return (self.param_bytes if self.padded_numel else 0) + sum(self.frozen)


@dataclass(frozen=True)
class MemoryPlan:
    blocks: Tuple[BlockPlan, ...]
    pools: Tuple[Pool, ...]
    grad_home: Placement                # DEVICE: next to the state (offload_optimizer none); HOST:
                                        # every block's buffer in offload-host; NVME: lent from
                                        # offload-grads, parked on NVMe between uses
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


def activation_host_bytes(config, host_available: Optional[int] = None) -> int:
    """Bytes of the offload-activations pool (0: activations stay on the device): the
    configured ``offload_activations.host_bytes``, else twice ``lookahead_bytes`` for nvme (the
    writes in flight plus, on CUDA, the reads ahead of backward) and half of
    ``host_available`` for cpu (every copy of a forward waits there for its backward). Rounded
    down to the 4096-byte page: the pool never exceeds what was configured."""
    ac = config.offload_activations
    if ac.placement is Placement.DEVICE:
        return 0
    if ac.host_bytes is not None:
        n = ac.host_bytes
    elif ac.placement is Placement.NVME:
        n = 2 * max(ac.lookahead_bytes, PAGE)
    else:
        if host_available is None:
            raise ValueError("offload_activations.device cpu without offload_activations.host_bytes is sized from "
                             "the host memory available: pass host_available, or set host_bytes")
        n = host_available // 2
    return n // PAGE * PAGE


def param_home(config) -> Placement:
    """Where parameter homes are. ZeRO-3 keeps parameters as shards even without
    offload_param: at home on the host."""
    home = config.offload_param.placement
    return Placement.HOST if home is Placement.DEVICE and config.zero_optimization.stage == 3 else home


def grad_home(config, grad_total: int, grad_largest: int) -> Placement:
    """Where gradient buffers live (NVME: lent from a pool, parked on NVMe between uses); see
    the module docstring."""
    oc = config.offload_optimizer
    if oc.placement is Placement.DEVICE:
        return Placement.DEVICE
    # step() commits the window: every block's gradients wait for it (and for the global
    # norm), so they either all stay in host memory or are parked on NVMe
    limit = getattr(oc, "grad_host_bytes", None)
    if limit is None:
        return Placement.NVME if oc.placement is Placement.NVME else Placement.HOST
    return Placement.HOST if grad_total <= limit else Placement.NVME


def grad_pool_slots(config, n_blocks: int, grad_largest: int) -> int:
    """Buffers in offload-grads: the host budget's worth, else buffer_count + workers + 1."""
    oc = config.offload_optimizer
    floor = config.optimizer_workers + 2
    limit = getattr(oc, "grad_host_bytes", None)
    n = limit // max(grad_largest, 1) if limit is not None else max(oc.buffer_count, config.optimizer_workers + 2)
    return max(1, min(max(n, floor), n_blocks))


def plan(blocks: Sequence[BlockSize], config, world_size: int = 1, rank: int = 0,
         compute_bytes: Optional[int] = None, working_set: int = 0, *, rule: Optional[str] = None,
         state_dtype: Optional[str] = None, host_available: Optional[int] = None) -> MemoryPlan:
    """The memory plan of ``blocks`` under ``config`` for one rank. Trained blocks come first
    (in block order), frozen-only blocks (numel 0) after them. ``working_set``: device bytes
    one forward needs at once (the default parameter budget: the larger of it and two
    largest blocks). ``host_available``: host bytes available, which size the activation
    pool of ``offload_activations.device: cpu`` when ``host_bytes`` is not set."""
    stage = config.zero_optimization.stage
    p = compute_bytes or DTYPE_BYTES[config.precision]
    gb = grad_bytes_per_param(config)
    bps = []
    for b in blocks:
        if b.numel:
            padded = sharding.padded_numel(b.numel, world_size)
            s0, s1 = (0, padded) if stage == 0 else sharding.shard_range(b.numel, world_size, rank)
        else:
            padded, s0, s1 = 0, 0, 0
        gn = (s1 - s0) if stage >= 2 else padded
        home = (s1 - s0) if stage == 3 else padded
        shp = tuple((o - s0, n, shp, g) for o, n, shp, g in b.params)
        sb = shard_state_bytes(config, s1 - s0, shp, rule, state_dtype) if b.numel else 0
        chunks = state_chunks(config, s1 - s0, shp, rule, state_dtype) if b.numel else ()
        cb = chunk_state_bytes(config, s1 - s0, chunks, shp, rule, state_dtype) if b.numel else ()
        bps.append(BlockPlan((s0, s1), padded, gn, sb, padded * p, home * p, tuple(b.frozen), chunks, cb,
                             tuple(b.frozen_home or b.frozen)))
    trained = [b for b in bps if b.padded_numel]
    oc, pc = config.offload_optimizer, config.offload_param
    grad_sizes = [b.grad_numel * gb for b in trained]
    gh = grad_home(config, sum(grad_sizes), max(grad_sizes, default=0))
    if gh is Placement.NVME and (world_size > 1 or stage >= 2):
        # Parking is single-rank, stages 0-1. With ranks, a block's buffer is the operand of
        # its collective (stages 0-1: all-reduce / reduce-scatter of the full buffer at the
        # boundary; 2: the reduced shard added into it every backward), whose completion
        # (GradSync's finish) runs on whichever thread waits first: a park must follow it,
        # but (a) stage 1's reopen() (another backward before step()) needs the unreduced
        # local sums the finish overwrites, and (b) stage 2's finish borrows the buffer,
        # which waits for a park in flight that itself waits for that finish. Both need the
        # collective's completion to hand the buffer to its park (and the commit to take
        # norms and updates block by block from parked sums): not done yet.
        gh = Placement.HOST
    pools, nvme = [], {}
    host_slots = []
    if gh is Placement.NVME:
        n = grad_pool_slots(config, len(trained), max(grad_sizes))
        pools.append(Pool("offload-grads", (max(grad_sizes),) * n, "gradient buffers lent per block"))
        nvme["grads"] = sum(_page(n) for n in grad_sizes)
    elif gh is Placement.HOST:
        host_slots += grad_sizes
    if oc.placement is Placement.HOST:
        host_slots += [b.state_bytes for b in trained]
    if getattr(oc, "update_ahead", False):
        # each block's update computed during backward (optim/ahead.py): a second state
        # buffer, and the new parameters staged until step() writes them back (none where
        # the parameters are resident fp32: they are copied from the master)
        host_slots += [b.state_bytes for b in trained]
        if param_home(config) is not Placement.DEVICE or config.precision != "fp32":
            host_slots += [(b.shard[1] - b.shard[0]) * p for b in trained]
    if host_slots:
        pools.append(Pool("offload-host", tuple(host_slots), "gradients of every block; cpu optimizer state"))
    swap_slots = max(oc.buffer_count, config.optimizer_workers + 1)
    if oc.placement is Placement.NVME:
        nvme["optimizer"] = sum(_page(c) for b in trained for c in b.chunk_bytes)
        pools.append(Pool("offload-swap", (max(c for b in trained for c in b.chunk_bytes),) * swap_slots,
                          "optimizer state read ahead / written behind, a chunk at a time"))
    device = 0
    if oc.placement is Placement.DEVICE:
        device += sum(b.state_bytes + b.grad_numel * 4 for b in trained)
    budget = None
    home = param_home(config)
    if home is Placement.DEVICE:
        device += sum(b.param_bytes for b in trained)
    else:
        sizes = [b.device_bytes for b in bps]
        largest = max(sizes)
        budget = budgets.device_budget(pc.device_budget_bytes, largest, working_set)
        device += budget
        homes = [([b.home_bytes] if b.padded_numel else []) + list(b.frozen_home) for b in bps]
        if home is Placement.HOST:
            pools.append(Pool("offload-param-home", tuple(h for hs in homes for h in hs),
                              "parameter homes (trainable and frozen parts)"))
        else:
            # frozen parts read in place live in the checkpoint's files, not in the swap file
            swapped = [([b.home_bytes] if b.padded_numel else [])
                       + [f for f, ip in zip(b.frozen_home, s.in_place or (False,) * len(b.frozen)) if not ip]
                       for b, s in zip(bps, blocks)]
            nvme["params"] = sum(_page(h) for hs in swapped for h in hs)
            pf = config.prefetch
            host_lookahead = budgets.host_lookahead(pf.host_lookahead_bytes, budget)
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
    act = activation_host_bytes(config, host_available)
    if act:
        pools.append(Pool("offload-activations", (act,), "host copies of saved activations"))
    return MemoryPlan(tuple(bps), tuple(pools), gh, gb, nvme, device, budget)


def host_lookahead(config, budget: int) -> int:
    return budgets.host_lookahead(config.prefetch.host_lookahead_bytes, budget)


def device_lookahead(config, budget: int, largest: int) -> int:
    return budgets.device_lookahead(config.prefetch.device_lookahead_bytes, budget, largest)


def placement_refusal(config) -> Optional[str]:
    """Why ``initialize`` refuses this config's optimizer placement (None: it runs it); what
    ``offload estimate`` marks a placement with."""
    if config.optimizer.state_dtype == "int8" and config.offload_optimizer.placement is Placement.DEVICE:
        return ("optimizer.state_dtype='int8' needs the optimizer state on the CPU: int8 state is "
                "quantized inside the CPU kernel. Set offload_optimizer.device to cpu or nvme, or use "
                "state_dtype bf16 with offload_optimizer.device none")
    return None
