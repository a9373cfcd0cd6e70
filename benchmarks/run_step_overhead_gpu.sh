#!/usr/bin/env bash
# Fused per-step bookkeeping (issue 29) on a GPU machine, in about 3 minutes, 3 files in $OUT:
#   $OUT/step_overhead.json         benchmarks/bench_step_overhead.py: launches per decode step and
#                                   GPU time of backup / translation / mapping / release, 61 and 78
#                                   layers, 656 / 1152 B rows, batch 1 / 16 / 64
#   $OUT/step_overhead_gpu.log      environment, JIT build of the all-layer copy, its GPU tests
#                                   (bit-exact vs the reference, CUDA-graph capture + replay),
#                                   compute-sanitizer memcheck of the kernel, the benchmark's
#                                   lines, and (time permitting) the CUDA exactness harness
#   $OUT/STEP_OVERHEAD_SUMMARY.txt  one screen: pass/fail of each step and the per-section table
# Run from the repository root. tvm-ffi: importable, or its wheel in .whl/ (docs: /work/shared
# DEVICE.md). The exit code is the kernel tests' (0 = passed).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/step_overhead_out}
mkdir -p "$OUT"
LOG="$OUT/step_overhead_gpu.log"
: > "$LOG"
if ! $PY -c "import tvm_ffi" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$LOG" 2>&1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export SGLANG_HISPARSE_JIT_CACHE=${SGLANG_HISPARSE_JIT_CACHE:-/tmp/hisparse_step_jit}
T0=$(date +%s)
secs() { echo $(( $(date +%s) - T0 )); }
say() { echo "== [$(secs) s] $*" | tee -a "$LOG"; }

{
  echo "date: $(date -u)  git: $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  $PY -c "import sys, torch, tvm_ffi; print('python', sys.version.split()[0], '| torch', torch.__version__, '| tvm_ffi', tvm_ffi.__version__, '| cuda', torch.cuda.is_available())" 2>&1
} >> "$LOG" 2>&1

say "building the all-layer copy (656, 1152 B rows)"
timeout 120 $PY -c "
from concurrent.futures import ThreadPoolExecutor
from sglang_hisparse.kernels import _jit
with ThreadPoolExecutor(2) as p: list(p.map(_jit.layer_copy_module, (656, 1152)))
print('built')" >> "$LOG" 2>&1
BUILD_RC=$?

say "GPU tests of the kernel (bit-exact vs reference, capture + replay)"
timeout 90 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_layer_copy_gpu.py >> "$LOG" 2>&1
TEST_RC=$?
say "kernel tests rc=$TEST_RC"

say "compute-sanitizer memcheck on the kernel"
SAN="skipped (no compute-sanitizer)"
if command -v compute-sanitizer >/dev/null; then
  (cd tests/kernels && timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 \
    $PY sanitize_layer_copy.py) 2>&1 | tail -8 >> "$LOG"
  SAN_RC=${PIPESTATUS[0]}
  SAN="rc=$SAN_RC ($([ "$SAN_RC" = 0 ] && echo clean || echo 'ERRORS or timeout: see the log'))"
fi
say "memcheck: $SAN"

LEFT=$(( 165 - $(secs) )); [ $LEFT -lt 60 ] && LEFT=60
say "benchmark (${LEFT} s budget)"
timeout $LEFT $PY benchmarks/bench_step_overhead.py --out "$OUT/step_overhead.json" >> "$LOG" 2>&1
BENCH_RC=$?
say "benchmark rc=$BENCH_RC"

LEFT=$(( 200 - $(secs) ))
HARNESS="skipped (no time left)"
if [ $LEFT -gt 30 ]; then
  say "CUDA exactness harness: staging, backups, preloads through the fused copy (${LEFT} s)"
  timeout $LEFT $PY -m pytest -x -q -p no:cacheprovider tests/unit/test_harness_cuda.py >> "$LOG" 2>&1
  H_RC=$?
  HARNESS="rc=$H_RC$([ $H_RC = 124 ] && echo ' (timed out)')"
fi
say "harness: $HARNESS"

$PY - "$OUT" "$BUILD_RC" "$TEST_RC" "$SAN" "$BENCH_RC" "$HARNESS" <<'EOF' | tee "$OUT/STEP_OVERHEAD_SUMMARY.txt"
import json, sys
from pathlib import Path
out, build_rc, test_rc, san, bench_rc, harness = Path(sys.argv[1]), *sys.argv[2:]
print("FUSED PER-STEP BOOKKEEPING (issue 29)")
print(f"build rc={build_rc}; kernel tests rc={test_rc} ({'PASS' if test_rc == '0' else 'FAIL'}); "
      f"memcheck {san}; benchmark rc={bench_rc}; CUDA harness {harness}")
p = out / "step_overhead.json"
if not p.exists():
    print("no benchmark JSON (see step_overhead_gpu.log)")
    sys.exit(0)
d = json.loads(p.read_text())
print(f"{d['gpu']}, torch {d['torch']}, {d['seconds']} s, complete={d.get('complete')}; cuda = CUDA "
      "runtime launch/copy calls per section (profiler); dispatch = device-side aten ops + tvm-ffi "
      "kernels; gpu us = summed device time; host us = host wall time (medians)")
print(f"{'L':>3} {'item':>5} {'bs':>3}  {'section':13} {'cuda':>6} {'dispatch':>9} "
      f"{'gpu us':>9} {'host us':>9}")
for r in d["results"]:
    for sec in ("map_last_loc", "backup", "translation", "release"):
        s = r["sections"][sec]
        def fig(key):
            return "-" if key not in s else f"{s[key]:.1f}"
        print(f"{r['layers']:>3} {r['item']:>5} {r['batch']:>3}  {sec:13} {fig('cuda_launches'):>6} "
              f"{fig('launches'):>9} {fig('gpu_us'):>9} {fig('host_us'):>9}")
EOF
say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $TEST_RC
