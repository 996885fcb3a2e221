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
