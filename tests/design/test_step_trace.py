"""The design doc's step map is true: one warm training step (parameters and optimizer state on
NVMe, one rank) traced on every thread runs exactly the package files listed between the
``step-map`` markers of docs/design.md, in that order (files and their order; the roles are
prose). The trace and the map's order are docs/step_map.py's, the generator that rewrites the
block: ``PYTHONPATH=. python docs/step_map.py --write``."""
import importlib.util
import os

import offload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(offload.__file__)))


def _generator():
    spec = importlib.util.spec_from_file_location("step_map", os.path.join(ROOT, "docs", "step_map.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_one_step_runs_the_files_of_the_design_docs_step_map_in_order(tmp_path):
    step_map = _generator()
    traced = step_map.trace_step(str(tmp_path))
    listed = [rel for rel, _, _ in step_map.doc_map()]
    assert len(listed) == len(set(listed)), "docs/design.md's step map lists a file twice"
    ran = [rel for rel, _ in traced]
    assert ran == listed, (
        "docs/design.md's step map is out of date (files or order).\n"
        f"executed but not listed: {sorted(set(ran) - set(listed))}; "
        f"listed but not executed: {sorted(set(listed) - set(ran))}\n"
        f"the traced map:\n{step_map.render(traced)}"
        f"rewrite it with `{step_map.COMMAND}` (then check the roles of new files)")


def test_the_step_map_lines_round_trip(tmp_path):
    """What --write puts between the markers is what the test reads back: the doc's own block
    rendered from its own files and thread kinds, unchanged."""
    step_map = _generator()
    entries = step_map.doc_map()
    doc = tmp_path / "design.md"
    with open(step_map.DESIGN) as f:
        doc.write_text(f.read())
    step_map.write([(rel, kind) for rel, kind, _ in entries], str(doc))
    assert doc.read_text() == open(step_map.DESIGN).read()
    assert step_map.doc_map(str(doc)) == entries
