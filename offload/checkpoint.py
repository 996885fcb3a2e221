"""Checkpoints: save / resume / consolidated fp32 export.

Layout of a checkpoint directory::

    meta.json          step counters, loss scaler, config, param groups, block table, key map
    block_00000.bin    fp32 rows [master | exp_avg | exp_avg_sq] of block 0, each numel long
    ...                (unpadded, so the files do not depend on world_size)
    extra.pt           frozen parameters, buffers, RNG states

Saving streams block by block from wherever the state lives (an NVMe-resident block visits
one pool buffer), so the model is never materialized whole in RAM. The directory is written
beside the target (``<dir>.tmp-<pid>``), every file fsynced, then swapped in by renames:
``<dir>`` -> ``<dir>.prev``, tmp -> ``<dir>``, then ``<dir>.prev`` is removed. A crash at any
point leaves a loadable checkpoint: ``<dir>`` itself, or ``<dir>.prev`` which ``load`` falls
back to. Every block file carries a CRC32 in meta.json, checked on load.
"""
from __future__ import annotations

import glob
import json
import os
import random
import shutil
import warnings
import zlib
from typing import Dict

import numpy as np
import torch

FORMAT = "offload-checkpoint"
VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged or does not match the model."""


# ---- saving -----------------------------------------------------------------------------
def save(engine, path: str) -> str:
    path = os.path.abspath(path.rstrip("/"))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(glob.escape(path) + ".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a crashed save
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(tmp)
    try:
        with engine.telemetry.span("offload::checkpoint_save"):
            meta = _write_all(engine, tmp)
            _write_json(os.path.join(tmp, "meta.json"), meta)
            _fsync_dir(tmp)
        prev = path + ".prev"
        if os.path.exists(path):
            if os.path.exists(prev):
                shutil.rmtree(prev)
            os.rename(path, prev)
        os.rename(tmp, path)
        _fsync_dir(parent)
        shutil.rmtree(prev, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_all(engine, tmp: str) -> dict:
    blocks = []
    for b in engine.blocks:
        fname = f"block_{b.index:05d}.bin"
        crc = _write_block(os.path.join(tmp, fname), b)
        lay = b.layout
        blocks.append({"index": b.index, "name": lay.name, "numel": lay.numel, "stepped": b.stepped,
                       "file": fname, "crc32": crc,
                       "segments": [{"name": s.name, "offset": s.offset, "numel": s.numel,
                                     "shape": list(s.shape)} for s in lay.segments]})
    keys, extra = _key_map(engine)
    extra_state = {"tensors": extra, "rng": _rng_state()}
    with open(os.path.join(tmp, "extra.pt"), "wb") as f:
        torch.save(extra_state, f)
        f.flush()
        os.fsync(f.fileno())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    return {"format": FORMAT, "version": VERSION, "global_step": engine.global_step,
            "micro_step": engine.micro_step, "scaler": engine.scaler.state_dict(),
            "config": engine.config.to_dict(), "param_groups": groups, "blocks": blocks, "keys": keys,
            "world_size": 1}


def _write_block(fname: str, block) -> int:
    """Stream one block's state rows to ``fname``; returns their CRC32."""
    st = block.state
    n = block.layout.numel
    crc = 0
    state = st.acquire()
    try:
        with open(fname, "wb") as f:
            for row in range(3):
                data = state[row, :n].numpy().tobytes() if n else b""
                crc = zlib.crc32(data, crc)
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
    finally:
        st.drop()
    return crc


def _key_map(engine):
    """state_dict key -> where its fp32 value lives: a block range, or the extra tensors."""
    where = {id(s.param): (b.index, s) for b in engine.blocks for s in b.layout.segments}
    keys, extra = {}, {}
    for k, v in engine.module.state_dict(keep_vars=True).items():
        if id(v) in where:
            bi, seg = where[id(v)]   # the segment's shape: an offloaded parameter may be a placeholder
            keys[k] = {"block": bi, "offset": seg.offset, "shape": list(seg.shape)}
        else:
            keys[k] = {"extra": True}
            extra[k] = v.detach().to("cpu", copy=True)
    return keys, extra


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


# ---- loading ----------------------------------------------------------------------------
def resolve(path: str) -> str:
    path = os.path.abspath(path.rstrip("/"))
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
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{path} is not an offload checkpoint of version {VERSION}")
    return meta


def _read_rows(path: str, binfo: dict) -> np.ndarray:
    """The [3, numel] fp32 rows of one block file, CRC-checked."""
    n = binfo["numel"]
    fname = os.path.join(path, binfo["file"])
    with open(fname, "rb") as f:
        data = f.read()
    if len(data) != 3 * n * 4:
        raise CheckpointError(f"{fname} holds {len(data)} bytes, expected {3 * n * 4}: the checkpoint is damaged")
    if zlib.crc32(data) != binfo["crc32"]:
        raise CheckpointError(f"{fname} fails its CRC32 check: the checkpoint is damaged")
    return np.frombuffer(data, dtype=np.float32).reshape(3, n)


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
            rows = torch.from_numpy(_read_rows(path, binfo).copy())

            def fill(t, rows=rows, n=lay.numel):
                t[:, :n].copy_(rows)
                t[:, n:].zero_()
            b.state.overwrite(fill)
            b.state.reclaim(block=True)
            s0, s1 = b.shard
            with torch.no_grad():
                if b.params is not None:      # offloaded: the home copy, in the compute dtype
                    home = torch.zeros(b.params.numel, dtype=b.params.dtype)
                    home[:lay.numel].copy_(rows[0])
                    b.params.write_home(home)
                else:
                    b.param_flat[s0:s0 + lay.numel].copy_(rows[0])
            b.stepped = binfo["stepped"]
            b.grad.reset_window()
        extra = torch.load(os.path.join(path, "extra.pt"), map_location="cpu", weights_only=False)
        sd = engine.module.state_dict(keep_vars=True)
        with torch.no_grad():
            for k, v in extra["tensors"].items():
                if k in sd:
                    sd[k].copy_(v)
        for g, saved in zip(engine.optimizer.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                g[k] = tuple(v) if isinstance(v, list) else v
        engine.global_step = meta["global_step"]
        engine.micro_step = meta["micro_step"]
        engine.scaler.load_state_dict(meta["scaler"])
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
    for k, loc in meta["keys"].items():
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
    out = {}
    by_block: Dict[int, list] = {}
    for k, v in engine.module.state_dict(keep_vars=True).items():
        if id(v) in where:
            b, s = where[id(v)]
            by_block.setdefault(b.index, []).append((k, s))
        else:
            t = v.detach().to("cpu", copy=True)
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
    with open(fname, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
