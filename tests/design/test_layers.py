"""The package's shape, read from its own source against docs/design.md's layer table: every
module's imports are allowed by its row, every module has a row, every path a row names
exists, and no import circle. Every ``import`` counts, the ones inside functions and under
``TYPE_CHECKING`` too: a deferred import is still a dependency.

The table is the contract a reader trusts, so it is parsed, not copied here: a row is
``| <paths covered> | <what it is> | <may import> |`` with paths in backticks, relative to
``offload/`` (a folder ends in ``/``). The longest path that covers a module picks its row.
A module may import its own folder (or file) and what its "may import" cell names:
backticked paths, ``the boundaries`` (the boundaries row's paths), ``every layer above``
(every row listed before it), ``any layer``, or ``nothing of the package``."""
import ast
import functools
import io
import os
import re
import tokenize

import offload

PKG = os.path.dirname(offload.__file__)
ROOT = os.path.dirname(PKG)
DESIGN = os.path.join(ROOT, "docs", "design.md")

# Imports docs/design.md's table does not allow and that are to change (the table states the
# intent; each entry says where the import should point). Keys are (importing path, imported
# path), each a file or a folder (ending in "/") covering the modules, so a file moved within
# its folder keeps its entry. An entry that covers no import any more fails
# test_pending_imports_still_exist: delete it then.
PENDING = {
    ("params/homes.py", "io/"):
        "read_range (io/safetensors.py), checksum (io/loader.py): reading a byte range of a checkpoint file "
        "in place and its CRC32C belong to storage/source.py, which params/ may import",
}


def _pending(violation) -> list:
    """The PENDING entries that cover an import (module path, imported path)."""
    m, d = violation
    return [k for k in PENDING if _covers(k[0], m) and _covers(k[1], d)]


def _path(module: str) -> str:
    """``offload.core.blocks`` -> ``core/blocks.py``; a package -> its ``__init__.py``."""
    rel = module.split(".")[1:]
    full = os.path.join(PKG, *rel)
    if os.path.isdir(full):
        return "/".join(rel + ["__init__.py"])
    return "/".join(rel) + ".py"


@functools.lru_cache(maxsize=None)
def _modules() -> dict:
    """module name -> set of offload modules it imports (any scope). ``from a import b`` is a
    dependency on the module ``a.b`` when that is a module, else on ``a``."""
    out, raw = {}, {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
            package = name if f == "__init__.py" else name.rpartition(".")[0]
            deps = []
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.Import):
                    deps += [(a.name, None) for a in node.names if a.name.split(".")[0] == "offload"]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                        base = ".".join(parts + ([base] if base else []))
                    if base.split(".")[0] == "offload":
                        deps += [(base, a.name) for a in node.names]
            raw[name] = deps
    known = set(raw)
    for name, deps in raw.items():
        resolved = set()
        for base, attr in deps:
            target = f"{base}.{attr}" if attr and f"{base}.{attr}" in known else base
            while target not in known:           # an imported name resolves to its module
                target = target.rpartition(".")[0]
            resolved.add(target)
        out[name] = resolved - {name}
    return out


TOKEN = re.compile(r"`([\w/]+/|[\w/]+\.py)`")       # a backticked folder or file; other code is prose


def layer_table(path: str = DESIGN) -> list:
    """The rows of docs/design.md's layer table, in order: (label, paths, may-import cell)."""
    with open(path) as f:
        text = f.read()
    section = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    if section is None:
        raise AssertionError("docs/design.md has no '## Layers' section")
    rows = []
    for line in section.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3 or cells[0] in ("layer", "---"):
            continue
        rows.append((cells[0], TOKEN.findall(cells[0]), cells[2]))
    if not rows:
        raise AssertionError("docs/design.md '## Layers' has no table rows")
    return rows


def _covers(entry: str, path: str) -> bool:
    return path.startswith(entry) if entry.endswith("/") else path == entry


def _row_of(rows: list, path: str):
    """The index of the row whose longest path covers ``path`` (None: no row does)."""
    best = None
    for i, (_, paths, _) in enumerate(rows):
        for entry in paths:
            if _covers(entry, path) and (best is None or len(entry) > best[1]):
                best = (i, len(entry))
    return None if best is None else best[0]


def _allowed(rows: list, i: int):
    """Row ``i``'s may-import cell as a list of path entries, or None for ``any layer``."""
    cell = rows[i][2]
    if "any layer" in cell:
        return None
    allowed = list(TOKEN.findall(cell))
    if "the boundaries" in cell:
        allowed += next(paths for label, paths, _ in rows if label.startswith("boundaries"))
    if "every layer above" in cell:
        allowed += [p for _, paths, _ in rows[:i] for p in paths]
    if not allowed and "nothing of the package" not in cell:
        raise AssertionError(f"docs/design.md layer row {rows[i][0]!r}: its may-import cell "
                             f"{cell!r} names nothing this test reads (backticked paths, "
                             f"'the boundaries', 'every layer above', 'any layer', 'nothing of the package')")
    return allowed


def _violations() -> list:
    rows, mods = layer_table(), _modules()
    bad = []
    for m, deps in sorted(mods.items()):
        path = _path(m)
        i = _row_of(rows, path)
        if i is None:
            continue                                 # test_every_module_has_a_row names it
        allowed = _allowed(rows, i)
        if allowed is None:
            continue
        own = [e for e in rows[i][1] if _covers(e, path)]
        for d in sorted(deps):
            dpath = _path(d)
            if not any(_covers(e, dpath) for e in allowed + own):
                bad.append((path, dpath))
    return bad


def test_every_module_imports_only_what_its_row_allows():
    bad = [v for v in _violations() if not _pending(v)]
    assert not bad, ("imports docs/design.md's layer table does not allow (fix the import, or the "
                     "table's row if the import is right):\n" +
                     "\n".join(f"  offload/{m} imports offload/{d}" for m, d in bad))


def test_pending_imports_still_exist():
    gone = sorted(set(PENDING) - {k for v in _violations() for k in _pending(v)})
    assert not gone, ("these imports no longer break the layer table: delete them from PENDING in "
                      f"tests/design/test_layers.py: {gone}")


def test_every_module_has_a_row():
    rows = layer_table()
    orphans = sorted(_path(m) for m in _modules() if _row_of(rows, _path(m)) is None)
    assert not orphans, ("modules no row of docs/design.md's layer table covers (add them to a row): "
                         + ", ".join(f"offload/{p}" for p in orphans))


def test_every_path_in_the_table_exists():
    rows = layer_table()
    named = {p for i, (_, paths, cell) in enumerate(rows) for p in paths + TOKEN.findall(cell)}
    missing = sorted(p for p in named
                     if not (os.path.isdir if p.endswith("/") else os.path.isfile)(os.path.join(PKG, p)))
    assert not missing, ("docs/design.md's layer table names paths that do not exist under offload/: "
                         + ", ".join(missing))


def test_the_table_keeps_core_at_the_bottom_and_the_engine_above_the_layers():
    """The two rules that matter most, checked on the table itself so an edit of the doc cannot
    loosen them: ``core/`` imports only the boundaries, and nothing under ``core/``,
    ``storage/``, ``dist/``, ``optim/``, ``params/``, ``io/`` may import ``engine/``."""
    rows = layer_table()
    row = {paths[0]: i for i, (_, paths, _) in enumerate(rows) if paths}
    boundaries = next(paths for label, paths, _ in rows if label.startswith("boundaries"))
    assert sorted(_allowed(rows, row["core/"])) == sorted(boundaries), \
        "docs/design.md: core/ may import only the boundaries"
    for layer in ("core/", "storage/", "dist/", "optim/", "params/", "io/"):
        allowed = _allowed(rows, row[layer])
        assert allowed is not None and not any(e.startswith("engine/") for e in allowed), \
            f"docs/design.md: {layer} may not import engine/"


def test_no_import_circle():
    mods = _modules()
    # a package's __init__ re-exporting its modules is not a dependency of those modules
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in mods.items()}
    cycles, state = [], {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d == "offload" or d.startswith(m + "."):
                continue
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


# Files docs/design.md names as a target, not yet in the tree. Once one exists, the doc's line
# must describe it as it is: test_every_file_the_design_doc_names_exists fails until the entry
# is deleted here.
TARGETS: dict = {}


def test_every_file_the_design_doc_names_exists():
    """A path in backticks anywhere in docs/design.md names a file or folder of the tree: from
    the repository root, from ``offload/``, or (a bare file name in a folder's paragraph, e.g.
    the planner's ``estimate.py``) one file under ``offload/``. ``myrule`` is the doc's
    placeholder for a new update rule; ``TARGETS`` the files the doc names as a target."""
    with open(DESIGN) as f:
        named = set(re.findall(r"`([\w./-]+(?:/|\.py|\.c|\.h|\.md))`", f.read()))
    files = {f for _, _, fs in os.walk(PKG) for f in fs}

    landed = sorted(p for p in TARGETS if os.path.exists(os.path.join(PKG, p)))
    assert not landed, (f"{landed} exist now: describe them as they are in docs/design.md (not as a "
                        "target) and delete them from TARGETS in tests/design/test_layers.py")

    def exists(p):
        if "myrule" in p or p in TARGETS:
            return True
        if any(os.path.exists(os.path.join(base, p)) for base in (ROOT, PKG)):
            return True
        return "/" not in p and p in files
    missing = sorted(p for p in named if not exists(p))
    assert not missing, f"docs/design.md names paths that do not exist: {missing}"


# A figure of speed or time quoted in a comment or docstring: a number with a time or rate
# unit, or "Nx / N% faster / slower". Measurements go to benchmarks/RESULTS.md; the comment
# keeps the reason. (A range of accepted values, "0..60000 ms", is a limit, not a measurement.)
MEASUREMENT = re.compile(
    r"(?<![.\d])\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:ms|us|µs|ns|GB/s|GiB/s|MB/s|MiB/s|s/step|s a step|s per step)\b"
    r"|\b\d+(?:\.\d+)?x (?:faster|slower)|\b\d+(?:\.\d+)? ?% (?:faster|slower)")
# Quoted figures still in a file another change owns, by their text (they survive a move):
# delete the figure from the comment (benchmarks/RESULTS.md has it) and the entry here.
MEASUREMENTS_PENDING: dict = {}


def _comments(path: str):
    """(line, text) of every comment and docstring of a Python or C file."""
    with open(path, encoding="utf-8") as f:
        src = f.read()
    if path.endswith(".py"):
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string
        for node in ast.walk(ast.parse(src, path)):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield getattr(node, "lineno", 1), doc
    else:
        for m in re.finditer(r"/\*.*?\*/|//[^\n]*", src, re.S):
            yield src.count("\n", 0, m.start()) + 1, m.group(0)


def test_no_measurements_in_comments():
    found = []
    for base in (PKG, os.path.join(ROOT, "native")):
        for root, _, files in os.walk(base):
            for f in sorted(files):
                if f.endswith((".py", ".c", ".h")):
                    path = os.path.join(root, f)
                    found += [(os.path.relpath(path, ROOT), line, m.group(0))
                              for line, text in _comments(path) for m in MEASUREMENT.finditer(text)]
    bad = [x for x in found if x[2] not in MEASUREMENTS_PENDING]
    assert not bad, ("measurements quoted in comments (move each to benchmarks/RESULTS.md, keep the "
                     "reason without the number): " + "; ".join(f"{p} near line {n}: {t!r}" for p, n, t in bad))
    gone = sorted(set(MEASUREMENTS_PENDING) - {t for _, _, t in found})
    assert not gone, f"no comment quotes these any more: delete them from MEASUREMENTS_PENDING: {gone}"
