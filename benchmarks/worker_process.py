"""A benchmark configuration in a process of its own, answering requests one at a time.

Some baselines cannot share the measuring process: a state that exists there only before the
engine's native pool first starts (bench_adam's small ops), a process-wide malloc setting
(bench_activations), memory the other configurations fault in and free (bench_prefetch's
compute-only on a CPU device). Such a configuration runs in a subprocess that waits for a
request, does the work, answers and waits again, so the two processes measure in turn, never
at once.

Protocol: one JSON object a line on the worker's stdin, one JSON answer a line on the stream
that was its stdout when ``serve`` started (anything the worker prints later goes to stderr).
Closing stdin ends the worker. Every wait of the caller is bounded.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from typing import Callable, Optional


class WorkerProcess:
    """The caller's side: ``call(**request)`` waits at most ``timeout_s`` for the answer."""

    def __init__(self, cmd: list, what: str, timeout_s: float = 900.0, env: Optional[dict] = None):
        self.what, self.timeout_s = what, timeout_s
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env if env is not None else dict(os.environ))

    def call(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise RuntimeError(f"{self.what} gave no answer to {request} (exit code {self.proc.poll()}, "
                               f"or none within {self.timeout_s:.0f} s); its error is printed above")
        return json.loads(line)

    def close(self, timeout_s: float = 60.0) -> None:
        """End the worker (its stdin closes); killed if it has not exited within ``timeout_s``."""
        try:
            if self.proc.poll() is None:
                self.proc.stdin.close()
                self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)


def serve(handle: Callable[[dict], dict]) -> None:
    """The worker's side: answer each request with ``handle(request)`` until stdin closes."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                 # prints of the work itself go to stderr, not into the protocol
    for line in sys.stdin:
        proto.write(json.dumps(handle(json.loads(line))) + "\n")
