#!/usr/bin/env bash
# One call on a machine with a CUDA GPU, as the project's GPU machine is: its python3 and
# packages (torch, transformers, accelerate, peft, psutil, safetensors, lightning, pytest,
# hypothesis, nvcc), no network. Installs nothing from the network: the one package the checks
# may need in another release travels as a wheel in benchmarks/wheels/ (WHEELS below; the
# README's "GPU check" says how to fetch it); without it the Hugging Face parts run with
# OFFLOAD_HF_UNTESTED=1 against the image's transformers, and the results say so.
#
# Builds the native library there, then runs the checks most important first, each under its
# own cap; the caps add up to at most 480 s (8 minutes) and a step starts only when its whole
# cap is left of BUDGET_S (default 480), else it is recorded as not run for time.
#
# Writes $OUT/gpu_check.json (OUT defaults to /tmp): per check its command, cap, seconds and
# status (passed / failed / not run for time), the machine, the packages and the HF mode.
# Everything printed also goes to $OUT/gpu_check.log; each step's output to $OUT/<step>.log.
# Exit status 0 when every check passed.
#
#   bash benchmarks/gpu_check.sh            run it
#   bash benchmarks/gpu_check.sh --dry-run  list the steps, their caps, their sum and the wheels
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp}
BUDGET=${BUDGET_S:-480}
WHEELS="transformers-5.24.0-py3-none-any.whl"    # the lowest transformers offload.hf supports

# bench NAME ARGS -- REQUIRED...: the benchmark's output kept, then its claims checked
# (benchmarks/check_claims.py); as a step command string
bench() {
  local name=$1; shift; local args=() req=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done
  [ $# -gt 0 ] && shift; req=("$@")
  echo "$PY benchmarks/bench_$name.py ${args[*]} > \$OUTDIR/bench_$name.out 2>&1; r=\$?; tail -n 12 \$OUTDIR/bench_$name.out | cut -c1-400; [ \$r -eq 0 ] && $PY benchmarks/check_claims.py \$OUTDIR/bench_$name.out ${req[*]}"
}
# NAME|CAP|COMMAND: the checks, most important first. No test_engine.py step: its models and
# batches are on the CPU, its engine on the GPU (test_cuda.py runs those checks with both on
# the GPU). No fake-NCCL step: it is a CPU test (gloo groups cannot carry CUDA tensors).
STEPS=(
  "build|70|$PY setup.py -q build_ext --inplace"
  "engine_parity_cuda|100|$PY -m pytest -q -x -m cuda tests/system/test_cuda.py -k '(parity or cells or lora) and not matrix'"
  "matrix_cells_cuda|70|$PY -m pytest -q -m cuda tests/system/test_cuda.py -k matrix"
  "stream_races_precision_ranks|70|$PY -m pytest -q -m cuda tests/system/test_cuda.py -k '(slow or mixed or two_ranks or bf16 or budget or resume or synchron or bit_exact) and not matrix'"
  "bench_adam|30|$(bench adam --size 64M --rounds 4)"
  "bench_prefetch|45|$(bench prefetch --rounds 2 -- step_vs_bound)"
  "bench_scale_7b_nf4|55|$(bench scale --size 7b --frozen-dtype nf4 --layers 4 --tokens 512 --steps 3 -- step_speedup_7b_nf4 param_wait_ratio_7b_nf4)"
  "activation_offload|40|$PY -m pytest -q -x tests/engine/test_activations.py -k 'bit_exact and gpt and not gpt2' && $(bench activations --device-check --rounds 3)"
)

total=0
for s in "${STEPS[@]}"; do total=$((total + $(cut -d'|' -f2 <<<"$s"))); done
if [ "${1:-}" = "--dry-run" ]; then
  printf '%-30s %5s  %s\n' step cap_s command
  for s in "${STEPS[@]}"; do IFS='|' read -r n c cmd <<<"$s"; printf '%-30s %5s  %s\n' "$n" "$c" "$cmd"; done
  echo "total cap: $total s (budget $BUDGET s, limit 480 s)"
  echo "wheels expected in benchmarks/wheels/ (optional): $WHEELS"
  echo "  without them: OFFLOAD_HF_UNTESTED=1 against the machine's transformers"
  [ "$total" -le 480 ] || { echo "the caps exceed 480 s"; exit 1; }
  exit 0
fi

mkdir -p "$OUTDIR"
exec > >(tee "$OUTDIR/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PIP_NO_INDEX=1 OUTDIR
echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc; uptime
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 1

# The Hugging Face version: a wheel from benchmarks/wheels/ when there, installed without the
# network into a directory of its own put first on the path; else the image's, unchecked.
HF_MODE=image-untested
SITE=$(mktemp -d)
if ls benchmarks/wheels/transformers-*.whl >/dev/null 2>&1; then
  if timeout 60 $PY -m pip install -q --no-index --no-deps --find-links benchmarks/wheels --target "$SITE" \
       benchmarks/wheels/transformers-*.whl; then
    if PYTHONPATH=$SITE:$PYTHONPATH $PY -c "import transformers, offload.hf.versions as v; v.check('transformers')"; then
      export PYTHONPATH=$SITE:$PYTHONPATH
      HF_MODE=wheel
    else
      echo "the transformers wheel does not import here (a dependency of it): the image's transformers instead"
    fi
  fi
fi
if [ "$HF_MODE" = image-untested ] && $PY -c "import offload.hf.versions as v; v.check('transformers')" 2>/dev/null; then
  HF_MODE=image                       # the image's transformers is in the supported range
fi
case $HF_MODE in wheel|image) ;; *) export OFFLOAD_HF_UNTESTED=1 ;; esac
echo "== packages (HF mode: $HF_MODE)"
$PY - <<'EOF'
from importlib import metadata
for n in ("torch", "transformers", "accelerate", "peft", "safetensors", "psutil", "pytest", "hypothesis", "lightning"):
    try:
        print(f"  {n} {metadata.version(n)}")
    except metadata.PackageNotFoundError:
        print(f"  {n} missing")
EOF

RESULTS=$OUTDIR/gpu_check.steps
: > "$RESULTS"
END=$((SECONDS + BUDGET))
for s in "${STEPS[@]}"; do
  IFS='|' read -r name cap cmd <<<"$s"
  left=$((END - SECONDS))
  if [ "$left" -lt "$cap" ]; then
    echo "== $name: not run for time ($left s left, cap $cap s)"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$cap" 0 "not run for time" "$cmd" >> "$RESULTS"
    continue
  fi
  echo "== $name (cap $cap s)"
  t0=$SECONDS
  timeout "$cap" bash -c "$cmd" > "$OUTDIR/$name.log" 2>&1
  rc=$?
  tail -n 8 "$OUTDIR/$name.log" | cut -c1-300
  status=passed
  [ $rc -eq 0 ] || status=failed
  [ $rc -eq 124 ] && status="failed (cap reached)"
  echo "   -> $status in $((SECONDS - t0)) s"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$cap" $((SECONDS - t0)) "$status" "$cmd" >> "$RESULTS"
  if [ "$name" = build ] && [ $rc -ne 0 ]; then
    echo "the native library did not build: the checks need it"; END=$SECONDS
  fi
done

$PY - "$RESULTS" "$OUTDIR/gpu_check.json" "$HF_MODE" "$BUDGET" <<'EOF'
import json, subprocess, sys
from importlib import metadata
steps_file, out, hf_mode, budget = sys.argv[1:]
checks = []
for line in open(steps_file):
    name, cap, secs, status, cmd = line.rstrip("\n").split("\t", 4)
    checks.append({"name": name, "status": status, "cap_s": int(cap), "seconds": int(secs), "command": cmd})
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as exc:   # noqa: BLE001
    gpu = f"unknown ({exc})"
pk = {}
for n in ("torch", "transformers", "accelerate", "peft"):
    try:
        pk[n] = metadata.version(n)
    except metadata.PackageNotFoundError:
        pk[n] = None
doc = {"gpu": gpu, "packages": pk, "budget_s": int(budget),
       "hf_mode": {"wheel": "transformers from benchmarks/wheels (supported)",
                   "image": "the image's transformers (supported)",
                   "image-untested": "the image's transformers, OFFLOAD_HF_UNTESTED=1"}[hf_mode],
       "checks": checks, "passed": all(c["status"] == "passed" for c in checks)}
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps({c["name"]: c["status"] for c in checks}))
print("passed" if doc["passed"] else "NOT passed", "->", out)
sys.exit(0 if doc["passed"] else 1)
EOF
