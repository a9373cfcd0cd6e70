"""`python -m sglang_hisparse doctor`: reports and exit codes, on this (GPU-less) machine."""

import json
import subprocess
import sys


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_hisparse", "doctor", *args], capture_output=True, text=True, timeout=300)


def test_healthy_install_without_gpu_passes_with_warning():
    out = doctor("--json", "--hisparse-config", '{"device_buffer_size": 4096}')
    report = json.loads(out.stdout)
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["sglang"]["status"] == "ok" and "0.5.23" in by_name["sglang"]["detail"]
    assert by_name["entry point"]["status"] == "ok"
    assert all(c["status"] == "ok" for n, c in by_name.items() if n.startswith("hook "))
    assert "device_buffer_size\": 4096" in by_name["hisparse-config"]["detail"]
    assert by_name["gpu"]["status"] in ("ok", "warn")
    assert out.returncode == 0 and report["ok"]


def test_bad_config_fails_with_exact_error():
    out = doctor("--skip-hooks", "--hisparse-config", '{"swap_in_block_size": 100}')
    assert out.returncode == 1
    assert "'swap_in_block_size' = 100 must be a positive multiple of 32" in out.stdout


def test_require_gpu_fails_without_one():
    import torch

    out = doctor("--skip-hooks", "--require-gpu")
    assert out.returncode == (0 if torch.cuda.is_available() else 1)


def test_plugins_env_excluding_us_is_reported():
    import os

    out = subprocess.run(
        [sys.executable, "-m", "sglang_hisparse", "doctor", "--skip-hooks"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, SGLANG_PLUGINS="other"),
    )
    assert "excludes it: SGLang's in-tree HiSparse will run" in out.stdout
