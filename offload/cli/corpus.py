"""A local text corpus and a byte-level tokenizer, so `offload train` needs no downloads.

The default corpus is prose already on every machine with Python: the help topics of the
standard library's ``pydoc_data.topics`` (about 450 KB of English). When that module is missing
(some distributions strip it) a few standard-library source files are used instead. Any UTF-8
(or binary) file can be given by path.

Tokens are bytes (vocabulary 256): no tokenizer files, and any text round-trips.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from offload.hf.data import DataError

VOCAB_SIZE = 256


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes as a 1D uint8 tensor."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def default_text() -> Tuple[str, str]:
    """(name, text) of the built-in corpus."""
    try:
        from pydoc_data import topics  # the stdlib's help() texts
        return "pydoc_data.topics", "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    except ImportError:
        pass
    # Stripped distributions still ship the standard library's sources: use a few of them.
    return stdlib_source()


def stdlib_source() -> Tuple[str, str]:
    """(name, text): the Python source of a few standard-library modules (about 400 KB)."""
    import inspect
    import argparse, difflib, textwrap, dataclasses, typing  # noqa: E401
    mods = (argparse, difflib, textwrap, dataclasses, typing)
    return "stdlib sources", "\n\n".join(inspect.getsource(m) for m in mods)


TEXTS = {"pydoc": default_text, "stdlib": stdlib_source}


class Corpus:
    """A token stream split into train/validation parts, sampled as (input, target) windows.

    # tokens: 1D uint8 on the host; batches are int64 (B, T) on the requested device.
    """

    def __init__(self, tokens: torch.Tensor, name: str = "corpus", val_fraction: float = 0.05):
        if tokens.numel() < 1024:
            raise DataError(f"corpus {name!r} is too small ({tokens.numel()} bytes): give at least 1 KiB of text")
        self.name = name
        n_val = max(int(tokens.numel() * val_fraction), 512)
        self.train = tokens[:-n_val]
        self.val = tokens[-n_val:]

    @classmethod
    def load(cls, path: Optional[str] = None) -> "Corpus":
        """The file at ``path`` (read as bytes), or the built-in corpus when ``path`` is None."""
        if path is None:
            name, text = default_text()
            return cls(encode(text), name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"corpus file {path!r} does not exist: give a text file")
        with open(path, "rb") as f:
            data = f.read()
        return cls(torch.frombuffer(bytearray(data), dtype=torch.uint8), path)

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator, split: str = "train",
              device: torch.device | str = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
        """Random windows: inputs (B, T) and the same windows shifted by one as targets."""
        data = self.train if split == "train" else self.val
        if data.numel() <= seq_len + 1:
            raise DataError(f"the {split} split ({data.numel()} bytes) is shorter than seq_len={seq_len}")
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
        window = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()
        return window[:, :-1].to(device), window[:, 1:].to(device)
