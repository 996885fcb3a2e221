"""``offload export``: consolidated fp32 weights from a checkpoint (.pt or .safetensors)."""
from __future__ import annotations

import os

from offload.cli.common import CLIError, fmt_bytes


def cmd_export(args) -> int:
    import torch
    import offload
    if not os.path.exists(args.checkpoint):
        raise CLIError(f"checkpoint {args.checkpoint!r} does not exist: give the directory save_checkpoint wrote")
    use_st = args.out.endswith(".safetensors")
    if use_st:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CLIError("writing .safetensors needs the safetensors package: pip install safetensors "
                           "(or give an OUT ending in .pt)") from None
    try:
        sd = offload.export_fp32(args.checkpoint)
    except (offload.CheckpointError, FileNotFoundError, ValueError) as exc:
        raise CLIError(f"cannot export {args.checkpoint!r}: {exc}") from None
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise CLIError(f"the directory of {args.out!r} does not exist")
    if use_st:   # safetensors refuses tensors that share memory (tied weights): one copy each
        save_file({k: v.detach().to(torch.float32).contiguous().clone() for k, v in sd.items()}, args.out)
    else:
        torch.save(sd, args.out)
    n = sum(v.numel() for v in sd.values())
    print(f"wrote {args.out}: {len(sd)} tensors, {n / 1e6:.2f}M values, fp32 "
          f"({'safetensors' if use_st else 'torch .pt'}, {fmt_bytes(os.path.getsize(args.out))})")
    return 0


def register(sub) -> None:
    x = sub.add_parser("export", help="consolidated fp32 weights from a checkpoint")
    x.set_defaults(func=cmd_export, _parser=x)
    x.add_argument("checkpoint", help="a checkpoint directory (engine.save_checkpoint)")
    x.add_argument("out", help="output file: .pt (torch) or .safetensors")
