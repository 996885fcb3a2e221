"""Loading a pretrained checkpoint: read rate against a raw O_DIRECT read of the same files,
and host memory during loading against the model's size.

1. ``load_vs_raw_read``: a Llama-shaped bf16 checkpoint written as sharded safetensors (shard
   by shard, random values, never held whole). In the same process, interleaved rounds:
   (a) a raw O_DIRECT read of every file in 64 MiB requests, (b) the loader's read path alone
   (its planned ranges per block, O_DIRECT into its two pool buffers, the next block in
   flight), medians of each, the ratio paired within rounds (the disk's rate drifts); both
   read into buffers whose pages were touched before the clock starts. Claim: (b) / (a) >= 0.8. Then (c) the full load through
   ``offload.initialize(model_on_meta, config, weights=...)``, fp32 masters and state written
   to their tier, reported separately (GB/s of checkpoint bytes over its wall time, and the
   seconds spent converting).
2. ``rss``: the same load (parameters and optimizer state on NVMe) in a fresh process for a
   shallow and a deep model of one width (the peak reset before each); the rise of peak RSS
   over the process's RSS before
   ``initialize`` must not grow with the checkpoint (claim ``rss_rise_deep_vs_shallow_mib``:
   the difference of the two rises, against the deep model's extra checkpoint bytes).

    python benchmarks/bench_load.py                    # ~1 minute
    python benchmarks/bench_load.py --hidden 2048 --layers 16 --rounds 5

``load_vs_raw_read(path, model_fn, ...)`` is importable (benchmarks/bench_scale.py uses it on
its own checkpoint). The last line printed is one JSON object with a ``claims`` map.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def llama_config(hidden: int, layers: int, vocab: int = 32000, inter: int = None):
    from transformers import LlamaConfig
    heads = max(1, hidden // 128)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter or (hidden * 11008 // 4096),
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=512, tie_word_embeddings=False)


def meta_llama(cfg):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def write_checkpoint(out_dir: str, cfg, dtype=torch.bfloat16, shard_bytes: int = 1 << 30, seed: int = 0) -> int:
    """A sharded safetensors checkpoint of ``cfg``'s Llama with random values, written tensor
    by tensor (host memory: one tensor). Returns the bytes of tensor data."""
    from offload.io.safetensors import TensorSpec, plan_shards, shard_names, write_safetensors
    os.makedirs(out_dir, exist_ok=True)
    sd = meta_llama(cfg).state_dict()
    specs = [TensorSpec(k, dtype, tuple(v.shape)) for k, v in sd.items() if k != "lm_head.weight"
             or not cfg.tie_word_embeddings]
    need = sum(s.nbytes for s in specs)
    free = shutil.disk_usage(out_dir).free
    if need * 1.1 > free:
        raise SystemExit(f"the checkpoint needs {need / 2**30:.2f} GiB, {out_dir} has {free / 2**30:.2f} GiB free: "
                         f"choose a smaller --hidden / --layers")
    gen = torch.Generator().manual_seed(seed)
    shards = plan_shards(specs, shard_bytes)
    names = shard_names(len(shards))
    wmap = {}
    for name, shard in zip(names, shards):
        write_safetensors(os.path.join(out_dir, name), shard,
                          lambda s: (torch.randn(s.shape, generator=gen) * 0.02).to(s.dtype))
        wmap.update({s.key: name for s in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": need}, "weight_map": wmap}, f)
    cfg.save_pretrained(out_dir)
    return need


def _groups(model):
    """The parameter groups the engine loads together: its blocks (every parameter, frozen
    or not, under each block root; the rest last)."""
    from offload.core.blocks import auto_block_roots
    mods = dict(model.named_modules())
    seen, groups = set(), []
    for r in auto_block_roots(model):
        g = [p for p in mods[r].parameters() if id(p) not in seen]
        seen.update(id(p) for p in g)
        groups.append(g)
    groups.append([p for p in model.parameters() if id(p) not in seen])
    return groups


def load_vs_raw_read(path: str, model_fn, config: dict = None, rounds: int = 3, full_load: bool = True) -> dict:
    """Checkpoint read rate of the loader against a raw O_DIRECT read of the same files, in
    this process, ``rounds`` interleaved rounds (medians). ``model_fn()`` builds the model on
    the meta device. With ``full_load`` also loads it through ``offload.initialize(model,
    config, weights=path)`` once and reports that separately (conversion and tier writes)."""
    from offload.io.safetensors import WeightFiles, raw_read
    from offload.io.loader import WeightLoader
    from offload.storage.pool import HostPool
    files = WeightFiles(path)
    total = sum(os.path.getsize(f) for f in files.files)
    raw_gbps, load_gbps = [], []
    pool = HostPool([64 << 20], pin=False, name="bench-raw")
    try:
        for _ in range(rounds):
            buf = pool.acquire(64 << 20)
            buf.view(torch.uint8, 64 << 20).zero_()      # pages touched, as the loader's are
            t0 = time.perf_counter()
            n = raw_read(files.files, buf)
            raw_gbps.append(n / (time.perf_counter() - t0) / 1e9)
            buf.release()
            model = model_fn()
            loader = WeightLoader(model, path)
            n, sec = loader.read_only(_groups(model))
            load_gbps.append(n / sec / 1e9)
    finally:
        pool.close()
    out = {"checkpoint_bytes": total, "raw_read_gbps": statistics.median(raw_gbps),
           "load_read_gbps": statistics.median(load_gbps), "rounds": rounds,
           "load_vs_raw_read": statistics.median(l / r for l, r in zip(load_gbps, raw_gbps)),
           "raw_read_gbps_all": [round(x, 3) for x in raw_gbps], "load_read_gbps_all": [round(x, 3) for x in load_gbps]}
    if full_load:
        import offload
        model = model_fn()
        t0 = time.perf_counter()
        eng = offload.initialize(model, config or {}, weights=path)
        wall = time.perf_counter() - t0
        w = eng.weights
        trainable = sum(lay.numel for lay in eng.layouts)
        out.update({"full_load_s": wall, "full_load_gbps": w.bytes_read / wall / 1e9,
                    "full_load_convert_s": w.seconds["convert"], "full_load_read_wait_s": w.seconds["read_wait"],
                    "trainable_params": trainable,
                    "trainable_written_bytes": sum(b.state.nbytes for b in eng.blocks if b.trains)})
        eng.close()
    return out


CHILD = r"""
import json, sys, os, shutil, time
sys.path.insert(0, sys.argv[1])
import psutil, torch, offload
from bench_load import llama_config, meta_llama, write_checkpoint
hidden, inter, vocab, work, hole = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
if hole:      # an untouched freed hole on the heap, below a live allocation (see rss_rise)
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 << 20)                  # M_MMAP_THRESHOLD: 16 MiB requests from the heap
    big, keep = [], []
    for _ in range(hole // 16):
        big.append(torch.empty(4 << 20))         # 16 MiB, never written: not resident
        keep.append(torch.empty(16))             # a small live allocation above it
    del big
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
for layers in map(int, sys.argv[7:]):
    cfg = llama_config(hidden, layers, vocab=vocab, inter=inter)
    ck, nvme = os.path.join(work, f"ck_{layers}"), os.path.join(work, f"nvme_{layers}")
    nbytes = write_checkpoint(ck, cfg, shard_bytes=64 << 20)
    os.makedirs(nvme, exist_ok=True)
    model = meta_llama(cfg)
    conf = {"optimizer": {"lr": 1e-4}, "precision": "bf16",
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2}}
    before = psutil.Process().memory_info().rss
    with open("/proc/self/clear_refs", "w") as f:   # reset the peak (VmHWM) to the current RSS
        f.write("5")
    t0 = time.perf_counter()
    eng = offload.initialize(model, conf, weights=ck)
    wall = time.perf_counter() - t0
    peak = hwm()
    print(json.dumps({"layers": layers, "rss_before": before, "peak": peak, "rise": peak - before, "load_s": wall,
                      "bytes_read": eng.weights.bytes_read, "checkpoint_bytes": nbytes}), flush=True)
    eng.close()
    del eng, model
    shutil.rmtree(ck, ignore_errors=True)
    shutil.rmtree(nvme, ignore_errors=True)
"""


def rss_rise(hidden: int, layers, inter: int, vocab: int, work: str, heap_hole_mib: int = 0) -> list:
    """Peak RSS rise of loading a bf16 Llama of each depth in ``layers`` (parameters and
    optimizer state on NVMe), one after the other in one fresh process, the peak reset
    before each (``/proc/self/clear_refs``). One dict per depth. ``heap_hole_mib``: first
    leave that much freed, never-touched memory on the heap below a live allocation, as
    building a model under accelerate's ``init_empty_weights`` does (its layers' weights are
    allocated on the CPU, then replaced by meta tensors: 2.1-2.7 GB of free heap at the 2B
    Llama shape's 40 layers); the load's allocations are then served from that hole."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", CHILD, HERE, str(hidden), str(inter), str(vocab), work,
                        str(heap_hole_mib), *map(str, layers)], capture_output=True, text=True, timeout=900, env=env)
    if r.returncode:
        raise RuntimeError(f"load child failed:\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in r.stdout.strip().splitlines() if line.startswith("{")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8, help="read-rate model depth")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rss-layers", type=int, nargs=2, default=[4, 16], metavar=("SHALLOW", "DEEP"))
    ap.add_argument("--rss-hidden", type=int, default=1024)
    ap.add_argument("--dir", default=None, help="where to write checkpoints (default: a temporary directory)")
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench_load_", dir=a.dir)
    t_start = time.perf_counter()
    try:
        cfg = llama_config(a.hidden, a.layers)
        ck = os.path.join(work, "ck")
        nbytes = write_checkpoint(ck, cfg, shard_bytes=256 << 20)
        nvme = os.path.join(work, "nvme")
        os.makedirs(nvme)
        rate = load_vs_raw_read(ck, lambda: meta_llama(cfg), {
            "optimizer": {"lr": 1e-4}, "precision": "bf16",
            "offload_param": {"device": "nvme", "nvme_path": nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}, rounds=a.rounds)
        shutil.rmtree(ck, ignore_errors=True)
        print(f"checkpoint {nbytes / 2**30:.2f} GiB bf16 ({a.layers} layers, hidden {a.hidden}): raw O_DIRECT "
              f"{rate['raw_read_gbps']:.2f} GB/s, loader read path {rate['load_read_gbps']:.2f} GB/s "
              f"({rate['load_vs_raw_read']:.2f}x); full load to NVMe {rate['full_load_s']:.1f} s "
              f"({rate['full_load_gbps']:.2f} GB/s of checkpoint, {rate['full_load_convert_s']:.1f} s converting)")
        s, d = a.rss_layers
        inter = a.rss_hidden * 11008 // 4096
        shallow, deep = rss_rise(a.rss_hidden, [s, d], inter, 8192, work)
        extra = deep["checkpoint_bytes"] - shallow["checkpoint_bytes"]
        diff = deep["rise"] - shallow["rise"]
        print(f"peak RSS rise while loading: {s} layers {shallow['rise'] / 2**20:.0f} MiB "
              f"({shallow['checkpoint_bytes'] / 2**20:.0f} MiB checkpoint), {d} layers {deep['rise'] / 2**20:.0f} MiB "
              f"({deep['checkpoint_bytes'] / 2**20:.0f} MiB checkpoint): +{diff / 2**20:.0f} MiB for "
              f"+{extra / 2**20:.0f} MiB of checkpoint")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    claims = {"load_vs_raw_read": round(rate["load_vs_raw_read"], 3),
              "rss_rise_deep_vs_shallow_mib": round(diff / 2**20, 1),
              "rss_rise_per_checkpoint_byte": round(diff / extra, 3)}
    print(json.dumps({"bench": "load", "loadavg_1m": round(os.getloadavg()[0], 2),
                      "wall_s": round(time.perf_counter() - t_start, 1), "read": rate,
                      "rss": {"shallow": shallow, "deep": deep}, "claims": claims}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
