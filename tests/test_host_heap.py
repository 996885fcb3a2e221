"""The host heap on a CPU device: trimmed after initialize always, after a committed step only
once its freed memory passes ``OFFLOAD_STEP_TRIM_BYTES`` (device.py ``step_trim_bytes``)."""
import ctypes

import psutil
import pytest
import torch
from torch import nn

import offload
from offload import device as dev

glibc = pytest.mark.skipif(dev.free_heap_bytes() is None, reason="glibc's mallinfo2 / malloc_trim")


def _heap_hole(mib: int):
    """``mib`` MiB freed on the heap below a live allocation (1 MiB tensors, under the mmap
    threshold, so they come from the heap and their pages stay resident once freed).
    Returns the live tensor, which keeps the hole below the heap's top."""
    ts = [torch.ones(1 << 18) for _ in range(mib)]      # 1 MiB each, every page touched
    keep = torch.ones(1 << 18)
    del ts
    return keep


@glibc
def test_trim_gives_a_heap_hole_back_only_past_the_threshold():
    dev.return_freed_host_memory()
    rss = psutil.Process().memory_info().rss
    keep = _heap_hole(96)
    free = dev.free_heap_bytes()
    assert free >= 90 << 20, f"the freed tensors are not on the heap: {free} bytes free"
    assert psutil.Process().memory_info().rss - rss > 80 << 20      # still resident
    assert dev.trim_host_heap(free + (1 << 30)) is False             # under the threshold: kept
    held = psutil.Process().memory_info().rss
    assert held - rss > 80 << 20
    assert dev.trim_host_heap(64 << 20) is True                      # past it: given back
    assert held - psutil.Process().memory_info().rss > 80 << 20
    del keep


def test_step_trim_bytes_setting(monkeypatch):
    monkeypatch.delenv("OFFLOAD_STEP_TRIM_BYTES", raising=False)
    assert dev.step_trim_bytes() == dev.DEFAULT_STEP_TRIM_BYTES == 256 << 20
    monkeypatch.setenv("OFFLOAD_STEP_TRIM_BYTES", "0")
    assert dev.step_trim_bytes() == 0
    monkeypatch.setenv("OFFLOAD_STEP_TRIM_BYTES", "64MiB")
    with pytest.raises(ValueError, match="OFFLOAD_STEP_TRIM_BYTES='64MiB'.*number of bytes"):
        dev.step_trim_bytes()
    if not torch.cuda.is_available():     # refused at initialize, not at the first step()
        with pytest.raises(ValueError, match="OFFLOAD_STEP_TRIM_BYTES"):
            offload.initialize(nn.Linear(4, 4), {"offload_optimizer": {"device": "cpu"}})


class _CountingLibc:
    """glibc's malloc_trim, counted."""

    def __init__(self):
        self.trims = 0
        self._libc = ctypes.CDLL("libc.so.6")

    def malloc_trim(self, pad):
        self.trims += 1
        return self._libc.malloc_trim(pad)


@glibc
@pytest.mark.skipif(torch.cuda.is_available(), reason="the heap is the device only on a CPU device")
@pytest.mark.parametrize("setting, gas, trims_per_step", [(None, 1, 0), ("0", 1, 1), ("0", 2, 2)])
def test_engine_trims_after_a_step_past_the_threshold(monkeypatch, setting, gas, trims_per_step):
    """A small model's step frees far less than the default threshold: no trim per step
    (the next step reuses those pages), the free heap read at most once a second; with the
    threshold at 0, one trim per micro-step (accumulation 2: two per committed step)."""
    if setting is None:
        monkeypatch.delenv("OFFLOAD_STEP_TRIM_BYTES", raising=False)
    else:
        monkeypatch.setenv("OFFLOAD_STEP_TRIM_BYTES", setting)
    libc = _CountingLibc()
    monkeypatch.setattr(dev, "_libc", libc)
    reads = []
    free_heap = dev.free_heap_bytes
    monkeypatch.setattr(dev, "free_heap_bytes", lambda: reads.append(1) or free_heap())
    monkeypatch.setattr(dev, "_step_trim_checked", float("-inf"))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
    eng = offload.initialize(model, {"optimizer": {"lr": 1e-3}, "offload_optimizer": {"device": "cpu"},
                                     "gradient_accumulation_steps": gas})
    start = libc.trims
    assert start >= 1                              # initialize always trims
    reads.clear()                                  # (and reads the free heap after each block)
    for _ in range(3):
        for k in range(gas):
            eng.backward(eng(torch.randn(8, 64)).square().mean())
            assert eng.step() is (k == gas - 1)
    eng.close()
    assert libc.trims - start == 3 * trims_per_step
    if setting is None:       # three quick steps: the heap read once (twice if a second passed)
        assert 1 <= len(reads) < 3, reads
    else:
        assert not reads      # a threshold of 0 trims without reading
