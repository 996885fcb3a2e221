"""The ``offload`` command: one module per subcommand, each with ``register(sub)`` adding
its parser (and ``func``) and the function it runs.

Errors in what the user gave (config, flags, paths) print one line, ``offload: error: ...``,
and exit with status 2; no traceback.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import List, Optional

from offload.cli import bench, corpus_text, estimate, export, finetune, new_model, plan, train
from offload.cli.common import EXIT_USAGE, CLIError, Parser
from offload.config import ConfigError

COMMANDS = (train, finetune, new_model, corpus_text, estimate, plan, bench, export)


def build_parser() -> Parser:
    parser = Parser(prog="offload", description="ZeRO-Offload engine for PyTorch: train, fine-tune, estimate, plan.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def _warning_line(message, category, filename, lineno, file=None, line=None):
    print(f"offload: warning: {message}", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    warnings.showwarning = _warning_line
    # bitsandbytes, when installed, logs on import that it could not fetch a CPU 4-bit matmul
    # from a hub; nothing here runs its kernels, so its output would only cloud the command's own
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help()
            return EXIT_USAGE
        return args.func(args)
    except (CLIError, ConfigError) as exc:
        print(f"offload: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except _user_errors() as exc:
        print(f"offload: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("offload: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:          # `offload estimate ... | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _user_errors():
    from offload.planner.estimate import EstimateError
    errs = [EstimateError]
    try:
        from offload.core.blocks import ModelError
        errs.append(ModelError)
    except ImportError:
        pass
    try:
        from offload.storage import NvmeSpaceError
        errs.append(NvmeSpaceError)
    except ImportError:
        pass
    return tuple(errs)


