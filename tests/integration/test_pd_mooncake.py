"""PD decode over a real transfer engine (issue 52): SGLang's prefill instance sends over
Mooncake TCP into our decode instance's host pool (``hisparse_testing.rig_mooncake``).

Two scheduler processes a scenario (SGLang's parallel runtime and Mooncake engine are
process-global); skipped when the Mooncake engine is not importable here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.managers.scheduler")

from hisparse_testing.rig_mooncake import engine_missing  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_MISSING = engine_missing()


def _run(scenario: str, workdir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, "-m", "hisparse_testing.rig_mooncake", scenario, str(workdir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    recs = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("RIG ")]
    if not recs:
        prefill_log = workdir / "prefill.log"
        tail = prefill_log.read_text()[-3000:] if prefill_log.exists() else ""
        pytest.fail(f"{scenario}: no record (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-5000:]}\n"
                    f"prefill:\n{tail}")
    return recs[0]


@pytest.mark.skipif(_MISSING is not None, reason=f"Mooncake transfer engine: {_MISSING}")
def test_mooncake_dsa_short(tmp_path: Path) -> None:
    """DSA short prompts: every token equals full KV, both instances idle clean, and the
    prefill wrote exactly one KV page, one indexer-key page and the metadata per request."""
    rec = _run("dsa_short", tmp_path)
    assert rec["ok"], f"{rec.get('error')}\n{rec.get('traceback', '')}"
    # prompts of 5-60 tokens: one 64-token page each
    assert rec["bytes_per_request"] == rec["kv_bytes_per_page"] + rec["state_bytes_per_page"] \
        + rec["metadata_bytes_per_request"], rec
    assert rec["bytes"] % rec["requests"] == 0, rec
