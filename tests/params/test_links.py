"""Bytes per link on a CPU compute device, against counts taken outside the engine.

Where host and device memory are one, a block's parameters reach the compute without a copy:
the forward reads them in their host home (``offload_param`` cpu) or in the buffer their NVMe
read landed in (nvme); nothing is staged from one host buffer into another. The telemetry
names a link only for bytes that crossed it: no ``h2d`` here; a gradient's landing in the
block's buffer is a copy within host memory, ``h2h``; NVMe reads and writes as the disk saw them.

The outside counts: every copy torch makes on the training thread (a dispatch mode, which
sees the parameter path's copies and the gradient landings, all smaller than the native
copier's threshold here), the addresses the forward's modules read their parameters at (a
forward pre-hook of the test's, after the engine's), the kernel's own I/O accounting of the
process (``/proc/self/io``: bytes read from and written to the block device; O_DIRECT I/O
bypasses the page cache, so each NVMe transfer is counted there once), and plain arithmetic
on the model's sizes.
"""
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import offload
from _hf import SEQ, VOCAB, tiny_llama

peft = pytest.importorskip("peft")

aten = torch.ops.aten
STEPS = 3


class Copies(TorchDispatchMode):
    """Every copy torch makes on this thread: (source storage address, source byte offset,
    bytes, destination storage address)."""

    OPS = {aten.copy_.default: 1, aten._to_copy.default: 0, aten.clone.default: 0}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        k = self.OPS.get(func)
        if k is not None:
            src = args[k]
            dst = args[0] if func is aten.copy_.default else out
            if isinstance(src, torch.Tensor) and src.device.type == "cpu":
                self.seen.append((src.untyped_storage().data_ptr(), src.storage_offset() * src.element_size(),
                                  src.numel() * src.element_size(), dst.untyped_storage().data_ptr()))
        return out


def _disk_io() -> tuple:
    """(bytes read, bytes written) by this process at the block device, or None."""
    try:
        with open("/proc/self/io") as f:
            io = dict(line.split(": ") for line in f.read().splitlines())
        return int(io["read_bytes"]), int(io["write_bytes"])
    except (OSError, KeyError):
        return None


def _lora_model():
    m = tiny_llama()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          task_type="CAUSAL_LM")
    return peft.get_peft_model(m, cfg)


@pytest.mark.parametrize("param,opt", [("cpu", "cpu"), ("nvme", "nvme")])
def test_cpu_device_reads_parameters_where_they_are(param, opt, tmp_path):
    model = _lora_model()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    offloaded = sum(p.numel() * p.element_size() for p in model.parameters())
    config = {"optimizer": {"lr": 1e-3},
              "offload_optimizer": {"device": opt, "nvme_path": str(tmp_path) if opt == "nvme" else None},
              "offload_param": {"device": param, "nvme_path": str(tmp_path) if param == "nvme" else None}}
    eng = offload.initialize(model, config)
    assert eng.device.type == "cpu"
    # the disk sees each transfer once where the store bypasses the page cache (not on tmpfs)
    direct = param == "nvme" and eng.resources.store("params").direct
    parts = [part for b in eng.blocks for part in b.parts]
    where = {id(s.param): part for part in parts for s in part.layout.segments}
    # the mappings the gradient buffers are lent from (a copy into one lands a gradient)
    grad_memory = {m.data.data_ptr() for pool in (eng.resources.pool("offload-host"), eng.resources.pool("offload-grads")) if pool is not None
                   for m in pool._memory}
    assert len(where) == len(list(model.parameters()))    # every parameter is offloaded

    # where each key's latest NVMe read landed: (address, bytes) of its destination
    landed = {}
    for store in (eng.resources.store("params"),) if param == "nvme" else ():
        read = store.read

        def spy(key, dst, read=read):
            landed[key] = (dst.data_ptr(), dst.numel() * dst.element_size())
            return read(key, dst)
        store.read = spy

    # (parameter, address it is read at, bytes, its block part's buffer then, bytes, where
    # that part's latest NVMe read landed)
    reads = []

    def seen(module, args):
        for p in module.parameters(recurse=False):
            part = where[id(p)]
            buf = part.home_buf if param == "cpu" else part._loan.acquire()
            reads.append((p, p.data_ptr(), p.numel() * p.element_size(), buf.data_ptr(),
                          buf.numel() * buf.element_size(), landed.get(part.key)))
    hooks = [m.register_forward_pre_hook(seen) for m in model.modules()]
    g = torch.Generator().manual_seed(1)
    xs = torch.randint(0, VOCAB, (STEPS + 1, 2, SEQ), generator=g)
    try:
        eng.backward(eng(input_ids=xs[0], labels=xs[0]).loss)     # the first step records the trace
        eng.step()
        eng.synchronize()
        before, io0 = eng.stats()["bytes"], _disk_io()
        reads.clear()
        with Copies() as copies:
            for x in xs[1:]:
                eng.backward(eng(input_ids=x, labels=x).loss)
                eng.step()
            eng.synchronize()
        after, io1 = eng.stats()["bytes"], _disk_io()
    finally:
        for h in hooks:
            h.remove()
        eng.close()
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}

    # the forward reads each parameter inside its home (cpu) or the buffer it was staged in (nvme)
    assert reads
    for p, addr, n, base, size, _ in reads:
        assert base <= addr and addr + n <= base + size, "a parameter is read outside its home / staging buffer"
    if param == "nvme":
        # ... and a frozen one (never written back) in the very buffer its part's latest NVMe read
        # landed in (a trained part's may be the buffer its update assembled, written through)
        frozen = [(addr, n, dst) for p, addr, n, _, _, dst in reads if not p.requires_grad]
        assert frozen and all(dst is not None and dst[0] <= addr and addr + n <= dst[0] + dst[1]
                              for addr, n, dst in frozen)

    # no copy reads parameter memory: parameters are never staged from one host buffer into another
    param_bytes = [(base, base + size) for _, _, _, base, size, _ in reads]
    staged = [c for c in copies.seen if any(a <= c[0] + c[1] < b for a, b in param_bytes)]
    assert staged == [], f"{len(staged)} copies read parameter memory"

    # links: nothing crossed a host-device boundary; the landings are copies within host memory,
    # one per trained parameter per step, counted by the dispatch mode as they happened
    assert moved.get("h2d", 0) == 0 and moved.get("d2h", 0) == 0, moved
    assert moved["h2h"] == STEPS * trainable
    landings = sum(n for _, _, n, dst in copies.seen if dst in grad_memory)
    assert landings == moved["h2h"]

    if param == "nvme":
        # every step reads the frozen base at least once (its forward)
        assert STEPS * (offloaded - trainable) <= moved["nvme_read"]
    if direct and io0 is not None and io1 is not None:
        # the store's counts are what reached the disk
        disk_read, disk_written = io1[0] - io0[0], io1[1] - io0[1]
        assert moved["nvme_read"] <= disk_read <= moved["nvme_read"] + (1 << 20)
        assert moved["nvme_write"] <= disk_written


@pytest.mark.parametrize("opt", ["none", "cpu"])
def test_cpu_device_parameters_are_the_master(opt):
    """Resident fp32 parameters on a CPU device are the fp32 master itself, wherever the state
    lives in host memory (tier cpu, or none: the device's memory is the host's): the update
    writes them in place and no copy follows it. The training is torch's AdamW within torch's
    own noise (twice single-tensor vs fused, plus 1e-6, as tests/system/test_matrix.py)."""
    from _parity import max_diff, noise_bound
    g = torch.Generator().manual_seed(1)
    xs = torch.randint(0, VOCAB, (STEPS, 2, SEQ), generator=g)

    def plain(fused):
        m = tiny_llama()
        opt_ = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0, fused=fused)
        for x in xs:
            m(input_ids=x, labels=x).loss.backward()
            opt_.step()
            opt_.zero_grad()
        return {n: p.detach().clone() for n, p in m.named_parameters()}
    ref, fused = plain(False), plain(True)
    model = tiny_llama()
    eng = offload.initialize(model, {"optimizer": {"lr": 1e-2, "weight_decay": 0.0},
                                     "offload_optimizer": {"device": opt}})
    try:
        for x in xs:
            eng.backward(eng(input_ids=x, labels=x).loss)
            eng.step()
        eng.synchronize()
        for b in eng.blocks:
            state = b.state.acquire()
            lo, hi = state.data_ptr(), state.data_ptr() + state.numel()
            for s in b.layout.segments:
                p = s.param
                assert lo <= p.data_ptr() and p.data_ptr() + p.numel() * 4 <= hi, s.name
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        eng.close()
    assert max_diff(ref, got) <= noise_bound(ref, fused)
