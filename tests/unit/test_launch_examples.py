"""launch_examples/: every script is valid bash and every flag it passes parses in SGLang 0.5.23.

Each launch script, run with ``HISPARSE_DRY_RUN=1``, prints the exact argument vector it
would hand to ``python -m sglang.launch_server``; that vector goes through SGLang's real
``ServerArgs`` parser (unknown flags and bad choices fail there, as they would at launch),
and its ``--hisparse-config`` through our ``HiSparseConfig``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import pytest

from sglang_hisparse.config import HiSparseConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "launch_examples"
SCRIPTS = sorted(EXAMPLES.glob("*.sh"))
LAUNCHERS = [p for p in SCRIPTS if "launch \"${args[@]}\"" in p.read_text()]
WRAPPERS = [EXAMPLES / "ab_plugin_off.sh", EXAMPLES / "ab_prefetch_off.sh"]


def _dry_run(*cmd: str, **env: str) -> subprocess.CompletedProcess[str]:
    knobs = {"EXTRA_ARGS", "MODEL_PATH", "HOST", "PORT", "CONTEXT_LENGTH", "IB_DEVICE", "BOOTSTRAP_PORT", "PYTHON"}
    full_env = {k: v for k, v in os.environ.items() if k not in knobs and not k.startswith(("SGLANG_", "HISPARSE"))}
    full_env.update(HISPARSE_DRY_RUN="1", **env)
    return subprocess.run(["bash", *cmd], cwd=EXAMPLES, env=full_env, capture_output=True, text=True, timeout=30)


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
    if "prefill" in script.name:
        assert ns.disaggregation_mode == "prefill" and not ns.enable_hisparse
        return
    assert ns.disable_radix_cache  # in both arms, so the A/B differs only in HiSparse
    assert ns.enable_hisparse is (hisparse == "on")
    if hisparse == "on":
        config = HiSparseConfig.from_json(ns.hisparse_config, model_top_k=2048)
        assert config.device_buffer_size == 4096
    if "pd_decode" in script.name:
        assert ns.disaggregation_mode == "decode"
        # sglang-hisparse refuses PD decode retraction with a backup (arg_scope.check_serving_paths)
        assert ns.disaggregation_decode_retraction_backup == ("none" if hisparse == "on" else None)


def test_bad_hisparse_switch_is_refused():
    result = _dry_run("glm51_colocated.sh", HISPARSE="maybe")
    assert result.returncode == 2 and "HISPARSE=maybe" in result.stderr


def test_plugin_off_wrapper_excludes_the_plugin_entry_point():
    # the entry-point name the whitelist must leave out
    assert 'hisparse = "sglang_hisparse.plugin:register"' in (ROOT / "pyproject.toml").read_text()
    result = _dry_run("ab_plugin_off.sh", "./glm51_colocated.sh")
    env, argv = _argv(result.stdout)
    # An empty SGLANG_PLUGINS would load every plugin; "none" names none of them.
    assert env["SGLANG_PLUGINS"] == "none" and "--enable-hisparse" in argv
    kept = _dry_run("ab_plugin_off.sh", "./glm51_colocated.sh", SGLANG_PLUGINS="other")
    assert _argv(kept.stdout)[0]["SGLANG_PLUGINS"] == "other"
    refused = _dry_run("ab_plugin_off.sh", "./glm51_colocated.sh", SGLANG_PLUGINS="other, hisparse")
    assert refused.returncode == 2 and "still names hisparse" in refused.stderr
    assert _dry_run("ab_plugin_off.sh").returncode == 2


def test_prefetch_wrapper_sets_the_switch():
    result = _dry_run("ab_prefetch_off.sh", "./glm52_colocated.sh")
    env, argv = _argv(result.stdout)
    assert env["SGLANG_HISPARSE_DISABLE_PREFETCH"] == "1" and "--enable-hisparse" in argv
