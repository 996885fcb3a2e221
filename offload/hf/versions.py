"""The transformers / accelerate / peft / trl versions ``offload.hf`` supports and is tested with.

``offload.hf.Trainer`` follows ``transformers.Trainer``'s training loop through a few of its
methods (saving, resuming, device placement), which change between releases. The policy:

- older than the lowest supported release, or a release known to break it (``BROKEN``):
  ``VersionError`` naming the fix (it would train wrongly or not at all);
- newer than the newest tested series: one warning naming the tested range, then it runs
  (a new release usually keeps those methods; refusing it would stop every fresh install);
- ``OFFLOAD_HF_UNTESTED=1`` skips the check (no refusal, no warning; at your own risk).

``make test`` runs a subset of the tests against the lowest supported releases
(``lowest_requirements()``, checked installed with ``not_lowest()``).
"""
from __future__ import annotations

import os
import warnings
from importlib import metadata
from typing import Dict, Tuple

from offload.core.errors import OffloadError

# package: (lowest supported release, newest tested minor series). The test extras in
# pyproject.toml allow exactly this range (a test checks it); `make test` runs against the
# newest installable release in it and, for a subset, against the lowest.
TESTED: Dict[str, Tuple[str, str]] = {
    "transformers": ("5.24.0", "5.25"),
    "accelerate": ("1.15.0", "1.16"),
    "peft": ("0.21.0", "0.21"),
    "trl": ("1.16.0", "1.16"),
}

# package: {release: why it cannot be used}; refused whatever the range says.
BROKEN: Dict[str, Dict[str, str]] = {}


class VersionError(ImportError, OffloadError):
    """A required package is missing, too old or a release known to break; the message names the fix."""


class UntestedVersionWarning(UserWarning):
    """A package is newer than the releases ``offload.hf`` is tested with (it runs anyway)."""


_warned = set()


def installed(name: str):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _series(v: str) -> tuple:
    return tuple(int(p) for p in v.split(".")[:2])


def requirement(name: str) -> str:
    """The pip requirement for ``name``'s supported range, e.g. ``transformers>=5.24.0,<5.26``."""
    lo, hi = TESTED[name]
    major, minor = _series(hi)
    return f"{name}>={lo},<{major}.{minor + 1}"


def describe(name: str) -> str:
    lo, hi = TESTED[name]
    return f"{name} {lo} to {hi}.x"


def check(*names: str) -> None:
    """Raise VersionError where a package named is missing, older than ``TESTED``'s lowest
    or in ``BROKEN``; warn once (``UntestedVersionWarning``) where it is newer than the
    newest tested series."""
    if os.environ.get("OFFLOAD_HF_UNTESTED") == "1":
        return
    for name in names:
        have = installed(name)
        spec = f"'{requirement(name)}'"
        if have is None:
            raise VersionError(f"offload.hf needs {name}: pip install {spec}")
        from packaging.version import InvalidVersion, Version   # a dependency of each package checked here
        try:
            v = Version(have)
        except InvalidVersion:
            raise VersionError(f"offload.hf cannot read {name}'s version {have!r}: pip install {spec}") from None
        lo, hi = TESTED[name]
        if have in BROKEN.get(name, {}):
            raise VersionError(f"{name} {have} is known to break offload.hf ({BROKEN[name][have]}): pip install {spec}")
        if v < Version(lo):
            raise VersionError(f"offload.hf supports {name}>={lo} (tested with {describe(name)}), found {have}: "
                               f"pip install -U {spec}")
        if v.release[:2] > _series(hi) and (name, have) not in _warned:
            _warned.add((name, have))
            warnings.warn(f"offload.hf is tested with {describe(name)}; found {name} {have}, newer: running anyway "
                          f"(pip install {spec} for a tested one; OFFLOAD_HF_UNTESTED=1 silences this)",
                          UntestedVersionWarning, stacklevel=2)


def lowest_requirements() -> str:
    """``transformers==5.24.0 accelerate==1.15.0 ...``: the lowest supported releases."""
    return " ".join(f"{n}=={lo}" for n, (lo, _) in TESTED.items())


def not_lowest() -> list:
    """The packages installed at another release than their lowest supported one."""
    out = []
    for n, (lo, _) in TESTED.items():
        have = installed(n)
        if have != lo:
            out.append(f"{n} {have or '(missing)'} (lowest supported: {lo})")
    return out

