"""The install we tell users to run works: the package is on no registry yet, so every place
that says how to install it gives the clone / wheel install, and the registry line only as
what it will be once published."""

from __future__ import annotations

import re
from pathlib import Path

from sglang_hisparse.cli import doctor
from sglang_hisparse.cli.main import EPILOG

REPO = Path(__file__).resolve().parents[2]
# `pip install sglang-hisparse` as an install step (extras such as `[plot]` are a separate
# question: they are printed where the package is already installed).
REGISTRY_INSTALL = re.compile(r"pip install sglang-hisparse(?![\[\w-])")


def _install_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if REGISTRY_INSTALL.search(line)]


def test_readme_gives_the_clone_and_wheel_install():
    text = (REPO / "README.md").read_text()
    serving = text[text.index("## Serving"):]
    assert "pip install -e ." in serving and "python -m build" in serving
    assert all("once published" in line for line in _install_lines(text)), _install_lines(text)


def test_cli_help_gives_the_clone_install():
    assert "pip install -e ." in EPILOG
    assert not _install_lines(EPILOG)


def test_doctor_fix_for_a_missing_entry_point_is_the_clone_install(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    check = doctor.check_entry_point()
    assert check.status == doctor.FAIL
    assert "pip install -e ." in check.detail and not _install_lines(check.detail)


def test_readme_serving_recipe_is_the_planners():
    """One recipe everywhere: the README's serving command carries exactly what
    `plan --emit-config` prints for the embedded default (and the launch script uses)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "sglang_hisparse", "plan", "--emit-config"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout.splitlines()
    config, flags = out[0], out[1]
    serving = (REPO / "README.md").read_text().split("## Serving", 1)[1].split("## Tools", 1)[0]
    command = " ".join(serving.replace("\\\n", " ").split())
    assert f"--hisparse-config '{config}'" in command
    for flag in flags.split():
        assert flag in command, flag
    script = (REPO / "launch_examples" / "glm51_colocated.sh").read_text()
    assert f"hisparse_args GLM-5.1 '{config}' " in script
