#!/usr/bin/env bash
# One call on a machine with one CUDA GPU: build, run the CUDA tests, run the benchmarks
# that exercise the device path. Uses the machine's python3 and its torch (never installs
# another torch); installs only what is missing. Finishes within about 8 minutes.
# Everything it prints also goes to $OUT/gpu_check.log when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp}/gpu_check.log
exec > >(tee "$LOG") 2>&1
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
for mod in numpy psutil aiofiles pytest; do
  $PY -c "import $mod" 2>/dev/null || $PY -m pip install -q "$mod" || echo "missing $mod"
done
echo "== build"; $PY setup.py -q build_ext --inplace 2>&1 | tail -3
$PY -c "import offload, json; print(json.dumps(offload.native_info()))"
rc=0
echo "== CUDA tests"; timeout 240 $PY -m pytest -q -m cuda tests/test_cuda.py || rc=1
echo "== engine tests on the GPU machine (CPU paths too)"; timeout 120 $PY -m pytest -q -x tests/test_engine.py -k "parity" || rc=1
echo "== bench_step"; timeout 60 $PY benchmarks/bench_step.py --rounds 2 | tail -6
echo "== bench_prefetch"; timeout 90 $PY benchmarks/bench_prefetch.py --rounds 3 | tail -8
echo "== bench_adam"; timeout 60 $PY benchmarks/bench_adam.py | tail -4
# activation offload (issue 13): claims gpu_step_overhead <= 1.05, gpu_saved_device_peak_vs_bound <= 1
echo "== activation offload tests + bench_activations --device-check"
timeout 120 $PY -m pytest -q -x tests/test_activations.py -k "bit_exact and gpt and not gpt2" || rc=1
timeout 120 $PY benchmarks/bench_activations.py --device-check --rounds 5 | tail -3
exit $rc
