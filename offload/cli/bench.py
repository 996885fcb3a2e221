"""``offload bench NAME``: run ``benchmarks/bench_<NAME>.py`` (a source checkout)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from offload.cli.common import CLIError, REPO_ROOT


def cmd_bench(args) -> int:
    script = os.path.join(REPO_ROOT, "benchmarks", f"bench_{args.name}.py")
    if not os.path.isfile(script):
        have = sorted(f[6:-3] for f in os.listdir(os.path.dirname(script))
                      if f.startswith("bench_") and f.endswith(".py")) if os.path.isdir(os.path.dirname(script)) else []
        raise CLIError(f"benchmarks/bench_{args.name}.py is not there (yet): available: "
                       f"{', '.join(have) or 'none'} (benchmarks run from a source checkout)")
    return subprocess.call([sys.executable, script, *args.bench_args])


def register(sub) -> None:
    b = sub.add_parser("bench", help="run benchmarks/bench_<name>.py (other arguments pass through)")
    b.set_defaults(func=cmd_bench, _parser=b)
    b.add_argument("name", help="adam | io | prefetch | step")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
