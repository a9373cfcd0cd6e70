#!/usr/bin/env bash
# Replacement policies on recorded selections on one H200 (docs/traces.md, "On the H200"): the
# held-aside traces' steps replayed through the resolve kernel as CUDA graphs under lru, slru and
# fra in one run (benchmarks/bench_recorded.py --policies), batch 16 and 64, 656-byte rows, B = 2k.
# Writes $OUT/recorded_<trace>.json and $OUT/recorded.log. ~2 min on an H200.
#   OUT=/tmp/out bash benchmarks/run_policy_recorded_gpu.sh
set -o pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh && gpu_env "$HOME/site" || exit 2
TRACES=${TRACES:-"gemma3_winters_tale_32k gemma3_lear_32k smollm2_licenses_8k"}
# The builds first, 6 at a time: (k, B = 2k) of each trace under the three policies.
timeout 200 python3 - $TRACES <<'PY' 2>&1 | tee "$OUT/recorded.log"
import sys, time
from concurrent.futures import ThreadPoolExecutor
from sglang_hisparse.kernels import _jit
from sglang_hisparse.traces.format import load_trace
ks = sorted({int(load_trace(f"tests/data/{t}.npz").header["top_k"]) for t in sys.argv[1:]})
jobs = [(k, p) for k in ks for p in (0, 1, 2)]
t = time.time()
with ThreadPoolExecutor(6) as ex:
    list(ex.map(lambda j: _jit.resolve_module(j[0], 2 * j[0], 656, policy=j[1]), jobs))
    ex.submit(_jit.gather_module, 656).result()
print(f"built {len(jobs) + 1} modules in {time.time() - t:.0f} s")
PY
for t in $TRACES; do
  timeout 240 python3 benchmarks/bench_recorded.py --trace "tests/data/$t.npz" --policies lru slru fra \
    --batch 16 64 --item 656 --out "$OUT/recorded_$t.json" 2>&1 | tee -a "$OUT/recorded.log"
done
