"""Plugin registration through SGLang's real load_plugins(), and the package's hard rules."""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import sglang_hisparse
from sglang_hisparse import plugin

REPO = Path(__file__).resolve().parents[2]


def test_entry_point_discovered(sglang_with_plugin):
    from sglang.srt.plugins import load_plugins_by_group

    found = load_plugins_by_group("sglang.srt.plugins")
    assert found["hisparse"][0] is plugin.register


def test_seams_resolve_to_our_classes(sglang_with_plugin):
    assert plugin.applied() == {t.target: True for t in plugin.TARGETS}
    # HookRegistry also rebinds module-level aliases SGLang imported before the patch.
    import sglang.srt.managers.scheduler as scheduler
    import sglang.srt.mem_cache.kv_cache_configurator as configurator
    import sglang.srt.mem_cache.sparsity as sparsity

    from sglang_hisparse.sglang_adapter.arg_hook import parse_hisparse_config
    from sglang_hisparse.sglang_adapter.coordinator import SGLangHiSparseCoordinator
    from sglang_hisparse.sglang_adapter.memory import HiSparseDSAPool, HiSparseTokenAllocator

    assert scheduler.HiSparseCoordinator is SGLangHiSparseCoordinator
    assert configurator.HiSparseTokenToKVPoolAllocator is HiSparseTokenAllocator
    assert configurator.HiSparseDSATokenToKVPool is HiSparseDSAPool
    assert plugin.is_ours(sparsity.parse_hisparse_config, parse_hisparse_config)


def test_loading_twice_changes_nothing(sglang_with_plugin):
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = {t: list(h) for t, h in HookRegistry._hooks.items()}
    plugin.register()
    load_plugins()
    assert {t: list(h) for t, h in HookRegistry._hooks.items()} == before
    assert all(plugin.applied().values())


def test_unresolvable_target_names_both_versions(monkeypatch, sglang_with_plugin):
    monkeypatch.setattr(plugin, "_registered", False)
    bogus = plugin.HookTarget("sglang.srt.no_such_module.Thing", "sglang_hisparse.plugin:register", "test")
    monkeypatch.setattr(plugin, "TARGETS", (*plugin.TARGETS, bogus))
    with pytest.raises(plugin.UnsupportedSGLangError, match=r"(?s)supports SGLang 0\.5\.23, but the installed SGLang is 0\.5\.23.*no_such_module"):
        plugin.register()


def _run_without_sglang(code: str) -> subprocess.CompletedProcess:
    # A None entry in sys.modules makes every `import sglang...` raise ImportError.
    prelude = "import sys; sys.modules['sglang'] = None\n"
    # the checkout's root: the test support (hisparse_testing/) is not installed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300, env=env)


SGLANG_SIDE = ("sglang_hisparse.plugin", "sglang_hisparse.sglang_adapter.arg_hook", "sglang_hisparse.sglang_adapter")


def test_core_imports_without_sglang():
    """The core, and the test support the CPU tests build on it (the rig imports ``sglang`` only
    inside functions), import with SGLang blocked."""
    import hisparse_testing

    core = [
        m.name
        for m in pkgutil.walk_packages(sglang_hisparse.__path__, "sglang_hisparse.")
        if not m.name.startswith(SGLANG_SIDE) and m.name != "sglang_hisparse.__main__"
    ]
    core += ["hisparse_testing", *(m.name for m in pkgutil.walk_packages(hisparse_testing.__path__, "hisparse_testing."))]
    code = "import importlib\n" + "".join(f"importlib.import_module({name!r})\n" for name in core)
    out = _run_without_sglang(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(core) > 5


def test_importing_plugin_has_no_side_effects():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, sglang_hisparse.plugin; print('sglang' in sys.modules)"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.stdout.strip() == "False", out.stderr[-2000:]


#: What a wheel is built from (pyproject's readme, setup.py's package_dir, the sources), and the
#: test support next to them as in a checkout, so that leaving it out is the build's doing.
WHEEL_INPUTS = (
    "pyproject.toml", "setup.py", "README.md", "sglang_hisparse", "jit_kernels", "hisparse_testing",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """The wheel ``pip wheel`` builds from a copy of the checkout, and the build's log."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    # NOTE: built from a copy: setuptools writes build/ and *.egg-info next to the sources,
    # and a test must not leave them in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in WHEEL_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    left_before = {n for n in ("build", "sglang_hisparse.egg-info") if (REPO / n).exists()}
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(tmp_path), str(src)],
        check=True, capture_output=True, text=True, timeout=600, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )
    assert {n for n in ("build", "sglang_hisparse.egg-info") if (REPO / n).exists()} == left_before
    (built,) = tmp_path.glob("sglang_hisparse-*.whl")
    return built, out.stdout + out.stderr


def test_wheel_ships_cuda_sources(wheel):
    built, log = wheel
    sources = sorted(p.name for p in (REPO / "jit_kernels").glob("*.cuh"))
    assert sources, "jit_kernels/ has no .cuh sources"
    assert "project.license" not in log and "License classifiers are deprecated" not in log, log[-3000:]
    names = set(zipfile.ZipFile(built).namelist())
    for s in sources:
        assert f"sglang_hisparse/jit_kernels/{s}" in names
    entry = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(built).read(entry[0]).decode()
    assert "[sglang.srt.plugins]" in text and "hisparse = sglang_hisparse.plugin:register" in text


def test_wheel_leaves_out_the_test_support(wheel):
    """The harness engines, toy models and rig (``hisparse_testing/``) are for a checkout's tests
    and benchmarks: neither their new place nor their old one is in the wheel."""
    built, _ = wheel
    assert (REPO / "hisparse_testing" / "__init__.py").is_file(), "the test support moved again"
    names = zipfile.ZipFile(built).namelist()
    assert any(n.startswith("sglang_hisparse/coordinator/") for n in names), sorted(names)[:20]
    shipped = [n for n in names if n.startswith(("hisparse_testing/", "sglang_hisparse/testing/"))]
    assert not shipped, f"test support in the wheel: {shipped}"
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:
        assert "hisparse_testing" not in zipfile.ZipFile(built).read(top_level[0]).decode().split()
