#!/usr/bin/env bash
# One call on a machine with one CUDA GPU: build, run the CUDA tests, run the benchmarks that
# exercise the device path, and fail (exit 1) when a test fails or a benchmark misses its
# target (its last line's JSON: "missed", or "claims" against "targets"), crashes or times
# out. Uses the machine's python3 and its torch (never installs another torch); installs only
# the packages below that are missing. Every step has a timeout: about 7 minutes in all.
# Everything it prints also goes to $OUT/gpu_check.log when OUT is set; each benchmark's full
# output to $OUT/bench_<name>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp}
LOG=$OUTDIR/gpu_check.log
exec > >(tee "$LOG") 2>&1
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
failed=()

echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc; uptime
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 1
for mod in numpy psutil aiofiles pytest safetensors; do
  $PY -c "import $mod" 2>/dev/null || timeout 120 $PY -m pip install -q "$mod" || echo "could not install $mod"
done

echo "== build"
timeout 120 $PY setup.py -q build_ext --inplace 2>&1 | tail -3 || failed+=("build")
$PY -c "import torch, offload, json; print(json.dumps(offload.native_info()))" || exit 1

echo "== CUDA tests"
timeout 150 $PY -m pytest -q -m cuda tests/test_cuda.py || failed+=("CUDA tests")
echo "== NCCL / gloo group tests (the 2-GPU one skips on 1 GPU)"
timeout 60 $PY -m pytest -q tests/test_zero.py -k nccl || failed+=("NCCL tests")
echo "== engine parity tests (CPU paths on the GPU machine)"
timeout 60 $PY -m pytest -q -x tests/test_engine.py -k parity || failed+=("engine parity tests")

# bench NAME TIMEOUT ARGS...: run it, keep its output, check its claims.
bench() {
  local name=$1 limit=$2; shift 2
  local out=$OUTDIR/bench_$name.log
  echo "== bench_$name $*"
  timeout "$limit" $PY "benchmarks/bench_$name.py" "$@" > "$out" 2>&1
  local rc=$?
  tail -n 12 "$out" | cut -c1-400
  if [ $rc -ne 0 ]; then
    failed+=("bench_$name (exit $rc$([ $rc -eq 124 ] && echo ', timed out after '"$limit"' s'))")
    return
  fi
  $PY - "$out" "$name" <<'EOF' || failed+=("bench_$name (missed a target)")
import json, sys
path, name = sys.argv[1], sys.argv[2]
last = [l for l in open(path).read().splitlines() if l.startswith("{")][-1]
d = json.loads(last)
claims = d["claims"]
missed = d.get("missed")
if missed is None:   # "targets": minimums
    missed = [k for k, t in d.get("targets", {}).items() if not claims[k] >= t]
for k, v in claims.items():
    print(f"  {name}.{k} = {v:.3f}" + ("   MISSED" if k in missed else ""))
sys.exit(1 if missed else 0)
EOF
}
bench step 120 --rounds 2
bench prefetch 150 --rounds 2
bench adam 90 --size 64M --rounds 8

echo "== summary"
if [ ${#failed[@]} -ne 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all CUDA tests passed and every benchmark met its target"
