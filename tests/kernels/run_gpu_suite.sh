#!/usr/bin/env bash
# Whole GPU verification + benchmark in one go (the lent H200 has no tvm-ffi: its wheel is
# carried in .whl/). Writes logs and JSON under $OUT (default ./out). Usage:
#   OUT=/tmp/out bash tests/kernels/run_gpu_suite.sh [quick]
# The kernel tests run in JOBS processes (pytest-xdist, default 8; JOBS=1: one process): one
# process took > 9 min for them on the H200, 8 processes ~4.5 min, so `quick` (build, tests,
# memcheck, racecheck) fits one 10-minute device call.
set -o pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
if ! python3 -c "import tvm_ffi" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export SGLANG_HISPARSE_JIT_CACHE=${SGLANG_HISPARSE_JIT_CACHE:-/tmp/hisparse_jit}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
t0=$SECONDS
python3 -m sglang_hisparse.kernels --grid tests --jobs 16 2>&1 | tee "$OUT/build.log" || exit 2
echo "build: $((SECONDS - t0)) s"
JOBS=${JOBS:-8}
XDIST=()
if [ "$JOBS" -gt 1 ]; then
  if python3 -c "import xdist" 2>/dev/null; then XDIST=(-n "$JOBS"); else echo "pytest-xdist missing: one process"; fi
fi
python3 -m pytest tests/kernels "${XDIST[@]}" --maxfail=5 -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
echo "pytest rc=$? at $((SECONDS - t0)) s"
if [ "$1" != "quick" ]; then
  python3 benchmarks/bench_resolve.py --out "$OUT/bench_resolve.json" 2>&1 | tail -60
  echo "bench at $((SECONDS - t0)) s"
fi
cd tests/kernels
compute-sanitizer --tool memcheck --error-exitcode 9 python3 sanitize_resolve.py 2>&1 \
  | tail -15 | tee "$OUT/memcheck.log"
echo "memcheck rc=$? at $((SECONDS - t0)) s"
compute-sanitizer --tool racecheck --error-exitcode 9 python3 sanitize_resolve.py --quick 2>&1 \
  | tail -15 | tee "$OUT/racecheck.log"
echo "racecheck rc=$? at $((SECONDS - t0)) s"
