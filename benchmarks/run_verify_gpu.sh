#!/usr/bin/env bash
# Verify-step resolve kernel (issue 7) on a GPU machine, in < 6 minutes (lru and slru builds):
#   0. environment facts                          -> $OUT/verify_env.txt
#   1. parallel JIT precompile of every module    -> $OUT/verify_build.log
#   2. GPU tests: kernel == reference bit-exact   -> $OUT/verify_pytest.log, $OUT/verify_junit.xml
#   3. benchmark (n=3, bs 16/64, k 2048, B 4k/5k) -> $OUT/bench_verify.json
#   4. optional compute-sanitizer memcheck       -> $OUT/verify_sanitizer.log
#   5. a one-screen summary of all of the above   -> $OUT/VERIFY_SUMMARY.txt (also on stdout)
# Run from the repository root with PYTHONPATH=$PWD (the package is not pip-installed) and
# apache-tvm-ffi importable. PYTHON overrides the interpreter; OUT defaults to ./verify_out.
# Every step runs even if an earlier one fails; the exit code is the tests' (0 = all passed).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/verify_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export SGLANG_HISPARSE_JIT_CACHE=${SGLANG_HISPARSE_JIT_CACHE:-/tmp/hisparse_verify_jit}
T0=$(date +%s)
secs() { echo $(( $(date +%s) - T0 )); }

{
  echo "date: $(date -u)"; echo "host: $(hostname)"; echo "git: $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  command -v nvcc >/dev/null && nvcc --version | tail -1
  $PY -c "import sys, torch, tvm_ffi; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| tvm_ffi', tvm_ffi.__version__, '| gpu', torch.cuda.is_available())" 2>&1
} > "$OUT/verify_env.txt" 2>&1
cat "$OUT/verify_env.txt"

echo "== [$(secs) s] precompiling the verify/replay/gather modules in parallel"
timeout 220 $PY - > "$OUT/verify_build.log" 2>&1 <<'EOF'
import time
from concurrent.futures import ThreadPoolExecutor
from sglang_hisparse.kernels import _jit
from sglang_hisparse.kernels.verify_ops import verify_module

specs = {(k, B, n + 1, 656 if B == 4 * k else 1152)
         for n in (1, 3) for k in (64, 2048) for B in (4 * k, (n + 2) * k)}   # GPU test grid
specs |= {(64, 256, 4, 656), (64, 320, 4, 1152), (64, 256, 2, 656)}           # small tests
specs |= {(2048, B, 4, i) for B in (8192, 10240) for i in (656, 1152)}        # benchmark
# the slru builds (policy 2) the tests run: the grid, the block/CTA split and the graph cases
slru = {(k, B, n + 1, 656 if B == 4 * k else 1152, 2)
        for n in (1, 3) for k in (64, 2048) for B in (4 * k, (n + 2) * k)}
slru |= {(64, 256, 4, 656, 2), (2048, 8192, 2, 656, 2)}
jobs = [("verify", s) for s in sorted(specs) + sorted(slru)] + [("replay", (1152,)), ("gather", (656,)),
                                                 ("gather", (1152,))]
def build(job):
    kind, args = job
    t = time.time()
    try:
        {"verify": verify_module, "replay": _jit.replay_module,
         "gather": _jit.gather_module}[kind](*args)
        return f"ok   {kind}{args} {time.time() - t:.1f} s"
    except Exception as e:  # keep going: the tests will report the failing module
        return f"FAIL {kind}{args}: {type(e).__name__}: {str(e)[-3000:]}"
with ThreadPoolExecutor(max_workers=12) as pool:
    for line in pool.map(build, jobs):
        print(line, flush=True)
EOF
BUILD_RC=$?
grep -c '^ok' "$OUT/verify_build.log" | xargs echo "modules built ok:"
grep '^FAIL' "$OUT/verify_build.log" | cut -c1-400

echo "== [$(secs) s] GPU tests"
timeout 120 $PY -m pytest -x -q -p no:cacheprovider tests/kernels/test_verify_gpu.py \
  --junitxml="$OUT/verify_junit.xml" > "$OUT/verify_pytest.log" 2>&1
TEST_RC=$?
tail -25 "$OUT/verify_pytest.log"

LEFT=$(( 195 - $(secs) ))
[ $LEFT -lt 20 ] && LEFT=20
QUICK=""
[ $LEFT -lt 90 ] && QUICK="--quick"
echo "== [$(secs) s] benchmark (${LEFT} s left, ${QUICK:-full sweep})"
timeout $LEFT $PY benchmarks/bench_verify.py $QUICK --out-dir "$OUT" > "$OUT/bench_verify.log" 2>&1
BENCH_RC=$?
tail -3 "$OUT/bench_verify.log"

# Optional: compute-sanitizer memcheck on the small block-size/CTA-split cases (k 64), if the
# tool exists and time is left. Not part of the exit code; see verify_sanitizer.log.
SAN="skipped (no compute-sanitizer or no time left)"
LEFT=$(( 228 - $(secs) ))
if command -v compute-sanitizer >/dev/null && [ $LEFT -gt 25 ]; then
  echo "== [$(secs) s] compute-sanitizer memcheck (${LEFT} s budget)"
  timeout $LEFT compute-sanitizer --tool memcheck --error-exitcode 9 \
    $PY -m pytest -x -q -p no:cacheprovider "tests/kernels/test_verify_gpu.py::test_every_block_size_and_cta_split" \
    > "$OUT/verify_sanitizer.log" 2>&1
  SAN_RC=$?
  SAN="rc=$SAN_RC ($([ $SAN_RC = 0 ] && echo clean || ([ $SAN_RC = 124 ] && echo 'timed out' || echo 'ERRORS: see verify_sanitizer.log')))"
fi
echo "sanitizer: $SAN"

$PY - "$OUT" "$BUILD_RC" "$TEST_RC" "$BENCH_RC" "$SAN" <<'EOF' | tee "$OUT/VERIFY_SUMMARY.txt"
import json, sys
from pathlib import Path
out, build_rc, test_rc, bench_rc, san = Path(sys.argv[1]), *sys.argv[2:]
print("VERIFY KERNEL (issue 7) SUMMARY")
print(open(out / "verify_env.txt").read().strip())
log = (out / "verify_pytest.log").read_text() if (out / "verify_pytest.log").exists() else ""
counts = "no junit xml (pytest did not finish: timeout or crash)"
if (out / "verify_junit.xml").exists():
    import xml.etree.ElementTree as ET
    ts = ET.parse(out / "verify_junit.xml").getroot()
    ts = ts if ts.tag == "testsuite" else ts.find("testsuite")
    a = {k: int(ts.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts = (f"{a['tests'] - a['failures'] - a['errors'] - a['skipped']} passed, "
              f"{a['failures']} failed, {a['errors']} errors, {a['skipped']} skipped "
              f"of {a['tests']} (pytest -x stops at the first failure)")
print(f"precompile rc={build_rc}; tests rc={test_rc} ({'PASS' if test_rc == '0' else 'FAIL'}): {counts}")
if test_rc != "0":
    print("first failure lines:")
    print("\n".join([l for l in log.splitlines() if l.startswith(("E ", "FAILED", "ERROR"))][:15]))
print(f"compute-sanitizer memcheck (k 64 block/CTA cases): {san}")
p = out / "bench_verify.json"
if not p.exists():
    print(f"benchmark rc={bench_rc}: no JSON written (see bench_verify.log)")
    sys.exit(0)
d = json.loads(p.read_text())
print(f"benchmark rc={bench_rc} ({'complete' if bench_rc == '0' else 'partial/killed'}), "
      f"{len(d['records'])} records; {d['meta']['note']}")
print(f"{'kind':10} {'bs':>3} {'B':>6} {'item':>5} {'churn':>5} {'ctas':>5} {'misses':>6} "
      f"{'us':>8} {'noIO':>7} {'GB/s':>6} {'ceil':>6} {'ratio':>5}")
for r in d["records"]:
    print(f"{r['kind']:10} {r['bs']:>3} {r['B']:>6} {r['item']:>5} {r['churn']:>5} "
          f"{str(r['ctas']):>5} {r['union_misses_per_step']:>6} {r['verify_us']:>8} "
          f"{r['noio_us']:>7} {r.get('io_gbps', '-'):>6} {r.get('ceiling_gbps', '-'):>6} "
          f"{r.get('io_ratio', '-'):>5}")
EOF
echo "== done in $(secs) s; files in $OUT"
exit $TEST_RC
