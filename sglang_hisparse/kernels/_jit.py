"""Build cache for the CUDA kernels: tvm-ffi JIT, keyed on exactly the template arguments.

One module per resolve specialization ``(k, B, item_bytes)`` (block size, CTAs per request,
batch and the plan/no-IO flags are runtime arguments, so one build serves every
``swap_in_block_size``; inside it, block sizes 512 and 1024 run kernels compiled for exactly
that size, every other one a kernel sized at run time), one per verify-step specialization
``(k, B, W, item_bytes)``, and one per replay and all-layer copy item size. Builds go to
``$SGLANG_HISPARSE_JIT_CACHE`` (default ``~/.cache/sglang_hisparse/jit``), never into the
installed package, under a directory named after the arguments and a hash of the sources,
compiler flags and target; an ``fcntl`` lock around each build lets TP ranks share the cache.
``python -m sglang_hisparse.kernels`` precompiles every specialization a config needs.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
from pathlib import Path
from typing import Any

from .signature import REPLAY, RESOLVE, RESOLVE_POLICY, VERIFY

_SOURCES = (
    "common.cuh", "resolve.cuh", "resolve_verify.cuh", "replay.cuh", "gather.cuh", "layer_copy.cuh",
)
_CFLAGS = ("-lineinfo", "--expt-relaxed-constexpr")

# The wrappers' parameter lists and calls, from the one copy of each signature (kernels.signature)
_RESOLVE_ARGS, _RESOLVE_CALL = RESOLVE.args, RESOLVE.call
_VERIFY_ARGS, _VERIFY_CALL = VERIFY.args, VERIFY.call
_REPLAY_ARGS, _REPLAY_CALL = REPLAY.args, REPLAY.call


def source_dir() -> Path:
    """Directory holding the .cuh sources: the wheel's ``sglang_hisparse.jit_kernels`` package,
    else ``<repo>/jit_kernels`` of a plain checkout."""
    try:
        from importlib.resources import files

        d = Path(str(files("sglang_hisparse.jit_kernels")))
        if (d / "resolve.cuh").is_file():
            return d
    except (ModuleNotFoundError, TypeError):
        pass
    d = Path(__file__).resolve().parents[2] / "jit_kernels"
    if not (d / "resolve.cuh").is_file():
        raise FileNotFoundError(
            f"resolve.cuh not found in the package sglang_hisparse.jit_kernels nor in {d}; "
            "reinstall sglang-hisparse (the wheel ships jit_kernels/*.cuh)."
        )
    return d


def cache_dir() -> Path:
    """Build cache root: ``SGLANG_HISPARSE_JIT_CACHE`` or ``~/.cache/sglang_hisparse/jit``."""
    from sglang_hisparse import envs

    root = envs.get("SGLANG_HISPARSE_JIT_CACHE") or "~/.cache/sglang_hisparse/jit"
    return Path(root).expanduser()


def cuda_arch() -> str:
    """Target as ``major.minor``: ``TVM_FFI_CUDA_ARCH_LIST`` if set, else the current GPU's,
    else 9.0 (Hopper) so that builds without a GPU (precompiling) still work."""
    env = os.environ.get("TVM_FFI_CUDA_ARCH_LIST")
    if env:
        return env
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return "9.0"


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build(name: str, wrapper: str, functions: list[str]) -> Any:
    import tvm_ffi
    import tvm_ffi.cpp

    src = source_dir()
    arch = cuda_arch()
    h = hashlib.sha256()
    for part in (wrapper, arch, tvm_ffi.__version__, *_CFLAGS):
        h.update(part.encode())
    for f in _SOURCES:
        h.update((src / f).read_bytes())
    build_dir = cache_dir() / f"{name}_{h.hexdigest()[:16]}"
    old = os.environ.get("TVM_FFI_CUDA_ARCH_LIST")
    with _locked(build_dir.with_suffix(".lock")):
        os.environ["TVM_FFI_CUDA_ARCH_LIST"] = arch
        try:
            return tvm_ffi.cpp.load_inline(
                name, cuda_sources=wrapper, functions=functions,
                extra_cuda_cflags=list(_CFLAGS), extra_include_paths=[str(src)],
                build_directory=str(build_dir),
            )
        finally:
            if old is None:
                os.environ.pop("TVM_FFI_CUDA_ARCH_LIST", None)
            else:
                os.environ["TVM_FFI_CUDA_ARCH_LIST"] = old


@functools.cache
def resolve_module(k: int, B: int, item: int, build: str = "", policy: int = 0, blocks: int = 0,
                   rowl: int = 0) -> Any:
    """The compiled resolve launcher for top-k ``k``, ``B`` hot slots, ``item``-byte rows, and
    ``smem_bytes(words)``: its shared memory per CTA for a position bitmap of ``words`` words.
    ``build``: a name for another, separate build of the same kernels (tests load two builds of
    one template in a process, as benchmarks/probes/probe_resolve.py's profiling build sits next to the op's).
    ``policy``: the replacement policy's id (``kernel_policy.policy_id``; 0 = lru); other
    policies' ``resolve`` takes the policy state (int32 [R, B]) as its last argument.
    ``blocks``: the selection layout, 0 for token positions, > 0 for block ids of that many
    positions each (MiniMax-M3's block top-k, expanded in the kernel; ``top_k`` then has
    ``k / blocks`` columns). ``rowl``: the device row layout (``kernels.row_layout``: 0 token
    rows, 1 DeepSeek-V4's paged C4 entries, 592-byte host rows)."""
    sig = RESOLVE_POLICY if policy else RESOLVE
    args, call = sig.args, sig.call
    wrapper = (
        (f"// build {build}\n" if build else "")
        + '#include "resolve.cuh"\nusing tvm::ffi::TensorView;\n'
        f"void resolve({args}) {{\n"
        f"  hisparse::resolve_launch<{k}, {B}, {item}, {policy}, {blocks}, {rowl}>({call});\n}}\n"
        # Shared memory per CTA for host_rows of `words` * 32 positions (kernel_limits mirrors it).
        "int64_t smem_bytes(int64_t words) {\n"
        f"  return static_cast<int64_t>(hisparse::Layout<{k}, {B}, {policy}>::total(words));\n}}\n"
    )
    name = (f"hisparse_resolve_k{k}_b{B}_i{item}" + (f"_p{policy}" if policy else "")
            + (f"_blk{blocks}" if blocks else "") + (f"_rl{rowl}" if rowl else "")
            + (f"_{build}" if build else ""))
    return _build(name, wrapper, ["resolve", "smem_bytes"])


@functools.cache
def verify_module(k: int, B: int, W: int, item: int, policy: int = 0) -> Any:
    """The compiled verify-step launcher for top-k ``k``, ``B`` history slots, ``W`` rows,
    ``item``-byte rows (one build serves plan/no-plan, copy/no-IO, every block size and batch),
    ``ctas_per_sm(block)``: how many of its CTAs of ``block`` threads one SM of the current
    device holds (the occupancy ``verify_ops`` sizes the grid from), and ``smem_bytes()``: its
    shared memory per CTA (``kernel_limits.verify_smem_bytes`` is asserted equal to it). ``policy``: 0 lru, 2 slru
    (``kernel_policy.policy_id``; its ``resolve_verify`` reads and rewrites ``policy_state``,
    which lru's ignores)."""
    wrapper = (
        '#include "resolve_verify.cuh"\nusing tvm::ffi::TensorView;\n'
        f"void resolve_verify({_VERIFY_ARGS}) {{\n"
        f"  hisparse::resolve_verify_launch<{k}, {B}, {W}, {item}, {policy}>({_VERIFY_CALL});\n}}\n"
        "int64_t ctas_per_sm(int64_t block) {\n"
        f"  return hisparse::verify_ctas_per_sm<{k}, {B}, {W}, {item}, {policy}>(block);\n}}\n"
        # Shared memory per CTA (kernel_limits.verify_smem_bytes must equal it: a GPU test asserts it).
        "int64_t smem_bytes() {\n"
        f"  return static_cast<int64_t>(hisparse::VerifyLayout<{k}, {B}, {W}>::bytes);\n}}\n"
    )
    return _build(f"hisparse_verify_k{k}_b{B}_w{W}_i{item}" + (f"_p{policy}" if policy else ""), wrapper,
                  ["resolve_verify", "ctas_per_sm", "smem_bytes"])


@functools.cache
def replay_module(item: int, rowl: int = 0) -> Any:
    """The compiled replay launcher for ``item``-byte host rows, device row layout ``rowl``."""
    wrapper = (
        '#include "replay.cuh"\nusing tvm::ffi::TensorView;\n'
        f"void replay({_REPLAY_ARGS}) {{\n"
        f"  hisparse::replay_launch<{item}, {rowl}>({_REPLAY_CALL});\n}}\n"
    )
    return _build(f"hisparse_replay_i{item}" + (f"_rl{rowl}" if rowl else ""), wrapper, ["replay"])


@functools.cache
def layer_copy_module(item: int, src_rowl: int = 0, dst_rowl: int = 0) -> Any:
    """The compiled all-layer row copy for ``item``-byte (host) rows (``kernels.layer_copy``):
    ``layer_copy(src_table, dst_table, src_rows, dst_rows)``, one launch for every layer; the
    source and destination row layouts ``src_rowl`` / ``dst_rowl`` (``kernels.row_layout``)."""
    wrapper = (
        '#include "layer_copy.cuh"\nusing tvm::ffi::TensorView;\n'
        "void layer_copy(TensorView src_table, TensorView dst_table, TensorView src_rows,\n"
        "                TensorView dst_rows) {\n"
        f"  hisparse::layer_copy_launch<{item}, {src_rowl}, {dst_rowl}>(src_table, dst_table, src_rows, dst_rows);\n}}\n"
    )
    layouts = f"_rl{src_rowl}{dst_rowl}" if src_rowl or dst_rowl else ""
    return _build(f"hisparse_layer_copy_i{item}{layouts}", wrapper, ["layer_copy"])


@functools.cache
def gather_module(item: int) -> Any:
    """Plain scattered gather (benchmark ceiling): ``gather(src, dst, host_cache, device_cache)``,
    and ``gather_lookup(key, dst, table, host_cache, device_cache)``, which first looks each
    row's host row up as ``table[key]`` (one more dependent load: the bound for kernels given
    positions instead of host rows)."""
    wrapper = (
        '#include "gather.cuh"\nusing tvm::ffi::TensorView;\n'
        "void gather(TensorView src, TensorView dst, TensorView host_cache, TensorView device_cache) {\n"
        f"  hisparse::gather_launch<{item}>(src, dst, host_cache, device_cache);\n}}\n"
        "void gather_lookup(TensorView key, TensorView dst, TensorView table, TensorView host_cache,\n"
        "                   TensorView device_cache) {\n"
        f"  hisparse::gather_launch<{item}>(key, dst, host_cache, device_cache, &table);\n}}\n"
    )
    return _build(f"hisparse_gather_i{item}", wrapper, ["gather", "gather_lookup"])
