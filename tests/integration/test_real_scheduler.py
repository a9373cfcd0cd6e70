"""SGLang 0.5.23's real Scheduler drives the plugin (``hisparse_testing.sglang_rig``).

Each scenario group needs its own scheduler configuration, and SGLang's parallel runtime is
process-global, so every group runs once in a subprocess
(``python -m hisparse_testing.rig_scenarios GROUP``), two groups at a time, and each
scenario is one test here. A scenario passes when every request's tokens equal the same toy model run with full
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

from hisparse_testing.rig_scenarios import GROUPS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_results: dict[str, dict[str, dict]] = {}


def _parse(group: str, proc: subprocess.Popen, out: str, err: str) -> dict[str, dict]:
    records = {}
    for line in out.splitlines():
        if line.startswith("RIG "):
            rec = json.loads(line[4:])
            records[rec["scenario"]] = rec
    if "startup" not in records:
        pytest.fail(f"rig group {group!r} did not start (exit {proc.returncode}):\n{(out + err)[-6000:]}")
    return records


def _run_groups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict]]:
    """Every group's process, started together on first use (two at a time: CI has 2 cores,
    and each process is CPU-bound)."""
    if not _results:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # two processes share CI's two cores: torch's own thread pool per process only contends
        # (the whole integration run took 278 s with it, 207 s with one thread each)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
        pending = list(GROUPS)
        running: list[tuple[str, subprocess.Popen]] = []
        while pending or running:
            while pending and len(running) < 2:
                group = pending.pop(0)
                work = tmp_path_factory.mktemp(f"rig_{group}")
                cmd = [sys.executable, "-m", "hisparse_testing.rig_scenarios", group, str(work)]
                running.append((group, subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
            group, proc = running.pop(0)
            out, err = proc.communicate(timeout=900)
            _results[group] = _parse(group, proc, out, err)
    return _results


CASES = [(g, fn.__name__) for g, (_, fns) in GROUPS.items() for fn in fns]


@pytest.mark.parametrize(("group", "scenario"), CASES, ids=[f"{g}-{s}" for g, s in CASES])
def test_real_scheduler(group: str, scenario: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    rec = _run_groups(tmp_path_factory)[group].get(scenario)
    assert rec is not None, f"scenario {scenario} produced no record (the group's process died?)"
    assert rec["ok"], f"{scenario}: {rec.get('error')}\n{rec.get('traceback', '')}"
