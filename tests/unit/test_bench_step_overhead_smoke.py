"""benchmarks/bench_step_overhead.py --smoke on CPU: the launch counts of the fused per-step
bookkeeping against the pre-fusion paths it keeps behind SGLANG_HISPARSE_UNFUSED_BOOKKEEPING.
Counts only (no timing is asserted): at L = 61 layers, the backup is one launch instead of a
gather + index_copy per layer, and one translation serves every layer of a forward."""

from __future__ import annotations

import json
import os


def test_smoke_counts_the_fused_launches(import_benchmark, tmp_path):
    bench = import_benchmark("bench_step_overhead")
    out = tmp_path / "smoke.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    assert "SGLANG_HISPARSE_UNFUSED_BOOKKEEPING" not in os.environ
    doc = json.loads(out.read_text())
    assert doc["complete"] and len(doc["results"]) == 4 and len(doc["ratios"]) == 2
    L = 61
    for row in doc["ratios"]:
        assert row["layers"] == L
        assert row["backup.launches"] == {"before": 2 * L, "after": 1, "after/before": 1 / (2 * L)}
        tr = row["translation.launches"]
        assert tr["before"] == 4 * L and tr["after"] == 4  # int64 locations: 4 ops, once
        step = row["map_last_loc.launches"]
        assert step["before"] - step["after"] == 2 * L - 1  # the rest of the step is unchanged
        rel = row["release.launches"]
        assert rel["after"] < rel["before"]  # no scan of the logical mapping
