"""The error family, read from the package itself: every exception class offload defines is an
``offload.OffloadError`` and keeps its builtin base (``except ValueError`` code keeps working),
every error the README or the design doc names is exported from ``offload``, and no ``assert``
guards anything (``python -O`` removes them)."""
import ast
import builtins
import importlib
import inspect
import os
import pkgutil
import re

import pytest

import offload

PKG = os.path.dirname(offload.__file__)
ROOT = os.path.dirname(PKG)
DOCS = ["README.md", "docs/design.md"]

# Files whose guards are still `assert` statements (block / loan / hook transitions, issue 43):
# each is converted to a named error; this set must end empty.
ASSERTS_PENDING: set = set()

# The builtin each error keeps, so code written against the builtin still catches it.
BUILTIN_BASES = {
    "ConfigError": ValueError, "ModelError": ValueError, "WeightsError": ValueError, "GGUFError": ValueError,
    "DataError": ValueError, "EstimateError": ValueError, "PoolBudgetError": ValueError,
    "VersionError": ImportError,
    "DeviceBudgetError": RuntimeError, "ActivationHostBudgetError": RuntimeError, "BlockError": RuntimeError,
    "CommError": RuntimeError, "JobError": RuntimeError, "CheckpointError": RuntimeError,
    "EngineClosedError": RuntimeError, "EngineInUseError": RuntimeError, "StoreClosedError": RuntimeError,
    "InvariantError": RuntimeError,
    "BlockIOError": OSError, "CheckpointIOError": OSError, "SourceChangedError": OSError, "TierIOError": OSError,
    "NvmeIOError": OSError, "ChecksumError": OSError, "NvmeSpaceError": OSError, "TierTimeout": TimeoutError,
}


def _modules():
    """Every module of the package, imported (the command-line entry point and the native
    library's binary excepted: running the one prints usage, the other is not Python)."""
    out = [offload]
    for info in pkgutil.walk_packages(offload.__path__, "offload."):
        if info.name.endswith(".__main__") or info.name == "offload._offload_native":
            continue
        out.append(importlib.import_module(info.name))
    return out


def _package_exceptions():
    """Every exception class defined in the package (warnings are not errors: they are
    reported, never raised)."""
    found = {}
    for mod in _modules():
        for obj in vars(mod).values():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and not issubclass(obj, Warning)
                    and obj.__module__.split(".")[0] == "offload"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_package_exception_is_an_offload_error():
    found = _package_exceptions()
    assert len(found) >= len(BUILTIN_BASES), sorted(found)      # the walk reached the whole package
    stray = sorted(name for name, cls in found.items() if not issubclass(cls, offload.OffloadError))
    assert not stray, f"exception classes outside the family: {stray}: derive them from offload.OffloadError"


@pytest.mark.parametrize("name", sorted(BUILTIN_BASES))
def test_each_error_is_exported_and_keeps_its_builtin_base(name):
    cls = getattr(offload, name)
    assert issubclass(cls, offload.OffloadError) and issubclass(cls, BUILTIN_BASES[name])


def test_budget_errors_are_one_family():
    for name in ("DeviceBudgetError", "ActivationHostBudgetError", "PoolBudgetError", "NvmeSpaceError"):
        assert issubclass(getattr(offload, name), offload.BudgetError), name
    assert issubclass(offload.BlockIOError, offload.BlockError)


def test_every_exported_error_is_in_the_family():
    errors = [n for n in offload.__all__
              if inspect.isclass(getattr(offload, n)) and issubclass(getattr(offload, n), BaseException)]
    assert {n for n in errors} >= set(BUILTIN_BASES)
    assert all(issubclass(getattr(offload, n), offload.OffloadError) for n in errors)


def _documented_errors():
    """Names ending in Error / Timeout in the user docs, unqualified or as ``offload.X``
    (a builtin or another package's error, e.g. ``torch.OutOfMemoryError``, is not ours)."""
    names = set()
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        for prefix, name in re.findall(r"(?:(\w+)\.)?\b([A-Z]\w*(?:Error|Timeout))\b", text):
            if prefix in ("", "offload") and not hasattr(builtins, name):
                names.add(name)
    return names


def test_every_documented_error_is_exported():
    names = _documented_errors()
    assert {"BlockError", "DeviceBudgetError", "ActivationHostBudgetError"} <= names   # the scan reads the docs
    missing = sorted(n for n in names if n not in offload.__all__)
    assert not missing, f"errors the docs name that `offload` does not export: {missing}"


def _asserts():
    """``path -> line numbers`` of every ``assert`` statement in the package source."""
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                lines = [n.lineno for n in ast.walk(ast.parse(open(path).read(), path)) if isinstance(n, ast.Assert)]
                if lines:
                    out[os.path.relpath(path, ROOT).replace(os.sep, "/")] = lines
    return out


def test_no_assert_guards_a_transition():
    found = _asserts()
    new = {p: lines for p, lines in found.items() if p not in ASSERTS_PENDING}
    assert not new, f"assert statements (removed by python -O): {new}: raise a named error instead"
    done = sorted(ASSERTS_PENDING - set(found))
    assert not done, f"{done} hold no assert any more: remove them from ASSERTS_PENDING"


def test_a_closed_engine_raises_engine_closed_error(tmp_path):
    from _models import make_model
    eng = offload.initialize(make_model(), {"offload_optimizer": {"device": "cpu"}})
    eng.close()
    with pytest.raises(offload.EngineClosedError, match="this engine is closed: create a new one"):
        eng.step()


def test_bad_user_input_raises_its_family():
    """A bad config, a bad --lora spec and too small a corpus, each caught as OffloadError and as
    the builtin it always was."""
    from offload.cli.corpus import Corpus
    from offload.hf.finetune import parse_lora
    import torch
    with pytest.raises(offload.ConfigError, match="offload_optimizer"):
        offload.Config.from_any({"offload_optimizer": {"device": "floppy"}})
    with pytest.raises(offload.OffloadError, match="--lora key 'rank' is unknown"):
        parse_lora("rank=4")
    with pytest.raises(offload.DataError, match="too small"):
        Corpus(torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="too small"):
        Corpus(torch.zeros(10, dtype=torch.uint8))
