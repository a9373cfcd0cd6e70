"""launch_examples/: every script is valid bash and every flag it passes parses in SGLang 0.5.23.

Each launch script, run with ``HISPARSE_DRY_RUN=1``, prints the exact argument vector it
would hand to ``python -m sglang.launch_server``; that vector goes through SGLang's real
``ServerArgs`` parser (unknown flags and bad choices fail there, as they would at launch),
and its ``--hisparse-config`` through our ``HiSparseConfig``. The built-in configs and batch
limits are the planner's; the scripts run from any directory; the PD scripts check their
transfer backend before launching and say how to install it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_hisparse.cli.main import main as cli_main
from sglang_hisparse.config import HiSparseConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "launch_examples"
SCRIPTS = sorted(EXAMPLES.glob("*.sh"))
LAUNCHERS = [p for p in SCRIPTS if "launch \"${args[@]}\"" in p.read_text()]
WRAPPERS = [EXAMPLES / "ab_plugin_off.sh", EXAMPLES / "ab_prefetch_off.sh"]


def _run(*cmd: str, cwd: Path = EXAMPLES, dry: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    knobs = {"EXTRA_ARGS", "MODEL_PATH", "HOST", "PORT", "CONTEXT_LENGTH", "IB_DEVICE", "BOOTSTRAP_PORT", "PYTHON",
             "PLAN", "MAX_RUNNING_REQUESTS", "TRANSFER_BACKEND", "RADIX"}
    full_env = {k: v for k, v in os.environ.items() if k not in knobs and not k.startswith(("SGLANG_", "HISPARSE"))}
    full_env.update(**env)
    if dry:
        full_env["HISPARSE_DRY_RUN"] = "1"
    return subprocess.run(["bash", *cmd], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=60)


def _dry_run(*cmd: str, **env: str) -> subprocess.CompletedProcess[str]:
    return _run(*cmd, **env)


#: `hisparse_args PRESET 'CONFIG' MAX_RUNNING` in a launch script
DEFAULTS = re.compile(r"^hisparse_args (\S+) '(\{.*\})' (\d+)$", re.M)


@functools.cache
def _planner(preset: str, *args: str) -> tuple[str, str]:
    """``plan --model PRESET ARGS --emit-config``: (config JSON line, flags line)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["plan", "--model", preset, *args, "--emit-config"]) == 0
    config, flags = out.getvalue().splitlines()[:2]
    return config, flags


def _planner_batch(flags: str) -> int:
    return int(re.search(r"--max-running-requests (\d+)", flags).group(1))


def _argv(out: str) -> tuple[dict[str, str], list[str]]:
    lines = out.splitlines()
    start = lines.index("sglang.launch_server")
    env = dict(line[2:].split("=", 1) for line in lines[:start] if line.startswith("# "))
    return env, lines[start + 1 :]


@pytest.fixture(scope="module")
def server_parser() -> argparse.ArgumentParser:
    server_args = pytest.importorskip("sglang.srt.server_args", reason="needs SGLang 0.5.23 installed")
    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    server_args.ServerArgs.add_cli_args(parser)
    return parser


def test_the_examples_exist():
    names = {p.name for p in SCRIPTS}
    for needed in ("glm51_colocated.sh", "dsv32_colocated.sh", "glm51_pd_decode.sh", "glm51_pd_prefill.sh",
                   "dsv32_pd_decode.sh", "dsv32_pd_prefill.sh", "ab_plugin_off.sh", "ab_prefetch_off.sh"):
        assert needed in names
    assert (EXAMPLES / "README.md").is_file()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", LAUNCHERS + WRAPPERS, ids=lambda p: p.name)
def test_documented_header(script):
    """A header comment says what runs, what to expect in the log, and how to A/B it."""
    header = script.read_text().split("\nsource ", 1)[0].split("\nset -euo pipefail", 1)[0]
    assert header.startswith("#!/usr/bin/env bash\n# ")
    assert all(line.startswith("#") for line in header.splitlines())
    if script in WRAPPERS:
        assert "Usage:" in header and "What changes" in header and "Expect" in header
    elif "prefill" in script.name:
        assert "Runs:" in header and "Expect" in header and "decode" in header
    else:
        assert "Runs:" in header and "Expect" in header and "A/B:" in header


@pytest.mark.parametrize("hisparse", ["on", "off"])
@pytest.mark.parametrize("script", LAUNCHERS, ids=lambda p: p.name)
def test_every_flag_parses_in_sglang(server_parser, script, hisparse):
    result = _dry_run(script.name, HISPARSE=hisparse, IB_DEVICE="mlx5_0,mlx5_1")
    assert result.returncode == 0, result.stderr
    _, argv = _argv(result.stdout)
    try:
        ns, unknown = server_parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:  # bad choice / bad type
        pytest.fail(f"{script.name}: {e}")
    assert unknown == [], f"{script.name}: flags SGLang 0.5.23 does not know: {unknown}"
    # SGLang keeps retired spellings (e.g. --enable-dp-attention) as Deprecated* actions that
    # only log a warning; the examples use the current spelling.
    actions = server_parser._option_string_actions
    retired = [a for a in argv if a in actions and type(actions[a]).__name__.startswith("Deprecated")]
    assert retired == [], f"{script.name}: deprecated in SGLang 0.5.23: {retired}"
    assert (ns.tp_size, ns.attn_dp_size) == (8, 8) and ns.model_path
    if "_pd_" in script.name:
        assert ns.disaggregation_transfer_backend == "mooncake" and ns.disaggregation_ib_device == "mlx5_0,mlx5_1"
    if "prefill" in script.name:
        assert ns.disaggregation_mode == "prefill" and not ns.enable_hisparse
        return
    preset, _, _ = DEFAULTS.search(script.read_text()).groups()
    # the planner's batch in both arms, so they differ only in HiSparse
    assert ns.max_running_requests == _planner_batch(_planner(preset)[1])
    # RADIX=on by default, in both arms; DeepSeek-V4 is served with it off
    assert ns.disable_radix_cache is ("dsv4" in script.name)
    assert ns.enable_hisparse is (hisparse == "on")
    if hisparse == "on":
        planned = json.loads(_planner(preset)[0])
        config = HiSparseConfig.from_json(ns.hisparse_config, model_top_k=planned["top_k"])
        assert config.device_buffer_size == planned["device_buffer_size"] == 2 * planned["top_k"]
    if "pd_decode" in script.name:
        assert ns.disaggregation_mode == "decode"
        # sglang-hisparse refuses PD decode retraction with a backup (arg_scope.check_serving_paths)
        assert ns.disaggregation_decode_retraction_backup == ("none" if hisparse == "on" else None)


def test_bad_hisparse_switch_is_refused():
    result = _dry_run("glm51_colocated.sh", HISPARSE="maybe")
    assert result.returncode == 2 and "HISPARSE=maybe" in result.stderr
    radix = _dry_run("glm51_colocated.sh", RADIX="maybe")
    assert radix.returncode == 2 and "RADIX=maybe" in radix.stderr


def test_plugin_off_wrapper_excludes_the_plugin_entry_point():
    # the entry-point name the whitelist must leave out
    assert 'hisparse = "sglang_hisparse.plugin:register"' in (ROOT / "pyproject.toml").read_text()
    result = _dry_run("ab_plugin_off.sh", "glm51_colocated.sh")
    env, argv = _argv(result.stdout)
    # An empty SGLANG_PLUGINS would load every plugin; "none" names none of them.
    assert env["SGLANG_PLUGINS"] == "none" and "--enable-hisparse" in argv
    # SGLang's in-tree HiSparse refuses the radix cache
    assert env["RADIX"] == "off" and "--disable-radix-cache" in argv
    kept = _dry_run("ab_plugin_off.sh", "./glm51_colocated.sh", SGLANG_PLUGINS="other")
    assert _argv(kept.stdout)[0]["SGLANG_PLUGINS"] == "other"
    refused = _dry_run("ab_plugin_off.sh", "./glm51_colocated.sh", SGLANG_PLUGINS="other, hisparse")
    assert refused.returncode == 2 and "still names hisparse" in refused.stderr
    assert _dry_run("ab_plugin_off.sh").returncode == 2


def test_prefetch_wrapper_sets_the_switch():
    result = _dry_run("ab_prefetch_off.sh", "./glm52_colocated.sh")
    env, argv = _argv(result.stdout)
    assert env["SGLANG_HISPARSE_DISABLE_PREFETCH"] == "1" and "--enable-hisparse" in argv


@pytest.mark.parametrize("script", [p for p in LAUNCHERS if "prefill" not in p.name], ids=lambda p: p.name)
def test_defaults_are_the_planners(script):
    """Each HiSparse script's built-in config and --max-running-requests are what the planner
    prints for its model at 128K (`plan --model PRESET --emit-config`)."""
    preset, config, max_running = DEFAULTS.search(script.read_text()).groups()
    planned_config, planned_flags = _planner(preset)
    assert json.loads(config) == json.loads(planned_config)
    assert int(max_running) == _planner_batch(planned_flags)
    assert "--enable-hisparse" in planned_flags.split()


def test_runs_from_any_directory(tmp_path):
    direct = _run(str(EXAMPLES / "glm51_colocated.sh"), cwd=tmp_path)
    assert direct.returncode == 0, direct.stderr
    by_name = _run(str(EXAMPLES / "ab_plugin_off.sh"), "glm51_colocated.sh", cwd=tmp_path)
    assert by_name.returncode == 0, by_name.stderr
    no_radix = _run(str(EXAMPLES / "glm51_colocated.sh"), cwd=tmp_path, RADIX="off")
    assert _argv(by_name.stdout) == (dict(_argv(no_radix.stdout)[0], SGLANG_PLUGINS="none"), _argv(no_radix.stdout)[1])
    assert "--disable-radix-cache" not in _argv(direct.stdout)[1]
    relative = _run("launch_examples/ab_prefetch_off.sh", "launch_examples/glm52_colocated.sh", cwd=ROOT)
    assert relative.returncode == 0 and _argv(relative.stdout)[0]["SGLANG_HISPARSE_DISABLE_PREFETCH"] == "1"
    missing = _run(str(EXAMPLES / "ab_plugin_off.sh"), "no_such_example.sh", cwd=tmp_path)
    assert missing.returncode == 2 and "usage:" in missing.stderr


def test_plan_knob_takes_the_planners_config_and_batch():
    result = _dry_run("glm51_pd_decode.sh", PLAN="--context 32K", PYTHON=sys.executable)
    assert result.returncode == 0, result.stderr
    argv = _argv(result.stdout)[1]
    config, flags = _planner("GLM-5.1", "--context", "32K")
    assert argv[argv.index("--hisparse-config") + 1] == config
    assert argv[argv.index("--max-running-requests") + 1] == str(_planner_batch(flags))
    # the knobs still override the planner
    pinned = _dry_run("glm51_colocated.sh", PLAN="--context 32K", PYTHON=sys.executable, MAX_RUNNING_REQUESTS="7")
    assert _argv(pinned.stdout)[1][_argv(pinned.stdout)[1].index("--max-running-requests") + 1] == "7"


def test_plan_verdict_off_runs_the_baseline():
    result = _dry_run("glm51_pd_decode.sh", PLAN="--context 4K", PYTHON=sys.executable)
    env, argv = _argv(result.stdout)
    assert result.returncode == 0 and env["HISPARSE"] == "off"
    assert "--enable-hisparse" not in argv and "--disaggregation-decode-retraction-backup" not in argv
    assert argv[argv.index("--max-running-requests") + 1] == str(_planner_batch(_planner("GLM-5.1", "--context", "4K")[1]))
    assert "the planner's verdict is HiSparse off here" in result.stderr


def test_plan_knob_refused_by_the_planner():
    result = _dry_run("glm51_colocated.sh", PLAN="--context banana", PYTHON=sys.executable)
    assert result.returncode == 2 and "PLAN=--context banana: the planner refused it" in result.stderr


@pytest.mark.parametrize("backend", ["mooncake_tcp", "nixl"])
def test_other_transfer_backends_parse(server_parser, backend):
    for script in ("glm51_pd_prefill.sh", "glm51_pd_decode.sh"):
        result = _dry_run(script, TRANSFER_BACKEND=backend, IB_DEVICE="mlx5_0")
        ns, unknown = server_parser.parse_known_args(_argv(result.stdout)[1])
        assert unknown == [] and ns.disaggregation_transfer_backend == backend
        # mooncake_tcp runs without RDMA: SGLang drops the IB device, so the script does not pass one
        assert ns.disaggregation_ib_device == (None if backend == "mooncake_tcp" else "mlx5_0")


@pytest.mark.parametrize("backend", ["fake", "mori", "ascend", "rdma"])
def test_transfer_backends_that_cannot_serve_h200_are_refused(backend):
    result = _dry_run("glm51_pd_decode.sh", TRANSFER_BACKEND=backend)
    assert result.returncode == 2 and f"TRANSFER_BACKEND={backend}: " in result.stderr
    assert "use mooncake, mooncake_tcp or nixl" in result.stderr


def test_every_choice_of_sglang_is_handled():
    choices = pytest.importorskip("sglang.srt.arg_groups.choices").DISAGG_TRANSFER_BACKEND_CHOICES
    common = (EXAMPLES / "_common.sh").read_text()
    for choice in choices:
        assert re.search(rf"^#   {choice}\b|^#   \S+, {choice}\b", common, re.M), f"_common.sh does not explain {choice}"


@pytest.mark.parametrize(("backend", "install"), [("mooncake", "pip install mooncake-transfer-engine"),
                                                   ("nixl", "pip install nixl")])
def test_missing_transfer_backend_is_named_with_its_install(backend, install):
    # /bin/false stands in for an interpreter without the backend: the import check fails
    result = _run("glm51_pd_prefill.sh", dry=False, PYTHON="/bin/false", TRANSFER_BACKEND=backend)
    assert result.returncode == 2
    assert f"TRANSFER_BACKEND={backend} needs the Python module" in result.stderr and install in result.stderr
    assert "Alternatives: TRANSFER_BACKEND=mooncake_tcp" in result.stderr


def test_importable_transfer_backend_launches(tmp_path):
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\n[ "$1" = -c ] && exit 0\necho "LAUNCHED $*"\n')
    stub.chmod(0o755)
    result = _run("glm51_pd_decode.sh", dry=False, PYTHON=str(stub))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("LAUNCHED -m sglang.launch_server ")
    assert "--disaggregation-transfer-backend mooncake" in result.stdout
