"""Which open engine holds which model, and how an engine lets its model go.

One engine per model's parameters at a time.

An engine installs hooks on its model's modules and parameters and keeps their values in its
own buffers (offloaded parameters are placeholders between uses), so two open engines on the
same parameters would both land each gradient (the second finding it gone) and the second
would lay out placeholders. A new engine on parameters an open engine holds therefore takes
them over: the old engine hands the trained weights back to the model and closes (its hooks,
buffers and threads go) before the new one reads the model. An engine whose offloaded
parameters do not fit in host memory cannot hand them back: that is an error naming the fix.

The table holds engines weakly: what keeps an engine alive is whoever holds it. Letting go
(``shut_down``, ``let_go``: ``Engine.close()``'s work) hands the trained weights back where
wanted and releases everything the engine made.

Ending in every order (docs/design.md, Lifecycle, states the rule). An engine's native
resources (its ``Resources``: pools, stores and their I/O contexts) are held here, strongly,
from the moment the engine is built until its close releases them (``register``/``shut_down``):
an engine collected in a reference cycle is therefore finalized (``dropped``) while its stores
are still open, never after their own finalizers ran (the collector calls those first). A
dropped engine closes on the thread that collected it, unless that thread is one of the
engine's own (named ``offload-*``: closing would join it or wait on itself): then a short-lived
``offload-reaper`` thread closes it. What is still open at interpreter exit is closed by an
``atexit`` hook that runs before the stores' own exit finalizers (``weakref.finalize``'s), with
nothing handed back and nothing said; after that, module teardown finds only closed engines.
"""
from __future__ import annotations

import atexit
import collections
import gc
import sys
import threading
import warnings
import weakref
from typing import Optional

from torch import nn

from offload import device as dev
from offload.engine import build
from offload.params import homes as ph
from offload.params.homes import offloaded_bytes
from offload.core.errors import OffloadError


class EngineInUseError(RuntimeError, OffloadError):
    """A model's parameters are held by an open engine that cannot hand them over."""


class EngineClosedError(RuntimeError, OffloadError):
    """A call on an engine after its ``close()``: create a new one with ``offload.initialize``."""


_OPEN: "weakref.WeakSet" = weakref.WeakSet()     # the open engines


_HELD: dict = {}        # id(resources) -> Resources of every engine not yet closed (strong)
_DEFERRED = collections.deque()    # engines dropped on their own threads, for the reaper to close
_reaper_lock = threading.Lock()
_reaper: Optional[threading.Thread] = None
_REAPER_WAIT_S = 120.0  # how long a new engine waits for deferred closes (each close is bounded)
_exit_hooked = False
_exiting = False


def register(engine) -> None:
    """A fully built engine: open (weakly) and its ``Resources`` held (strongly) until its close."""
    _hook_exit()
    _HELD[id(engine.resources)] = engine.resources
    _OPEN.add(engine)


def unhold(resources) -> None:
    _HELD.pop(id(resources), None)


def _hook_exit() -> None:
    """Register ``_close_at_exit`` once, after ``weakref.finalize``'s own exit hook (made here
    first if no finalizer exists yet): atexit runs hooks last-in first-out, so open engines
    close while their stores are still open."""
    global _exit_hooked
    if _exit_hooked:
        return
    weakref.finalize(_OPEN, int)        # a finalizer that never fires: registers weakref's hook now
    atexit.register(_close_at_exit)
    _exit_hooked = True


def _close_at_exit() -> None:
    """At interpreter exit: every engine still open is closed (bounded waits, nothing handed
    back to models about to go, nothing raised or said)."""
    global _exiting
    _exiting = True
    _settle_deferred(_REAPER_WAIT_S)
    for engine in [*_DEFERRED, *_OPEN]:      # (a reaper that did not finish in time leaves some)
        try:
            engine.close(restore=False)
        except BaseException:    # noqa: BLE001 - the process is ending: nothing to report to
            pass


def forget(engine) -> None:
    _OPEN.discard(engine)


def take_over(model: nn.Module) -> None:
    """Close every open engine that holds any of ``model``'s parameters, its trained weights
    handed back to the model first (``close(restore=True)``)."""
    _settle_deferred(_REAPER_WAIT_S)      # engines dropped on their own threads close first
    mine = {id(p) for p in model.parameters()}
    for other in list(_OPEN):
        if other.closed or not any(id(p) in mine for p in other.module.parameters()):
            continue
        if other.param_offload is not None and not restore_wanted(other, None):
            nbytes = offloaded_bytes(other.param_offload)
            raise EngineInUseError(
                f"the model's parameters are held by another open engine, whose offloaded parameters "
                f"({nbytes / 2**30:.2f} GiB) do not fit in host memory to be handed back to the model: save what it "
                f"trained (engine.save_checkpoint(dir), or offload.hf.Trainer.save_model(dir)), close it "
                f"(engine.close(), trainer.close()), then build the new engine with weights=dir")
        other.close(restore=True)


def dropped(engine, _finalizing=sys.is_finalizing, _current=threading.current_thread) -> None:
    """An engine nobody holds any more (its model's hooks hold it weakly), being collected:
    closed with ``restore`` None (False with ZeRO-3 across ranks, where restoring is a
    collective); a warning where it fails or leaves the model with placeholders. On one of the
    engine's own threads the close is handed to the reaper (the engine stays alive until then).
    (Defaults bind what module teardown may already have cleared.)"""
    d = engine.__dict__
    if not d.get("_ready") or d.get("_closed", True) or _finalizing() or _exiting:
        return                   # (at interpreter exit _close_at_exit closed what was open)
    if _current().name.startswith("offload-"):
        _defer(engine)
        return
    _close_dropped(engine)


def _close_dropped(engine) -> None:
    d = engine.__dict__
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


def _defer(engine) -> None:
    """Hand a dropped engine to the reaper thread (started if none runs): holding it keeps the
    engine alive, so the collector leaves it whole (its weak references, ``_OPEN``'s included,
    are gone already)."""
    global _reaper
    with _reaper_lock:
        _DEFERRED.append(engine)
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="offload-reaper", daemon=True)
            _reaper.start()


def _reap() -> None:
    """Close the deferred engines, then end (a later ``_defer`` starts a new reaper)."""
    global _reaper
    while True:
        with _reaper_lock:
            if not _DEFERRED:
                _reaper = None
                return
            engine = _DEFERRED.popleft()
        _close_dropped(engine)
        del engine


def _settle_deferred(timeout: float) -> None:
    """Wait (at most ``timeout`` s) for the reaper to close the engines handed to it."""
    reaper = _reaper
    if reaper is not None and reaper is not threading.current_thread():
        reaper.join(timeout)


def restore_wanted(engine, restore: Optional[bool]) -> bool:
    """``restore``, or (None) whether the engine's offloaded parameters fit in half the
    available host memory (params/homes.py ``restore_fits``; a collective with ZeRO-3 across
    ranks)."""
    if restore is not None:
        return bool(restore)
    return ph.restore_fits(engine.param_offload, engine.comm, engine.stage)


def shut_down(engine, restore: Optional[bool]) -> None:
    """``Engine.close()``'s work: the updates and writes in flight finish (a failure already
    reported is not raised again), the offloaded parameters are handed back when wanted, and
    every hook, thread, buffer, swap file and process group the engine made goes."""
    e = engine
    restored = None
    prior = e.pipeline.failure()
    told = prior is not None and prior.reported      # an earlier call raised it already
    try:
        try:
            e.pipeline.close()
            if e.param_offload is not None:
                e.param_offload.wait_writes()
                e.pipeline.raise_failure()
        except Exception as exc:
            if not (told and exc is prior):
                raise
        else:
            if e.param_offload is not None and restore_wanted(e, restore):
                restored = ph.hand_back_blocks(e.param_offload)
    finally:
        if e._gatherer is not None:
            e._gatherer.close()
        # asynchronous copies still queued on the device (prefetches, activation copies, the
        # last write-backs) read or write pinned pool memory: they complete before it goes
        dev.synchronize(e.device)
        if e.hooks is not None:
            e.hooks.remove()
        if e.param_offload is not None:
            if restored is None:          # what close() leaves as placeholders (dropped warns)
                e._lost = ph.placeholders(e.param_offload)[:3]
            e.param_offload.close()
        if e.activations is not None:
            e.activations.close()
        build.own_master_params(e._master_params)
        e._master_params = []
        try:
            e.resources.release()
        finally:
            unhold(e.resources)
        e.comm.close()
    for seg, t in restored or ():
        seg.param.data = t


# what a closed engine keeps: what the user reaches through it and what describes it
KEPT_AFTER_CLOSE = ("_closed", "module", "optimizer", "config", "telemetry", "rule", "plan", "tier",
                    "state_dtype", "device", "dtype", "stage", "_lost")


def let_go(engine, counters) -> None:
    """Drop all of the engine but ``KEPT_AFTER_CLOSE`` (``counters``: what its step counters
    read from now on) and collect the reference cycles its parts leave (hooks and callbacks
    point back at the engine), so their memory goes now, not at the cyclic collector's next run."""
    d = engine.__dict__
    kept = {k: d[k] for k in KEPT_AFTER_CLOSE if k in d}
    d.clear()
    d.update(kept, control=counters)
    gc.collect()
