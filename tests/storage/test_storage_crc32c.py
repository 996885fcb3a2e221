"""crc32c parity: the dispatched path (AVX-512 VPCLMULQDQ folding where the CPU has it), the
SSE4.2 path and the slicing-by-8 table path against a bitwise reference."""
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


def native(data: bytes, crc: int = 0, offset: int = 0, table: bool = False, sse42: bool = False) -> int:
    buf = ctypes.create_string_buffer(bytes(offset) + data)
    return _native.crc32c(ctypes.addressof(buf) + offset, len(data), crc, table=table, sse42=sse42)


PATHS = [{}, {"sse42": True}, {"table": True}]


def test_known_vectors():
    assert crc32c_reference(b"123456789") == 0xE3069283
    for path in PATHS:
        assert native(b"123456789", **path) == 0xE3069283
        assert native(b"", **path) == 0
        assert native(bytes(32), **path) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
        assert native(bytes(4096), **path) == native(bytes(4096), table=True)


def test_dispatch_reports_the_fastest_path():
    info = _native.native_info()["crc32c"]
    want = ("vpclmulqdq" if all(f in _cpu_flags() for f in ("avx512f", "vpclmulqdq", "pclmulqdq", "sse4_2"))
            else "sse4.2" if "sse4_2" in _cpu_flags() else "table")
    assert info == want


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# the folding path: below 256 bytes it defers to SSE4.2; at 256 a whole block, then 16-byte
# folds and the crc32 instruction for the last < 16 bytes
@pytest.mark.parametrize("size", [1, 3, 7, 8, 9, 63, 255, 256, 257, 271, 272, 511, 512, 527, 4095, 4097, 24575,
                                  24576, 24577, 3 * 24576 + 13])
@pytest.mark.parametrize("offset", [0, 1, 3, 7])
def test_parity_odd_sizes_and_alignments(size, offset):
    data = random.Random(size * 8 + offset).randbytes(size)
    ref = crc32c_reference(data) if size < 5000 else native(data, table=True)
    for path in PATHS:
        assert native(data, offset=offset, **path) == ref, path


def test_continuation_and_lanes():
    # long enough for several 3 x 8 KiB interleaved blocks of the hardware path
    data = random.Random(1).randbytes(200_003)
    whole = native(data, table=True)
    assert native(data) == whole
    assert native(data, sse42=True) == whole
    for cut in (1, 255, 256, 8191, 24576, 100_000):
        assert native(data[cut:], native(data[:cut])) == whole
        assert native(data[cut:], native(data[:cut], sse42=True)) == whole
    assert crc32c_reference(data[:3000]) == native(data[:3000])
