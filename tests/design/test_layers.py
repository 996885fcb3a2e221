"""The package's shape, read from its own source: layers point one way (core/ beneath
everything, nothing under params/, optim/, storage/, io/ reaching up into engine/), no
import circle between modules, and a thin engine facade. Every ``import`` counts, the ones
inside functions too: a deferred import is still a dependency."""
import ast
import os

import offload

PKG = os.path.dirname(offload.__file__)


def _modules() -> dict:
    """module name -> set of offload modules it imports (any scope)."""
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
            name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
            package = name if f == "__init__.py" else name.rpartition(".")[0]
            deps = set()
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names if a.name.startswith("offload")}
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                        base = ".".join(parts + ([base] if base else []))
                    if base.startswith("offload"):
                        for a in node.names:   # "from offload.x import y": y may be a module
                            deps.add(f"{base}.{a.name}")
                        deps.add(base)
            out[name] = deps
    known = set(out)
    for name, deps in out.items():      # keep modules only (an imported name resolves to its module)
        out[name] = {d if d in known else d.rpartition(".")[0] for d in deps} & known - {name}
    return out


def test_lower_layers_do_not_import_the_engine():
    mods = _modules()
    bad = [(m, d) for m, deps in mods.items() for d in deps
           if m.split(".")[1:2] and m.split(".")[1] in ("params", "optim", "storage", "io", "core", "dist")
           and d.startswith("offload.engine")]
    assert not bad, f"imports from engine/ below it: {bad}"


def test_core_imports_only_core_and_the_boundaries():
    allowed = ("offload.core", "offload.device", "offload._native", "offload.dtypes")
    bad = [(m, d) for m, deps in _modules().items() if m.startswith("offload.core")
           for d in deps if not d.startswith(allowed) and d != "offload"]
    assert not bad, f"core/ imports a layer above it: {bad}"


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
