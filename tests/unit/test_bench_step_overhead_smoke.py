"""benchmarks/bench_step_overhead.py --smoke on CPU: the launch counts of the fused per-step
bookkeeping. Counts only (no timing is asserted): at L = 61 layers the backup is one launch
for every layer, one translation serves every layer of a forward, and no section launches per
layer."""

from __future__ import annotations

import json


def test_smoke_counts_the_fused_launches(import_benchmark, tmp_path):
    bench = import_benchmark("bench_step_overhead")
    out = tmp_path / "smoke.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] and [r["batch"] for r in doc["results"]] == [1, 16]
    L = 61
    steps = set()
    for res in doc["results"]:
        assert res["layers"] == L and res["stale_mappings_after_release"] == 0
        s = {k: v["launches"] for k, v in res["sections"].items()}
        assert s["backup"] == 1  # all layers' rows in one kernel call
        assert s["translation"] == 4  # int64 locations: 4 ops, once per forward
        assert s["map_last_loc"] < L and s["release"] < L  # nothing per layer
        steps.add(s["map_last_loc"])
    assert len(steps) == 1  # the step's launches do not grow with the batch
