"""The design doc's step map is true: one warm training step (parameters and optimizer state on
NVMe, one rank) is traced on every thread, and the package's Python files it executes must be
exactly those listed under ``## One step`` in docs/design.md. (Issue 43 withdrew the cap on
their number that issue 35 set: a step may run through more files when each holds one noun.)

How the trace sees every thread: ``threading.settrace`` is set before the engine starts, so each
thread it starts (step workers, I/O threads, the gatherer) carries the global trace function;
files are recorded only while the measured step's window is open. A worker already running a
function when the window opens (a loop blocked on its queue) gets a line tracer on each of its
package frames, so the loop's own file counts once a line of it runs inside the window. The
window is the step's forward, backward and ``step()`` on the main thread, and on the workers
until ``synchronize()`` has drained what that step queued (the work the step started)."""
import os
import re
import sys
import threading

import offload
from _models import batches, make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "offload") + os.sep
DESIGN = os.path.join(ROOT, "docs", "design.md")


class StepTrace:
    """Files under offload/ executed while ``open`` (first-seen order, with the phase)."""

    def __init__(self):
        self.main = threading.get_ident()
        self.recording = False          # workers record while this is set
        self.main_recording = False     # the main thread records while this is set
        self.phase = ""
        self.seen = {}                  # relative path -> phase that first ran it

    def _record(self, filename: str) -> None:
        if filename.startswith(PACKAGE) and filename.endswith(".py"):
            rel = "offload/" + os.path.relpath(filename, PACKAGE).replace(os.sep, "/")
            self.seen.setdefault(rel, self.phase)

    def _on(self) -> bool:
        if threading.get_ident() == self.main:
            return self.main_recording
        return self.recording

    def global_trace(self, frame, event, arg):
        if event == "call" and self._on():
            self._record(frame.f_code.co_filename)
        return None

    def _line_trace(self, frame, event, arg):
        if self._on():
            self._record(frame.f_code.co_filename)
            return None             # one line is enough: stop tracing this frame
        return self._line_trace

    def open(self, phase: str) -> None:
        """Start recording; arm the package frames already on the workers' stacks."""
        self.phase = phase
        me = threading.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            while frame is not None:
                if frame.f_code.co_filename.startswith(PACKAGE):
                    frame.f_trace = self._line_trace
                frame = frame.f_back
        self.recording = self.main_recording = True
        sys.settrace(self.global_trace)


def traced_step(tmp_path):
    tracer = StepTrace()
    threading.settrace(tracer.global_trace)      # every thread the engine starts carries it
    try:
        config = {"optimizer": {"lr": 1e-3},
                  "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                  "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
        eng = offload.initialize(make_model(), config)
        try:
            data = batches(4)
            for x, y in data[:3]:               # warm: orders recorded, files written once
                eng.backward(eng(x, y))
                eng.step()
            eng.synchronize()
            x, y = data[3]
            tracer.open("forward")
            loss = eng(x, y)
            tracer.phase = "backward"
            eng.backward(loss)
            tracer.phase = "step"
            eng.step()
            tracer.main_recording = False       # the workers go on until the step's work is drained
            tracer.phase = "drain"
            eng.synchronize()
            tracer.recording = False
            sys.settrace(None)
        finally:
            eng.close()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return tracer.seen


ENTRY = re.compile(r"^[ \t]*[-*\d.]+\s*`(offload/[\w/]+\.py)`(.*)$", re.M)


def _section(text: str):
    section = re.search(r"^## One step\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/design.md has no '## One step' section"
    return section


def step_map(path: str = DESIGN) -> list:
    """The files listed under ``## One step`` in docs/design.md, in the doc's order."""
    with open(path) as f:
        return [m.group(1) for m in ENTRY.finditer(_section(f.read()).group(1))]


def rewrite_step_map(seen: dict, path: str = DESIGN) -> None:
    """Rewrite the section's list from a trace, in first-run order, keeping each file's role
    (a new file gets ``ROLE?`` to fill in); the prose before the list stays."""
    with open(path) as f:
        text = f.read()
    section = _section(text)
    body = section.group(1)
    roles = {m.group(1): m.group(2) for m in ENTRY.finditer(body)}
    first = ENTRY.search(body)
    intro = body[:first.start()] if first else body.rstrip("\n") + "\n\n"
    lines = [f"- `{rel}`{roles.get(rel, f' ({phase}) ROLE?')}" for rel, phase in seen.items()]
    new = intro + "\n".join(lines) + "\n\n"
    with open(path, "w") as f:
        f.write(text[:section.start(1)] + new + text[section.end(1):])


def test_one_step_runs_the_files_the_design_doc_lists(tmp_path):
    seen = traced_step(tmp_path)
    print(f"\none warm step (optimizer and parameters on NVMe) executes {len(seen)} files of offload/:")
    for rel, phase in seen.items():
        print(f"  {phase:<9}{rel}")
    listed = step_map()
    assert len(listed) == len(set(listed)), "docs/design.md lists a file twice under '## One step'"
    missing, extra = sorted(set(seen) - set(listed)), sorted(set(listed) - set(seen))
    assert not missing and not extra, (f"docs/design.md '## One step' is out of date: executed but not "
                                       f"listed {missing}; listed but not executed {extra}")


if __name__ == "__main__":
    # After a change to what a step runs: PYTHONPATH=. python tests/test_step_trace.py
    # rewrites docs/design.md's list from a fresh trace (fill in the ROLE? of new files).
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        traced = traced_step(d)
    rewrite_step_map(traced)
    print(f"{len(traced)} files; docs/design.md '## One step' rewritten")
