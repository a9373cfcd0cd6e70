"""SGLang 0.5.23's real Scheduler drives the plugin (``sglang_hisparse.testing.sglang_rig``).

Each scenario group needs its own scheduler configuration, and SGLang's parallel runtime is
process-global, so every group runs once in a subprocess
(``python -m sglang_hisparse.testing.rig_scenarios GROUP``) and each scenario is one test
here. A scenario passes when every request's tokens equal the same toy model run with full
KV (HiSparse off) and the idle checks (SGLang's leak check and ours) pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.managers.scheduler")

from sglang_hisparse.testing.rig_scenarios import GROUPS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_results: dict[str, dict[str, dict]] = {}


def _run_group(group: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    if group not in _results:
        work = tmp_path_factory.mktemp(f"rig_{group}")
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(
            [sys.executable, "-m", "sglang_hisparse.testing.rig_scenarios", group, str(work)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
        )
        records = {}
        for line in proc.stdout.splitlines():
            if line.startswith("RIG "):
                rec = json.loads(line[4:])
                records[rec["scenario"]] = rec
        if "startup" not in records:
            tail = (proc.stdout + proc.stderr)[-6000:]
            pytest.fail(f"rig group {group!r} did not start (exit {proc.returncode}):\n{tail}")
        _results[group] = records
    return _results[group]


CASES = [(g, fn.__name__) for g, (_, fns) in GROUPS.items() for fn in fns]


@pytest.mark.parametrize(("group", "scenario"), CASES, ids=[f"{g}-{s}" for g, s in CASES])
def test_real_scheduler(group: str, scenario: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    rec = _run_group(group, tmp_path_factory).get(scenario)
    assert rec is not None, f"scenario {scenario} produced no record (the group's process died?)"
    assert rec["ok"], f"{scenario}: {rec.get('error')}\n{rec.get('traceback', '')}"
