"""The config layer's leaf: the one way it reads a JSON file, and its error (``ConfigError``,
defined with the error family in core/errors.py so that the layers below the config raise it
too); schema.py, deepspeed.py and flags.py import them from here; it imports none of them."""
from __future__ import annotations

import json
import os

from offload.core.errors import ConfigError


def read_json(path: str, what: str, fix: str = "", error=ConfigError, missing_error=None):
    """The parsed JSON in ``path``; a missing file or invalid JSON is one clear error naming
    ``what`` and the path (``fix``, e.g. ": give a JSON config file", follows the former)."""
    if not os.path.isfile(path):
        raise (missing_error or error)(f"{what} {path!r} does not exist{fix}")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise error(f"{what} {path!r} is not valid JSON: {exc}") from None
