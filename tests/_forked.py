"""Processes of their own for the tests that need them, without paying the imports each time.

A test that must run the engine in a fresh process (a hang bounded by a timeout, a resume in
a new process, one process per rank) starts a child forked from a server process (Python's
multiprocessing "forkserver") that has imported torch, torch._dynamo (which the constructor of
torch.optim.Optimizer imports at its first call) and the engine once, and nothing else: no
engine, no torch op, no thread pool. Each child then starts in ~0.1 s instead of the ~6 s a
`python` subprocess spends importing.

The server starts at the first use, with the environment of that moment, and every child
inherits that environment; a test that changes an OFFLOAD_*, OMP_* or MALLOC_* variable first
must run a subprocess of its own instead (start() refuses).
"""
import multiprocessing
import os
import socket
import traceback

PRELOAD = ["torch._dynamo", "offload", "_models", "_failure_worker", "_resume_worker", "_zero_worker",
           "_checkpoint_worker", "_nvme_worker", "_job_worker", "_lightning_worker"]
_WATCHED = ("OFFLOAD_", "OMP_", "MALLOC_", "GOMP_", "KMP_")
_server_env = None


def _watched_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith(_WATCHED)}


def _context():
    global _server_env
    ctx = multiprocessing.get_context("forkserver")
    if _server_env is None:
        ctx.set_forkserver_preload(PRELOAD)
        _server_env = _watched_env()
    elif _watched_env() != _server_env:
        raise RuntimeError(f"the environment changed since the fork server started ({_server_env} -> "
                           f"{_watched_env()}): run this case in a subprocess of its own")
    return ctx


def context():
    """The fork server's multiprocessing context: for the events and barriers passed to a
    child started here."""
    return _context()


def start(target, *args):
    """A child forked from the server, running target(*args); target is a module-level
    function of a module the server imports (PRELOAD). Returns the started Process."""
    p = _context().Process(target=target, args=args)
    p.start()
    return p


def _send_result(target, args, conn):
    try:
        conn.send(("ok", target(*args)))
    except BaseException:   # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class Child:
    """target(*args) running in a child; ``result`` waits for its answer. Several run at once
    when started one after the other and waited for in turn."""

    def __init__(self, target, *args):
        self._ours, theirs = _context().Pipe(duplex=False)
        self.process = start(_send_result, target, args, theirs)
        theirs.close()

    def result(self, *, timeout_s: float, what: str):
        """The child's result; AssertionError with the child's traceback if it raised, or
        naming ``what`` if no result came within timeout_s (the child is killed)."""
        p, got = self.process, None
        if self._ours.poll(timeout_s):
            try:
                got = self._ours.recv()
            except EOFError:              # the child died before it could answer
                p.join(10)
                raise AssertionError(f"{what} died without a result (exit code {p.exitcode})") from None
        p.join(10)
        if got is None or p.is_alive():
            p.kill()
            p.join()
            raise AssertionError(f"{what}: no result within {timeout_s} s (hung)")
        kind, result = got
        if kind != "ok":
            raise AssertionError(f"{what} raised:\n{result}")
        if p.exitcode != 0:
            raise AssertionError(f"{what} exited with {p.exitcode}")
        return result


def call(target, *args, timeout_s: float, what: str):
    """target(*args) in a child; returns its result (``Child.result``)."""
    return Child(target, *args).result(timeout_s=timeout_s, what=what)


def free_port() -> int:
    """A TCP port on the loopback that was free a moment ago, for a rendezvous of ranks."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
