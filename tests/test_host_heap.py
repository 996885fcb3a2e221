"""The host heap on a CPU device: trimmed after initialize always, after a committed step only
once its freed memory passes ``OFFLOAD_STEP_TRIM_BYTES`` (device.py ``step_trim_bytes``)."""
import ctypes
import json
import os
import subprocess
import sys

import psutil
import pytest
import torch
from torch import nn

import offload
from offload import device as dev

glibc = pytest.mark.skipif(dev.free_heap_bytes() is None, reason="glibc's mallinfo2 / malloc_trim")


def _heap_hole(mib: int):
    """``mib`` MiB freed on the heap below a live allocation (1 MiB tensors, under the mmap
    threshold, so they come from the heap and their pages stay resident once freed; glibc's
    own threshold starts at 128 KiB and rises past 1 MiB once such a mapped block is freed).
    Returns the live tensor, which keeps the hole below the heap's top."""
    first = torch.ones(1 << 18)
    del first
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


_FAULTS_SCRIPT = r"""
import json, resource, sys, tempfile, torch
from torch import nn
import offload
from offload import device as dev
torch.manual_seed(0)
cfg = {"optimizer": {"lr": 1e-3}, "offload_optimizer": {"device": "cpu"}}
if sys.argv[1] == "activations":
    cfg["offload_activations"] = {"device": "nvme", "nvme_path": tempfile.mkdtemp()}
elif sys.argv[1] != "none":
    cfg["offload_param"] = {"device": sys.argv[1]}
eng = offload.initialize(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), cfg)
faults = []
for _ in range(12):      # what a user's torch work does each step: a 4 MiB gradient-sized tensor
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.empty(1 << 20)
    t.fill_(1.0)
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
mode = dev.heap_mode()
eng.close()
print(json.dumps({"faults": faults, "mode": mode}))
"""


@glibc
@pytest.mark.skipif(torch.cuda.is_available(), reason="the heap is the device only on a CPU device")
@pytest.mark.parametrize("offloaded, mode", [("none", None), ("cpu", "reuse"), ("activations", "bounded")])
def test_malloc_is_tuned_only_when_saved_activations_leave_the_cpu_device(offloaded, mode):
    """The mmap threshold is process-wide: it changes the user's own torch work too (every
    4 MiB tensor a fresh mapping, 1024 page faults each time). With parameters resident the
    engine leaves malloc alone, so a 4 MiB tensor allocated again and again is served from
    the heap (glibc's own threshold rises after the first free) and faults no more after the
    first rounds. With parameters offloaded the bound holds only while initialize loads,
    then blocks that size come from the heap again ("reuse"); with saved activations
    offloaded it holds while training, so each such tensor faults its pages in. In a fresh
    process: the setting is process-wide."""
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_MMAP_THRESHOLD"}
    res = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, offloaded], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["mode"] == mode
    faults = out["faults"]
    if mode == "bounded":
        assert min(faults[6:]) >= 1000, faults    # 1024 pages of a fresh mapping each time
    else:
        assert max(faults[6:]) < 64, faults       # reused heap pages
