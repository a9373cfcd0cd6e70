"""benchmarks/bench_residency_ab.py --smoke: the interleaved low-pressure A/B runs on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_smoke_writes_interleaved_samples_and_exact_outputs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/bench_residency_ab.py", "--smoke", "--device", "cpu",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "residency_ab.json").read_text())
    (rec,) = data["results"]
    assert set(rec["samples_ms"]) == {"full", "pressure", "always_hot"}
    assert all(len(v) == rec["rounds"] for v in rec["samples_ms"].values())
    assert all(rec["exact"].values())
    # HBM not short: every request resident, nothing missed; always_hot misses
    assert rec["pressure_residency"]["hot"] == 0 and rec["pressure_miss_rate"] == 0.0
    assert rec["always_hot_miss_rate"] > 0.0
