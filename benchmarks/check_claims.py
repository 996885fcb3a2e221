"""Exit 1 when a benchmark's output misses a target: its last JSON line's "missed" (or its
"claims" below its "targets"), or a claim named on the command line that it did not measure
(a benchmark that ran on the CPU names such claims in "not_applicable").

    python benchmarks/check_claims.py OUTPUT_FILE [REQUIRED_CLAIM ...]
"""
import json
import sys


def main(path: str, required: list) -> int:
    lines = [line for line in open(path).read().splitlines() if line.startswith("{")]
    if not lines:
        print(f"  {path}: no JSON result line")
        return 1
    d = json.loads(lines[-1])
    claims = d.get("claims", {})
    missed = d.get("missed")
    if missed is None:                       # "targets": minimums
        missed = [k for k, t in d.get("targets", {}).items() if not claims.get(k, float("-inf")) >= t]
    missed = list(missed)
    for k in required:
        if k not in claims:
            why = d.get("not_applicable", {}).get(k, "absent from its claims")
            print(f"  {k} = not measured as a claim ({why})   MISSED")
            missed.append(k)
    for k, v in claims.items():
        shown = f"{v:.3f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
        print(f"  {k} = {shown}" + ("   MISSED" if k in missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
