"""``offload corpus --pydoc FILE --stdlib FILE``: write the local texts (nothing downloaded)
to files, for ``offload finetune --data``: ``pydoc`` (the help topics of
``pydoc_data.topics``, the corpus of ``offload train``) and ``stdlib`` (the source of a few
standard-library modules)."""
from __future__ import annotations

import os

from offload.cli.common import CLIError


def cmd_corpus(args) -> int:
    from offload.cli.corpus import TEXTS
    todo = [(name, getattr(args, name)) for name in TEXTS if getattr(args, name)]
    if not todo:
        raise CLIError("give at least one of --pydoc FILE, --stdlib FILE")
    for key, out in todo:
        parent = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(parent):
            raise CLIError(f"the directory of {out!r} does not exist")
        name, text = TEXTS[key]()
        data = text.encode("utf-8")
        tmp = out + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, out)
        print(f"wrote {out}: {name}, {len(data) / 1e3:.0f} KB")
    return 0


def register(sub) -> None:
    c = sub.add_parser("corpus", help="write the local texts (pydoc topics, stdlib source) to files")
    c.set_defaults(func=cmd_corpus, _parser=c)
    c.add_argument("--pydoc", metavar="FILE", help="the help topics of pydoc_data.topics (~450 KB of English)")
    c.add_argument("--stdlib", metavar="FILE", help="the source of a few standard-library modules (~380 KB)")
