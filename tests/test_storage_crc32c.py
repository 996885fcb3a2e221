"""crc32c parity: the SSE4.2 path and the slicing-by-8 table path against a bitwise reference."""
import ctypes
import random

import pytest

from offload import _native

pytestmark = pytest.mark.skipif(_native.lib() is None, reason="native library not built")


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def native(data: bytes, crc: int = 0, offset: int = 0, table: bool = False) -> int:
    buf = ctypes.create_string_buffer(bytes(offset) + data)
    return _native.crc32c(ctypes.addressof(buf) + offset, len(data), crc, table=table)


def test_known_vectors():
    assert crc32c_reference(b"123456789") == 0xE3069283
    for table in (False, True):
        assert native(b"123456789", table=table) == 0xE3069283
        assert native(b"", table=table) == 0
        assert native(bytes(32), table=table) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros


@pytest.mark.parametrize("size", [1, 3, 7, 8, 9, 63, 4095, 4097, 24575, 24576, 24577, 3 * 24576 + 13])
@pytest.mark.parametrize("offset", [0, 1, 3, 7])
def test_parity_odd_sizes_and_alignments(size, offset):
    data = random.Random(size * 8 + offset).randbytes(size)
    ref = crc32c_reference(data) if size < 5000 else native(data, table=True)
    assert native(data, offset=offset) == ref
    assert native(data, offset=offset, table=True) == ref


def test_continuation_and_lanes():
    # long enough for several 3 x 8 KiB interleaved blocks of the hardware path
    data = random.Random(1).randbytes(200_003)
    whole = native(data, table=True)
    assert native(data) == whole
    for cut in (1, 8191, 24576, 100_000):
        assert native(data[cut:], native(data[:cut])) == whole
    assert crc32c_reference(data[:3000]) == native(data[:3000])
