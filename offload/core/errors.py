"""Errors of the engine's per-block work, naming the block and the stage where they happened.

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


class BlockError(RuntimeError):
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
