"""``offload estimate``: bytes per tier for every placement, against this machine."""
from __future__ import annotations

import json

from offload.cli.common import (CLIError, add_model_args, add_rss_args, model_spec, parse_size,
                               rss_prediction)
from offload.units import fmt_bytes


def cmd_estimate(args) -> int:
    from offload.planner import estimate as est
    spec = model_spec(args)
    machine = est.this_machine(args.nvme_path, parse_size(args.device_memory, "--device-memory"))
    rows = est.estimate(spec, args.precision, args.world_size, args.buffer_count, args.gradient_clipping,
                        args.gradient_accumulation_steps, parse_size(args.grad_host_bytes, "--grad-host-bytes"),
                        rule=args.optimizer, state_dtype=args.state_dtype,
                        activations=args.offload_activations,
                        activation_host_bytes=parse_size(args.activation_host_bytes, "--activation-host-bytes"),
                        host_available=machine.host_available,
                        device_budget_bytes=parse_size(args.device_budget_bytes, "--device-budget-bytes"),
                        host_lookahead_bytes=parse_size(args.host_lookahead_bytes, "--host-lookahead-bytes"),
                        update_ahead=args.update_ahead)
    rss = None
    if args.placement:
        o, _, prm = args.placement.partition("/")
        if o not in est.TIERS or prm not in est.TIERS:
            raise CLIError(f"--placement {args.placement!r} must be OPTIMIZER/PARAM with none, cpu or nvme, "
                           "e.g. nvme/nvme")
        rss = rss_prediction(args, spec, o, prm, machine.device_bytes is None and not _cuda(),
                             args.batch_size, args.seq_len, buffer_count=args.buffer_count,
                             gradient_clipping=args.gradient_clipping,
                             gradient_accumulation_steps=args.gradient_accumulation_steps,
                             grad_host_bytes=parse_size(args.grad_host_bytes, "--grad-host-bytes"),
                             world_size=args.world_size, activations=args.offload_activations,
                             activation_host_bytes=parse_size(args.activation_host_bytes, "--activation-host-bytes"),
                             host_available=machine.host_available, update_ahead=args.update_ahead)
    if args.json:
        out = {"model": {k: v for k, v in spec.__dict__.items() if k != "plan_blocks"}, "machine": machine.__dict__,
               "placements": [{**r.__dict__, "fit": est.check_fit(r, machine)} for r in rows],
               "deepspeed_reference": est.deepspeed_reference(spec, args.world_size)}
        if rss is not None:
            out["peak_rss"] = {"placement": args.placement, **rss.as_dict()}
        print(json.dumps(out, indent=2))
        return 0
    print(spec.describe() + f"; precision {args.precision}, world size {args.world_size}, "
          f"optimizer {args.optimizer} with {args.state_dtype} state"
          + (", update_ahead (optimizer on cpu)" if args.update_ahead else "")
          + ("" if spec.exact else "; largest layer assumed params/12 (give --largest-layer)"))
    acts = ("activations come on top, on the device" if args.offload_activations == "none" else
            f"the {args.offload_activations} activation pool is in pinned, the device keeps what is not offloaded")
    print(f"bytes per tier for each placement (model states only: {acts};"
          "\n device per rank, host and nvme per node):")
    hdr = f"  {'optimizer':<10}{'param':<7}{'device':>11}{'pinned':>11}{'host':>11}{'host total':>12}{'nvme':>11}  fits"
    print(hdr)
    refusals = []
    for r in rows:
        fit = est.check_fit(r, machine)
        verdict = "yes" if est.fits(r, machine) else "no (" + ", ".join(k for k, v in fit.items() if v is False) + ")"
        if fit["device"] is None and est.fits(r, machine):
            verdict = "yes, if the device has room"
        if r.refused:
            if r.refused not in refusals:
                refusals.append(r.refused)
            verdict = f"refused by the engine [{refusals.index(r.refused) + 1}]"
        print(f"  {r.optimizer:<10}{r.param:<7}{fmt_bytes(r.device):>11}{fmt_bytes(r.pinned):>11}"
              f"{fmt_bytes(r.host):>11}{fmt_bytes(r.host_total):>12}{fmt_bytes(r.nvme):>11}  {verdict}")
    for i, why in enumerate(refusals, 1):
        print(f"  [{i}] {why}")
    dev = ("unknown (no accelerator; give --device-memory)" if machine.device_bytes is None
           else f"{fmt_bytes(machine.device_bytes)} ({machine.device_name})")
    print(f"this machine: device {dev}; host {fmt_bytes(machine.host_available)} available; "
          f"nvme {fmt_bytes(machine.nvme_free)} free at {machine.nvme_path}")
    print(f"  (fits: under {est.DEVICE_MARGIN:.0%} of the device, {est.HOST_MARGIN:.0%} of available host "
          f"memory, {est.NVME_MARGIN:.0%} of free disk)")
    if rss is not None:
        where = "the device is this process's heap" if machine.device_bytes is None and not _cuda() else \
            "device memory not included"
        print(f"peak host RSS of the training process at --placement {args.placement} ({where}):")
        for line in rss.lines():
            print(line)
    if args.deepspeed:
        print("DeepSpeed's estimators for comparison (buffer factor 1.5 on host):")
        for k, v in est.deepspeed_reference(spec, args.world_size).items():
            print(f"  {k:<34} device {fmt_bytes(v['device']):>10}  host {fmt_bytes(v['host']):>10}")
    return 0


def register(sub) -> None:
    e = sub.add_parser("estimate", help="bytes per tier for each placement, against this machine")
    e.set_defaults(func=cmd_estimate, _parser=e)
    add_model_args(e, gpt_defaults=False)
    e.add_argument("--world-size", type=int, default=1, help="data-parallel ranks on this node")
    e.add_argument("--buffer-count", type=int, default=4, help="swap slots per NVMe tier")
    e.add_argument("--gradient-clipping", type=float, default=0.0,
                   help="clipping (> 0) makes gradients wait for the global norm: parked on NVMe")
    e.add_argument("--gradient-accumulation-steps", type=int, default=1)
    e.add_argument("--grad-host-bytes", metavar="SIZE",
                   help="offload_optimizer.grad_host_bytes: host memory for gradient buffers")
    e.add_argument("--offload-activations", choices=("none", "cpu", "nvme"), default="none",
                   help="count the host pool of offloaded activations (offload_activations.device)")
    e.add_argument("--activation-host-bytes", metavar="SIZE",
                   help="offload_activations.host_bytes (default: nvme twice the lookahead, cpu half the "
                        "available host memory)")
    e.add_argument("--update-ahead", action="store_true",
                   help="offload_optimizer.update_ahead: count its second optimizer state and staged parameters "
                        "(placements with the optimizer on cpu)")
    e.add_argument("--device-memory", metavar="SIZE", help="accelerator memory per rank, e.g. 24GiB")
    e.add_argument("--nvme-path", metavar="DIR", help="where the NVMe tier would live (free space is checked)")
    e.add_argument("--deepspeed", action="store_true", help="also print DeepSpeed's estimator figures")
    e.add_argument("--placement", metavar="O/P",
                   help="print the peak host RSS of this placement (optimizer/param, e.g. nvme/nvme), term by term")
    add_rss_args(e, batch=True)
    e.add_argument("--json", action="store_true")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()
