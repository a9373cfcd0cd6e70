"""`python -m sglang_hisparse doctor`: reports and exit codes, on this (GPU-less) machine.

The command runs in-process (``main([...])``) except once: the real CLI in a fresh interpreter,
which must stay quiet and must not import SGLang (reading its sources is the default check).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import pytest

from sglang_hisparse.cli import doctor
from sglang_hisparse.cli.main import main
from sglang_hisparse.plugin import HookTarget

_FRESH = textwrap.dedent(
    """
    import sys
    from sglang_hisparse.cli.main import main
    rc = main(["doctor", "--json", "--hisparse-config", '{"device_buffer_size": 4096}'])
    heavy = [m for m in ("sglang.srt.managers.scheduler", "sglang.srt.server_args") if m in sys.modules]
    print("RC", rc, "IMPORTED", ",".join(heavy) or "nothing", file=sys.stderr)
    """
)


def run_doctor(capsys, *args: str) -> tuple[int, str]:
    rc = main(["doctor", *args])
    return rc, capsys.readouterr().out


def test_fresh_interpreter_is_quiet_and_leaves_sglang_unimported():
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=300)
    # stderr holds only our own last line: no SGLang import warnings, no traceback
    assert out.stderr.strip().splitlines() == ["RC 0 IMPORTED nothing"], out.stderr[-2000:]
    report = json.loads(out.stdout)
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["sglang"]["status"] == "ok" and "0.5.23" in by_name["sglang"]["detail"]
    assert by_name["entry point"]["status"] == "ok"
    hooks = [c for n, c in by_name.items() if n.startswith("hook ")]
    from sglang_hisparse.plugin import TARGETS

    assert len(hooks) == len(TARGETS) and all(c["status"] == "ok" for c in hooks)
    assert "device_buffer_size\": 4096" in by_name["hisparse-config"]["detail"]
    assert by_name["gpu"]["status"] in ("ok", "warn")
    assert by_name["kernel build"]["status"] in ("ok", "warn")  # FAIL only with --require-gpu
    assert report["ok"]


def test_bad_config_fails_with_exact_error(capsys):
    rc, out = run_doctor(capsys, "--skip-hooks", "--hisparse-config", '{"swap_in_block_size": 100}')
    assert rc == 1
    assert "'swap_in_block_size' = 100 must be a positive multiple of 32" in out


def test_require_gpu_fails_without_one(capsys):
    import torch

    rc, out = run_doctor(capsys, "--skip-hooks", "--require-gpu", "--json")
    gpu = next(c for c in json.loads(out)["checks"] if c["name"] == "gpu")
    assert (gpu["status"] == "FAIL") is (not torch.cuda.is_available())
    if not torch.cuda.is_available():
        assert rc == 1


def test_plugins_env_excluding_us_is_reported(capsys, monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "other")
    _, out = run_doctor(capsys, "--skip-hooks")
    assert "excludes it: SGLang's in-tree HiSparse will run" in out


def test_hook_check_reads_sources_and_imports_only_what_they_cannot_show(monkeypatch):
    import sglang_hisparse.plugin as plugin

    targets = (
        HookTarget("json.decoder.JSONDecoder.decode", "sglang_hisparse.plugin:register", "defined in its class"),
        # ArgumentParser inherits add_argument: the source reading cannot see it, the import can
        HookTarget("argparse.ArgumentParser.add_argument", "sglang_hisparse.plugin:register", "inherited"),
        HookTarget("json.decoder.JSONDecoder.no_such_method", "sglang_hisparse.plugin:register", "missing"),
        HookTarget("json.decoder.JSONDecoder.decode", "sglang_hisparse.plugin:no_such_hook", "ours missing"),
    )
    monkeypatch.setattr(plugin, "TARGETS", targets)
    checks = doctor.check_hooks()
    assert [c.status for c in checks] == [doctor.OK, doctor.OK, doctor.FAIL, doctor.FAIL]
    assert not checks[0].detail.endswith("(imported)") and checks[1].detail.endswith("(imported)")
    assert "no 'no_such_method' in json.decoder.JSONDecoder" in checks[2].detail
    assert "our sglang_hisparse.plugin:no_such_hook is not there" in checks[3].detail


def test_import_hooks_catches_and_summarises_warnings(tmp_path, monkeypatch, capsys):
    (tmp_path / "noisy_pkg.py").write_text(
        "import warnings\n"
        "warnings.warn('Only CUDA, HIP and XPU support AWQ currently.')\n"
        "warnings.warn('Only CUDA, HIP and XPU support AWQ currently.')\n"
        "warnings.warn('Triton is not supported on current platform,\\nroll back to CPU.')\n"
        "def target():\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    checks, caught = doctor._import_hooks([HookTarget("noisy_pkg.target", "sglang_hisparse.plugin:register", "")])
    assert checks[0].status == doctor.OK and len(caught) == 3
    assert capsys.readouterr().err == ""  # recorded, not printed
    quiet = doctor.summarise_warnings(caught, 12.3, cuda=False)
    assert quiet.status == doctor.OK and "3 warning(s) (expected without a CUDA device)" in quiet.detail
    assert quiet.detail.count("AWQ") == 1 and "noisy_pkg: Triton is not supported on current platform," in quiet.detail
    assert doctor.summarise_warnings(caught, 12.3, cuda=True).status == doctor.WARN
    assert doctor.summarise_warnings([], 1.0, cuda=True).detail == "1.0 s, no warnings"


def test_summarised_warning_keeps_the_raising_module():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("something", stacklevel=1)
    check = doctor.summarise_warnings(caught, 0.5, cuda=False)
    assert "test_doctor: something" in check.detail


@pytest.mark.parametrize("require", [False, True])
def test_incomplete_cuda_home_warns_or_fails(monkeypatch, tmp_path, require):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    check = doctor.check_kernel_build(require, torch_cuda=None)
    assert check.status == (doctor.FAIL if require else doctor.WARN)
    assert f"CUDA home {tmp_path / 'nowhere'} (from $CUDA_HOME) has no bin/nvcc" in check.detail
    assert "python -m sglang_hisparse.kernels would fail" in check.detail
