"""Checkpoints: save / resume / consolidated fp32 export.

Layout of a checkpoint directory::

    meta.json               step counters, loss scaler, config, param groups, key map, and the
                            block table: per block its shards (rank, [start, end), file, CRC32)
    block_00000.rank0.bin   fp32 rows [master | exp_avg | exp_avg_sq] of rank 0's shard of
    block_00000.rank1.bin   block 0, each (end - start) long: the shard without the padding,
    ...                     so a tail shard is shorter and an all-padding shard has no file
    extra.pt                frozen parameters, buffers, rank 0's RNG states
    rng.rank1.pt ...        the other ranks' RNG states

Every rank writes the shards it owns, in parallel (stage 0: rank 0 writes whole blocks).
Loading reads, for each block, the range the loading rank owns now from whichever files
hold it, so a checkpoint loads at any world size (re-sharded) and bit-exactly at the same
one. Checkpoints of version 1 with one ``block_XXXXX.bin`` per block load as one shard.

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
from typing import Dict

import numpy as np
import torch

from offload.dist.sharding import clip_range
from offload.io import origin

FORMAT = "offload-checkpoint"
VERSION = 2


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged or does not match the model."""


class CheckpointIOError(OSError):
    """Reading or writing a checkpoint file failed: names the operation, the path, the block
    (for a block file) and the errno."""


def _io_error(op: str, path: str, exc: OSError, block=None, during: str = "save") -> CheckpointIOError:
    """``block``: a BlockShard, or a block's name as the checkpoint records it."""
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
def save(engine, path: str) -> str:
    """Every rank calls this with the same ``path`` (a directory all ranks can reach)."""
    comm = engine.comm
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
        return _save_locked(engine, path, parent, tmp)
    finally:
        lock.release()


def _save_locked(engine, path: str, parent: str, tmp: str) -> str:
    comm = engine.comm
    try:
        with engine.telemetry.span("offload::checkpoint_save"):
            mine = _write_shards(engine, tmp)
            shards = comm.gather_objects(mine, "checkpoint save: shard table")   # after every fsync
            if comm.rank != 0:
                comm.barrier("checkpoint save: renamed")
                return path
            meta = _meta(engine, tmp, shards)
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


def _owned(engine, b) -> tuple:
    """The unpadded range of block ``b`` this rank saves (empty: nothing)."""
    if engine.stage == 0:
        return (0, b.layout.numel) if engine.comm.rank == 0 else (0, 0)
    s0, s1 = b.shard
    return s0, max(s0, min(s1, b.layout.numel))


def _write_shards(engine, tmp: str) -> list:
    """This rank's shard files, fsynced; returns their table rows."""
    rank = engine.comm.rank
    rows = []
    for b in engine.blocks:
        a, e = _owned(engine, b)
        if e <= a:
            continue
        fname = f"block_{b.index:05d}.rank{rank}.bin"
        full = os.path.join(tmp, fname)
        try:
            crc = _write_block(full, b, a - b.shard[0], e - b.shard[0])
        except CheckpointIOError:
            raise
        except OSError as exc:
            raise _io_error("writing the state", full, exc, block=b) from exc
        rows.append({"block": b.index, "rank": rank, "start": a, "end": e, "file": fname, "crc32": crc})
    if rank == 0:
        keys, extra = _key_map(engine)
        _save_pt(os.path.join(tmp, "extra.pt"), {"tensors": extra, "rng": _rng_state()})
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


def _meta(engine, tmp: str, shards: list) -> dict:
    by_block: Dict[int, list] = {}
    for rows in shards:
        for r in rows:
            by_block.setdefault(r.pop("block"), []).append(r)
    blocks = []
    for b in engine.blocks:
        lay = b.layout
        blocks.append({"index": b.index, "name": lay.name, "numel": lay.numel, "stepped": b.stepped,
                       "shards": sorted(by_block.get(b.index, []), key=lambda r: r["start"]),
                       "segments": [{"name": s.name, "offset": s.offset, "numel": s.numel,
                                     "shape": list(s.shape)} for s in lay.segments]})
    keys, _ = _key_map(engine, tensors=False)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    return {"format": FORMAT, "version": VERSION, "global_step": engine.global_step,
            "micro_step": engine.micro_step, "scaler": engine.scaler.state_dict(),
            "config": engine.config.to_dict(), "param_groups": groups, "blocks": blocks, "keys": keys,
            "world_size": engine.comm.world, "zero_stage": engine.stage, **origin.record(engine)}


def _write_block(fname: str, block, a: int, e: int) -> int:
    """Stream columns [a, e) of one block shard's state rows to ``fname``; returns their CRC32."""
    st = block.state
    crc = 0
    state = st.acquire()
    try:
        with open(fname, "wb") as f:
            for row in range(3):
                data = state[row, a:e].cpu().numpy().tobytes()
                crc = zlib.crc32(data, crc)
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
    finally:
        st.drop()
    return crc


def _key_map(engine, tensors: bool = True):
    """state_dict key -> where its fp32 value lives: a block range, or the extra tensors."""
    where = {id(s.param): (b.index, s) for b in engine.blocks for s in b.layout.segments}
    base = origin.base_keys(engine)
    sd = engine.module.state_dict(keep_vars=True)
    frozen = _frozen_values(engine, {id(v) for k, v in sd.items() if k not in base}) if tensors else {}
    keys, extra = {}, {}
    for k, v in engine.module.state_dict(keep_vars=True).items():
        if id(v) in where:
            bi, seg = where[id(v)]   # the segment's shape: an offloaded parameter may be a placeholder
            keys[k] = {"block": bi, "offset": seg.offset, "shape": list(seg.shape)}
        elif k in base:              # a frozen parameter read from the base files: referenced, not copied
            keys[k] = {"base": True}
        else:
            keys[k] = {"extra": True}
            if tensors:
                extra[k] = frozen[id(v)] if id(v) in frozen else v.detach().to("cpu", copy=True)
    return keys, extra


def _frozen_values(engine, wanted=None) -> dict:
    """``id(param) -> value`` of the offloaded frozen parameters (read from their homes),
    only those in ``wanted`` (ids) when given: a part with none of them is not read."""
    po = engine.param_offload
    return po.read_frozen(wanted) if po is not None else {}


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
    if meta.get("format") != FORMAT or meta.get("version") not in (1, VERSION):
        raise CheckpointError(f"{path} is not an offload checkpoint of version {VERSION}")
    return meta


def _shards(binfo: dict) -> list:
    if "file" in binfo:        # version 1: one file per block
        return [{"start": 0, "end": binfo["numel"], "file": binfo["file"], "crc32": binfo["crc32"]}]
    return binfo["shards"]


def _read_shard(path: str, sh: dict, block: str = "") -> np.ndarray:
    """The [3, end - start] fp32 rows of one shard file, CRC-checked."""
    n = sh["end"] - sh["start"]
    fname = os.path.join(path, sh["file"])
    try:
        with open(fname, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise _io_error("reading the state", fname, exc, block=block or None, during="load") from exc
    if len(data) != 3 * n * 4:
        raise CheckpointError(f"{fname} holds {len(data)} bytes, expected {3 * n * 4}: the checkpoint is damaged")
    if zlib.crc32(data) != sh["crc32"]:
        raise CheckpointError(f"{fname} fails its CRC32 check: the checkpoint is damaged")
    return np.frombuffer(data, dtype=np.float32).reshape(3, n)


def _read_rows(path: str, binfo: dict, a: int = 0, e: int = None) -> np.ndarray:
    """Rows [3, e - a] of a block's unpadded range [a, e), from whichever shard files hold it
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


def block_master(path: str, binfo: dict) -> torch.Tensor:
    """The fp32 master row of one block (unpadded, 1-D) from its shard files, each read in
    chunks with its CRC32 checked, so memory holds the master and one chunk, not all rows."""
    out = torch.empty(binfo["numel"], dtype=torch.float32)
    covered = 0
    for sh in _shards(binfo):
        n = sh["end"] - sh["start"]
        fname = os.path.join(path, sh["file"])
        crc, pos, dst = 0, 0, out[sh["start"]:sh["end"]].numpy().view(np.uint8)
        with open(fname, "rb") as f:
            while True:
                chunk = f.read(64 << 20)
                if not chunk:
                    break
                crc = zlib.crc32(chunk, crc)
                a, b = pos, pos + len(chunk)
                if a < 4 * n:
                    dst[a:min(b, 4 * n)] = np.frombuffer(chunk, dtype=np.uint8)[:min(b, 4 * n) - a]
                pos = b
        if pos != 3 * n * 4:
            raise CheckpointError(f"{fname} holds {pos} bytes, expected {3 * n * 4}: the checkpoint is damaged")
        if crc != sh["crc32"]:
            raise CheckpointError(f"{fname} fails its CRC32 check: the checkpoint is damaged")
        covered += n
    if covered != binfo["numel"]:
        raise CheckpointError(f"{path}: the shard files of block {binfo['name'] or '<root>'!r} do not cover it: "
                              f"the checkpoint is incomplete")
    return out


def load(engine, path: str) -> None:
    path = resolve(path)
    meta = read_meta(path)
    if len(meta["blocks"]) != len(engine.blocks):
        raise CheckpointError(f"{path} has {len(meta['blocks'])} blocks, the model has {len(engine.blocks)}: "
                              f"it was saved from a different model or block grouping")
    with engine.telemetry.span("offload::checkpoint_load"):
        if engine.param_offload is not None:
            engine.param_offload.release_all()   # device copies would be stale
        for b, binfo in zip(engine.blocks, meta["blocks"]):
            lay = b.layout
            names = [s.name for s in lay.segments]
            if binfo["numel"] != lay.numel or [s["name"] for s in binfo["segments"]] != names:
                raise CheckpointError(f"block {binfo['name'] or '<root>'!r} in {path} does not match the "
                                      f"model's block {lay.name or '<root>'!r}: different model or grouping")
            s0, s1 = b.shard
            e = max(s0, min(s1, lay.numel))                  # this rank's unpadded range [s0, e)
            rows = torch.from_numpy(_read_rows(path, binfo, s0, e))

            def fill(t, rows=rows, m=e - s0):
                t[:, :m].copy_(rows)
                t[:, m:].zero_()
            b.state.overwrite(fill)
            b.state.reclaim(block=True)
            with torch.no_grad():
                if b.params is not None and b.params.home_numel == s1 - s0:   # the home holds the shard
                    home = torch.zeros(b.params.home_numel, dtype=b.params.dtype)
                    home[:e - s0].copy_(rows[0])
                    b.params.write_home(home)
                else:
                    master = rows[0] if (s0, e) == (0, lay.numel) else \
                        torch.from_numpy(_read_rows(path, binfo)[0])
                    if b.params is not None:  # offloaded: the home copy, in the compute dtype
                        home = torch.zeros(b.params.home_numel, dtype=b.params.dtype)
                        home[:lay.numel].copy_(master)
                        b.params.write_home(home)
                    else:
                        b.param_flat[:lay.numel].copy_(master)
            b.stepped = binfo["stepped"]
            b.grad.reset_window()
        extra = torch.load(os.path.join(path, "extra.pt"), map_location="cpu", weights_only=False)
        sd = engine.module.state_dict(keep_vars=True)
        offloaded = engine.param_offload.frozen_ids() if engine.param_offload is not None else set()
        with torch.no_grad():
            for k, v in extra["tensors"].items():
                if k in sd and id(sd[k]) not in offloaded:
                    sd[k].copy_(v)
        if offloaded:
            engine.param_offload.write_frozen({id(sd[k]): v for k, v in extra["tensors"].items()
                                               if k in sd and id(sd[k]) in offloaded})
        origin.restore_base(engine, meta, path)
        for g, saved in zip(engine.optimizer.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                g[k] = tuple(v) if isinstance(v, list) else v
        engine.global_step = meta["global_step"]
        engine.micro_step = meta["micro_step"]
        engine.scaler.load_state_dict(meta["scaler"])
        rng = os.path.join(path, f"rng.rank{engine.comm.rank}.pt")
        if engine.comm.rank and os.path.exists(rng):
            _set_rng_state(torch.load(rng, map_location="cpu", weights_only=False)["rng"])
        else:
            _set_rng_state(extra["rng"])


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
    extra = torch.load(os.path.join(path, "extra.pt"), map_location="cpu", weights_only=False)["tensors"]
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
            masters[bi] = torch.from_numpy(_read_rows(path, meta["blocks"][bi])[0].copy())
        n = int(np.prod(loc["shape"])) if loc["shape"] else 1
        out[k] = masters[bi][loc["offset"]:loc["offset"] + n].view(loc["shape"]).clone()
    return out


def live_state_dict(engine) -> Dict[str, torch.Tensor]:
    """The same consolidated fp32 state_dict from a live engine (streams block by block).
    With ZeRO stages >= 1 across ranks this is a collective: every rank must call it."""
    where = {id(s.param): (b, s) for b in engine.blocks for s in b.layout.segments}
    frozen = _frozen_values(engine)
    out = {}
    by_block: Dict[int, list] = {}
    for k, v in engine.module.state_dict(keep_vars=True).items():
        if id(v) in where:
            b, s = where[id(v)]
            by_block.setdefault(b.index, []).append((k, s))
        else:
            t = frozen[id(v)] if id(v) in frozen else v.detach().to("cpu", copy=True)
            out[k] = t.float() if t.is_floating_point() else t
    for b in engine.blocks:
        items = by_block.get(b.index)
        if not items:
            continue
        state = b.state.acquire()
        try:
            master, base = state[0], b.shard[0]
            if engine.comm.active and engine.stage >= 1:   # a collective: every rank calls it
                master, base = torch.empty(b.layout.padded_numel), 0
                engine.comm.all_gather(master, state[0].to("cpu").contiguous(), f"full_state_dict of block {b.index}")
            for k, s in items:
                a = s.offset - base
                out[k] = master[a:a + s.numel].to("cpu", copy=True).view(s.shape)
        finally:
            b.state.drop()
    sd_order = list(engine.module.state_dict().keys())
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
