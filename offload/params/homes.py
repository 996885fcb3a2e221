"""Parameter homes: where each offloaded block's parameters live between visits to the device.

With ``offload_param`` cpu or nvme (and with ZeRO-3, whose parameter shards stay at home on
the host without it) every block that visits the device has a home per part: the trainable
part (``trainable_home``; the shard with ZeRO-3, else the full flat, in the compute dtype)
and each frozen part (``frozen_home``; in the dtype ``frozen_dtype`` decides). A home is a
host pool buffer (cpu), an NVMe key ``b<i>.param`` / ``b<i>.frozen<k>`` staged through a
host pool (nvme), or, for a frozen part stored in the checkpoint in the dtype it is kept in,
the checkpoint's own byte ranges (read in place, storage/source.py). ``ParamHomes`` makes
the pools and stores from the memory plan (storage/resources.py) and each home from them.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch

from offload import device as dev
from offload import dtypes
from offload.core import blocks as blk
from offload.core import sharding
from offload.params import quantized
from offload.placement import Placement


def home_device(config, stage: int) -> Placement:
    """Where parameter homes are. ZeRO-3 keeps parameters as shards even without
    offload_param: at home on the host."""
    home = config.offload_param.placement
    return Placement.HOST if home is Placement.DEVICE and stage == 3 else home


def frozen_dtype(p: torch.Tensor, compute: torch.dtype) -> torch.dtype:
    """The dtype a frozen parameter is kept in (at home, on the device, and in the file
    ranges read in place): its own, or the compute dtype when that is narrower (an fp32
    frozen weight in a bf16 run); a bf16 base beside fp32 training stays bf16. Integer
    parameters keep theirs. The one place this is decided."""
    return dtypes.kept_dtype(p.dtype, compute)


def frozen_part_bytes(part: blk.BlockLayout, compute: torch.dtype) -> int:
    """Bytes of a frozen part as kept (padded)."""
    return part.padded_numel * frozen_dtype(part.segments[0].param, compute).itemsize


def block_roots(layouts, frozen) -> list:
    """(name, module, trainable layout or None, frozen part layouts) per block, in block
    index order: the trained blocks in order, then blocks holding only frozen parameters.
    ``frozen``: (root name, root module, parts) per block root holding any."""
    by_root = {name: (mod, parts) for name, mod, parts in frozen}
    roots = [(lay.name, lay.module, lay, by_root.pop(lay.name, (None, []))[1]) for lay in layouts]
    roots += [(name, mod, None, parts) for name, (mod, parts) in by_root.items()]
    return roots


def part_keys(i: int, unit) -> List[str]:
    """NVMe keys of block i's parts: ``b<i>.param`` for the trainable part, then
    ``b<i>.frozen<k>`` per frozen part."""
    _, _, lay, parts = unit
    return ([f"b{i}.param"] if lay is not None else []) + [f"b{i}.frozen{k}" for k in range(len(parts))]


def fill_flat(flat: torch.Tensor, part: blk.BlockLayout) -> None:
    """Write a part's parameter values into ``flat`` (padding zeroed), converting dtypes."""
    with torch.no_grad():
        flat.zero_()
        for sg in part.segments:
            flat[sg.offset:sg.offset + sg.numel].copy_(sg.param.detach().reshape(-1))


class ParamHomes:
    """The homes of one engine's offloaded parameters. Made once the memory plan is known:
    its pools and stores are made here through ``resources`` (host: "offload-param-home";
    nvme: the "params" store with every swapped key reserved, the "offload-param-stage" and
    "offload-param-write" pools, and the "source" store where frozen parts are read in
    place). ``in_place``: id(frozen part) -> its file ranges. ``on_write_failure(index,
    err)``: a trainable home's write-back failed after its job returned."""

    def __init__(self, *, config, stage: int, comm, dtype: torch.dtype, device: torch.device, telemetry,
                 weights, plan, roots: list, in_place: Dict[int, list], codecs: Dict[int, object], resources,
                 on_write_failure: Callable[[int, BaseException], None]):
        self.device_kind = home_device(config, stage)
        if self.device_kind is Placement.DEVICE:
            raise ValueError("ParamHomes without offloaded parameters")
        self._config, self._stage, self._comm = config, stage, comm
        self._dtype, self._device, self._telemetry = dtype, device, telemetry
        self._weights, self._in_place, self.codecs = weights, in_place, codecs
        self._on_write_failure = on_write_failure
        # a CPU device's dequantized flats, reused block to block (quantized.DequantFlats)
        self.flats = quantized.DequantFlats(plan.param_budget or 0) if codecs and device.type == "cpu" else None
        self._store = self._stage_pool = self._write_pool = self._home_pool = self._source = None
        pc = config.offload_param
        pin = pc.pin_memory and dev.can_pin()
        if self.device_kind is Placement.HOST:
            self._home_pool = resources.make_pool("offload-param-home", pin=pin)
            return
        self._store = resources.make_store("params", pc.nvme_path)
        swapped = {}                       # NVMe key -> bytes; frozen parts read in place have none
        for i, (unit, bp) in enumerate(zip(roots, plan.blocks)):
            _, _, lay, parts = unit
            homes = ([(lay, bp.home_bytes)] if lay is not None else []) + list(zip(parts, bp.frozen_home))
            for key, (part, n) in zip(part_keys(i, unit), homes):
                if id(part) not in in_place:
                    swapped[key] = n
        self._store.reserve(swapped)
        if in_place:
            from offload.io.safetensors import read_range
            from offload.io.loader import checksum
            from offload.storage.source import SourceStore
            self._source = SourceStore(lambda b: checksum(b)[1], read_range, threads=2)
            resources.add_store("source", self._source)
        self._stage_pool = resources.make_pool("offload-param-stage", pin=pin)
        self._write_pool = resources.make_pool("offload-param-write", pin=pin)

    # ---- the trainable part -------------------------------------------------------------
    def home_numel(self, lay: blk.BlockLayout) -> int:
        """Elements of a block's trainable home: the shard with ZeRO-3, else the full flat."""
        if self._stage == 3:
            s0, s1 = sharding.shard_range(lay.numel, self._comm.world, self._comm.rank)
            return s1 - s0
        return lay.padded_numel

    def trainable_home(self, lay: blk.BlockLayout):
        """The ParamPart of block ``lay``'s trainable part (its values are written home by
        the caller). With ZeRO-3 across ranks it all-gathers the shards on each visit."""
        from offload.params.part import ParamPart
        n = self.home_numel(lay)
        gather = None
        if self._stage == 3 and self._comm.active:
            what = f"param allgather of block {lay.index} ({lay.name or '<root>'})"
            comm, telemetry = self._comm, self._telemetry

            def allgather(full, shard, what=what):
                with telemetry.span("offload::param_allgather"):
                    return comm.all_gather(full, shard, what, async_op=True)
            gather = allgather
        kw = {"home_numel": n, "gather": gather}
        if self.device_kind is Placement.HOST:
            home = self._home_pool.acquire(n * self._dtype.itemsize).view(self._dtype, n)
            return ParamPart(lay, self._dtype, self._device, home_buf=home, **kw)
        return ParamPart(lay, self._dtype, self._device, store=self._store, pool=self._stage_pool,
                           write_pool=self._write_pool, key=f"b{lay.index}.param",
                           wait_timeout_s=self._config.wait_timeout_s, on_failure=self._on_write_failure, **kw)

    # ---- frozen parts -------------------------------------------------------------------
    def frozen_home(self, i: int, k: int, part: blk.BlockLayout):
        """The ParamPart of frozen part ``k`` of block ``i``, in ``frozen_dtype``: its values
        written home from the parameters (loaded from the checkpoint, or materialized from the
        meta device by the model's initialisation), whose original memory then goes; or, read
        in place, the checkpoint's own byte ranges with nothing copied."""
        from offload.params.part import ParamPart
        part.index = i                     # errors name the block it visits the device with
        dtype = frozen_dtype(part.segments[0].param, self._dtype)
        key = f"b{i}.frozen{k}"
        if id(part) in self._in_place:
            bp = self._source_home(key, part, dtype)
            bp.release_initial()
            return bp
        # from the checkpoint (remembered as the base's origin, so checkpoints refer to it),
        # or the model's own initialisation for a meta part
        self._weights.load([s.param for s in part.segments], frozen_reference=True)
        n = part.padded_numel
        codec = self.codecs.get(id(part))     # stored quantized (params/quantized.py): its blob's bytes
        nbytes = codec.nbytes if codec is not None else n * dtype.itemsize

        def fill(buf):
            if codec is not None:
                return codec.fill(buf.view(torch.uint8, nbytes))
            flat = buf.view(dtype, n)
            fill_flat(flat, part)
            return flat
        if self.device_kind is Placement.HOST:
            home = fill(self._home_pool.acquire(nbytes))
            bp = ParamPart(part, dtype, self._device, home_buf=home, codec=codec, flats=self.flats)
        else:
            bp = ParamPart(part, dtype, self._device, store=self._store, pool=self._stage_pool, key=key,
                             codec=codec, flats=self.flats)
            with self._stage_pool.acquire(nbytes) as loan:   # page-aligned: O_DIRECT
                bp.write_home(fill(loan))
        bp.release_initial()
        return bp

    def _source_home(self, key: str, part: blk.BlockLayout, dtype: torch.dtype):
        """A frozen part read in place: its tensors are read once now for their checksums
        (recorded as the base's origin, and checked on every later read)."""
        from offload.params.part import ParamPart
        from offload.storage.source import SourceTensor
        crcs = self._weights.refer_all([s.param for s in part.segments])
        esize = dtype.itemsize
        self._source.add(key, self._in_place[id(part)],
                         [SourceTensor(s.name, s.offset * esize, s.numel * esize, crcs[id(s.param)])
                          for s in part.segments])
        return ParamPart(part, dtype, self._device, store=self._source, pool=self._stage_pool, key=key,
                           wait_timeout_s=self._config.wait_timeout_s)


def hand_back_blocks(param_offload) -> list:
    """Every offloaded block's parameters bound to host copies (``ParamPart.hand_back``)
    of their current values, on the device each block was on at initialize (each part's
    ``origin``); blocks handed back already keep theirs. Returns
    (segment, tensor) of every offloaded parameter."""
    po, out = param_offload, []
    for bp in po.offloaded:
        to = bp.parts[0].origin
        todo = [part for part in bp.parts if part.handed_back is None]
        if todo:
            if all(part.home_numel == part.numel for part in todo):   # homes hold whole flats: read them
                po._release(bp)
                flats = [part.read_home().to(to) for part in todo]
            else:                          # shards (ZeRO-3): gathered on the device
                po.materialize(bp)
                flats = [part.device_buf.detach().to(to, copy=True) for part in todo]
                po._release(bp)
            for part, flat in zip(todo, flats):
                part.hand_back(flat)
        for part in bp.parts:              # the trainable part and each frozen part
            flat = part.handed_back
            out += [(s, flat[s.offset:s.offset + s.numel].view(s.shape)) for s in part.layout.segments]
    return out


def placeholders(param_offload) -> List[str]:
    """Names of the offloaded parameters not handed back (empty placeholders once the
    engine lets their homes go)."""
    return [s.name for bp in param_offload.offloaded
            for part in bp.parts if part.handed_back is None for s in part.layout.segments]


def offloaded_bytes(param_offload) -> int:
    """Bytes of every offloaded part (trainable and frozen) as kept at home."""
    return sum(bp.nbytes for bp in param_offload.offloaded)


def restore_fits(param_offload, comm, stage: int) -> bool:
    """Whether the offloaded parameters fit in half the available host memory (copies
    handed back already cost nothing more). With ZeRO-3 across ranks, where handing back
    all-gathers every block, the ranks decide together (it fits on all of them): a collective."""
    import psutil
    parts = [part for bp in param_offload.offloaded for part in bp.parts]
    held = sum(p.handed_back.numel() * p.handed_back.element_size() for p in parts if p.handed_back is not None)
    fits = offloaded_bytes(param_offload) - held <= psutil.virtual_memory().available // 2
    if comm.active and stage == 3:
        fits = all(comm.gather_objects(fits, "hand back: whether the parameters fit on every rank"))
    return fits
