"""The root of the package's errors, its families, and the errors of per-block work.

``OffloadError`` is the base of every error offload raises on purpose: ``except
offload.OffloadError`` catches them all. Each error also keeps the builtin base it had
(a ``ConfigError`` is a ``ValueError``, a ``TierIOError`` an ``OSError``), so code catching the
builtin still works. This file imports nothing of the package, so every layer can import it.

Families a caller catches as one: ``BudgetError`` (a configured memory or space budget cannot
hold what is needed), ``BlockError`` (a stage of one block's work failed), and
``InvariantError`` (the package's own bookkeeping disagrees: a bug in offload, not in the use).

A failure on a worker thread (an optimizer job, a state write completing later, a parameter
all-gather) is wrapped once, where it happens, in a ``BlockError`` whose message reads
``"<stage> of block <i> (<name>) failed: <cause>"`` (with the cause's type when it is a
specific one, e.g. ``CommError: ...``); the cause stays chained. An OS-level
cause gives a ``BlockIOError``, which is also an ``OSError`` with the cause's errno and file,
so ``except OSError`` still catches a full disk. The engine raises it from the user's next
call (``backward``, ``step``, the forward, ``synchronize``, ``close``).
"""
from __future__ import annotations

import errno as errno_mod


class OffloadError(Exception):
    """The base of every error offload raises on purpose; the message names the problem and the fix."""


class BudgetError(OffloadError):
    """A configured budget (device bytes, a host pool, the swap directory's space) cannot hold
    what is needed; the message names the budget and what it must hold."""


class InvariantError(RuntimeError, OffloadError):
    """A check of the package's own bookkeeping failed: a bug in offload, not in the caller's
    use (please report it with the message)."""


class ConfigError(ValueError, OffloadError):
    """A configuration key or value is invalid; the message names it and the fix."""


class BlockError(RuntimeError, OffloadError):
    """A stage of one block's work failed (``block``: "3 (layers.2)", ``stage``: its name)."""

    block: str = ""
    stage: str = ""
    reported: bool = False     # raised to the user once already (close() then does not raise it again)


class BlockIOError(OSError, BlockError):
    """A BlockError whose cause is an OS error: ``errno`` and ``filename`` are the cause's."""


def block_error(block: str, stage: str, exc: BaseException) -> BaseException:
    """``exc`` from ``stage`` of ``block`` as a BlockError naming both; a BlockError is
    returned as it is (it already names where it happened), and so are KeyboardInterrupt
    and SystemExit."""
    if isinstance(exc, BlockError) or not isinstance(exc, Exception):
        return exc
    # the cause's type is named unless it says nothing more than the wrapper does
    cause = (exc.strerror or str(exc)) if isinstance(exc, OSError) else \
        str(exc) if type(exc) in (RuntimeError, Exception) else f"{type(exc).__name__}: {exc}"
    msg = f"{stage} of block {block} failed: {cause}"
    if isinstance(exc, OSError):
        code = exc.errno or (errno_mod.ETIMEDOUT if isinstance(exc, TimeoutError) else errno_mod.EIO)
        err: BlockError = BlockIOError(code, msg, exc.filename)
    else:
        err = BlockError(msg)
    err.block, err.stage = block, stage
    err.__cause__ = exc
    return err
