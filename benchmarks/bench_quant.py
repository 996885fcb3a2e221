"""Dequantization of frozen weights on the CPU (offload/quantize.py, native/quant.c), per ISA.

For each format (NF4; NF4 with double-quantized absmax; int8 per row) and output dtype (bf16,
fp32), one tensor of `--size` elements is dequantized into a preallocated output:
  native/<isa>  the native kernel forced to each ISA this CPU runs (OFFLOAD_ISA's names)
  torch         the torch reference (dequantize_*_reference), the fallback
  copy          out.copy_(src) of a tensor of the output's dtype and size: a memory-bound pass
                that writes the same bytes (and reads as many), the rate to compare with
Each ratio is the median over `--pairs` pairs run back to back (a b a b ..., after one untimed
b), so both methods find the threads awake and the cache as the other left it. The kernels use
the pool's threads (`--threads`, default all); torch the same count.

Quantization (once per tensor, at load): each format's native quantizer at the best ISA and
at AVX2 against its torch reference (`<fmt>_quantize_vs_torch`, `<fmt>_quantize_avx2_ms`).

Claims (the last line, one JSON object): `<fmt>_<dtype>_<isa>_vs_copy`: the copy's time over the
kernel's (1.0: as fast as a copy of its output, i.e. memory-bound; the native ISAs should be
near each other), `<fmt>_<dtype>_vs_torch`: the torch reference's time over the best ISA's, and
`avx2_vs_best_<fmt>_<dtype>`: the best ISA's time over AVX2's. Figures taken on a machine
shared with other work are noisy: look at the medians and the spread in `runs`.

Usage: python benchmarks/bench_quant.py [--size 16M] [--pairs 11] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from offload import _native
from offload import quantize as Q
from offload.optim import set_num_threads


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * mult[text[-1].upper()]) if text[-1].upper() in mult else int(text)


def paired(a, b, pairs: int) -> tuple:
    """Median of time(b) / time(a) over pairs of back-to-back calls, and both medians."""
    b()
    ta, tb, ratios = [], [], []
    for _ in range(pairs):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(ratios), statistics.median(ta), statistics.median(tb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="16M", help="elements per tensor (default 16M)")
    ap.add_argument("--pairs", type=int, default=11)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    set_num_threads(threads)
    torch.set_num_threads(threads)
    L = _native.lib()
    if L is None:
        raise SystemExit(f"the native library is not in use ({_native.load_error() or 'OFFLOAD_NATIVE=off'})")
    isas = [n for c, n in sorted(_native.ISA_NAMES.items()) if c <= L.offload_kernel_best_isa()]
    n = parse_size(args.size)
    cols = 4096
    n -= n % cols
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n // cols, cols, generator=gen).to(torch.bfloat16)
    formats = {"nf4": (Q.quantize_nf4(w), Q.dequantize_nf4, Q.dequantize_nf4_reference),
               "nf4_dq": (Q.quantize_nf4(w, double_quant=True), Q.dequantize_nf4, Q.dequantize_nf4_reference),
               "int8_rows": (Q.quantize_int8_rows(w), Q.dequantize_int8_rows, Q.dequantize_int8_rows_reference)}
    load = os.getloadavg()
    results, claims = {}, {}
    try:
        for fmt, (t, deq, ref) in formats.items():
            for dtype, dname in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                out = torch.empty(w.shape, dtype=dtype)
                src, dst = torch.randn(w.shape, generator=gen).to(dtype), torch.empty(w.shape, dtype=dtype)
                r = {"bytes_in": t.nbytes, "bytes_out": out.numel() * out.element_size()}
                times = {}
                for isa in isas:
                    _native.kernel_set_isa(L, isa)
                    ratio, t_copy, t_isa = paired(lambda: dst.copy_(src), lambda: deq(t, dtype, out=out), args.pairs)
                    times[isa] = t_isa
                    r[f"{isa}_ms"] = round(t_isa * 1e3, 2)
                    r[f"{isa}_gelem_s"] = round(n / t_isa / 1e9, 2)
                    claims[f"{fmt}_{dname}_{isa}_vs_copy"] = round(1 / ratio, 2)
                _native.kernel_set_isa(L, None)
                best = min(times, key=times.get)
                ratio, _, t_torch = paired(lambda: deq(t, dtype, out=out), lambda: ref(t, dtype), max(3, args.pairs // 3))
                r["torch_ms"] = round(t_torch * 1e3, 2)
                r["copy_ms"] = round(t_copy * 1e3, 2)
                claims[f"{fmt}_{dname}_vs_torch"] = round(ratio, 2)
                if "avx2" in times:
                    claims[f"avx2_vs_best_{fmt}_{dname}"] = round(times[best] / times["avx2"], 2)
                results[f"{fmt}_{dname}"] = r
                print(fmt, dname, json.dumps(r), flush=True)
        quantizers = {"nf4": (Q.quantize_nf4, Q.quantize_nf4_reference),
                      "int8_rows": (Q.quantize_int8_rows, Q.quantize_int8_rows_reference)}
        for fmt, (quant, ref) in quantizers.items():
            r = {}
            for isa in ([i for i in ("avx2",) if i in isas] + [isas[-1]]):
                _native.kernel_set_isa(L, isa)
                ratio, t_native, t_torch = paired(lambda: quant(w), lambda: ref(w), 3)
                r[f"{isa}_ms"] = round(t_native * 1e3, 2)
                claims[f"{fmt}_quantize_{isa}_ms"] = r[f"{isa}_ms"]
            r["torch_ms"] = round(t_torch * 1e3, 2)
            claims[f"{fmt}_quantize_vs_torch"] = round(ratio, 1)
            _native.kernel_set_isa(L, None)
            results[f"{fmt}_quantize"] = r
            print(fmt, "quantize", json.dumps(r), flush=True)
    finally:
        _native.kernel_set_isa(L, None)
    print(json.dumps({"benchmark": "bench_quant", "size": n, "threads": threads, "native": _native.native_info(),
                      "load_before": [round(x, 2) for x in load], "load_after": [round(x, 2) for x in os.getloadavg()],
                      "results": results, "claims": claims}))


if __name__ == "__main__":
    sys.exit(main())
