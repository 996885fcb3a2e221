"""Holding a Ctrl-C back while the commit queues a step's updates (``sigint_deferred``)."""
from __future__ import annotations

import _signal
import signal
import threading


class sigint_deferred:
    """Hold a Ctrl-C back until the body ends, then deliver it to the handler that was in
    place (Python's: KeyboardInterrupt). A signal mask cannot do this: SIGINT sent to the
    process lands on any thread that does not block it, and Python raises it on the main
    thread between any two bytecodes all the same. Only the main thread can swap handlers,
    and only a handler Python installed can be put back; elsewhere this does nothing.
    Swapped through ``_signal``, the C module under ``signal``: ``signal``'s wrappers turn
    each handler into an enum member by raising and catching a ValueError, twice per swap,
    which costs step() measurably right after a backward (benchmarks/RESULTS.md)."""

    __slots__ = ("previous", "caught")

    def __enter__(self):
        self.previous, self.caught = None, False
        if threading.current_thread() is not threading.main_thread():
            return self
        previous = _signal.getsignal(signal.SIGINT)
        if previous is None:             # installed outside Python: cannot be restored
            return self
        _signal.signal(signal.SIGINT, self._catch)
        self.previous = previous
        return self

    def _catch(self, signum, frame) -> None:
        self.caught = True

    def __exit__(self, *exc) -> None:
        if self.previous is None:
            return
        _signal.signal(signal.SIGINT, self.previous)
        self.previous = None
        if self.caught:
            _signal.raise_signal(signal.SIGINT)   # now, to the handler in place again
