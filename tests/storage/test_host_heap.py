"""The host heap on a CPU device: trimmed after initialize always, after a committed step only
once its freed memory passes ``OFFLOAD_STEP_TRIM_BYTES`` (device.py ``step_trim_bytes``)."""
import ctypes
import gc
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
    (the next step reuses those pages), the process's RSS read at most once a second; with the
    threshold at 0, one trim per micro-step (accumulation 2: two per committed step)."""
    if setting is None:
        monkeypatch.delenv("OFFLOAD_STEP_TRIM_BYTES", raising=False)
    else:
        monkeypatch.setenv("OFFLOAD_STEP_TRIM_BYTES", setting)
    # engines earlier tests dropped without close() are closed when collected, and the memory
    # they free counts in the heap: collected now, not inside the steps counted below
    gc.collect()
    libc = _CountingLibc()
    monkeypatch.setattr(dev, "_libc", libc)
    reads = []
    rss = dev._rss_bytes
    monkeypatch.setattr(dev, "_rss_bytes", lambda: reads.append(1) or rss())
    monkeypatch.setattr(dev, "_step_trim_checked", float("-inf"))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
    eng = offload.initialize(model, {"optimizer": {"lr": 1e-3}, "offload_optimizer": {"device": "cpu"},
                                     "gradient_accumulation_steps": gas})
    start = libc.trims
    assert start >= 1                              # initialize always trims
    reads.clear()
    for _ in range(3):
        for k in range(gas):
            eng.backward(eng(torch.randn(8, 64)).square().mean())
            assert eng.step() is (k == gas - 1)
    eng.close()
    assert libc.trims - start == 3 * trims_per_step
    if setting is None:       # three quick steps: RSS read once (twice if a second passed)
        assert 1 <= len(reads) < 3, reads
    else:
        assert not reads      # a threshold of 0 trims without reading


@glibc
@pytest.mark.skipif(torch.cuda.is_available(), reason="the heap is the device only on a CPU device")
def test_engine_trims_after_steps_only_where_rss_grows(monkeypatch):
    """Each step frees more than the threshold (its activations and autograd's gradients) and
    the next allocates it again: not trimmed after every step, those pages are reused warm
    (trimmed, every one faulted in again). Memory the steps do not reuse (freed memory left
    resident in a hole of the heap beside training) is given back once RSS has grown past the
    threshold over where the steps settled."""
    monkeypatch.setenv("OFFLOAD_STEP_TRIM_BYTES", str(64 << 20))
    monkeypatch.setattr(dev, "STEP_TRIM_CHECK_S", 0.0)             # a check after every step
    libc = _CountingLibc()
    monkeypatch.setattr(dev, "_libc", libc)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4)))
    eng = offload.initialize(model, {"optimizer": {"lr": 1e-3}, "offload_optimizer": {"device": "cpu"}})
    x = torch.randn(2048, 1024)                    # 8 MiB per activation: ~64 MiB freed per step
    try:
        free_after = []
        for _ in range(6):
            eng.backward(eng(x).square().mean())
            eng.step()
            free_after.append(dev.free_heap_bytes())
        assert max(free_after) > 64 << 20, free_after           # what a rule on the free heap trims
        start = libc.trims
        for _ in range(6):
            eng.backward(eng(x).square().mean())
            eng.step()
        assert libc.trims == start                               # settled: no trim
        keep = _heap_hole(320)                                   # more than a step can reuse
        eng.backward(eng(x).square().mean())
        eng.step()
        assert libc.trims == start + 1                           # grown past the threshold: given back
        del keep
    finally:
        eng.close()


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
    env["THP_MEM_ALLOC_ENABLE"] = "0"     # 4 KiB pages: the count below is the heap mode's alone
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


_HUGE_PAGES_SCRIPT = r"""
import json, os, sys, tempfile, warnings, torch
from torch import nn
import offload
from offload import device as dev
if sys.argv[1] == "late":
    early = torch.ones(4)          # a CPU tensor first: torch has read its switch
preferred = dev.prefer_huge_pages() if sys.argv[1] != "untouched" else None
leaked = "THP_MEM_ALLOC_ENABLE" in os.environ and sys.argv[2] == "unset"
cfg = {"optimizer": {"lr": 1e-3}, "offload_activations": {"device": "nvme", "nvme_path": tempfile.mkdtemp()}}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    eng = offload.initialize(nn.Linear(8, 8), cfg)
eng.close()
warned = [(str(w.message), w.filename) for w in caught if "4 KiB pages" in str(w.message)]
print(json.dumps({"huge": dev.huge_pages_in_effect(), "preferred": preferred, "leaked": leaked, "warned": warned}))
"""
THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")     # MADV_HUGEPAGE is accepted


@glibc
@pytest.mark.skipif(torch.cuda.is_available(), reason="the heap is the device only on a CPU device")
@pytest.mark.parametrize("order, setting, huge", [
    ("untouched", "unset", False),  # torch's default: 4 KiB pages, and initialize says how to change it
    ("early", "unset", THP),        # prefer_huge_pages before any tensor: torch advises huge pages
    ("late", "unset", False),       # a tensor came first: too late, and initialize says so
    ("early", "0", False),          # the user's 0 stands, and asks for no warning
    ("untouched", "1", THP),        # the user's own 1 works without offload asking
])
def test_large_cpu_tensors_go_on_huge_pages_when_asked_before_the_first(order, setting, huge):
    """With saved activations offloaded from a CPU device the heap stays bounded and every large
    tensor faults in afresh (device.py ``prefer_huge_pages``): on 2 MiB pages 512 times fewer
    faults. torch reads its switch once, at its first CPU allocation; ``prefer_huge_pages``
    sets it for that allocation only (children do not inherit it), and a user's own setting
    stands. A fresh process each time."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting != "unset":
        env["THP_MEM_ALLOC_ENABLE"] = setting
    res = subprocess.run([sys.executable, "-c", _HUGE_PAGES_SCRIPT, order, setting], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["huge"] is huge and out["leaked"] is False
    if order != "untouched":
        assert out["preferred"] is huge
    if huge or setting == "0" or not dev._kernel_huge_pages():
        assert out["warned"] == []
    else:
        [(message, filename)] = out["warned"]
        assert "THP_MEM_ALLOC_ENABLE=1" in message and "the offload command sets it" in message
        assert filename == "<string>"           # points at the user's initialize call


@pytest.mark.skipif(torch.cuda.is_available(), reason="the heap is the device only on a CPU device")
@pytest.mark.parametrize("acts", ["nvme", "none"])
def test_offload_train_asks_for_huge_pages_only_with_activations_offloaded(acts, tmp_path):
    """The command reads its flags before any tensor exists, so with saved activations
    offloaded it asks for huge pages in time (and says so); without, torch stays as it is."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    r = subprocess.run([sys.executable, "-m", "offload.cli", "train", "--steps", "1", "--out", str(tmp_path),
                        "--offload-optimizer", "cpu", "--offload-param", "none", "--no-checkpoint",
                        "--offload-activations", acts,    # nvme: a temporary directory, as for the other tiers
                        "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "2",
                        "--sample", "0", "--log-every", "0"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    tiers = next(ln for ln in r.stdout.splitlines() if "tiers:" in ln)
    if acts == "none":
        assert "activations" not in tiers and "huge pages" not in tiers
    else:
        assert ("activations -> nvme (large CPU tensors on huge pages)" in tiers) is THP, tiers
        assert "4 KiB pages" not in r.stderr


def test_huge_pages_probe_reads_the_mappings_flags():
    """``_mapping_flags`` finds the mapping of an address and its flags (a tensor's memory is
    readable and writable: ``rd`` and ``wr``); an address no mapping holds has none."""
    t = torch.ones(1 << 20)
    flags = dev._mapping_flags(t.data_ptr())
    if not os.path.exists("/proc/self/smaps"):
        assert flags == []
    else:
        assert "rd" in flags and "wr" in flags
    assert dev._mapping_flags(0) == []


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_engine_host_buffers_ask_for_huge_pages_on_a_cpu_device(tier, tmp_path):
    """On a CPU device the engine's host pools are unpinned and on huge pages: the optimizer
    state's and the gradients' buffers (offload_optimizer cpu), the swap buffers the state is
    read into and the buffers the gradients are lent from (nvme: a block's sum is parked on
    NVMe as soon as it is complete, so its own buffer may already be back), all streamed
    through at every step."""
    import mmap
    if dev.can_pin() or not hasattr(mmap, "MADV_HUGEPAGE") or not dev._kernel_huge_pages():
        pytest.skip("unpinned host pools on a kernel with transparent huge pages")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    eng = offload.initialize(model, {"optimizer": {"lr": 1e-3},
                                     "offload_optimizer": {"device": tier, "nvme_path": str(tmp_path)}})
    try:
        x = torch.randn(4, 512)
        eng.backward(eng(x).square().mean())
        block = eng.blocks[0]
        if tier == "cpu":
            addresses = [block.grads.tensor.data_ptr(), block.state.chunks[0].acquire(timeout=10).data_ptr()]
        else:
            addresses = []
            for pool in (eng.resources.pool("offload-grads"), eng.resources.pool("offload-swap")):
                buf = pool.acquire(4096, timeout=10)
                addresses.append(buf.view(torch.uint8, 4096).data_ptr())
                buf.release()
        for a in addresses:
            assert "hg" in dev._mapping_flags(a), hex(a)
        eng.step()
        eng.synchronize()
    finally:
        eng.close()
