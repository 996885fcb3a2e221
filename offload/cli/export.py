"""``offload export``: a checkpoint's weights: one consolidated fp32 file (.pt or
.safetensors), or with ``--format hf`` the Hugging Face layout (safetensors laid out as save_pretrained
lays them out, config.json; a PEFT model's adapter in PEFT's layout, or merged)."""
from __future__ import annotations

import os

from offload import dtypes
from offload.cli.common import CLIError
from offload.units import fmt_bytes


def _export_hf(args) -> int:
    import offload
    from offload.config.flags import parse_bytes
    if os.path.isfile(args.out):
        raise CLIError(f"{args.out!r} is a file: --format hf writes a directory")
    try:
        shard = parse_bytes(args.max_shard_size) if args.max_shard_size else 5 * 10**9
        out = offload.export_hf(args.checkpoint, args.out, max_shard_bytes=shard, dtype=args.dtype,
                                peft=args.peft or "adapter")
    except (offload.CheckpointError, offload.WeightsError, FileNotFoundError, ValueError) as exc:
        raise CLIError(f"cannot export {args.checkpoint!r}: {exc}") from None
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files if os.path.isfile(os.path.join(out, f)))
    print(f"wrote {out}: {len(files)} files ({', '.join(files[:6])}{', ...' if len(files) > 6 else ''}), "
          f"{fmt_bytes(size)}")
    if args.peft == "merged":
        from offload.io.export import merged_base_note
        note = merged_base_note(args.checkpoint)
        if note:
            print(f"merged: {note}")
    return 0


def cmd_export(args) -> int:
    import torch
    import offload
    if not os.path.exists(args.checkpoint):
        raise CLIError(f"checkpoint {args.checkpoint!r} does not exist: give the directory save_checkpoint wrote")
    if args.format == "hf":
        return _export_hf(args)
    if args.peft or args.dtype or args.max_shard_size:
        raise CLIError("--peft, --dtype and --max-shard-size apply to --format hf")
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
    x = sub.add_parser("export", help="a checkpoint's weights: one fp32 file, or the Hugging Face layout")
    x.set_defaults(func=cmd_export, _parser=x)
    x.add_argument("checkpoint", help="a checkpoint directory (engine.save_checkpoint)")
    x.add_argument("out", help="output file: .pt (torch) or .safetensors; with --format hf a directory")
    x.add_argument("--format", choices=("fp32", "hf"), default="fp32",
                   help="fp32: one consolidated file; hf: sharded safetensors + index + config.json "
                        "(from_pretrained loads it), a PEFT model's adapter in PEFT's layout")
    x.add_argument("--peft", choices=("adapter", "merged"), default=None,
                   help="a PEFT model: its adapter in PEFT's layout (default) or merged into the base")
    x.add_argument("--dtype", choices=dtypes.PRECISIONS, default=None,
                   help="convert floating-point tensors (default: each tensor's training dtype)")
    x.add_argument("--max-shard-size", default=None, help="largest safetensors shard (default 5GB), e.g. 2GB")
