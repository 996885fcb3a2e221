"""``offload corpus NAME OUT``: write one of the local texts (nothing downloaded) to a file,
for ``offload finetune --data``: ``pydoc`` (the help topics of ``pydoc_data.topics``, the
corpus of ``offload train``) or ``stdlib`` (the source of a few standard-library modules)."""
from __future__ import annotations

import os

from offload.cli.common import CLIError


def cmd_corpus(args) -> int:
    from offload.cli.corpus import TEXTS
    name, text = TEXTS[args.name]()
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise CLIError(f"the directory of {args.out!r} does not exist")
    data = text.encode("utf-8")
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {name}, {len(data) / 1e3:.0f} KB")
    return 0


def register(sub) -> None:
    c = sub.add_parser("corpus", help="write a local text (pydoc | stdlib) to a file")
    c.set_defaults(func=cmd_corpus, _parser=c)
    c.add_argument("name", choices=("pydoc", "stdlib"))
    c.add_argument("out", metavar="FILE")
