"""Resolve (swap-in) and replay kernels: typed ops, pure-torch references, JIT build cache.

``resolve``/``replay`` here are the ops of :mod:`.ops`: CUDA tensors run the fused kernels of
``jit_kernels/resolve.cuh`` / ``replay.cuh``, CPU tensors run :mod:`.reference` (same
contract). ``python -m sglang_hisparse.kernels`` precompiles the CUDA specializations.
See docs/kernels.md.
"""

from .contract import MissPlan, ResidentRows, ResolveMode, validate_replay, validate_resolve
from .ops import replay, reserve_workspace, resolve

__all__ = [
    "MissPlan",
    "ResidentRows",
    "ResolveMode",
    "replay",
    "reserve_workspace",
    "resolve",
    "validate_replay",
    "validate_resolve",
]
