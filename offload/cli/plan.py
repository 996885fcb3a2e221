"""``offload plan``: measure this machine, rank the placements by predicted step time
(``--check``: against measured engine steps)."""
from __future__ import annotations

import json
import os
import tempfile

from offload import dtypes
from offload.cli.common import (CLIError, REPO_ROOT, add_gpt_args, add_model_args, add_rss_args, model_spec,
                               parse_size, rss_prediction)
from offload.units import fmt_bytes


def _gpt_case(args):
    import torch
    from offload.planner import estimate as est
    from offload.models.gpt import GPT, GPTConfig
    from offload.planner.validate import CheckCase
    gcfg = GPTConfig(block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    gen = torch.Generator().manual_seed(0)

    def batch():
        x = torch.randint(0, gcfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)
        return x, torch.roll(x, -1, 1)

    def build():
        torch.manual_seed(0)
        return GPT(gcfg)
    with torch.device("meta"):
        spec = est.spec_from_module(GPT(gcfg), f"GPT {gcfg.n_layer}x{gcfg.n_embd}")
    return CheckCase(spec.name, build, batch, spec)


def _bench_step_case(layers=12, numel=1 << 20, fwd_ms=3.0, bwd_ms=6.0):
    """benchmarks/bench_step.py's model (compute simulated by GIL-free waits), when present."""
    import importlib.util
    import torch
    from offload.planner import estimate as est
    from offload.planner.measure import Compute
    from offload.planner.validate import CheckCase
    path = os.path.join(REPO_ROOT, "benchmarks", "bench_step.py")
    if not os.path.isfile(path):
        return None
    spec_ = importlib.util.spec_from_file_location("_offload_bench_step", path)
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)

    def build():
        torch.manual_seed(0)
        return mod.Stack(layers, numel, fwd_ms / 1e3, bwd_ms / 1e3)
    x = torch.ones(8, requires_grad=True)
    spec = est.ModelSpec(layers * numel, numel, numel, f"bench_step {layers}x{numel / 1e6:.0f}M", layers)
    compute = Compute(layers * fwd_ms / 1e3, layers * bwd_ms / 1e3, False, False)
    return CheckCase(spec.name, build, lambda: (x,), spec, compute)


def _scaled(profile, prec: str) -> bool:
    """The GPT's compute in ``prec`` is too slow to measure here: fp32's, scaled."""
    from offload.planner import precision
    return profile.slowdown(prec) > precision.SLOW


def _gpt_compute(case, device, profile, prec: str):
    """The built-in GPT's forward and backward measured in ``prec`` on the device, or where
    ``prec`` is slow here, in fp32 times the measured matmul slowdown."""
    import dataclasses
    from offload.planner import measure
    if not _scaled(profile, prec):
        return measure.measure_compute(case.build(), case.make_batch, device, dtype=dtypes.compute_dtype(prec))
    c = measure.measure_compute(case.build(), case.make_batch, device)
    f = profile.slowdown(prec)
    return dataclasses.replace(c, forward_s=c.forward_s * f, backward_s=c.backward_s * f)


def cmd_plan(args) -> int:
    import torch
    from offload.planner import estimate as est
    from offload.planner import measure, precision, predict, rank
    nvme_path = args.nvme_path or tempfile.gettempdir()
    if not os.path.isdir(nvme_path):
        raise CLIError(f"--nvme-path {nvme_path!r} does not exist: give an existing directory")
    if args.profile:
        try:
            profile = measure.Profile.load(args.profile)
        except (FileNotFoundError, ValueError) as exc:
            raise CLIError(str(exc)) from None
        print(f"profile {args.profile} (measured {profile.created} on {profile.device})")
    else:
        print("measuring this machine (CPU Adam, copies, NVMe, matmul; a few seconds) ...", flush=True)
        profile = measure.measure_profile(nvme_path)
        if args.save_profile:
            profile.save(args.save_profile)
            print(f"saved the profile to {args.save_profile}")
    print(f"  CPU Adam {profile.adam_params_per_s / 1e9:.2f} Gparam/s ({profile.adam_backend}); device Adam "
          f"{profile.device_adam_params_per_s / 1e9:.2f} Gparam/s; h2d {profile.h2d_gbps:.1f} GB/s, d2h "
          f"{profile.d2h_gbps:.1f} GB/s" + (" (host memcpy: no accelerator)" if not profile.cuda else "")
          + f"; nvme read {profile.nvme_read_gbps:.2f} GB/s, write {profile.nvme_write_gbps:.2f} GB/s "
          f"({profile.io_backend}, {profile.nvme_read_latency_s * 1e3:.2f}/{profile.nvme_write_latency_s * 1e3:.2f} ms per request, duplex {profile.nvme_duplex:.0%}); matmul "
          + ", ".join(f"{profile.tflops(p):.3g} {p}" for p in dtypes.PRECISIONS) + " TFLOP/s")

    if args.check:
        return _plan_check(args, profile, nvme_path)
    choice = precision.decide(args.precision, table=profile.matmul_tflops_by_dtype, where=profile.device)
    precision.announce(choice, say=print)
    args.precision = choice.precision

    spec = model_spec(args, default_gpt=True)
    tokens = args.batch_size * args.seq_len
    if spec is None:      # the built-in GPT (offload train's model): measure its compute
        case = _gpt_case(args)
        spec = case.spec
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        compute = _gpt_compute(case, device, profile, args.precision)
    else:
        compute = predict.flops_compute(spec, tokens, profile, args.precision)
    machine = est.this_machine(nvme_path, parse_size(args.device_memory, "--device-memory"))
    budget = parse_size(args.device_budget_bytes, "--device-budget-bytes")
    lookahead = parse_size(args.host_lookahead_bytes, "--host-lookahead-bytes")
    ranked = rank.rank(spec, profile, compute, machine, args.precision, args.gradient_accumulation_steps,
                       args.gradient_clipping > 0, buffer_count=args.buffer_count, rule=args.optimizer,
                       state_dtype=args.state_dtype, device_budget_bytes=budget, host_lookahead_bytes=lookahead,
                       update_ahead=args.update_ahead)
    print(spec.describe() + f"; {tokens} tokens per micro-step, precision {args.precision}, optimizer "
          f"{args.optimizer} with {args.state_dtype} state" + (", update_ahead" if args.update_ahead else ""))
    print(f"compute (forward+backward) {compute.total_s * 1e3:.1f} ms per micro-step, "
          + ("measured on the device without offload" if compute.measured
             else f"from 6 x params x tokens at the measured {args.precision} matmul rate")
          + (f" (in fp32, times {args.precision}'s measured matmul slowdown)" if _scaled(profile, args.precision)
             and compute.measured else ""))
    print(f"  {'rank':<5}{'optimizer':<10}{'param':<7}{'step':>10}{'tokens/s':>11}  {'bottleneck':<11}"
          f"{'device':>10}{'host':>10}{'nvme':>10}  fits")
    for i, r in enumerate(ranked, 1):
        p, m = r.prediction, r.memory
        fit = "yes" if r.fits and r.fit["device"] else ("yes, if the device has room" if r.fits else
              "no (" + ", ".join(k for k, v in r.fit.items() if v is False) + ")")
        if m.refused:
            fit = "refused by the engine: " + m.refused.split(":")[0]
        tok_s = tokens * args.gradient_accumulation_steps / p.step_s
        print(f"  {i:<5}{m.optimizer:<10}{m.param:<7}{p.step_s * 1e3:>8.1f}ms{tok_s:>11,.0f}  {p.bottleneck:<11}"
              f"{fmt_bytes(m.device):>10}{fmt_bytes(m.host_total):>10}{fmt_bytes(m.nvme):>10}  {fit}")
    base = rank.fits_without_offload(ranked)
    if base is not None:
        slowest = max(ranked, key=lambda r: r.prediction.step_s)
        print(f"the model fits on the device without offload ({fmt_bytes(base.memory.device)} of "
              f"{fmt_bytes(machine.device_bytes)}): train with offload_optimizer none, offload_param none. "
              f"Offloading it only slows it down (up to {slowest.prediction.step_s / base.prediction.step_s:.1f}x "
              "slower per step here).")
    elif machine.device_bytes is None:
        print("no accelerator memory size known: give --device-memory (e.g. 24GiB) to check the device tier")
    else:
        best = next((r for r in ranked if r.fits), None)
        if best is None:
            print("no placement fits this machine: more host memory, disk, or ranks (--world-size in estimate)")
        else:
            print(f"best placement that fits: --offload-optimizer {best.memory.optimizer} "
                  f"--offload-param {best.memory.param} ({best.prediction.step_s * 1e3:.1f} ms per step)")
    chosen = _rss_placement(args, ranked)
    if chosen is not None:
        device_is_host = machine.device_bytes is None and not torch.cuda.is_available()
        mem = rss_prediction(args, spec, chosen[0], chosen[1], device_is_host, args.batch_size, args.seq_len,
                             buffer_count=args.buffer_count, gradient_clipping=args.gradient_clipping,
                             gradient_accumulation_steps=args.gradient_accumulation_steps,
                             host_available=machine.host_available, update_ahead=args.update_ahead)
        where = "the device is this process's heap" if device_is_host else "device memory not included"
        print(f"peak host RSS of the training process at optimizer={chosen[0]} param={chosen[1]} ({where}):")
        for line in mem.lines():
            print(line)
    print("model: step = max over resources + the rest / blocks (exposed first fetch and last update); "
          "see `python -c 'import offload.planner.predict; help(offload.planner.predict)'`")
    return 0


def _rss_placement(args, ranked):
    """(optimizer, param) whose host RSS ``plan`` prints: --placement, else the best that fits."""
    if args.placement:
        o, _, prm = args.placement.partition("/")
        if o not in est_tiers() or prm not in est_tiers():
            raise CLIError(f"--placement {args.placement!r} must be OPTIMIZER/PARAM with none, cpu or nvme, "
                           "e.g. nvme/nvme")
        return o, prm
    best = next((r for r in ranked if r.fits), None)
    return None if best is None else (best.memory.optimizer, best.memory.param)


def est_tiers():
    from offload.planner.estimate import TIERS
    return TIERS


def _plan_check(args, profile, nvme_path) -> int:
    from offload.planner import validate
    cases = []
    for name in args.check_models.split(","):
        name = name.strip()
        if name == "gpt":
            cases.append(_gpt_case(args))
        elif name == "bench_step":
            bench = _bench_step_case()
            if bench is None:
                print("  (benchmarks/bench_step.py is not there: its model is skipped)")
            else:
                cases.append(bench)
        else:
            raise CLIError(f"--check-models {name!r}: use gpt or bench_step")
    placements = []
    for item in args.check_placements.split(","):
        o, _, prm = item.strip().partition("/")
        if o not in est_tiers() or (prm or "none") not in est_tiers():
            raise CLIError(f"--check-placements item {item!r} must be OPTIMIZER/PARAM with none, cpu or nvme, "
                           "e.g. cpu/none")
        placements.append((o, prm or "none"))
    print(f"checking predictions against measured engine steps ({args.check_rounds} rounds per placement) ...",
          flush=True)
    results = validate.check(cases, profile, placements, nvme_path, rounds=args.check_rounds,
                             log=lambda s: print("  " + s, flush=True))
    if not results:
        raise CLIError("no placement could be measured")
    worst = max(r.error for r in results)
    mean = sum(r.error for r in results) / len(results)
    ok = worst <= args.tolerance
    print(f"prediction error: mean {mean:.0%}, worst {worst:.0%} (goal <= {args.tolerance:.0%}): "
          + ("OK" if ok else "OVER"))
    if args.json:
        print(json.dumps([{**r.__dict__, "error": r.error} for r in results]))
    return 0 if ok else 1


def register(sub) -> None:
    p = sub.add_parser("plan", help="measure this machine and rank the placements by predicted step time")
    p.set_defaults(func=cmd_plan, _parser=p)
    add_model_args(p, gpt_defaults=True)
    add_gpt_args(p)
    p.add_argument("--device-memory", metavar="SIZE", help="accelerator memory per rank, e.g. 24GiB")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--gradient-clipping", type=float, default=0.0)
    p.add_argument("--update-ahead", action="store_true",
                   help="offload_optimizer.update_ahead for the placements with the optimizer on cpu")
    p.add_argument("--nvme-path", metavar="DIR", help="where to measure NVMe bandwidth (default: the temp dir)")
    p.add_argument("--profile", metavar="FILE", help="read the machine profile instead of measuring")
    p.add_argument("--save-profile", metavar="FILE", help="save the measured profile as JSON")
    p.add_argument("--check", action="store_true",
                   help="run the GPT (and bench_step's model) through the engine at several placements and "
                        "compare measured with predicted step times")
    p.add_argument("--check-rounds", type=int, default=5, help="measured rounds per placement (--check)")
    p.add_argument("--check-placements", default="none/none,cpu/none,nvme/none,cpu/cpu,nvme/nvme",
                   metavar="O/P,...", help="placements --check runs (optimizer/param)")
    p.add_argument("--check-models", default="gpt,bench_step", metavar="NAME,...",
                   help="models --check runs: gpt (offload train's model), bench_step (benchmarks/bench_step.py's)")
    p.add_argument("--tolerance", type=float, default=0.25, help="--check fails above this relative error")
    p.add_argument("--buffer-count", type=int, default=4, help="offload_optimizer.buffer_count (swap slots)")
    p.add_argument("--placement", metavar="O/P",
                   help="print the peak host RSS of this placement (default: the best that fits)")
    add_rss_args(p, batch=False)
    p.add_argument("--json", action="store_true")
