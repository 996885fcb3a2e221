"""Checkpoints: save / resume / consolidated fp32 export.

Layout of a checkpoint directory::

    meta.json               step counters, loss scaler, config, param groups, key map, the
                            update rule (``optimizer``: rule name, hyper-parameters,
                            state_dtype) and the block table: per block its shards (rank,
                            [start, end) of the padded flat, file, CRC32, ``layout``: the
                            shard's StateLayout.describe())
    block_00000.rank0.bin   rank 0's shard of block 0 as the optimizer state buffer holds it
    block_00000.rank1.bin   (optim/state.py: the fp32 master, the rule's rows at the
    ...                     state dtype, int8 codes and their scales), byte for byte
    extra.pt                frozen parameters (those stored quantized as their blobs), buffers,
                            rank 0's RNG states
    rng.rank1.pt ...        the other ranks' RNG states

Format 3 (this one). Every rank writes the shards it owns, in parallel (stage 0: rank 0
writes whole blocks). Loading reads, for each block, the range the loading rank owns now from
whichever files hold it, so a checkpoint loads at any world size (re-sharded: elementwise rows
element by element, int8 scales by their 256-element blocks, which shard boundaries never
split) and bit-exactly at the same one; a per-tensor rule's state (Adafactor) loads only at
the sharding it was saved at. A checkpoint holds one rule's state at one state dtype: loading
it into an engine running another is an error naming both. Formats 1 and 2 (AdamW / Adam,
fp32 rows ``[master | exp_avg | exp_avg_sq]`` of the unpadded range; version 1 with one
``block_XXXXX.bin`` per block) still load.

Saving streams block by block from wherever the state lives (an NVMe-resident block visits
one pool buffer), so the model is never materialized whole in RAM. The directory is written
beside the target (``<dir>.tmp-<token>``), every file fsynced by its writer; after a barrier
rank 0 writes meta.json and swaps the directory in by renames:
``<dir>`` -> ``<dir>.prev``, tmp -> ``<dir>``, then ``<dir>.prev`` is removed. A crash at any
point leaves a loadable checkpoint: ``<dir>`` itself, or ``<dir>.prev`` which ``load`` falls
back to. Every block file carries a CRC32 in meta.json, checked on load.

Concurrent saves. Rank 0 holds an exclusive lock on ``<dir>.lock`` (flock: released by the
kernel if the process dies, so it never goes stale) for the whole save; the lock file names
its holder (pid, host, start time). A second save to the same directory, from any process,
fails at once with a CheckpointError naming that holder, before touching anything; leftover
``<dir>.tmp-*`` directories are removed only while the lock is held, so a live save's files
are never deleted. Every I/O error names the operation, the path, the block (for block files)
and the errno (``CheckpointIOError``, an OSError).
"""
from __future__ import annotations

import errno as errno_mod
import fcntl
import glob
import json
import os
import random
import shutil
import socket
import time
import warnings
import zlib
from typing import Callable, ContextManager, Dict, Protocol, Sequence, Tuple

import numpy as np
import torch

from offload.core.sharding import clip_range
from offload.io import origin
from offload.core.errors import OffloadError

FORMAT = "offload-checkpoint"
VERSION = 3


class CheckpointError(RuntimeError, OffloadError):
    """A checkpoint is missing, damaged or does not match the model."""


class CheckpointIOError(OSError, OffloadError):
    """Reading or writing a checkpoint file failed: names the operation, the path, the block
    (for a block file) and the errno."""


class Subject(Protocol):
    """What a checkpoint saves and loads of a live engine, as the engine lends it
    (engine/checkpoint_view.py); this module and origin.py touch nothing else of it.

    Facts read: ``comm`` (rank, world size, collectives), ``telemetry``, ``module``,
    ``optimizer`` (its param groups are saved and restored), ``scaler``, ``config``,
    ``rule`` (the update rule's name), ``state_dtype``, ``stage``, ``weights`` (the base
    the checkpoint refers to, io/loader.py), ``param_offload`` (offloaded frozen
    parameters: ``frozen_io``, params/frozen_io.py, and ``release_all``; None without) and
    ``blocks`` (per block: ``index``, ``name``, ``layout``, ``shard``, ``update.step``). Block state, parameters and gradients change only through the methods."""
    comm: object
    telemetry: object
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: object
    config: object
    rule: str
    state_dtype: str
    stage: int
    weights: object
    param_offload: object
    blocks: Sequence

    def counters(self) -> Tuple[int, int]:
        """(global_step, micro_step)."""

    def set_counters(self, global_step: int, micro_step: int) -> None: ...

    def state_layout(self, i: int):
        """Block ``i``'s StateLayout (optim/state.py)."""

    def read_state(self, i: int) -> ContextManager[Tuple[torch.Tensor, torch.Tensor]]:
        """Block ``i``'s state buffer and its fp32 master view, held for the ``with``."""

    def write_state(self, i: int, fill: Callable[[torch.Tensor, torch.Tensor], None], stepped: int) -> None:
        """Overwrite block ``i``'s state: ``fill(buffer, master view)`` writes every byte;
        the block has taken ``stepped`` updates."""

    def write_params(self, i: int, mine: torch.Tensor, full: Callable[[], torch.Tensor]) -> None:
        """Block ``i``'s parameters from the master: ``mine`` this rank's unpadded shard of
        it, ``full()`` the whole unpadded flat (read only where the parameters need it)."""

    def reset_grads(self) -> None:
        """Discard every block's accumulated gradients."""


def _io_error(op: str, path: str, exc: OSError, block=None, during: str = "save") -> CheckpointIOError:
    """``block``: a Block, or a block's name as the checkpoint records it."""
    if block is None:
        what = ""
    elif isinstance(block, str):
        what = f" of block {block!r}"
    else:
        what = f" of block {block.index} ({block.name})"
    code = exc.errno or errno_mod.EIO
    err = CheckpointIOError(code, f"checkpoint {during}: {op}{what} failed at {path}: "
                                  f"{exc.strerror or os.strerror(code)}", path)
    err.__cause__ = exc
    return err


class _SaveLock:
    """``<dir>.lock``: at most one save to a directory at a time (see the module doc)."""

    def __init__(self, path: str):
        self.file = path + ".lock"
        self.fd = -1

    def acquire(self) -> None:
        try:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _io_error("creating the lock file", self.file, exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            except (OSError, ValueError):
                owner = {}
            os.close(fd)
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner["started"])) \
                if "started" in owner else "an unknown time"
            raise CheckpointError(
                f"checkpoint {self.file[:-5]} is being saved by another process (pid {owner.get('pid', '?')} on "
                f"host {owner.get('host', '?')}, since {since}): two saves to one directory would overwrite each "
                "other; wait for that save to finish, or save to another path") from None
        except OSError as exc:
            os.close(fd)
            raise _io_error("locking", self.file, exc) from exc
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.ftruncate(self.fd, 0)        # the file stays (removing it would race a waiting locker)
            os.close(self.fd)               # closing drops the flock
            self.fd = -1


# ---- saving -----------------------------------------------------------------------------
def save(subject: Subject, path: str) -> str:
    """Every rank calls this with the same ``path`` (a directory all ranks can reach)."""
    comm = subject.comm
    path = os.path.abspath(os.fspath(path).rstrip("/"))
    parent = os.path.dirname(path)
    lock = _SaveLock(path)
    refused = None
    if comm.rank == 0:
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise _io_error("creating the parent directory", parent, exc) from exc
        try:
            lock.acquire()
        except (CheckpointError, OSError) as exc:
            refused = exc
    # every rank learns whether rank 0 got the lock (and its pid for the tmp name)
    first = comm.gather_objects((os.getpid(), str(refused) if refused else None), "checkpoint save: rendezvous")[0]
    if first[1] is not None:
        if refused is not None:
            raise refused
        raise CheckpointError(first[1])
    tmp = f"{path}.tmp-{first[0]}"
    try:
        if comm.rank == 0:
            for stale in glob.glob(glob.escape(path) + ".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a crashed save (a live one holds the lock)
            try:
                os.makedirs(tmp)
            except OSError as exc:
                raise _io_error("creating the directory", tmp, exc) from exc
        comm.barrier("checkpoint save: directory created")
        return _save_locked(subject, path, parent, tmp)
    finally:
        lock.release()


def _save_locked(subject: Subject, path: str, parent: str, tmp: str) -> str:
    comm = subject.comm
    try:
        with subject.telemetry.span("offload::checkpoint_save"):
            mine = _write_shards(subject, tmp)
            shards = comm.gather_objects(mine, "checkpoint save: shard table")   # after every fsync
            if comm.rank != 0:
                comm.barrier("checkpoint save: renamed")
                return path
            meta = _meta(subject, tmp, shards)
            _write_json(os.path.join(tmp, "meta.json"), meta)
            _fsync_dir(tmp)
        prev = path + ".prev"
        try:
            if os.path.exists(path):
                if os.path.exists(prev):
                    shutil.rmtree(prev)
                os.rename(path, prev)
            os.rename(tmp, path)
            _fsync_dir(parent)
        except OSError as exc:
            raise _io_error("swapping in the new directory", path, exc) from exc
        shutil.rmtree(prev, ignore_errors=True)
    except BaseException:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    comm.barrier("checkpoint save: renamed")
    return path


def _owned(subject: Subject) -> bool:
    """Whether this rank saves its block shards (stage 0: rank 0 saves whole blocks)."""
    return subject.stage != 0 or subject.comm.rank == 0


def _write_shards(subject: Subject, tmp: str) -> list:
    """This rank's shard files, fsynced; returns their table rows."""
    rank = subject.comm.rank
    rows = []
    for i, b in enumerate(subject.blocks):
        if not _owned(subject):
            continue
        fname = f"block_{b.index:05d}.rank{rank}.bin"
        full = os.path.join(tmp, fname)
        try:
            crc = _write_block(full, subject, i)
        except CheckpointIOError:
            raise
        except OSError as exc:
            raise _io_error("writing the state", full, exc, block=b) from exc
        s0, s1 = b.shard
        rows.append({"block": b.index, "rank": rank, "start": s0, "end": s1, "file": fname, "crc32": crc,
                     "layout": subject.state_layout(i).describe()})
    if rank == 0:
        keys, extra, quantized = _key_map(subject)
        _save_pt(os.path.join(tmp, "extra.pt"), {"tensors": extra, "quantized": quantized, "rng": _rng_state()})
    else:
        _save_pt(os.path.join(tmp, f"rng.rank{rank}.pt"), {"rng": _rng_state()})
    return rows


def _save_pt(fname: str, obj) -> None:
    try:
        with open(fname, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise _io_error("writing", fname, exc) from exc
    except RuntimeError as exc:   # torch.save reports a failed write as a RuntimeError
        if "write" not in str(exc).lower() and "errno" not in str(exc).lower():
            raise
        raise _io_error("writing", fname, OSError(errno_mod.EIO, str(exc))) from exc


def _meta(subject: Subject, tmp: str, shards: list) -> dict:
    by_block: Dict[int, list] = {}
    for rows in shards:
        for r in rows:
            by_block.setdefault(r.pop("block"), []).append(r)
    blocks = []
    for b in subject.blocks:
        lay = b.layout
        blocks.append({"index": b.index, "name": lay.name, "numel": lay.numel, "padded_numel": lay.padded_numel,
                       "stepped": b.update.step,
                       "shards": sorted(by_block.get(b.index, []), key=lambda r: r["start"]),
                       "segments": [{"name": s.name, "offset": s.offset, "numel": s.numel,
                                     "shape": list(s.shape)} for s in lay.segments]})
    keys = _key_map(subject, tensors=False)[0]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in subject.optimizer.param_groups]
    global_step, micro_step = subject.counters()
    return {"format": FORMAT, "version": VERSION, "global_step": global_step,
            "micro_step": micro_step, "scaler": subject.scaler.state_dict(),
            "config": subject.config.to_dict(), "param_groups": groups, "blocks": blocks, "keys": keys,
            "optimizer": {"rule": subject.rule, "state_dtype": subject.state_dtype,
                          "hparams": subject.config.optimizer.hparams()},
            "world_size": subject.comm.world, "zero_stage": subject.stage, **origin.record(subject)}


def _write_block(fname: str, subject: Subject, i: int) -> int:
    """Write block ``i``'s state buffer on this rank (its StateLayout's bytes) to ``fname``;
    returns its CRC32."""
    with subject.read_state(i) as (buf, _):
        data = buf.cpu().numpy().tobytes()
        crc = zlib.crc32(data)
        with open(fname, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return crc


def _key_map(subject: Subject, tensors: bool = True):
    """(state_dict key -> where its value lives: a block range, the base files or the extra
    tensors; the extra tensors; the frozen parts stored quantized, as stored). A frozen part
    the engine stores quantized (offload_param.frozen_dtype) is kept as its blob and code
    (``extra.pt``'s "quantized": ``{"keys": [state_dict key per segment], "blob", "code"}``), so
    a resume reads it back as it was, not quantized a second time."""
    where = {id(s.param): (b.index, s) for b in subject.blocks for s in b.layout.segments}
    base = origin.base_keys(subject)
    sd = subject.module.state_dict(keep_vars=True)
    wanted = {id(v) for k, v in sd.items() if k not in base}
    po = subject.param_offload
    quantized = po.frozen_io.read_quantized(wanted) if tensors and po is not None else []
    as_blob = {i for ids, _, _ in quantized for i in ids}
    frozen = _frozen_values(subject, wanted - as_blob) if tensors else {}
    name = {}
    keys, extra = {}, {}
    for k, v in sd.items():
        if id(v) in where:
            bi, seg = where[id(v)]   # the segment's shape: an offloaded parameter may be a placeholder
            keys[k] = {"block": bi, "offset": seg.offset, "shape": list(seg.shape)}
        elif k in base:              # a frozen parameter read from the base files: referenced, not copied
            keys[k] = {"base": True}
        else:
            keys[k] = {"extra": True}
            if id(v) in as_blob:
                name.setdefault(id(v), k)
            elif tensors:
                extra[k] = frozen[id(v)] if id(v) in frozen else v.detach().to("cpu", copy=True)
    stored = [{"keys": [name[i] for i in ids], "blob": blob, "code": code} for ids, blob, code in quantized]
    tied = {k: name[id(v)] for k, v in sd.items() if id(v) in as_blob and name[id(v)] != k}
    if tied:                         # a second key of one stored parameter: its value by the first key's
        for q in stored:
            q["tied"] = {k: first for k, first in tied.items() if first in q["keys"]}
    return keys, extra, stored


def extra_tensors(extra: dict) -> Dict[str, torch.Tensor]:
    """``extra.pt``'s tensors by state_dict key, the frozen parts stored quantized among them
    as their dequantized values (what the engine trained against)."""
    from offload.params.quantized import QuantizedPart
    out = dict(extra["tensors"])
    for q in extra.get("quantized", ()):
        codec = QuantizedPart.from_code(q["code"])
        flat = codec.values(q["blob"])
        for k, sc in zip(q["keys"], codec.segments):
            out[k] = flat[sc.offset:sc.offset + sc.numel].view(sc.shape)
        for k, first in q.get("tied", {}).items():
            out[k] = out[first]
    return out


def _frozen_values(subject: Subject, wanted=None) -> dict:
    """``id(param) -> value`` of the offloaded frozen parameters (read from their homes),
    only those in ``wanted`` (ids) when given: a part with none of them is not read."""
    po = subject.param_offload
    return po.frozen_io.read(wanted) if po is not None else {}


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


# ---- loading ----------------------------------------------------------------------------
def resolve(path: str) -> str:
    path = os.path.abspath(os.fspath(path).rstrip("/"))
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    prev = path + ".prev"
    if os.path.isfile(os.path.join(prev, "meta.json")):
        warnings.warn(f"checkpoint {path} is incomplete (a save was interrupted); loading the previous one, {prev}")
        return prev
    raise CheckpointError(f"no checkpoint at {path}: expected {path}/meta.json (written by engine.save_checkpoint)")


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") not in (1, 2, VERSION):
        raise CheckpointError(f"{path} is not an offload checkpoint of version 1 to {VERSION}")
    return meta


def saved_optimizer(meta: dict) -> tuple:
    """(rule name, state_dtype) of the state a checkpoint holds (formats 1 and 2: AdamW /
    Adam with fp32 state, as their config says)."""
    if "optimizer" in meta and "rule" in meta["optimizer"]:
        return meta["optimizer"]["rule"], meta["optimizer"]["state_dtype"]
    return (meta.get("config") or {}).get("optimizer", {}).get("type", "AdamW"), "fp32"


def _check_optimizer(subject: Subject, meta: dict, path: str) -> None:
    rule, sd = saved_optimizer(meta)
    if (rule, sd) != (subject.rule, subject.state_dtype):
        raise CheckpointError(
            f"{path} holds {rule} optimizer state with state_dtype {sd}, but this engine runs {subject.rule} "
            f"with state_dtype {subject.state_dtype}: set optimizer.type={rule!r} and optimizer.state_dtype={sd!r} to "
            f"resume it, or start a new run from its weights (offload.export_fp32, or initialize(weights=))")


def _shards(binfo: dict) -> list:
    if "file" in binfo:        # version 1: one file per block
        return [{"start": 0, "end": binfo["numel"], "file": binfo["file"], "crc32": binfo["crc32"]}]
    return binfo["shards"]


def _read_file(path: str, sh: dict, nbytes: int, block: str = "") -> bytes:
    """A shard file's bytes, size and CRC32 checked."""
    fname = os.path.join(path, sh["file"])
    try:
        with open(fname, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise _io_error("reading the state", fname, exc, block=block or None, during="load") from exc
    if len(data) != nbytes:
        raise CheckpointError(f"{fname} holds {len(data)} bytes, expected {nbytes}: the checkpoint is damaged")
    if zlib.crc32(data) != sh["crc32"]:
        raise CheckpointError(f"{fname} fails its CRC32 check: the checkpoint is damaged")
    return data


def _read_shard(path: str, sh: dict, block: str = "") -> np.ndarray:
    """The [3, end - start] fp32 rows of one shard file of format 1 or 2, CRC-checked."""
    n = sh["end"] - sh["start"]
    data = _read_file(path, sh, 3 * n * 4, block)
    return np.frombuffer(data, dtype=np.float32).reshape(3, n)


def _read_rows(path: str, binfo: dict, a: int = 0, e: int = None) -> np.ndarray:
    """Rows [3, e - a] of a block's unpadded range [a, e) from format 1 / 2 shard files
    (the world size it was saved at does not matter)."""
    e = binfo["numel"] if e is None else e
    out = np.zeros((3, max(e - a, 0)), dtype=np.float32)
    covered = 0
    for sh in _shards(binfo):
        r = clip_range(sh["start"], sh["end"], a, e)
        if r is None:
            continue
        rows = _read_shard(path, sh, binfo["name"] or "<root>")
        out[:, r[0] - a:r[1] - a] = rows[:, r[0] - sh["start"]:r[1] - sh["start"]]
        covered += r[1] - r[0]
    if covered != max(e - a, 0):
        raise CheckpointError(f"{path}: the shard files of block {binfo['name'] or '<root>'!r} do not cover "
                              f"[{a}, {e}): the checkpoint is incomplete")
    return out


def _fill_state(path: str, binfo: dict, layout, buf: torch.Tensor, s0: int, s1: int) -> None:
    """Fill ``buf`` (the loading rank's shard [s0, s1) laid out by ``layout``) from the
    checkpoint's shard files, whatever the sharding they were saved at."""
    from offload.optim import quant
    from offload.optim.state import StateLayout
    name = binfo["name"] or "<root>"
    master, rows = layout.views(buf)
    buf.zero_()
    n = binfo["numel"]
    if "layout" not in (_shards(binfo) or [{}])[0]:          # formats 1 and 2: AdamW / Adam fp32 rows
        e = max(s0, min(s1, n))
        old = torch.from_numpy(_read_rows(path, binfo, s0, e))
        master[:e - s0].copy_(old[0])
        rows["exp_avg"][:e - s0].copy_(old[1])
        rows["exp_avg_sq"][:e - s0].copy_(old[2])
        return
    covered = 0
    for sh in _shards(binfo):
        lo, hi = max(s0, sh["start"]), min(s1, sh["end"])
        if lo >= hi:
            continue
        src = StateLayout.from_description(sh["layout"])
        if layout.tensors or src.tensors:
            if (sh["start"], sh["end"]) != (s0, s1) or src.describe() != layout.describe():
                raise CheckpointError(
                    f"{path}: the per-tensor optimizer state of block {name!r} was saved for shard "
                    f"[{sh['start']}, {sh['end']}) and cannot be re-sharded to [{s0}, {s1}): resume at the world "
                    f"size it was saved at ({binfo.get('world_size', 'see meta.json')})")
        elif [r.name for r in src.rows] != [r.name for r in layout.rows] or src.state_dtype != layout.state_dtype:
            raise CheckpointError(f"{path}: block {name!r} holds state rows {[r.name for r in src.rows]} "
                                  f"({src.state_dtype}), this engine's layout has {[r.name for r in layout.rows]} "
                                  f"({layout.state_dtype})")
        data = _read_file(path, sh, src.nbytes, name)
        sbuf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if layout.tensors:
            buf.copy_(sbuf)
            covered += hi - lo
            continue
        smaster, srows = src.views(sbuf)
        a, b, c = lo - s0, hi - s0, lo - sh["start"]
        master[a:b].copy_(smaster[c:c + b - a])
        for r in layout.rows:
            rows[r.name][a:b].copy_(srows[r.name][c:c + b - a])
            if layout.state_dtype == "int8":     # lo, and hi unless it ends the row, on block boundaries
                k, m = a // quant.BLOCK, quant.nblocks(b) - a // quant.BLOCK
                rows[r.name + "_absmax"][k:k + m].copy_(srows[r.name + "_absmax"][c // quant.BLOCK:c // quant.BLOCK + m])
        covered += hi - lo
    if covered < max(0, min(s1, n) - s0):
        raise CheckpointError(f"{path}: the shard files of block {name!r} do not cover [{s0}, {min(s1, n)}): "
                              f"the checkpoint is incomplete")


def block_master(path: str, binfo: dict) -> torch.Tensor:
    """The fp32 master row of one block (unpadded, 1-D) from its shard files, each read in
    chunks with its CRC32 checked, so memory holds the master and one chunk, not all rows."""
    n_all = binfo["numel"]
    out = torch.zeros(n_all, dtype=torch.float32)
    covered = 0
    for sh in _shards(binfo):
        n = sh["end"] - sh["start"]
        keep = max(0, min(n_all, sh["end"]) - sh["start"])      # master elements inside the unpadded range
        expect = sh["layout"]["nbytes"] if "layout" in sh else 3 * n * 4
        fname = os.path.join(path, sh["file"])
        crc, pos = 0, 0
        dst = out[sh["start"]:sh["start"] + keep].numpy().view(np.uint8)
        with open(fname, "rb") as f:
            while True:
                chunk = f.read(64 << 20)
                if not chunk:
                    break
                crc = zlib.crc32(chunk, crc)
                a, b = pos, pos + len(chunk)
                if a < 4 * keep:
                    dst[a:min(b, 4 * keep)] = np.frombuffer(chunk, dtype=np.uint8)[:min(b, 4 * keep) - a]
                pos = b
        if pos != expect:
            raise CheckpointError(f"{fname} holds {pos} bytes, expected {expect}: the checkpoint is damaged")
        if crc != sh["crc32"]:
            raise CheckpointError(f"{fname} fails its CRC32 check: the checkpoint is damaged")
        covered += keep
    if covered != n_all:
        raise CheckpointError(f"{path}: the shard files of block {binfo['name'] or '<root>'!r} do not cover it: "
                              f"the checkpoint is incomplete")
    return out


def load(subject: Subject, path: str, rng: bool = True) -> None:
    """``subject``'s state as of checkpoint ``path``; ``rng=False`` leaves the RNG states."""
    path = resolve(path)
    meta = read_meta(path)
    _check_optimizer(subject, meta, path)
    if len(meta["blocks"]) != len(subject.blocks):
        raise CheckpointError(f"{path} has {len(meta['blocks'])} blocks, the model has {len(subject.blocks)}: "
                              f"it was saved from a different model or block grouping")
    with subject.telemetry.span("offload::checkpoint_load"):
        if subject.param_offload is not None:
            subject.param_offload.release_all()   # device copies would be stale
        for i, (b, binfo) in enumerate(zip(subject.blocks, meta["blocks"])):
            lay = b.layout
            names = [s.name for s in lay.segments]
            if binfo["numel"] != lay.numel or [s["name"] for s in binfo["segments"]] != names:
                raise CheckpointError(f"block {binfo['name'] or '<root>'!r} in {path} does not match the "
                                      f"model's block {lay.name or '<root>'!r}: different model or grouping")
            s0, s1 = b.shard
            e = max(s0, min(s1, lay.numel))                  # this rank's unpadded range [s0, e)
            got = []

            def fill(buf, master, i=i, binfo=binfo):
                _fill_state(path, binfo, subject.state_layout(i), buf, s0, s1)
                got.append(master[:e - s0].to("cpu", copy=True))   # this rank's master
            subject.write_state(i, fill, stepped=binfo["stepped"])
            mine = got[0]
            subject.write_params(i, mine, lambda mine=mine, binfo=binfo, whole=(s0, e) == (0, lay.numel):
                                 mine if whole else block_master(path, binfo))
        subject.reset_grads()
        extra = torch.load(os.path.join(path, "extra.pt"), map_location="cpu", weights_only=False)
        sd = subject.module.state_dict(keep_vars=True)
        po = subject.param_offload
        offloaded = po.frozen_io.ids() if po is not None else set()
        # buffers and the frozen parameters the model keeps go through the model's own
        # load_state_dict, as torch loads them: a module that resizes or converts what it
        # loads (its _load_from_state_dict / load_state_dict) does it here too
        tensors = dict(extra["tensors"])
        for q in extra.get("quantized", ()):      # as stored where this engine stores them alike
            ids = [id(sd[k]) for k in q["keys"] if k in sd]
            if not (po is not None and len(ids) == len(q["keys"]) and po.frozen_io.write_quantized(ids, q["blob"], q["code"])):
                tensors.update(extra_tensors({"tensors": {}, "quantized": [q]}))
        rest = {k: _like(v, sd.get(k)) for k, v in tensors.items() if k not in sd or id(sd[k]) not in offloaded}
        if rest:
            subject.module.load_state_dict(rest, strict=False)
        if offloaded:
            po.frozen_io.write({id(sd[k]): v for k, v in tensors.items() if k in sd and id(sd[k]) in offloaded})
        origin.restore_base(subject, meta, path)
        for g, saved in zip(subject.optimizer.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                g[k] = tuple(v) if isinstance(v, list) else v
        subject.set_counters(meta["global_step"], meta["micro_step"])
        subject.scaler.load_state_dict(meta["scaler"])
        if not rng:
            return
        rng_file = os.path.join(path, f"rng.rank{subject.comm.rank}.pt")
        if subject.comm.rank and os.path.exists(rng_file):
            _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False)["rng"])
        else:
            _set_rng_state(extra["rng"])


def _like(v: torch.Tensor, live) -> torch.Tensor:
    """A saved tensor on the live one's device (and, floating-point, in its dtype): what a
    module that replaces a tensor it loads (a resized buffer) keeps."""
    if live is None:
        return v
    dtype = live.dtype if live.is_floating_point() and v.is_floating_point() else None
    return v.to(device=live.device, dtype=dtype)


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- consolidated fp32 ------------------------------------------------------------------------
def export_fp32(path: str) -> Dict[str, torch.Tensor]:
    """The fp32 weights of a checkpoint on disk as a state_dict the original model loads."""
    path = resolve(path)
    meta = read_meta(path)
    extra = extra_tensors(torch.load(os.path.join(path, "extra.pt"), map_location="cpu", weights_only=False))
    masters = {}
    out = {}
    origin.check_files(meta, path)
    headers: dict = {}
    for k, loc in meta["keys"].items():
        if loc.get("base"):
            out[k] = origin.read_base_tensor(meta, k, headers).float()
            continue
        if loc.get("extra"):
            v = extra[k]
            out[k] = v.float() if v.is_floating_point() else v
            continue
        bi = loc["block"]
        if bi not in masters:
            masters[bi] = block_master(path, meta["blocks"][bi])
        n = int(np.prod(loc["shape"])) if loc["shape"] else 1
        out[k] = masters[bi][loc["offset"]:loc["offset"] + n].view(loc["shape"]).clone()
    return out


def live_state_dict(subject: Subject) -> Dict[str, torch.Tensor]:
    """The same consolidated fp32 state_dict from a live engine (streams block by block).
    With ZeRO stages >= 1 across ranks this is a collective: every rank must call it."""
    where = {id(s.param): (i, s) for i, b in enumerate(subject.blocks) for s in b.layout.segments}
    frozen = _frozen_values(subject)
    out = {}
    by_block: Dict[int, list] = {}
    for k, v in subject.module.state_dict(keep_vars=True).items():
        if id(v) in where:
            i, s = where[id(v)]
            by_block.setdefault(i, []).append((k, s))
        else:
            t = frozen[id(v)] if id(v) in frozen else v.detach().to("cpu", copy=True)
            out[k] = t.float() if t.is_floating_point() else t
    comm = subject.comm
    for i, b in enumerate(subject.blocks):
        items = by_block.get(i)
        if not items:
            continue
        with subject.read_state(i) as (_, mine):
            master, base = mine, b.shard[0]
            if comm.active and subject.stage >= 1:   # a collective: every rank calls it
                master, base = torch.empty(b.layout.padded_numel), 0
                comm.all_gather(master, mine.to("cpu").contiguous(), f"full_state_dict of block {b.index}")
            for k, s in items:
                a = s.offset - base
                out[k] = master[a:a + s.numel].to("cpu", copy=True).view(s.shape)
    sd_order = list(subject.module.state_dict().keys())
    return {k: out[k] for k in sd_order}


def _write_json(fname: str, obj) -> None:
    try:
        with open(fname, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise _io_error("writing", fname, exc) from exc


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
