#!/usr/bin/env bash
# End-to-end benchmark on one H200 (benchmarks/E2E.md): HiSparse sync / prefetch / no-IO vs
# full-KV residency at 32K and 128K under one 24 GiB KV budget. Writes bench_e2e.json,
# bench_e2e.log, build.log, machine.txt (and bench_e2e.png when matplotlib exists) to $OUT.
# Expected wall time: ~1 min kernel build + ~0.5 min pinning the host pool + ~2 min runs.
#   OUT=/tmp/out bash benchmarks/run_e2e_gpu.sh [extra bench_e2e.py flags]
set -o pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
if ! python3 -c "import tvm_ffi" 2>/dev/null; then
  # The lent GPU machine has no tvm-ffi; its wheel is carried in .whl/ (same as tests/kernels).
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "tvm_ffi missing and .whl/ has no wheel"; exit 2; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export SGLANG_HISPARSE_JIT_CACHE=${SGLANG_HISPARSE_JIT_CACHE:-/tmp/hisparse_jit}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; free -g; nproc; } \
  2>&1 | tee "$OUT/machine.txt"
t0=$SECONDS
# Build the one resolve specialization (k 2048, B 4096, 1152-byte rows) and the replay kernel
# up front so no nvcc time lands in a warm-up step.
python3 -m sglang_hisparse.kernels --top-k 2048 --buffer 4096 --items 1152 --jobs 2 2>&1 \
  | tee "$OUT/build.log" || { echo "kernel build failed (see $OUT/build.log)"; exit 2; }
echo "build: $((SECONDS - t0)) s"
# The plan (batches, pinned host bytes) is printed before anything large is allocated; the
# benchmark refuses with exit 1 and a message when the machine cannot hold it.
timeout 250 python3 benchmarks/bench_e2e.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_e2e.log"
rc=${PIPESTATUS[0]}
echo "bench_e2e rc=$rc at $((SECONDS - t0)) s (rc 1: outputs not exact or refused; 124: timed out,"
echo "  bench_e2e.json then holds the contexts that finished)"
exit "$rc"
