"""What the kernels' JIT build needs from this host, checked without building anything.

``kernels/_jit.py`` hands the ``.cuh`` sources to ``tvm_ffi.cpp.load_inline``, which writes a
ninja file and runs it. Read from tvm-ffi 0.1.11's ``cpp/extension.py``, that build uses:

- a CUDA home, chosen as ``$CUDA_HOME``, else ``$CUDA_PATH``, else the parent of the folder
  holding the ``nvcc`` on ``PATH``, else ``/usr/local/cuda`` (:func:`cuda_home`);
- ``<home>/bin/nvcc`` to compile (not necessarily the ``nvcc`` on ``PATH``), which finds the
  CUDA headers (``cuda_runtime.h``) through its own ``nvcc.profile``;
- ``$CXX`` (default ``c++``) to link, with ``-L<home>/lib64 -lcudart``: the runtime library
  must be at ``<home>/lib64``, as ``libcudart.so`` or ``libcudart.a`` (a bare ``libcudart.so.13``
  does not satisfy ``-lcudart``);
- ``ninja`` on ``PATH``.

So an ``nvcc`` that runs is not enough: a wrapper script in ``/usr/local/bin`` makes the home
``/usr/local``, and the pip wheel ``nvidia-cuda-nvcc`` ships ``bin/nvcc`` with ``lib/`` but no
``lib64/libcudart.so``; both compile and then fail to link with ``cannot find -lcudart``.
:func:`inspect` reports each requirement and, when the home is incomplete, a complete toolkit
on this host to point ``CUDA_HOME`` at.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: Where CUDA toolkits are installed when nothing says otherwise (NVIDIA's packages and runfile).
TOOLKIT_GLOBS = ("/usr/local/cuda", "/usr/local/cuda-*", "/opt/cuda", "/opt/nvidia/cuda*")
LIBCUDART = ("libcudart.so", "libcudart.a")  # what `-lcudart` accepts
DEFAULT_HOME = "/usr/local/cuda"  # tvm-ffi's last guess


@dataclass
class BuildReadiness:
    """The outcome of :func:`inspect`: ``problems`` is empty when the build has what it needs."""

    home: str | None
    home_from: str  # how tvm-ffi picked it: "$CUDA_HOME", "$CUDA_PATH", "the nvcc on PATH, ...", "the default"
    nvcc_release: str | None = None  # "13.0" from `<home>/bin/nvcc --version`
    problems: list[str] = field(default_factory=list)
    fix: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """The problems and the fix in one line (empty when ``ok``): doctor's ``kernel build``
        detail, and the kernels CLI's error after a failed build."""
        fix = f"; fix: {self.fix}" if self.fix else ""
        return "; ".join(self.problems) + fix


def cuda_home(env: Mapping[str, str], which: Callable[[str], str | None]) -> tuple[str | None, str]:
    """The CUDA home tvm-ffi's build will use, and where it came from (its ``_find_cuda_home``
    order). None when nothing names one and :data:`DEFAULT_HOME` does not exist."""
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(name):
            return env[name], f"${name}"
    nvcc = which("nvcc")
    if nvcc:
        return str(Path(nvcc).parent.parent), f"the nvcc on PATH, {nvcc}"
    return (DEFAULT_HOME if Path(DEFAULT_HOME).exists() else None), "the default"


def toolkit_gaps(home: str) -> list[str]:
    """What ``home`` lacks of a toolkit the build can use, relative to it (empty: nothing)."""
    root = Path(home)
    gaps = []
    if not os.access(root / "bin" / "nvcc", os.X_OK):
        gaps.append("bin/nvcc")
    if not any((root / "lib64" / lib).exists() for lib in LIBCUDART):
        gaps.append(f"lib64/libcudart.so (the link passes -L{root / 'lib64'} -lcudart)")
    headers = [root / "include" / "cuda_runtime.h", *root.glob("targets/*/include/cuda_runtime.h")]
    if not any(h.is_file() for h in headers):
        gaps.append("include/cuda_runtime.h")
    return gaps


def find_toolkits(patterns: tuple[str, ...] = TOOLKIT_GLOBS) -> list[str]:
    """Complete toolkits (nvcc, headers, lib64/libcudart) at the usual places, newest name last."""
    seen, found = set(), []
    for pattern in patterns:
        for d in sorted(glob.glob(pattern)):
            real = os.path.realpath(d)
            if real not in seen and Path(d).is_dir() and not toolkit_gaps(d):
                seen.add(real)
                found.append(d)
    return found


def nvcc_release(nvcc: str) -> str | None:
    """``"13.0"`` from ``nvcc --version`` (``... release 13.0, V13.0.88``), None if it fails."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if "release" in line:
            return line.split("release", 1)[1].split(",", 1)[0].strip()
    return None


def loadable(soname: str, env: Mapping[str, str]) -> bool:
    """Whether the dynamic loader finds ``soname``: in ``LD_LIBRARY_PATH`` or ``ldconfig``'s cache."""
    for d in env.get("LD_LIBRARY_PATH", "").split(":"):
        if d and (Path(d) / soname).exists():
            return True
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any(line.strip().startswith(soname + " ") for line in cache.splitlines())


def inspect(env: Mapping[str, str] | None = None, which: Callable[[str], str | None] = shutil.which,
            torch_cuda: str | None = None, toolkit_globs: tuple[str, ...] = TOOLKIT_GLOBS) -> BuildReadiness:
    """Check each requirement of the build (module docstring) on this host.

    ``env``/``which`` default to the process's; tests pass a fake environment. ``torch_cuda`` is
    ``torch.version.cuda``: the built modules link the toolkit's ``libcudart.so.<major>``; torch
    brings its own runtime, so a toolkit of another major needs that library on the loader path.
    """
    env = os.environ if env is None else env
    home, source = cuda_home(env, which)
    result = BuildReadiness(home, source)
    gaps = ["a CUDA toolkit"] if home is None else toolkit_gaps(home)
    if home is None:
        result.problems.append(f"no CUDA toolkit: $CUDA_HOME and $CUDA_PATH unset, no nvcc on PATH, no {DEFAULT_HOME}")
    elif gaps:
        result.problems.append(f"CUDA home {home} (from {source}) has no {', no '.join(gaps)}")
    if home is not None and os.access(Path(home) / "bin" / "nvcc", os.X_OK):
        result.nvcc_release = nvcc_release(str(Path(home) / "bin" / "nvcc"))
    cxx = env.get("CXX", "c++")
    if not which(cxx):
        result.problems.append(f"no C++ compiler {cxx!r} on PATH (it links the modules; set CXX or install g++)")
    if not which("ninja"):
        beside = Path(sys.executable).parent / "ninja"
        how = f"put {beside.parent} on PATH (activate the venv)" if beside.exists() else "pip install ninja"
        result.problems.append(f"no ninja on PATH (tvm-ffi runs it): {how}")
    want = torch_cuda.split(".")[0] if torch_cuda else None
    major = result.nvcc_release.split(".")[0] if result.nvcc_release else None
    if major and want and major != want and not loadable(f"libcudart.so.{major}", env):
        gaps.append("matching CUDA major")
        result.problems.append(
            f"nvcc is CUDA {result.nvcc_release}, torch CUDA {torch_cuda}: the modules need libcudart.so.{major} "
            f"at load time, which torch does not bring and the loader does not find (add {home}/lib64 to "
            f"LD_LIBRARY_PATH, or use a CUDA {want} toolkit)")
    if gaps:
        result.fix = _suggest_home(home, want, toolkit_globs)
    return result


def _suggest_home(home: str | None, want_major: str | None, toolkit_globs: tuple[str, ...]) -> str:
    """``export CUDA_HOME=...`` for a complete toolkit on this host (of torch's CUDA major when
    one is), else how to get one."""
    others = [t for t in find_toolkits(toolkit_globs) if home is None or os.path.realpath(t) != os.path.realpath(home)]
    if want_major:
        matching = [t for t in others if (nvcc_release(f"{t}/bin/nvcc") or "").split(".")[0] == want_major]
        others = matching or others
    if others:
        return f"export CUDA_HOME={others[-1]}  (a complete toolkit on this host)"
    return ("install a CUDA toolkit (nvcc, headers and lib64/libcudart.so; e.g. NVIDIA's cuda-toolkit "
            "package) and export CUDA_HOME=<its folder>")
