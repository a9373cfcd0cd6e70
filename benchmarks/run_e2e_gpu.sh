#!/usr/bin/env bash
# End-to-end benchmark on one H200 (benchmarks/E2E.md), in one call of at most ~9.5 minutes:
#   1. the selection calibration table (CPU, in the background while the kernels build)
#   2. the kernel build (resolve k 2048 / B 4096 / 1152-byte rows, replay, gather ceiling)
#   3. bench_e2e.py: every step replayed from CUDA graphs, real sparse MLA attention (Triton,
#      compiled at first use); 61 and 78 layers x 32K and 128K (plugin off, sync, prefetch,
#      no-IO, then each IO-hiding change and pressure residency against prefetch in
#      interleaved rounds), a GLM-5.1 8xH200 node's proportion (--node-preset), low pressure at
#      batch 1 / 4 / 16, the ramp, the toy-churn variant.
#      The whole set does not fit one call: split it with --kinds / --layers / --contexts, e.g.
#        OUT=/tmp/a bash benchmarks/run_e2e_gpu.sh --kinds main --contexts 32768
#        OUT=/tmp/b bash benchmarks/run_e2e_gpu.sh --kinds main --contexts 131072
#        OUT=/tmp/c bash benchmarks/run_e2e_gpu.sh --kinds node low_pressure ramp toy
# Writes at most 3 files to $OUT: bench_e2e.json, bench_e2e.png (when matplotlib is there)
# and run.log (machine, build, calibration, benchmark). Each step survives the others
# failing: a failed build leaves the kernels to compile at first use, a failed calibration
# leaves bench_e2e to embed its quick one, and bench_e2e rewrites its JSON after every point.
#   OUT=/tmp/out bash benchmarks/run_e2e_gpu.sh [extra bench_e2e.py flags]
#   STACK=v4 OUT=/tmp/out bash benchmarks/run_e2e_gpu.sh   # DeepSeek-V4-Flash's C4 stack instead:
#      builds the C4 kernels (k 512 / B 1024 / 592-byte rows, C4 pages) and runs --stack v4
set -o pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/e2e.XXXXXX)

main() {
. benchmarks/gpu_env.sh; gpu_env "$WORK/site"  # (a failed install: the kernels fail later, the calibration still runs)
echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; free -g; nproc
git log --oneline -1 2>/dev/null || true
python3 -c "import matplotlib" 2>/dev/null || echo "matplotlib missing: no plot (the JSON has every figure)"

echo "== calibration (background, CPU)"
( timeout 200 python3 benchmarks/e2e_selection.py --json "$WORK/calibration.json" \
    > "$WORK/calibration.txt" 2>&1 ) &
CAL=$!

echo "== build"
t0=$SECONDS
STACK_ARG=()
if [ "${STACK:-dsa}" = v4 ]; then
  STACK_ARG=(--stack v4)
  # resolve (ROWL 1), replay, the host<->C4 all-layer copies and the gather ceiling, in parallel
  timeout 240 python3 - <<'PY' 2>&1 | tail -8 || echo "kernel build failed or timed out: kernels compile at first use"
import time
from concurrent.futures import ThreadPoolExecutor
from sglang_hisparse.kernels import _jit
jobs = [("resolve", lambda: _jit.resolve_module(512, 1024, 592, rowl=1)),
        ("replay", lambda: _jit.replay_module(592, rowl=1)),
        ("layer_copy host->c4", lambda: _jit.layer_copy_module(592, 0, 1)),
        ("layer_copy c4->host", lambda: _jit.layer_copy_module(592, 1, 0)),
        ("gather", lambda: _jit.gather_module(592))]
def one(job):
    t = time.perf_counter(); job[1](); return f"{job[0]}: {time.perf_counter() - t:.1f} s"
with ThreadPoolExecutor(5) as pool:
    for line in pool.map(one, jobs):
        print(line)
PY
else
( timeout 180 python3 -c "from sglang_hisparse.kernels import _jit; _jit.gather_module(1152)" \
    > "$WORK/gather.txt" 2>&1 || echo "gather ceiling build failed: link figures will be missing" >> "$WORK/gather.txt" ) &
GATHER=$!
# the slru resolve (the server's default policy; the run's slru A/B) builds beside the lru one
( timeout 240 python3 -m sglang_hisparse.kernels --top-k 2048 --buffer 4096 --items 1152 --jobs 4 \
    --policy slru > "$WORK/slru.txt" 2>&1 || echo "slru build failed: it compiles at first use" >> "$WORK/slru.txt" ) &
SLRU=$!
timeout 240 python3 -m sglang_hisparse.kernels --top-k 2048 --buffer 4096 --items 1152 --jobs 4 2>&1 | tail -20 \
  || echo "kernel build failed or timed out: kernels compile at first use"
wait "$SLRU"; tail -3 "$WORK/slru.txt"
wait "$GATHER"; tail -5 "$WORK/gather.txt"
fi
echo "build: $((SECONDS - t0)) s"

wait "$CAL"; echo "calibration rc=$?"; cat "$WORK/calibration.txt"
CAL_ARG=()
[ -s "$WORK/calibration.json" ] && CAL_ARG=(--calibration "$WORK/calibration.json")
# the table above is the DSA stack's (k 2048 over tokens); a V4 run embeds its own quick one
[ "${STACK:-dsa}" = v4 ] && CAL_ARG=()

echo "== bench_e2e"
# a crash in a driver call (a segfault) also prints the Python stack it came from
export PYTHONFAULTHANDLER=1
left=$(( ${E2E_SECONDS:-570} - SECONDS )); [ "$left" -lt 60 ] && left=60
# --deadline-s: points not started by then are recorded as skipped, so the summary and plot
# are still written; the timeout only catches a point that hangs.
timeout "$left" python3 benchmarks/bench_e2e.py --out "$OUT" "${STACK_ARG[@]}" "${CAL_ARG[@]}" --deadline-s $((left - 60)) "$@"
rc=$?
echo "bench_e2e rc=$rc at $SECONDS s (1: an output not exact, a point failed or refused; 124: timed out,"
echo "  bench_e2e.json then holds the points that finished)"
[ -f "$OUT/bench_e2e.png" ] || echo "no plot here: python benchmarks/e2e_report.py $OUT/bench_e2e.json out.png (needs matplotlib)"
return "$rc"
}

# One log for everything; tee has written all of it before the script exits.
main "$@" 2>&1 | tee -a "$OUT/run.log"
rc=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$rc"
