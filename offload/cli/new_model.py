"""``offload new-model DIR``: write a freshly initialised small Llama-shaped model with a
byte-level tokenizer in Hugging Face layout (nothing downloaded; the first stage of
``make train``)."""
from __future__ import annotations

from offload.cli.common import CLIError


def cmd_new_model(args) -> int:
    from offload.cli.finetune import quiet_hf
    from offload.hf.byte_llama import write_byte_llama
    quiet_hf()
    try:
        out = write_byte_llama(args.out, hidden=args.hidden, layers=args.layers, heads=args.heads,
                               intermediate=args.intermediate, max_positions=args.max_positions, seed=args.seed)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(out)
    print(f"wrote {out}/: Llama {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size} "
          f"(byte-level tokenizer), freshly initialised (seed {args.seed})")
    return 0


def register(sub) -> None:
    n = sub.add_parser("new-model", help="write a fresh small Llama with a byte-level tokenizer (HF layout)")
    n.set_defaults(func=cmd_new_model, _parser=n)
    n.add_argument("out", metavar="DIR")
    n.add_argument("--hidden", type=int, default=256)
    n.add_argument("--layers", type=int, default=4)
    n.add_argument("--heads", type=int, default=4)
    n.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4 x hidden)")
    n.add_argument("--max-positions", type=int, default=512)
    n.add_argument("--seed", type=int, default=0)
