"""Trained weights out of a live engine, in the Hugging Face layout.

One function, so the source can change in one place: the engine writes its checkpoint into a
scratch directory inside ``out_dir`` (every rank its shard), ``offload.export_hf`` turns it
into sharded safetensors + index + config.json (a PEFT model: its adapter in PEFT's layout),
block by block with bounded host memory, and the scratch directory is removed.
"""
from __future__ import annotations

import os
import shutil

SCRATCH = ".offload-export"


def save_hf(engine, out_dir: str, is_main: bool = True) -> None:
    """Write ``engine``'s trained model to ``out_dir``. Every rank must call it (the
    checkpoint is per rank); the rank with ``is_main`` exports."""
    import offload
    import torch.distributed as dist
    scratch = os.path.join(out_dir, SCRATCH)
    if is_main:
        os.makedirs(out_dir, exist_ok=True)
    engine.save_checkpoint(scratch)
    try:
        if is_main:
            offload.export_hf(scratch, out_dir)
    finally:
        if dist.is_available() and dist.is_initialized() and engine.comm.active:
            dist.barrier()                    # every rank is done with the scratch checkpoint
        if is_main:
            shutil.rmtree(scratch, ignore_errors=True)
            try:                              # the save's lock file: the scratch path is ours alone
                os.remove(scratch + ".lock")
            except FileNotFoundError:
                pass
