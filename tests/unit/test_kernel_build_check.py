"""doctor's kernel-build check against fake CUDA homes: what tvm-ffi's build will use, and what
it lacks. No GPU, no compiler run: each fake nvcc is a shell script printing a version."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_hisparse.kernels import toolchain

NVCC = "#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.88'\n"


def toolkit(root: Path, *, release: str = "13.0", lib_dir: str = "lib64", libcudart: str = "libcudart.so",
            headers: bool = True) -> Path:
    """A fake CUDA home: bin/nvcc, <lib_dir>/<libcudart>, include/cuda_runtime.h."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(NVCC.format(release=release))
    nvcc.chmod(0o755)
    (root / lib_dir).mkdir()
    (root / lib_dir / libcudart).write_bytes(b"")
    if headers:
        (root / "include").mkdir()
        (root / "include" / "cuda_runtime.h").write_text("")
    return root


def which_from(**tools: Path | str | None):
    """A ``shutil.which`` stand-in: c++ and ninja found unless overridden."""
    found = {"c++": "/usr/bin/c++", "ninja": "/usr/bin/ninja", **{k.replace("_", "+"): v for k, v in tools.items()}}
    return lambda name: None if found.get(name) is None else str(found[name])


def test_complete_toolkit_from_cuda_home(tmp_path):
    home = toolkit(tmp_path / "cuda-13.0")
    r = toolchain.inspect(env={"CUDA_HOME": str(home)}, which=which_from(), torch_cuda="13.0")
    assert r.ok, r.problems
    assert (r.home, r.home_from, r.nvcc_release, r.fix) == (str(home), "$CUDA_HOME", "13.0", None)


def test_cuda_path_is_the_second_choice(tmp_path):
    home = toolkit(tmp_path / "cuda")
    r = toolchain.inspect(env={"CUDA_PATH": str(home)}, which=which_from(), toolkit_globs=())
    assert r.ok and r.home_from == "$CUDA_PATH"


def test_wrapper_nvcc_on_path_makes_an_incomplete_home(tmp_path):
    """The case doctor used to call ok: /usr/local/bin/nvcc runs the real one, so the home is
    /usr/local, which has no lib64/libcudart.so: the link step fails with -lcudart."""
    real = toolkit(tmp_path / "cuda-13.0")
    wrapper = tmp_path / "usr_local" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f"#!/bin/sh\nexec {real}/bin/nvcc \"$@\"\n")
    wrapper.chmod(0o755)
    r = toolchain.inspect(env={}, which=which_from(nvcc=wrapper), toolkit_globs=(str(tmp_path / "cuda-*"),))
    assert r.home == str(tmp_path / "usr_local") and r.nvcc_release == "13.0"  # nvcc itself runs
    assert len(r.problems) == 1
    assert f"(from the nvcc on PATH, {wrapper}) has no lib64/libcudart.so" in r.problems[0]
    assert f"-L{tmp_path / 'usr_local' / 'lib64'} -lcudart" in r.problems[0]
    assert "no include/cuda_runtime.h" in r.problems[0]
    assert r.fix == f"export CUDA_HOME={real}  (a complete toolkit on this host)"


def test_pip_wheel_layout_lacks_lib64_libcudart(tmp_path):
    """nvidia-cuda-nvcc + nvidia-cuda-runtime: bin/nvcc and lib/libcudart.so.13, no lib64."""
    home = toolkit(tmp_path / "cu13", lib_dir="lib", libcudart="libcudart.so.13")
    r = toolchain.inspect(env={"CUDA_HOME": str(home)}, which=which_from(), toolkit_globs=())
    assert not r.ok and "has no lib64/libcudart.so" in r.problems[0]
    assert r.fix.startswith("install a CUDA toolkit (nvcc, headers and lib64/libcudart.so")


def test_bare_soname_does_not_satisfy_lcudart_but_a_static_archive_does(tmp_path):
    versioned = toolkit(tmp_path / "a", libcudart="libcudart.so.13")
    static = toolkit(tmp_path / "b", libcudart="libcudart.a")
    assert toolchain.toolkit_gaps(str(versioned))[0].startswith("lib64/libcudart.so")
    assert toolchain.toolkit_gaps(str(static)) == []


def test_headers_under_targets_count(tmp_path):
    home = toolkit(tmp_path / "cuda", headers=False)
    (home / "targets" / "x86_64-linux" / "include").mkdir(parents=True)
    assert toolchain.toolkit_gaps(str(home)) == ["include/cuda_runtime.h"]
    (home / "targets" / "x86_64-linux" / "include" / "cuda_runtime.h").write_text("")
    assert toolchain.toolkit_gaps(str(home)) == []


def test_no_toolkit_anywhere(monkeypatch, tmp_path):
    monkeypatch.setattr(toolchain, "DEFAULT_HOME", str(tmp_path / "absent"))
    r = toolchain.inspect(env={}, which=which_from(nvcc=None), toolkit_globs=())
    assert r.home is None and r.nvcc_release is None
    assert r.problems == ["no CUDA toolkit: $CUDA_HOME and $CUDA_PATH unset, no nvcc on PATH, no " + str(tmp_path / "absent")]
    assert "export CUDA_HOME=<its folder>" in r.fix


def test_missing_ninja_and_compiler(tmp_path):
    home = toolkit(tmp_path / "cuda")
    r = toolchain.inspect(env={"CUDA_HOME": str(home), "CXX": "g++-99"}, which=which_from(ninja=None),
                             toolkit_globs=())
    assert any("no C++ compiler 'g++-99' on PATH" in p for p in r.problems)
    assert any(p.startswith("no ninja on PATH (tvm-ffi runs it)") for p in r.problems)
    assert r.fix is None  # the CUDA home itself is fine


@pytest.mark.parametrize("on_loader_path", [False, True])
def test_toolkit_of_another_cuda_major_than_torch(monkeypatch, tmp_path, on_loader_path):
    home = toolkit(tmp_path / "cuda-12.8", release="12.8")
    matching = toolkit(tmp_path / "cuda-13.0", release="13.0")
    monkeypatch.setattr(toolchain, "loadable", lambda soname, env: on_loader_path)
    r = toolchain.inspect(env={"CUDA_HOME": str(home)}, which=which_from(), torch_cuda="13.0",
                             toolkit_globs=(str(tmp_path / "cuda-*"),))
    if on_loader_path:
        assert r.ok
        return
    assert "nvcc is CUDA 12.8, torch CUDA 13.0: the modules need libcudart.so.12" in r.problems[0]
    assert r.fix == f"export CUDA_HOME={matching}  (a complete toolkit on this host)"


def test_loadable_reads_ld_library_path(tmp_path):
    (tmp_path / "libcudart.so.99").write_bytes(b"")
    assert toolchain.loadable("libcudart.so.99", {"LD_LIBRARY_PATH": f"/nonexistent:{tmp_path}"})
    assert not toolchain.loadable("libcudart.so.99", {"LD_LIBRARY_PATH": ""})
