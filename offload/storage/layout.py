"""The on-disk extent layout of one NVMe key, described once for both I/O backends.

A key of N bytes is reserved at a 4096-aligned file offset with ``round_up(N, 4096)`` bytes
and stored as:

* its **body**, the first ``N // 4096 * 4096`` bytes, cut into extents of ``block_size``
  bytes (the last may be shorter); body extent ``i`` covers
  ``[offset + i * block_size, offset + min((i + 1) * block_size, body))`` and moves straight
  between the caller's buffer and the file;
* its **tail**, the last ``N % 4096`` bytes (when there are any), stored zero-padded in one
  4096-byte page right after the body; it is the last extent and moves through a bounce page,
  because the bytes after the caller's tensor may belong to a neighbouring tensor.

Extents are the unit of I/O and of checksums (one crc32c per extent). ``NvmeStore`` sizes its
reservations and checksum arrays and locates failed extents from this description; the
portable backend moves exactly these extents; the native engine (native/aio.c) implements the
same geometry in C from the same ``block_size`` (``tests/test_nvme.py`` checks that the two
agree on the extent count and the bytes at every offset). The native request struct
(``offload._native.IoReq``) carries ``nbytes`` (the body) and ``tail_len``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

PAGE = 4096


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Extent:
    """One unit of I/O and checksum of a key, offsets relative to the key's start."""
    index: int
    offset: int       # in the file, from the key's offset; in the caller's buffer for the body
    length: int       # bytes moved to or from the file (the tail: one whole page)
    tail: bool        # the zero-padded last page, moved through the bounce page


class ExtentLayout:
    """The extents of a key of ``nbytes`` bytes for a given ``block_size``."""

    def __init__(self, block_size: int):
        if not isinstance(block_size, int) or block_size <= 0 or block_size % PAGE:
            raise ValueError(f"block_size={block_size!r} must be a positive multiple of {PAGE}")
        self.block_size = block_size

    @staticmethod
    def split(nbytes: int) -> tuple:
        """(body bytes, tail bytes) of a key of ``nbytes``."""
        body = nbytes // PAGE * PAGE
        return body, nbytes - body

    @staticmethod
    def reserved(nbytes: int) -> int:
        """Bytes a key of ``nbytes`` occupies in its file."""
        return round_up(nbytes)

    def body_extents(self, body: int) -> int:
        return -(-body // self.block_size)

    def count(self, body: int, tail_len: int) -> int:
        """Extents of one transfer: the body's, plus the tail page."""
        return self.body_extents(body) + (1 if tail_len else 0)

    def max_extents(self, nbytes: int) -> int:
        """Checksum slots a key reserved with ``nbytes`` needs at most (body extents + tail)."""
        return self.body_extents(self.split(nbytes)[0]) + 1

    def extent(self, body: int, tail_len: int, i: int) -> Extent:
        nbody = self.body_extents(body)
        if i < nbody:
            start = i * self.block_size
            return Extent(i, start, min(self.block_size, body - start), False)
        if i == nbody and tail_len:
            return Extent(i, body, PAGE, True)
        raise IndexError(f"extent {i} of a transfer with {self.count(body, tail_len)} extents")

    def extents(self, body: int, tail_len: int) -> Iterator[Extent]:
        for i in range(self.count(body, tail_len)):
            yield self.extent(body, tail_len, i)
