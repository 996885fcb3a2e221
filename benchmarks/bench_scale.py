"""Fine-tuning a Llama-shaped checkpoint larger than the device (and, at --size 7b, larger than
host memory): LoRA with the frozen base offloaded, and a full fine-tune with clipping and
gradient accumulation, each in a fresh process that reports its own peak RSS.

1. Writes a Llama-shaped checkpoint as sharded bf16 safetensors (Hugging Face layout, random
   tensors written shard by shard, never the whole model in memory), then reads it once with
   O_DIRECT (the raw read rate of the same files, in this run).
2. (a) LoRA: the model is built on the meta device, loaded, and trained on a repeated batch
   with the frozen base and the adapters offloaded (parameters and optimizer state on NVMe),
   a device budget of a few layers.
   (b) Full fine-tune of a smaller model at two depths (a quarter and all of its layers),
   clipping 1.0 and gradient accumulation 4, everything on NVMe: peak RSS must not grow
   with depth.
Reports parameters, load time, step time (median), peak RSS (ru_maxrss), peak device
parameter bytes against the budget, NVMe bytes and the loss per step, beside the planner's
prediction of each run: its compute term measured right before the run, its disk rates the
mean of the planner's disk probe right before and right after it (``disk_probes``; the
prediction from the probe at the start is ``step_s_start_profile``).

Loading uses ``offload.initialize(..., weights=DIR)`` when this offload has it; otherwise
the model is materialized by the engine from the meta device with its own initialisation,
block by block straight to its tier (labelled ``load: "init (simulated: no weights= loader)"``,
and ``load_vs_raw_read`` is null). On a CPU-only machine the "device" is the process heap,
so the device budget is inside the RSS.

    python benchmarks/bench_scale.py                    # small shapes, about a minute
    python benchmarks/bench_scale.py --size 7b          # Llama-7B shape LoRA (writes ~13.4 GB)
    python benchmarks/bench_scale.py --size 2b          # the full fine-tune at hidden 2048, 10 and 40 layers
    python benchmarks/bench_scale.py --size 7b --frozen-dtype nf4 --tokens 32 --budget-layers 2
                                                        # LoRA over the nf4 base in host memory against
                                                        # the bf16 base from NVMe, in the same run; claims:
                                                        # rss, no steady reads, step_speedup >= 2.5,
                                                        # param_wait_ratio <= 0.35, the planner's step and
                                                        # RSS within 25% / 15% ("missed" names misses)
    offload bench scale [...]                           # the same
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Llama shapes: hidden, layers, intermediate, vocab, heads, kv heads
SHAPES = {
    "small": dict(hidden=384, layers=6, inter=1024, vocab=4000, heads=6, kv=6),
    "7b": dict(hidden=4096, layers=32, inter=11008, vocab=32000, heads=32, kv=32),
    "13b": dict(hidden=5120, layers=40, inter=13824, vocab=32000, heads=40, kv=40),
    "ft-small": dict(hidden=384, layers=8, inter=1024, vocab=4000, heads=6, kv=6),
    "ft-2b": dict(hidden=2048, layers=40, inter=5504, vocab=32000, heads=16, kv=16),
}
GIB = 2 ** 30


# ---- the checkpoint ---------------------------------------------------------------------------
def tensor_specs(s: dict, layers: int):
    """(name, shape, init) of a Llama checkpoint in Hugging Face key names."""
    h, i, v = s["hidden"], s["inter"], s["vocab"]
    kvd = h // s["heads"] * s["kv"]
    out = [("model.embed_tokens.weight", (v, h), "normal")]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [(p + "self_attn.q_proj.weight", (h, h), "normal"), (p + "self_attn.k_proj.weight", (kvd, h), "normal"),
                (p + "self_attn.v_proj.weight", (kvd, h), "normal"), (p + "self_attn.o_proj.weight", (h, h), "normal"),
                (p + "mlp.gate_proj.weight", (i, h), "normal"), (p + "mlp.up_proj.weight", (i, h), "normal"),
                (p + "mlp.down_proj.weight", (h, i), "normal"),
                (p + "input_layernorm.weight", (h,), "ones"), (p + "post_attention_layernorm.weight", (h,), "ones")]
    out += [("model.norm.weight", (h,), "ones"), ("lm_head.weight", (v, h), "normal")]
    return out


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def write_checkpoint(out_dir: str, s: dict, layers: int, max_shard: int = 2 << 30, seed: int = 0) -> int:
    """Sharded bf16 safetensors + index + config.json, written tensor by tensor in chunks of
    at most 64 MiB (normal * 0.02 from a pool of 8 random chunks at random rotations; norms
    1). Returns the bytes written."""
    import torch
    os.makedirs(out_dir, exist_ok=True)
    specs = tensor_specs(s, layers)
    shards, cur, size = [], [], 0
    for name, shape, init in specs:
        nb = _numel(shape) * 2
        if cur and size + nb > max_shard:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape, init))
        size += nb
    shards.append(cur)
    g = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    chunk = 32 << 20                                   # elements per chunk (64 MiB of bf16)
    # 8 chunks of normal(0, 0.02) values drawn once, each tensor's chunks taken from them at
    # a random rotation: the random generator would otherwise take most of the writing time
    chunk = min(chunk, max(_numel(shape) for _, shape, _ in specs))
    pool = [(torch.randn(chunk, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16).numpy()
            for _ in range(8)]
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, shape, _ in shard:
            nb = _numel(shape) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
            weight_map[name] = fname
        hb = json.dumps(header).encode()
        hb += b" " * (-(len(hb) + 8) % 8)
        path = os.path.join(out_dir, fname)
        with open(path, "wb") as f:
            f.write(len(hb).to_bytes(8, "little") + hb)
            for name, shape, init in shard:
                left = _numel(shape)
                while left:
                    n = min(left, chunk)
                    if init == "ones":
                        f.write(torch.ones(n).to(torch.bfloat16).view(torch.int16).numpy().tobytes())
                    else:
                        k, r = torch.randint(0, 8, (2,), generator=g).tolist()
                        src = pool[k]
                        rot = r * 4099 % chunk
                        f.write(memoryview(src[rot:rot + n]))
                        if rot + n > chunk:
                            f.write(memoryview(src[:rot + n - chunk]))
                    left -= n
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)   # the page cache goes
        total += os.path.getsize(path)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(s, layers), f)
    return total


def hf_config(s: dict, layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["hidden"],
            "intermediate_size": s["inter"], "num_hidden_layers": layers, "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv"], "vocab_size": s["vocab"], "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


def raw_read_rate(ckpt: str) -> float:
    """Bytes per second of an O_DIRECT read of every safetensors file of ``ckpt``."""
    files = sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    buf = mmap.mmap(-1, 64 << 20)                      # page-aligned
    total, t0 = 0, time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            while True:
                n = os.readv(fd, [buf])
                total += n
                if n < len(buf):
                    break
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t0)


def read_rate(ckpt: str, s: dict):
    """bench_load.load_vs_raw_read on this checkpoint (the loader's read path against a raw
    O_DIRECT read, interleaved rounds), or None where this offload has no loader."""
    try:
        sys.path.insert(0, HERE)
        from bench_load import load_vs_raw_read
        import torch
        import transformers
    except ImportError:
        return None
    conf = transformers.LlamaConfig(**{k: v for k, v in hf_config(s, s["layers"]).items()
                                       if k not in ("architectures", "torch_dtype")})

    def model_fn():
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(conf)
    out = load_vs_raw_read(ckpt, model_fn, rounds=2, full_load=False)
    return {k: out[k] for k in ("load_vs_raw_read", "raw_read_gbps", "load_read_gbps")}


# ---- one run, in a fresh process ---------------------------------------------------------------
CHILD = r"""
import inspect, json, os, resource, statistics, sys, time
sys.path.insert(0, sys.argv[2])
import torch
import offload
a = json.loads(sys.argv[1])
import transformers
from accelerate import init_empty_weights

torch.manual_seed(0)
conf = transformers.LlamaConfig(**{k: v for k, v in a["hf"].items() if k not in ("architectures", "torch_dtype")})
with init_empty_weights():                               # parameters on meta, buffers real
    model = transformers.LlamaForCausalLM(conf).to(torch.bfloat16)
if a["lora"]:
    import peft
    model = peft.get_peft_model(model, peft.LoraConfig(r=a["rank"], lora_alpha=2 * a["rank"], lora_dropout=0.0,
                                                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))

lm = model                 # (no wrapper: the checkpoint's keys are the model's own)
import psutil, threading


def _status():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in f)
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")}


# What is resident at the peak: /proc/self/status sampled every 50 ms, the sample with the most
# VmRSS kept with the phase it fell in (the planner's RSS terms are compared with it).
phase, peak, done = ["build"], {"VmRSS": 0}, threading.Event()


def _sampler():
    while not done.wait(0.05):
        st = _status()
        if st["VmRSS"] > peak["VmRSS"]:
            peak.clear()
            peak.update(st, phase=phase[0])


threading.Thread(target=_sampler, daemon=True).start()
rss_base = psutil.Process().memory_info().rss    # now, before initialize: imports + the meta model
rss_build_peak = _status()["VmHWM"]              # building it (transient; this process's own peak)
loader = "weights" in inspect.signature(offload.initialize).parameters
if not loader:      # simulated load: the engine materializes each meta block with the model's init
    for m in lm.modules():
        if not hasattr(m, "reset_parameters") and any(True for _ in m.parameters(recurse=False)):
            m.reset_parameters = (lambda m=m: [p.fill_(1.0) for p in m.parameters(recurse=False)])
cfg = a["cfg"]
phase[0] = "load"
t0 = time.perf_counter()
eng = offload.initialize(lm, cfg, weights=a["ckpt"]) if loader else offload.initialize(lm, cfg)
load_s = time.perf_counter() - t0
rss_load = _status()["VmHWM"]
x = torch.randint(0, conf.vocab_size, (1, a["tokens"]), generator=torch.Generator().manual_seed(1))
x = x.to(offload.device.compute_device())      # the batch on the compute device (CUDA when present)
losses, times, step_reads, step_waits = [], [], [], []
for step in range(a["steps"]):
    read0 = eng.stats()["bytes"].get("nvme_read", 0)
    # time the compute thread spends on parameters: fetches it waits for, and the prefetches it
    # issues itself (a quantized base is dequantized there)
    wait0 = sum(eng.stats().get("seconds", {}).get(k, 0.0) for k in ("param_fetch", "prefetch_h2d"))
    t0 = time.perf_counter()
    for _ in range(a["gas"]):                # step() closes each micro-step; the gas-th commits
        phase[0] = f"step {step} forward"
        loss = eng(input_ids=x, labels=x).loss
        phase[0] = f"step {step} backward"
        eng.backward(loss)
        phase[0] = f"step {step} step()"
        eng.step()
    eng.synchronize()
    times.append(time.perf_counter() - t0)
    step_reads.append(eng.stats()["bytes"].get("nvme_read", 0) - read0)   # swap files and checkpoint
    step_waits.append(sum(eng.stats().get("seconds", {}).get(k, 0.0) for k in ("param_fetch", "prefetch_h2d"))
                      - wait0)
    losses.append(loss.item())
st = eng.stats()
out = {"bytes": st.get("bytes", {}), "params": sum(b.layout.numel for b in eng.blocks if b.trains) + sum(p.layout.numel for b in eng.blocks for p in b.frozen),
       "trainable": sum(b.layout.numel for b in eng.blocks if b.trains), "load": "weights=" if loader else
       "init (simulated: no weights= loader)", "load_s": load_s, "step_s": statistics.median(times[1:] or times),
       "losses": losses, "device_param_bytes_peak": st["device_param_bytes_peak"], "budget": a["budget"],
       "nvme_bytes": st["tier_bytes"]["nvme"], "host_pool_bytes": st["tier_bytes"]["host"],
       "rss_after_load_bytes": rss_load, "rss_base_bytes": rss_base, "rss_build_peak_bytes": rss_build_peak,
       "step_times": times, "step_nvme_read_bytes": step_reads, "step_param_wait_s": step_waits,
       "frozen_quant": {k: v for k, v in st.get("frozen_quant", {}).items() if k != "per_tensor"},
       "source_bytes": st.get("source_bytes", 0), "stage_seconds": st.get("seconds", {}),
       "host_pools": st.get("host_pools", {})}
phase[0] = "close"
# restore=False: the run's model is discarded; bringing 2 bytes per parameter back into it
# (close()'s default when they fit in RAM) is not the fine-tune's memory, and would be counted
eng.close(restore=False)
done.set()
out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
# ru_maxrss of a child started by fork/vfork + exec starts at the parent's own peak (Linux
# carries the old mm's high-water mark over exec); VmHWM is this process's alone
out["vm_hwm_bytes"] = _status()["VmHWM"]
out["rss_at_peak"] = {k: peak.get(k) for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "phase")}
with open("/proc/self/io") as f:       # bytes this process read from the disk (load and steps)
    out["disk_read_bytes"] = next((int(l.split()[1]) for l in f if l.startswith("read_bytes:")), None)
print("RESULT " + json.dumps(out))
"""


def engine_config(run: dict) -> dict:
    """The engine config of one run (the child trains with it; the planner predicts with it):
    everything on NVMe unless the run names its homes (``optimizer_home`` / ``param_home``)
    and how the frozen base is stored (``frozen_dtype``)."""
    od, pd = run.get("optimizer_home", "nvme"), run.get("param_home", "nvme")
    return {"precision": "bf16", "optimizer": {"lr": run["lr"]},
            "gradient_clipping": run["clip"], "gradient_accumulation_steps": run["gas"],
            "offload_optimizer": {"device": od, "nvme_path": run["nvme"] if od == "nvme" else None, "buffer_count": 2},
            "offload_param": {"device": pd, "nvme_path": run["nvme"] if pd == "nvme" else None,
                              "device_budget_bytes": run["budget"],
                              "frozen_dtype": run.get("frozen_dtype", "compute")},
            "prefetch": {"host_lookahead_bytes": run["budget"]}}    # one budget staged ahead on the host


def child(args: dict, timeout: float) -> dict:
    args = dict(args, cfg=engine_config(args))
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args), ROOT], capture_output=True, text=True,
                       timeout=timeout)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def bf16_matmul_tflops(s: dict, tokens: int = 128) -> float:
    """TFLOP/s of this machine's bf16 matmul at the benchmark's shapes (tokens x hidden x
    intermediate), best of a few: the planner's compute rate for these runs."""
    import torch
    a = torch.randn(tokens, s["hidden"], dtype=torch.bfloat16)
    w = torch.randn(s["inter"], s["hidden"], dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ w.t()
        best = min(best, time.perf_counter() - t0)
    return 4 * 2 * tokens * s["hidden"] * s["inter"] / best / 1e12


def _llama(hf: dict, layers: int, lora: bool, rank: int, device=None):
    import torch
    import transformers
    conf = transformers.LlamaConfig(**{k: v for k, v in dict(hf, num_hidden_layers=layers).items()
                                       if k not in ("architectures", "torch_dtype")})
    with torch.device(device or "meta"):
        model = transformers.LlamaForCausalLM(conf).to(torch.bfloat16)
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model


def measure_compute(run: dict, rounds: int = 3) -> dict:
    """Forward and backward seconds of one micro-step of the run's model on the compute device
    (this CPU without CUDA) with no offload, from a 1- and a 3-layer model of the same width (layers cost the same each): the
    planner's compute term (``offload.planner.plan.Compute``). The two are measured in
    alternating rounds and each keeps its best round (other processes only slow a round
    down): a difference of two medians taken at different moments of a shared machine's
    load could come out at zero or below."""
    import torch
    from offload import device as odev
    dev = odev.compute_device()
    x = torch.randint(0, run["hf"]["vocab_size"], (1, run["tokens"]), generator=torch.Generator().manual_seed(1))
    x = x.to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    depths = (1, 3)
    models = {}
    for layers in depths:
        models[layers] = _llama(run["hf"], layers, run["lora"], run["rank"], device=dev)
        with torch.no_grad():
            for prm in models[layers].parameters():
                prm.normal_(0, 0.02)
    best = {layers: [float("inf"), float("inf")] for layers in depths}
    for i in range(rounds + 1):
        for layers in depths:
            model = models[layers]
            sync()
            t0 = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            sync()
            t1 = time.perf_counter()
            loss.backward()
            sync()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if i:                                   # the first round warms up
                best[layers] = [min(best[layers][0], t1 - t0), min(best[layers][1], t2 - t1)]
    del models
    L, (a, b) = run["hf"]["num_hidden_layers"], depths
    per = [(hi - lo) / (b - a) for lo, hi in zip(best[a], best[b])]
    total = [lo + (L - a) * d for lo, d in zip(best[a], per)]
    return {"forward_s": max(total[0], 0.0), "backward_s": max(total[1], 0.0)}


def run_baseline(run: dict) -> int:
    """The planner's baseline RSS of a run's process: a fresh interpreter importing what the
    child imports and building its model on the meta device (``rss.measure_baseline``)."""
    from offload.planner import rss
    hf = {k: v for k, v in run["hf"].items() if k not in ("architectures", "torch_dtype")}
    setup = ("from accelerate import init_empty_weights\n"
             f"conf = transformers.LlamaConfig(**{hf!r})\n"
             "with init_empty_weights():\n    model = transformers.LlamaForCausalLM(conf).to(torch.bfloat16)\n")
    if run["lora"]:
        setup += (f"model = peft.get_peft_model(model, peft.LoraConfig(r={run['rank']}, lora_alpha={2 * run['rank']}, "
                  "lora_dropout=0.0, target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj']))\n")
    return rss.measure_baseline(("torch", "offload", "transformers", "psutil") + (("peft",) if run["lora"] else ()),
                                setup)


def predict(run: dict, profile: dict, compute: dict, base_rss: int) -> dict:
    """The planner's prediction of one run (offload/planner) with the run's own config:
    ``plan.predict`` for the step time, ``rss.predict_rss`` for the peak host memory, term by
    term: the baseline of the process (``base_rss``: a fresh interpreter importing what the
    child imports), each host pool of the engine's memory plan, the activations autograd saves
    in one micro-step (counted on the meta device) and one block's gradients in flight (on a
    CPU-only machine the device is the process heap; offloaded parameters are used in their
    staging slots)."""
    import torch
    from offload.config import Config
    from offload.engine import memory_plan as mp
    from offload.planner import estimate as est
    from offload import device as odev
    from offload.planner import plan, rss
    od, pd, fd = run.get("optimizer_home", "nvme"), run.get("param_home", "nvme"), run.get("frozen_dtype", "compute")
    in_place = run["lora"] and pd == "nvme"          # a LoRA base on NVMe is read in place from the checkpoint
    model = _llama(run["hf"], run["hf"]["num_hidden_layers"], run["lora"], run["rank"])
    spec = est.spec_from_module(model, "bench_scale", "bf16", frozen_in_place=in_place, frozen_dtype=fd)
    config = Config.from_dict(engine_config(run))
    blocks = est.blocks_of_module(model, "bf16", frozen_in_place=in_place, frozen_dtype=fd)
    mplan = mp.plan(blocks, config, compute_bytes=2)
    x = torch.zeros(1, run["tokens"], dtype=torch.long, device="meta")
    saved = rss.saved_activation_bytes(model, lambda m: m(input_ids=x, labels=x).loss)
    mem = rss.predict_rss(mplan, baseline=base_rss, activations=saved, device_is_host=odev.compute_device().type != "cuda",
                          grad_in_flight=max(b.numel for b in blocks) * 2)
    prof = plan.Profile(**{k: v for k, v in profile.items() if k in plan.Profile.__dataclass_fields__})
    prof = dataclasses_replace(prof, matmul_tflops=profile.get("matmul_tflops_bf16", prof.matmul_tflops))
    pred = plan.predict(spec, od, pd, prof, plan.Compute(compute["forward_s"], compute["backward_s"], True,
                                                                  not prof.cuda),
                        "bf16", run["gas"], run["clip"] > 0, device_budget_bytes=run["budget"])
    return {"step_s": pred.step_s, "terms": pred.terms, "groups": pred.groups, "mode": pred.mode, "io": pred.io,
            "host_pools_bytes": mplan.host, "activation_bytes": saved, "base_rss_bytes": base_rss,
            "rss_terms": mem.as_dict()["terms"], "peak_rss_bytes": mem.total, "nvme_bytes": mplan.nvme_total}


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


DISK_FIELDS = {"read_gbps": "nvme_read_gbps", "read_latency_s": "nvme_read_latency_s", "write_gbps": "nvme_write_gbps",
               "write_latency_s": "nvme_write_latency_s", "duplex": "nvme_duplex"}


def disk_probe(root: str) -> dict:
    """The planner's disk probe (``plan.measure_nvme``, as ``measure_profile`` runs it here),
    once more: this disk's rates move by up to 1.5x from one minute to the next while others
    use it (0.8-1.8 GB/s of reads here), so each run gets probes of its own, right before and
    right after it, as its compute term is measured right before it."""
    from offload.planner.plan import measure_nvme
    io = measure_nvme(root, total=512 << 20)
    return {k: getattr(io, k) for k in DISK_FIELDS}


def run_profile(profile: dict, probes: list) -> dict:
    """``profile`` with the disk rates of the probes around one run (their mean): the
    machine's rates while that run ran."""
    return dict(profile, **{DISK_FIELDS[k]: statistics.mean(p[k] for p in probes) for k in DISK_FIELDS})


def measured_peak(r: dict) -> int:
    """The child's own peak RSS: VmHWM where recorded (its ru_maxrss starts at the parent's
    peak, carried over exec), else ru_maxrss."""
    return r.get("vm_hwm_bytes") or r["peak_rss_bytes"]


def compare(r: dict) -> dict:
    """Predicted against measured: step time and peak host memory, relative errors."""
    p, peak = r["predicted"], measured_peak(r)
    out = {}
    if p.get("io") and r.get("step_nvme_read_bytes"):      # the bytes behind the nvme term, steady steps
        reads = r["step_nvme_read_bytes"][1:] or r["step_nvme_read_bytes"]
        out["nvme_read_gb_per_step"] = [p["io"]["nvme_read"] / 1e9, statistics.median(reads) / 1e9]
    if r.get("predicted_start_profile_step_s"):     # the disk rates of the probe at the start instead
        out["step_s_start_profile"] = [r["predicted_start_profile_step_s"], r["step_s"]]
    return {**out, "step_s": [p["step_s"], r["step_s"]], "step_error": abs(p["step_s"] - r["step_s"]) / r["step_s"],
            "peak_rss_gib": [p["peak_rss_bytes"] / GIB, peak / GIB],
            "rss_error": abs(p["peak_rss_bytes"] - peak) / peak}


def print_rss(name: str, r: dict) -> None:
    """The predicted RSS terms of a run beside what was measured."""
    p = r["predicted"]
    print(f"{name}: peak host RSS, predicted term by term (GiB):", flush=True)
    for k, v in p["rss_terms"].items():
        extra = ""
        if k == "baseline":
            extra = f"   (the run's own, before initialize: {r['rss_base_bytes'] / GIB:.3f})"
        elif k.startswith("pool ") and k[5:] in r.get("host_pools", {}):
            extra = f"   (lent at most at once in the run: {r['host_pools'][k[5:]]['peak_bytes'] / GIB:.3f})"
        print(f"  {k:<28}{v / GIB:8.3f}{extra}")
    at = r.get("rss_at_peak") or {}
    print(f"  {'predicted':<28}{p['peak_rss_bytes'] / GIB:8.3f}\n  {'measured (VmHWM)':<28}{measured_peak(r) / GIB:8.3f}"
          + (f"   (at its peak, {at.get('phase')}: anonymous {at['RssAnon'] / GIB:.3f}, file-backed "
             f"{at['RssFile'] / GIB:.3f})" if at.get("RssAnon") is not None else ""), flush=True)


def predict_from(log: str) -> int:
    """Predictions for the runs of an earlier output (this script's output, whose last line is
    the JSON summary, or that JSON alone): its profile, the compute recorded with each run
    (measured now where it was not), the baseline measured now."""
    with open(log) as f:
        text = f.read()
    try:
        out = json.loads(text)
    except ValueError:
        out = json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])
    prof = out["profile"]
    if not prof.get("crc32c_gbps"):
        from offload.planner.plan import measure_crc32c
        prof["crc32c_gbps"] = measure_crc32c()
    runs = ([("lora", out["lora"])] if "lora" in out else []) + [(f"full {k}", v) for k, v in out.get("full", {}).items()]
    res = {}
    for name, r in runs:
        compute = r.get("compute") or measure_compute(r["run"])
        r["predicted"] = predict(r["run"], r.get("profile", prof), compute, run_baseline(r["run"]))
        res[name] = {"compute": compute, "predicted": r["predicted"], "vs_predicted": compare(r)}
        print_rss(name, r)
        print(f"{name}: {json.dumps(res[name])}", flush=True)
    print(json.dumps({"predictions": res, "claims": {f"{k}_{m}": v["vs_predicted"][m] for k, v in res.items()
                                                     for m in ("step_error", "rss_error")}}))
    return 0


def layer_bytes(s: dict) -> int:
    h, i = s["hidden"], s["inter"]
    kvd = h // s["heads"] * s["kv"]
    return 2 * (2 * h * h + 2 * kvd * h + 3 * h * i + 2 * h)


def checkpoint_bytes(s: dict, layers: int) -> int:
    return sum(_numel(shape) * 2 for _, shape, _ in tensor_specs(s, layers))


def nvme_need(s: dict, layers: int, full: bool) -> int:
    """Checkpoint + the engine's swap files: a full fine-tune keeps bf16 params, fp32 state
    and parked fp32 gradients there; LoRA reads its frozen base in place from the checkpoint
    (the swap files hold the adapters: a few MB)."""
    ck = checkpoint_bytes(s, layers)
    return ck + (ck + ck // 2 * (12 + 4) if full else 64 << 20)


def shapes(size: str):
    """(LoRA shape, full fine-tune shape) of a --size."""
    return SHAPES[size if size in ("7b", "13b") else "small"], SHAPES["ft-2b" if size == "2b" else "ft-small"]


def disk_need(size: str, frozen_dtype: str = "compute") -> int:
    """Bytes of disk a --size needs at its peak: the LoRA run, or the deep full fine-tune
    (--frozen-dtype: the LoRA runs only)."""
    lora, ft = shapes(size)
    a = nvme_need(lora, lora["layers"], False) if size != "2b" else 0
    b = nvme_need(ft, ft["layers"], True) if size not in ("7b", "13b") and frozen_dtype == "compute" else 0
    return max(a, b)


# --frozen-dtype: the peak RSS (GiB) each size claims at its full depth
FROZEN_TARGETS = {"7b": 6.0, "13b": 10.0}


def frozen_compare(args, root: str, out: dict) -> dict:
    """--frozen-dtype: LoRA over the base quantized in host memory (offload_param cpu) against
    the bf16 base read from NVMe (in place from the checkpoint), the same shape, tokens,
    batch and steps, each in a fresh process; the adapters' optimizer state in host memory in
    both, so every NVMe read of a step is the base's. Steady state: the steps after the first.
    Each run beside the planner's prediction of it (step time and peak RSS), from this
    machine's profile, the compute measured here and disk probes around the run.
    ``out["missed"]``: the claims that miss their targets."""
    shape, _ = shapes(args.size)
    if args.layers:
        shape = dict(shape, layers=args.layers)
    tokens = args.tokens or (128 if args.size in ("7b", "13b") else 64)
    steps = max(args.steps or 3, 2)
    ck = os.path.join(root, "lora-ckpt")
    t0 = time.perf_counter()
    nbytes = write_checkpoint(ck, shape, shape["layers"])
    print(f"wrote {nbytes / 1e9:.2f} GB of bf16 safetensors in {time.perf_counter() - t0:.1f} s", flush=True)
    from dataclasses import asdict
    from offload.planner.plan import measure_profile
    profile = asdict(measure_profile(root, io_bytes=512 << 20))
    profile["matmul_tflops_bf16"] = bf16_matmul_tflops(shape, tokens)
    out["profile"] = profile
    budget = args.budget_layers * layer_bytes(shape) + (1 << 20)   # the same device budget for both runs
    names = [(f"{args.frozen_dtype}_host", "cpu", args.frozen_dtype)]
    if not args.frozen_only:
        names.insert(0, ("bf16_nvme", "nvme", "compute"))
    compute = None
    for name, home, fmt in names:
        nv = os.path.join(root, f"nvme-{name}")
        os.makedirs(nv)
        run = {"hf": hf_config(shape, shape["layers"]), "lora": True, "rank": 8, "lr": 1e-3, "clip": 0.0, "gas": 1,
               "tokens": tokens, "steps": steps, "budget": budget, "ckpt": ck, "nvme": nv,
               "optimizer_home": "cpu", "param_home": home, "frozen_dtype": fmt}
        compute = compute or measure_compute(run)
        probes = [disk_probe(root)]
        r = child(run, timeout=7200)
        probes.append(disk_probe(root))
        r["run"], r["compute"], r["profile"] = run, compute, run_profile(profile, probes)
        steady = slice(1, None)
        r["steady"] = {"step_s": statistics.median(r["step_times"][steady]),
                       "nvme_read_bytes_per_step": max(r["step_nvme_read_bytes"][steady]),
                       "param_wait_s": statistics.median(r["step_param_wait_s"][steady])}
        r["step_s"] = r["steady"]["step_s"]
        r["predicted"] = predict(run, r["profile"], compute, run_baseline(run))
        r["vs_predicted"] = compare(r)
        print_rss(name, r)
        print(f"{name}: peak RSS {measured_peak(r) / GIB:.2f} GiB (predicted {r['predicted']['peak_rss_bytes'] / GIB:.2f}), "
              f"steady step {r['steady']['step_s']:.2f} s (predicted {r['predicted']['step_s']:.2f}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["predicted"]["terms"].items())
              + f"), param wait {r['steady']['param_wait_s']:.2f} s/step, NVMe read "
              f"{r['steady']['nvme_read_bytes_per_step'] / 1e9:.3f} GB/step, losses "
              f"{', '.join(f'{x:.4f}' for x in r['losses'])}, load {r['load_s']:.1f} s"
              + (f", quantized base {r['frozen_quant'].get('home_bytes', 0) / GIB:.2f} GiB" if fmt != "compute" else ""),
              flush=True)
        out[name] = r
        shutil.rmtree(nv, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(ck, ignore_errors=True)
    b = out[f"{args.frozen_dtype}_host"]
    tag = f"{args.size}_{args.frozen_dtype}"
    claims = {f"rss_{tag}_gib": measured_peak(b) / GIB,
              f"nvme_read_bytes_steady_{tag}": b["steady"]["nvme_read_bytes_per_step"],
              f"no_steady_nvme_reads_{tag}": b["steady"]["nvme_read_bytes_per_step"] == 0,
              f"loss_falling_{tag}": b["losses"][-1] < b["losses"][0],
              f"rss_error_{tag}": b["vs_predicted"]["rss_error"],
              f"step_error_{tag}": b["vs_predicted"]["step_error"]}
    targets = {f"no_steady_nvme_reads_{tag}": (True, "eq"), f"loss_falling_{tag}": (True, "eq"),
               f"rss_error_{tag}": (0.15, "max"), f"step_error_{tag}": (0.25, "max")}
    if args.size in FROZEN_TARGETS and not args.layers:
        targets[f"rss_{tag}_gib"] = (FROZEN_TARGETS[args.size], "max")
    if "bf16_nvme" in out:
        a = out["bf16_nvme"]
        claims.update({f"param_wait_ratio_{tag}": (b["steady"]["param_wait_s"] / a["steady"]["param_wait_s"]
                                                   if a["steady"]["param_wait_s"] > 0 else None),
                       f"step_speedup_{tag}": a["steady"]["step_s"] / b["steady"]["step_s"],
                       "bf16_nvme_read_bytes_per_step": a["steady"]["nvme_read_bytes_per_step"],
                       "bf16_param_wait_s": a["steady"]["param_wait_s"], "bf16_step_s": a["steady"]["step_s"],
                       "bf16_step_error": a["vs_predicted"]["step_error"]})
        targets.update({f"param_wait_ratio_{tag}": (0.35, "max"), f"step_speedup_{tag}": (2.5, "min")})
    out["missed"] = [k for k, (t, how) in targets.items()
                     if claims.get(k) is None or (claims[k] != t if how == "eq" else
                                                  claims[k] > t if how == "max" else claims[k] < t)]
    out["targets"] = {k: t for k, (t, _) in targets.items()}
    claims.update({"tokens": tokens, "budget_layers": args.budget_layers, "layers": shape["layers"]})
    return claims


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=["small", "7b", "13b", "2b"], default="small",
                   help="small: ~1 minute; 7b: Llama-7B LoRA (writes ~13.4 GB); 13b: Llama-13B LoRA (writes ~26 GB); "
                        "2b: full fine-tune at hidden 2048")
    p.add_argument("--frozen-dtype", choices=["compute", "int8", "nf4"], default="compute",
                   help="int8 / nf4: LoRA over the base stored so in host memory against the bf16 base from NVMe")
    p.add_argument("--tokens", type=int, default=None, help="tokens per step of the LoRA runs (default 64, 128 at 7b+)")
    p.add_argument("--budget-layers", type=int, default=4,
                   help="--frozen-dtype: the device budget of both runs, in layers (on a CPU device it is in the RSS)")
    p.add_argument("--layers", type=int, default=None,
                   help="--frozen-dtype: the shape's width with this many layers (a shorter run; no RSS target)")
    p.add_argument("--frozen-only", action="store_true",
                   help="--frozen-dtype: the quantized run alone (no bf16 run from NVMe to compare with)")
    p.add_argument("--path", default=None, help="directory on the disk under test (default: a temp dir)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--only", choices=["lora", "full"], help="run one part only")
    p.add_argument("--depths", metavar="N,N", help="full fine-tune: the layer counts to run (default: a quarter "
                   "and all of the shape's layers); rss_deep_vs_shallow needs both")
    p.add_argument("--predict-from", metavar="LOG", help="print the planner's prediction against the runs recorded "
                   "in LOG (this script's output: its last line), measuring the compute term here; runs nothing else")
    args = p.parse_args(argv)
    if args.predict_from:
        return predict_from(args.predict_from)
    lora_shape, ft_shape = shapes(args.size)
    lora_tokens = 128 if args.size == "7b" else 64
    steps = args.steps or 3
    root = tempfile.mkdtemp(prefix="bench_scale-", dir=args.path)
    free = shutil.disk_usage(root).free
    deep, shallow = ft_shape["layers"], ft_shape["layers"] // 4
    depths = [int(d) for d in args.depths.split(",")] if args.depths else [shallow, deep]
    runs_lora = args.size != "2b" and args.only in (None, "lora")
    runs_ft = args.size != "7b" and args.only in (None, "full")
    need = disk_need(args.size, args.frozen_dtype)
    print(f"free disk at {root}: {free / GIB:.1f} GiB; --size {args.size} needs about {need / GIB:.1f} GiB", flush=True)
    if need > 0.95 * free:
        fit = [k for k in ("small", "2b", "7b", "13b") if disk_need(k, args.frozen_dtype) < 0.95 * free]
        print(f"not enough free disk for --size {args.size}: sizes that fit here: {', '.join(fit) or 'none'}")
        shutil.rmtree(root, ignore_errors=True)
        return 2
    out = {"size": args.size, "load_avg": os.getloadavg()[0]}
    if args.frozen_dtype != "compute":
        try:
            out["frozen_dtype"] = args.frozen_dtype
            out["claims"] = frozen_compare(args, root, out)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        out["load_avg_end"] = os.getloadavg()[0]
        print(json.dumps(out))
        return 0
    from offload.planner.plan import measure_profile
    from dataclasses import asdict
    t0 = time.perf_counter()
    out["profile"] = asdict(measure_profile(root, io_bytes=512 << 20))        # this machine, for the planner's prediction
    out["profile"]["matmul_tflops_bf16"] = bf16_matmul_tflops(lora_shape if runs_lora else ft_shape)
    print(f"measured the machine for the planner in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        if runs_lora:
            ck = os.path.join(root, "lora-ckpt")
            t0 = time.perf_counter()
            nbytes = write_checkpoint(ck, lora_shape, lora_shape["layers"])
            print(f"wrote {nbytes / 1e9:.2f} GB of bf16 safetensors in {time.perf_counter() - t0:.1f} s", flush=True)
            raw = raw_read_rate(ck)
            rate = read_rate(ck, lora_shape)
            budget = 4 * layer_bytes(lora_shape) + (1 << 20)    # a few layers (+ their adapters)
            nv = os.path.join(root, "nvme-lora")
            os.makedirs(nv)
            run = {"hf": hf_config(lora_shape, lora_shape["layers"]), "lora": True, "rank": 8, "lr": 1e-3,
                   "clip": 0.0, "gas": 1, "tokens": lora_tokens, "steps": steps, "budget": budget,
                   "ckpt": ck, "nvme": nv}
            compute = measure_compute(run)
            probes = [disk_probe(root)]
            r = child(run, timeout=3600)
            probes.append(disk_probe(root))
            r["run"], r["compute"], r["disk_probes"] = run, compute, probes
            r["profile"] = run_profile(out["profile"], probes)
            r["predicted"] = predict(run, r["profile"], compute, run_baseline(run))
            r["predicted_start_profile_step_s"] = predict(run, out["profile"], compute, 0)["step_s"]
            r["vs_predicted"] = compare(r)
            print_rss("(a) LoRA", r)
            r.update({"checkpoint_bytes": nbytes, "raw_read_gbps": raw / 1e9,
                      "load_gbps": nbytes / r["load_s"] / 1e9, "read_rate": rate})
            out["lora"] = r
            print(f"(a) LoRA: {json.dumps(r)}", flush=True)
            if not args.keep:
                shutil.rmtree(ck, ignore_errors=True)
            shutil.rmtree(nv, ignore_errors=True)
        if runs_ft:
            out["full"] = {}
            for layers in depths:
                ck = os.path.join(root, f"ft-ckpt-{layers}")
                write_checkpoint(ck, ft_shape, layers)
                nv = os.path.join(root, f"nvme-ft-{layers}")
                os.makedirs(nv)
                run = {"hf": hf_config(ft_shape, layers), "lora": False, "rank": 0, "lr": 1e-4, "clip": 1.0,
                       "gas": 4, "tokens": 64, "steps": max(2, steps - 1), "budget": 4 * layer_bytes(ft_shape),
                       "ckpt": ck, "nvme": nv}
                compute = measure_compute(run)
                probes = [disk_probe(root)]
                r = child(run, timeout=7200)
                probes.append(disk_probe(root))
                r["run"], r["compute"], r["disk_probes"] = run, compute, probes
                r["profile"] = run_profile(out["profile"], probes)
                r["predicted"] = predict(run, r["profile"], compute, run_baseline(run))
                r["predicted_start_profile_step_s"] = predict(run, out["profile"], compute, 0)["step_s"]
                r["vs_predicted"] = compare(r)
                print_rss(f"(b) {layers} layers", r)
                out["full"][str(layers)] = r
                print(f"(b) full fine-tune, {layers} layers: {json.dumps(r)}", flush=True)
                shutil.rmtree(ck, ignore_errors=True)
                shutil.rmtree(nv, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    claims = {}
    if "lora" in out:
        r = out["lora"]
        claims["lora_rss_gib"] = r["peak_rss_bytes"] / GIB
        claims["lora_device_peak_vs_budget"] = r["device_param_bytes_peak"] / r["budget"]
        claims["lora_loss_falling"] = r["losses"][-1] < r["losses"][0]
        # the loader's read path against a raw O_DIRECT read of the same files (bench_load's
        # interleaved measure); the full load above also converts and writes every part to NVMe
        claims["load_vs_raw_read"] = r["read_rate"]["load_vs_raw_read"] if r.get("read_rate") else None
    if "full" in out:
        claims["rss_full_gib"] = {k: r["peak_rss_bytes"] / GIB for k, r in out["full"].items()}
    if str(shallow) in out.get("full", {}) and str(deep) in out["full"]:
        a, b = out["full"][str(shallow)], out["full"][str(deep)]
        claims["rss_deep_vs_shallow"] = b["peak_rss_bytes"] / a["peak_rss_bytes"]
        claims["rss_deep_gib"] = b["peak_rss_bytes"] / GIB
        claims["rss_layers"] = [shallow, deep]
    out["claims"] = claims
    out["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
