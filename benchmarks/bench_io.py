"""NVMe store throughput against the raw disk, in the same run.

Writes then reads --gib GiB through the NvmeStore with each backend (native with and without
checksums, portable), beside raw sequential O_DIRECT baselines on the same filesystem: one
large read / write between the file and a big aligned buffer, and dd with 1, 4 and 8 MiB
blocks (fio too when installed). The baseline for each direction is the best raw method, so
no ratio is flattered by a weak baseline. Everything uses O_DIRECT (no page cache) and
overwrites files written once during set-up, so every method sees the same on-disk state.
Methods run interleaved, in a shuffled order each round (the disk's state depends on what ran
just before); figures are per-method medians. It also measures
the native read rate while a torch matmul loop keeps the CPU busy on another thread.

    .venv/bin/python benchmarks/bench_io.py [--gib 2] [--rounds 3] [--path DIR]

The last line of output is one JSON object with a ``claims`` map.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from offload.storage import HostPool, NvmeStore  # noqa: E402
from offload.storage.nvme import DEFAULT_BLOCK_SIZE, DEFAULT_QUEUE_DEPTH  # noqa: E402

MiB = 1 << 20
PIECE = 1 << 30  # one syscall moves at most ~2 GiB; the "single large" raw I/O uses 1 GiB pieces


def raw_single(path: str, buf, nbytes: int, write: bool) -> float:
    """One large O_DIRECT pwritev / preadv of the whole buffer (1 GiB per syscall)."""
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    view = memoryview(buf).cast("B")
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, PIECE):
            part = view[off:min(off + PIECE, nbytes)]
            n = (os.pwritev if write else os.preadv)(fd, [part], off)
            assert n == len(part), "short raw transfer"
        return time.perf_counter() - t0
    finally:
        view.release()
        os.close(fd)


def raw_dd(path: str, nbytes: int, block: int, write: bool) -> float:
    count = nbytes // block
    if write:
        cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "oflag=direct", "conv=notrunc"]
    else:
        cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={block}", f"count={count}", "iflag=direct"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def raw_fio(path: str, nbytes: int, block: int, write: bool) -> float:
    cmd = ["fio", "--name=raw", f"--filename={path}", f"--size={nbytes}", f"--bs={block}", "--direct=1",
           f"--rw={'write' if write else 'read'}", "--ioengine=io_uring", "--iodepth=32", "--output-format=json"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    job = out["jobs"][0]["write" if write else "read"]
    return job["io_bytes"] / (job["bw_bytes"] or 1)


def store_io(store: NvmeStore, tensors: list, write: bool) -> float:
    t0 = time.perf_counter()
    handles = [(store.write if write else store.read)(f"b{i}", t) for i, t in enumerate(tensors)]
    for h in handles:
        h.wait()
    return time.perf_counter() - t0


class BusyCPU:
    """A torch matmul loop on another thread, for as long as the context is open."""

    def __init__(self, n: int = 768):
        self.a, self.b = torch.randn(n, n), torch.randn(n, n)
        self.stop = threading.Event()
        self.iters = 0

    def _loop(self):
        torch.mm(self.a, self.b)  # warm up outside the count
        self.started.set()
        t0 = time.perf_counter()
        while not self.stop.is_set():
            torch.mm(self.a, self.b)
            self.iters += 1
        self.rate = self.iters / (time.perf_counter() - t0)

    def __enter__(self):
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        self.started.wait()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="GiB written and read per method per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", type=int, default=16, help="keys (block shards) the data is split into")
    ap.add_argument("--path", default=tempfile.gettempdir(), help="directory on the filesystem under test")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    ap.add_argument("--queue-depth", type=int, default=DEFAULT_QUEUE_DEPTH)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()

    # Odd key sizes, as block shards are: never a multiple of the block size or of 4096.
    key_bytes = int(args.gib * 2**30) // args.keys - 12345
    stride = (key_bytes + 4095) // 4096 * 4096
    total = stride * args.keys
    nbytes = key_bytes * args.keys
    work = tempfile.mkdtemp(prefix="bench_io-", dir=args.path)
    raw_path = os.path.join(work, "raw.bin")
    stores, pool = {}, None
    t_setup = time.perf_counter()
    try:
        # One big page-aligned slot: the raw methods move all of it in one go, the store moves
        # it as `keys` tensors packed at 4096-aligned offsets (tails next to their neighbours).
        pool = HostPool([total], name="bench")
        slot = pool.acquire(total)
        whole = slot.view(torch.uint8, total)
        raw_buf = (ctypes.c_char * total).from_address(whole.data_ptr())
        noise = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        for off in range(0, total, noise.numel()):  # incompressible bytes (64 MiB of noise, repeated)
            whole[off:off + noise.numel()] = noise[:total - off]
        tensors = [slot.view(torch.uint8, key_bytes, offset_bytes=i * stride) for i in range(args.keys)]
        with open(raw_path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, total)
        raw_single(raw_path, raw_buf, total, write=True)  # the file is written once before timing

        common = dict(block_size=args.block_size, queue_depth=args.queue_depth, threads=args.threads)
        stores = {"native": NvmeStore(work, backend="native", name="native", **common),
                  "native_nocrc": NvmeStore(work, backend="native", checksum=False, name="nocrc", **common),
                  "portable": NvmeStore(work, backend="portable", name="portable", **common)}
        for s in stores.values():
            s.reserve({f"b{i}": key_bytes for i in range(args.keys)})
            store_io(s, tensors, write=True)  # first write: allocates the unwritten extents

        methods = {"raw_single_write": lambda: (total, raw_single(raw_path, raw_buf, total, True)),
                   "raw_single_read": lambda: (total, raw_single(raw_path, raw_buf, total, False))}
        raw_blocks = (1 * MiB, 4 * MiB, 8 * MiB)
        if shutil.which("dd"):
            for b in raw_blocks:
                methods[f"raw_dd{b // MiB}M_write"] = lambda b=b: (total, raw_dd(raw_path, total, b, True))
                methods[f"raw_dd{b // MiB}M_read"] = lambda b=b: (total, raw_dd(raw_path, total, b, False))
        if shutil.which("fio"):
            for b in raw_blocks:
                methods[f"raw_fio{b // MiB}M_write"] = lambda b=b: (total, raw_fio(raw_path, total, b, True))
                methods[f"raw_fio{b // MiB}M_read"] = lambda b=b: (total, raw_fio(raw_path, total, b, False))
        for name, s in stores.items():
            methods[f"{name}_write"] = lambda s=s: (nbytes, store_io(s, tensors, True))
            methods[f"{name}_read"] = lambda s=s: (nbytes, store_io(s, tensors, False))
        busy = {"iters": []}

        def busy_read():
            with BusyCPU() as cpu:
                seconds = store_io(stores["native"], tensors, False)
            busy["iters"].append(cpu.rate)
            return nbytes, seconds
        methods["native_read_busy_cpu"] = busy_read

        print(f"set-up {time.perf_counter() - t_setup:.1f} s", file=sys.stderr)
        rates = {m: [] for m in methods}
        t_start = time.perf_counter()
        order = list(methods)
        rng = random.Random(0)
        for r in range(args.rounds):
            rng.shuffle(order)  # a fresh order each round: no method always follows the same one
            for m in order:
                moved, seconds = methods[m]()
                rates[m].append(moved / seconds / 1e9)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} {v[-1]:.2f}" for m, v in rates.items())
                  + " GB/s", file=sys.stderr)
        elapsed = time.perf_counter() - t_start
        med = {m: statistics.median(v) for m, v in rates.items()}

        # Matmul rate alone, to show what the I/O costs the CPU work beside it.
        with BusyCPU() as cpu:
            time.sleep(1.0)
        matmul_alone = cpu.rate

        def best(direction):
            raw = {m: v for m, v in med.items() if m.startswith("raw_") and m.endswith("_" + direction)}
            m = max(raw, key=raw.get)
            return m, raw[m]

        raw_read_m, raw_read = best("read")
        raw_write_m, raw_write = best("write")
        ck_read = 1 - med["native_read"] / med["native_nocrc_read"]
        ck_write = 1 - med["native_write"] / med["native_nocrc_write"]
        claims = {
            "read_vs_raw": round(med["native_read"] / raw_read, 3),
            "write_vs_raw": round(med["native_write"] / raw_write, 3),
            "checksum_cost": round(max(0.0, ck_read, ck_write), 3),
            "portable_read_vs_raw": round(med["portable_read"] / raw_read, 3),
            "portable_write_vs_raw": round(med["portable_write"] / raw_write, 3),
            "busy_cpu_read_vs_idle": round(med["native_read_busy_cpu"] / med["native_read"], 3),
        }
        st = stores["native"].stats()
        result = {
            "bench": "io", "gib": round(total / 2**30, 3), "rounds": args.rounds, "keys": args.keys,
            "key_bytes": key_bytes, "path": args.path, "seconds": round(elapsed, 1),
            "native_backend": st["backend"], "direct": st["direct"], "checksum": st["checksum"],
            "block_size": args.block_size, "queue_depth": args.queue_depth, "threads": args.threads,
            "median_gbps": {m: round(v, 3) for m, v in med.items()},
            "baseline": {"read": {"method": raw_read_m, "gbps": round(raw_read, 3)},
                         "write": {"method": raw_write_m, "gbps": round(raw_write, 3)}},
            "checksum_cost_read": round(ck_read, 3), "checksum_cost_write": round(ck_write, 3),
            "matmul_iters_per_s": {"alone": round(matmul_alone, 1),
                                   "during_read": round(statistics.median(busy["iters"]), 1)},
            "claims": claims,
            "targets": {"read_vs_raw": ">= 0.9", "write_vs_raw": ">= 0.9", "checksum_cost": "<= 0.10"},
        }
        print(json.dumps(result))
    finally:
        for s in stores.values():
            s.close()
        if pool is not None:
            pool.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
