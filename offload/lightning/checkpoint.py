"""The layout of a Lightning checkpoint written by the offload strategies: a directory at
the path Lightning names (``epoch=0-step=8.ckpt``, ``last.ckpt``, ``fabric.save``'s path)
holding the engine's checkpoint (``offload/``: weights, fp32 master, optimizer state,
counters; every rank writes its shard) and the rest of Lightning's state (``lightning.pt``:
loops, callbacks, LR schedulers, hyper-parameters, the user's objects; rank 0 writes it).
"""
from __future__ import annotations

import os

from offload.io.checkpoint import CheckpointError

ENGINE_DIR = "offload"
REST_FILE = "lightning.pt"


def engine_dir(path) -> str:
    return os.path.join(os.fspath(path), ENGINE_DIR)


def save_rest(checkpoint_io, rest: dict, path, is_main: bool) -> None:
    """Lightning's state beside the engine's checkpoint (saved first, which made the
    directory); the save's lock file goes once the checkpoint is whole."""
    if not is_main:
        return
    checkpoint_io.save_checkpoint(rest, os.path.join(os.fspath(path), REST_FILE))
    try:
        os.remove(engine_dir(path) + ".lock")
    except FileNotFoundError:
        pass


def load_rest(checkpoint_io, path, weights_only=None) -> dict:
    """Lightning's state of a checkpoint directory; a path that is not one is an error naming it."""
    path = os.fspath(path)
    rest = os.path.join(path, REST_FILE)
    if not (os.path.isdir(engine_dir(path)) and os.path.isfile(rest)):
        raise CheckpointError(f"{path!r} is not a checkpoint of the offload strategy (a directory with "
                              f"{ENGINE_DIR}/ and {REST_FILE}): resume from a checkpoint it saved, or start from "
                              f"plain weights by loading them into the model before setup")
    return checkpoint_io.load_checkpoint(rest, weights_only=weights_only) if weights_only is not None \
        else checkpoint_io.load_checkpoint(rest)
