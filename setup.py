"""Package discovery only; all metadata lives in pyproject.toml.

NOTE: the CUDA sources live at the repo root (``jit_kernels/``, the layout the project keeps)
but must ship inside the wheel. Mapping that folder to the subpackage
``sglang_hisparse.jit_kernels`` needs an explicit package list next to the discovered one,
which pyproject's declarative ``packages.find`` cannot express.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["sglang_hisparse", "sglang_hisparse.*"]), "sglang_hisparse.jit_kernels"],
    package_dir={"sglang_hisparse.jit_kernels": "jit_kernels"},
)
