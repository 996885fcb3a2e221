"""Which open engine holds which model: one engine per model's parameters at a time.

An engine installs hooks on its model's modules and parameters and keeps their values in its
own buffers (offloaded parameters are placeholders between uses), so two open engines on the
same parameters would both land each gradient (the second finding it gone) and the second
would lay out placeholders. A new engine on parameters an open engine holds therefore takes
them over: the old engine hands the trained weights back to the model and closes (its hooks,
buffers and threads go) before the new one reads the model. An engine whose offloaded
parameters do not fit in host memory cannot hand them back: that is an error naming the fix.

The table holds engines weakly: what keeps an engine alive is whoever holds it.
"""
from __future__ import annotations

import sys
import warnings
import weakref

from torch import nn

from offload.params.homes import offloaded_bytes


class EngineInUseError(RuntimeError):
    """A model's parameters are held by an open engine that cannot hand them over."""


_OPEN: "weakref.WeakSet" = weakref.WeakSet()     # the open engines


def register(engine) -> None:
    _OPEN.add(engine)


def forget(engine) -> None:
    _OPEN.discard(engine)


def take_over(model: nn.Module) -> None:
    """Close every open engine that holds any of ``model``'s parameters, its trained weights
    handed back to the model first (``close(restore=True)``)."""
    mine = {id(p) for p in model.parameters()}
    for other in list(_OPEN):
        if other.closed or not any(id(p) in mine for p in other.module.parameters()):
            continue
        if other.param_offload is not None and not other._restore_wanted(None):
            nbytes = offloaded_bytes(other.param_offload)
            raise EngineInUseError(
                f"the model's parameters are held by another open engine, whose offloaded parameters "
                f"({nbytes / 2**30:.2f} GiB) do not fit in host memory to be handed back to the model: save what it "
                f"trained (engine.save_checkpoint(dir), or offload.hf.Trainer.save_model(dir)), close it "
                f"(engine.close(), trainer.close()), then build the new engine with weights=dir")
        other.close(restore=True)


def dropped(engine) -> None:
    """An engine nobody holds any more (its model's hooks hold it weakly), being collected:
    closed with ``restore`` None (False with ZeRO-3 across ranks, where restoring is a
    collective); a warning where it fails or leaves the model with placeholders."""
    d = engine.__dict__
    if not d.get("_ready") or d.get("_closed", True) or sys.is_finalizing():
        return                   # (at interpreter exit the process lets everything go)
    collective = engine.comm.active and engine.stage == 3
    try:
        engine.close(restore=False if collective else None)
        lost = d.get("_lost") or []
    except Exception as exc:     # nothing to raise to: say it
        warnings.warn(f"offload: an engine dropped without close() failed to close: {exc!r}", RuntimeWarning)
        return
    if lost:
        warnings.warn(f"offload: an engine was dropped without close() and its model's offloaded parameters "
                      f"({', '.join(lost)}, ...) did not fit in host memory to be restored: they are empty "
                      f"placeholders now. Keep the engine (or its Trainer) until its weights are saved, and "
                      f"close() it", RuntimeWarning)
