"""Typed verify-step resolve op: CUDA tensors run ``jit_kernels/resolve_verify.cuh``, CPU
tensors run :mod:`.verify_reference`.

Speculative decoding gives every request W = n+1 query rows per layer; :func:`resolve_verify`
resolves their union in one launch (semantics and shapes: :mod:`.verify_reference`). The miss
plan it records has ``W*k`` columns and replays with the unchanged
:func:`sglang_hisparse.kernels.replay`. The CUDA path is CUDA-graph capturable (no host sync,
no allocation after the arrival workspace is reserved, ``num_real_reqs`` on the device).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch

from . import _jit, verify_reference
from .contract import (
    DEFAULT_BLOCK_SIZE,
    MissPlan,
    ResolveMode,
    check_block_size,
    validation_enabled,
)
from .verify_reference import check_verify_shapes, validate_verify
from .workspace import ArrivalCounters

__all__ = ["reserve_verify_workspace", "resolve_verify", "verify_module"]


# NOTE: its own counters rather than ops.py's instance: a verify launch and a resolve launch
# never share a batch, and 4 bytes per batch row is nothing.
_arrivals = ArrivalCounters(
    "resolve_verify", "sglang_hisparse.kernels.verify_ops.reserve_verify_workspace"
)


def reserve_verify_workspace(device: torch.device | str, max_batch: int) -> None:
    """Allocate the arrival counters (int32 zeros) for verify batches up to ``max_batch``.

    The first eager call does this implicitly; call it before capturing a CUDA graph of a
    larger batch than any eager call has seen. The kernel leaves the counters zeroed.
    """
    _arrivals.reserve(device, max_batch)


def _check_launch(host_cache: torch.Tensor, block: int, ctas: int, validate: bool) -> None:
    check_block_size(block)
    if not 0 <= ctas <= 1024:
        raise ValueError(f"ctas_per_request = {ctas} must be in [1, 1024] (None = automatic).")
    if validate and not torch.cuda.is_current_stream_capturing() and not host_cache.is_pinned():
        raise ValueError(
            "host_cache is a pageable CPU tensor; the kernel reads it from the GPU, so it must be "
            "pinned (allocate it with pin_memory=True or call .pin_memory())."
        )

_ARGS = (
    "TensorView top_k, TensorView req_index, TensorView seq_lens, TensorView num_real, "
    "TensorView slot_tokens, TensorView slot_rows, TensorView lru, TensorView host_rows, "
    "TensorView host_cache, TensorView device_cache, TensorView out_rows, TensorView plan_src, "
    "TensorView plan_dst, TensorView plan_count, TensorView arrivals, int64_t ctas, "
    "int64_t block, int64_t write_plan, int64_t copy"
)
_CALL = (
    "top_k, req_index, seq_lens, num_real, slot_tokens, slot_rows, lru, host_rows, host_cache, "
    "device_cache, out_rows, plan_src, plan_dst, plan_count, arrivals, ctas, block, write_plan, copy"
)


def _source_digest() -> str:
    # NOTE: _jit keys its cache on the wrapper text and its own sources; resolve_verify.cuh is not
    # among them, so its digest goes into the wrapper (a comment) to invalidate stale builds.
    h = hashlib.sha256()
    for name in ("resolve_verify.cuh", "common.cuh"):
        h.update((_jit.source_dir() / name).read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def verify_module(k: int, B: int, W: int, item: int) -> Any:
    """The compiled verify launcher for top-k ``k``, ``B`` history slots, ``W`` rows, ``item``-byte
    rows (one build serves plan/no-plan, copy/no-IO, every block size and batch)."""
    wrapper = (
        f"// resolve_verify.cuh {_source_digest()}\n"
        '#include "resolve_verify.cuh"\nusing tvm::ffi::TensorView;\n'
        f"void resolve_verify({_ARGS}) {{\n"
        f"  hisparse::resolve_verify_launch<{k}, {B}, {W}, {item}>({_CALL});\n}}\n"
    )
    return _jit._build(f"hisparse_verify_k{k}_b{B}_w{W}_i{item}", wrapper, ["resolve_verify"])


@torch.no_grad()
def resolve_verify(
    *, top_k: torch.Tensor, req_index: torch.Tensor, seq_lens: torch.Tensor,
    num_real_reqs: torch.Tensor, slot_tokens: torch.Tensor, slot_rows: torch.Tensor,
    lru: torch.Tensor, host_rows: torch.Tensor, host_cache: torch.Tensor,
    device_cache: torch.Tensor, out_rows: torch.Tensor, plan: MissPlan | None = None,
    mode: ResolveMode = ResolveMode.COPY, block_size: int | None = None,
    ctas_per_request: int | None = None, validate: bool | None = None,
) -> None:
    """Resolve one layer's verify-step top-k (W rows per request) and copy the union's misses.

    Args (bs requests, W = n+1 verify rows, k top-k, R request slots, B history slots, I bytes):
        top_k: int32 [bs, W, k] logical positions, -1 = padding entry (-> out -1).
        req_index: int32|int64 [bs] request slot of each request.
        seq_lens: int32|int64 [bs, W], row j's length ``n0 + j`` (SGLang's
            ``dsa_seqlens_expanded.view(bs, W)``); the window is positions ``n0-1 .. n0+W-2``.
        num_real_reqs: int32 [1] device tensor; requests b >= it are padding (out -1, inert).
        slot_tokens: int32 [R, B+W] (mutated), slot_rows: int32 [R, B+W]; slots B.. = window.
        lru: int16 [R, B] (mutated), host_rows: int64 [R, max_ctx].
        host_cache: uint8 [H, I] pinned host; device_cache: uint8 [D, I] (mutated).
        out_rows: int32 [bs, W, k] (written): device row of each entry, aligned with top_k.
        plan: optional MissPlan (src int64 [bs, >=W*k], dst int32 [bs, >=W*k], count int32 [bs]).
        mode: COPY, or NO_IO (bookkeeping only; timing oracle).
        block_size: CUDA threads per CTA (multiple of 32, <= 1024; default 512).
        ctas_per_request: CTAs sharing one request's copies (default: one resident wave).
        validate: run :func:`validate_verify` (default: SGLANG_HISPARSE_VALIDATE).
    """
    kw = dict(top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real_reqs=num_real_reqs,
              slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows,
              host_cache=host_cache, device_cache=device_cache, out_rows=out_rows)
    if not top_k.is_cuda:
        verify_reference.resolve_verify(**kw, plan=plan, mode=mode, validate=validate)
        return
    check = validation_enabled(validate)
    if check:
        validate_verify(**kw, plan=plan)
    bs, W, k, B, item = check_verify_shapes(**kw, plan=plan)
    block = block_size or DEFAULT_BLOCK_SIZE
    ctas = 0 if ctas_per_request is None else ctas_per_request
    _check_launch(host_cache, block, ctas, check)
    arrivals = _arrivals.get(top_k.device, bs)
    p = plan if plan is not None else MissPlan(arrivals, arrivals, arrivals)
    verify_module(k, B, W, item).resolve_verify(
        top_k, req_index, seq_lens, num_real_reqs, slot_tokens, slot_rows, lru, host_rows,
        host_cache, device_cache, out_rows, p.src, p.dst, p.count, arrivals, ctas, block,
        int(plan is not None), int(mode is ResolveMode.COPY),
    )
