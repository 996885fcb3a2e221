"""The transformers / peft / accelerate versions ``offload.hf`` is tested with.

``offload.hf.Trainer`` follows ``transformers.Trainer``'s training loop through a few of its
methods (saving, resuming, device placement), which change between releases; outside the
tested range it refuses to start rather than train wrongly. ``OFFLOAD_HF_UNTESTED=1``
skips the check (at your own risk).
"""
from __future__ import annotations

import os
from importlib import metadata

# package: (lowest tested, first untested). Update together with the tests in tests/test_hf_*.py.
TESTED = {
    "transformers": ("5.24", "5.25"),
    "accelerate": ("1.15", "1.17"),
    "peft": ("0.21", "0.22"),
}


class VersionError(ImportError):
    """A required package is missing or outside the tested range; the message names the fix."""


def _key(v: str) -> tuple:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits or digits != part:
            out.append(int(digits) if digits else 0)
            break
        out.append(int(digits))
    return tuple(out)


def installed(name: str):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check(*names: str) -> None:
    """Raise VersionError unless every package named is installed within ``TESTED``."""
    if os.environ.get("OFFLOAD_HF_UNTESTED") == "1":
        return
    for name in names:
        lo, hi = TESTED[name]
        have = installed(name)
        spec = f"'{name}>={lo},<{hi}'"
        if have is None:
            raise VersionError(f"offload.hf needs {name}: pip install {spec}")
        if not _key(lo) <= _key(have) < _key(hi):
            raise VersionError(f"offload.hf is tested with {name}>={lo},<{hi}, found {have}: "
                               f"pip install {spec} (or set OFFLOAD_HF_UNTESTED=1 to try this version anyway)")
