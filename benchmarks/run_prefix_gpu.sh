#!/usr/bin/env bash
# Prefix (radix) cache on one H200 (docs/prefix-cache.md section 10), in one call of <= ~9 min:
#   1. the kernel build (resolve k 2048 / B 4096 / 1152-byte rows, row copies)
#   2. the GPU tests of the row copies a prefix hit uses (host->device, device->device)
#   3. bench_prefix.py: the shared-prefix and agent workloads, radix off / radix / always-hot
# Writes to $OUT: bench_prefix.json, run.log.   OUT=/tmp/out bash benchmarks/run_prefix_gpu.sh [flags]
set -o pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/prefix.XXXXXX)

main() {
. benchmarks/gpu_env.sh; gpu_env "$WORK/site"
echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; free -g; nproc
git log --oneline -1 2>/dev/null || true
echo "== build"; t0=$SECONDS
timeout 240 python3 -m sglang_hisparse.kernels --top-k 2048 --buffer 4096 --items 1152 --jobs 8 2>&1 | tail -8 \
  || echo "kernel build failed or timed out: kernels compile at first use"
echo "build: $((SECONDS - t0)) s"
echo "== GPU tests (row copies)"
if python3 -m pytest --version >/dev/null 2>&1; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_layer_copy_gpu.py 2>&1 | tail -5
else
  echo "no pytest on this machine: the copy tests did not run"
fi
echo "== bench_prefix"
left=$(( 560 - SECONDS )); [ "$left" -lt 60 ] && left=60
timeout "$left" python3 benchmarks/bench_prefix.py --out "$OUT" "$@"
rc=$?
echo "bench_prefix rc=$rc at $SECONDS s (1: a mode failed or was not exact; 124: timed out, the JSON"
echo "  holds the modes that finished)"
return "$rc"
}

main "$@" 2>&1 | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$rc"
