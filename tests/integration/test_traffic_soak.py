"""The real-traffic soak: 2,000 requests per traffic configuration through SGLang's scheduler
(``python -m hisparse_testing.rig_soak``), slow (about half an hour each on one core),
so only under ``-m slow``; CI runs the same traffic, 48 requests a group, in
``test_real_scheduler``. Each passes when every request's tokens equal full KV (aborted ones:
a prefix), nothing stalls and both idle checks pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.managers.scheduler")

from hisparse_testing.rig_scenarios import TRAFFIC_GROUPS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SOAK_REQUESTS = int(os.environ.get("SGLANG_HISPARSE_SOAK_REQUESTS", "2000"))


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(TRAFFIC_GROUPS))
def test_traffic_soak(group: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "hisparse_testing.rig_soak", group, str(tmp_path),
         "--requests", str(SOAK_REQUESTS)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=4 * 3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TRAFFIC ")]
    assert lines, f"{group}: no summary (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
    out = json.loads(lines[-1][len("TRAFFIC "):])
    assert out["ok"], f"{group}: {out.get('error')}"
    assert out["requests"] == SOAK_REQUESTS and out["mismatches"] == 0 and out["leaks"] == 0
