"""``python -m sglang_hisparse.kernels`` when a build fails: one line from doctor's kernel-build
check where the host lacks part of the toolchain, the build's own error where it lacks nothing.
No compiler runs: ``precompile`` is replaced by one that fails as tvm-ffi's link step does."""

from __future__ import annotations

import pytest

import sglang_hisparse.kernels.__main__ as kmain
from sglang_hisparse.kernels import toolchain

#: the end of what tvm-ffi raises when ``c++ ... -L/usr/local/lib64 -lcudart`` fails
LINK_ERROR = ("ninja exited with status 1\nstdout:\n[2/2] c++ cuda_0.o -shared -L/usr/local/lib64 -lcudart\n"
              "/usr/bin/ld: cannot find -lcudart: No such file or directory\nninja: build stopped: subcommand failed.")


def failing_precompile(*args, **kwargs):
    raise RuntimeError(LINK_ERROR)


@pytest.fixture
def no_build(monkeypatch):
    monkeypatch.setattr(kmain, "precompile", failing_precompile)
    monkeypatch.setattr(kmain._jit, "cache_dir", lambda: "/cache")
    monkeypatch.setattr(kmain._jit, "cuda_arch", lambda: "9.0")


def test_missing_toolchain_is_one_line_with_the_fix(monkeypatch, tmp_path, capsys, no_build):
    nowhere = tmp_path / "nowhere"
    monkeypatch.setenv("CUDA_HOME", str(nowhere))
    assert kmain.main(["--top-k", "64", "--buffer", "128", "--items", "128", "--jobs", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback, no linker output
    assert err.startswith(f"error: the kernel build failed: CUDA home {nowhere} (from $CUDA_HOME) has no bin/nvcc")
    assert "; fix: " in err  # a toolkit elsewhere on this host, or how to install one
    assert "Traceback" not in err and "cannot find -lcudart" not in err


def test_the_line_is_doctors(monkeypatch, tmp_path, capsys, no_build):
    """The CLI words the problem exactly as doctor's ``kernel build`` check does."""
    import torch

    from sglang_hisparse.cli import doctor

    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    assert kmain.main([]) == 1
    err = capsys.readouterr().err.rstrip("\n")
    detail = doctor.check_kernel_build(False, torch_cuda=torch.version.cuda).detail
    assert detail == "python -m sglang_hisparse.kernels would fail: " + err.removeprefix("error: the kernel build failed: ")


def test_a_complete_toolchain_shows_the_build_error(monkeypatch, no_build):
    """Nothing missing: a compile error or a bug, which the user needs in full."""
    monkeypatch.setattr(toolchain, "inspect", lambda **kw: toolchain.BuildReadiness("/cuda", "$CUDA_HOME"))
    with pytest.raises(RuntimeError, match="cannot find -lcudart"):
        kmain.main([])
