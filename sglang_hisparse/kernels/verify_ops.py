"""Typed verify-step resolve op: CUDA tensors run ``jit_kernels/resolve_verify.cuh``, CPU
tensors run :func:`.reference.resolve_verify`.

Speculative decoding gives every request W = n+1 query rows per layer; :func:`resolve_verify`
resolves their union in one launch (semantics and shapes: :mod:`.reference`, the window W of
the decode resolve's W = 1). The miss plan it records has ``W*k`` columns and replays with the
unchanged :func:`sglang_hisparse.kernels.replay`. The CUDA path is CUDA-graph capturable (no
host sync, no allocation after the arrival workspace is reserved, ``num_real_reqs`` on the
device).
"""

from __future__ import annotations

import torch

from ..kernel_policy import policy_id
from . import reference
from ._jit import verify_module
from .contract import (
    DEFAULT_BLOCK_SIZE,
    MissPlan,
    ResolveMode,
    check_block_size,
    check_verify_shapes,
    validate_verify,
    validation_enabled,
)
from .ops import MAX_CTAS_PER_REQUEST, _check_pinned, _sms
from .signature import VERIFY
from .workspace import ArrivalCounters

__all__ = ["default_verify_ctas", "reserve_verify_workspace", "resolve_verify", "verify_module"]


# NOTE: its own counters rather than ops.py's instance: a verify launch and a resolve launch
# never share a batch, and 4 bytes per batch row is nothing.
_arrivals = ArrivalCounters(
    "resolve_verify", "sglang_hisparse.kernels.verify_ops.reserve_verify_workspace"
)
#: (device, k, B, W, item, block) -> CTAs of the verify kernel one SM holds; a host query, made
#: once per key (the eager warm-up), so a graph capture finds it here.
_ctas_per_sm: dict[tuple, int] = {}


def reserve_verify_workspace(device: torch.device | str, max_batch: int) -> None:
    """Allocate the arrival counters (int32 zeros) for verify batches up to ``max_batch``.

    The first eager call does this implicitly; call it before capturing a CUDA graph of a
    larger batch than any eager call has seen. The kernel leaves the counters zeroed.
    """
    _arrivals.reserve(device, max_batch)


def default_verify_ctas(bs: int, *, k: int, B: int, W: int, item: int, block: int,
                        device: torch.device, policy: int = 0) -> int:
    """CTAs per request when the caller leaves them open: the whole batch in one resident wave
    (SMs x CTAs per SM, over the batch), at least 1, at most ``MAX_CTAS_PER_REQUEST``.

    NOTE: each extra CTA repeats the bookkeeping, so a second wave would only add latency; the
    verify kernel's shared memory (about ``8*pow2(2*W*k) + 6*W*k + 3*B`` bytes) decides how many
    CTAs an SM holds, unlike the decode kernel, whose grid is sized from the SM count alone
    (``ops.default_ctas_per_request``).
    """
    key = (device, k, B, W, item, block, policy)
    if key not in _ctas_per_sm:
        with torch.cuda.device(device):
            _ctas_per_sm[key] = int(verify_module(k, B, W, item, policy).ctas_per_sm(block))
    c = _sms(device) * _ctas_per_sm[key] // max(bs, 1)
    return max(1, min(MAX_CTAS_PER_REQUEST, c))


@torch.no_grad()
def resolve_verify(
    *, top_k: torch.Tensor, req_index: torch.Tensor, seq_lens: torch.Tensor,
    num_real_reqs: torch.Tensor, slot_tokens: torch.Tensor, slot_rows: torch.Tensor,
    lru: torch.Tensor, host_rows: torch.Tensor, host_cache: torch.Tensor,
    device_cache: torch.Tensor, out_rows: torch.Tensor, plan: MissPlan | None = None,
    mode: ResolveMode = ResolveMode.COPY, block_size: int | None = None,
    ctas_per_request: int | None = None, validate: bool | None = None,
    policy: str = "lru", policy_state: torch.Tensor | None = None,
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
        ctas_per_request: CTAs sharing one request's copies, in [1, 1024] (default:
            :func:`default_verify_ctas`).
        validate: run :func:`.contract.validate_verify` (default: SGLANG_HISPARSE_VALIDATE).
        policy: ``"lru"`` (default) or ``"slru"`` (``kernel_policy``; the verify kernel has no
            fra); policy_state: slru's int32 [R, 1] (one layer's view; mutated), else None.
    """
    kw = dict(top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real_reqs=num_real_reqs,
              slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows,
              host_cache=host_cache, device_cache=device_cache, out_rows=out_rows)
    if not top_k.is_cuda:  # (checks the policy itself)
        reference.resolve_verify(**kw, plan=plan, mode=mode, validate=validate, policy=policy,
                                 policy_state=policy_state)
        return
    reference.check_verify_policy(policy, policy_state, lru=lru)
    if validation_enabled(validate):
        validate_verify(**kw, plan=plan)
        _check_pinned(host_cache)
    bs, W, k, B, item = check_verify_shapes(**kw, plan=plan)
    block = check_block_size(block_size or DEFAULT_BLOCK_SIZE)
    if ctas_per_request is None:
        ctas = default_verify_ctas(bs, k=k, B=B, W=W, item=item, block=block,
                                   device=top_k.device, policy=policy_id(policy))
    elif 1 <= ctas_per_request <= 1024:
        ctas = ctas_per_request
    else:
        raise ValueError(f"ctas_per_request = {ctas_per_request} must be in [1, 1024] "
                         f"(None = one resident wave).")
    arrivals = _arrivals.get(top_k.device, bs)
    p = plan if plan is not None else MissPlan(arrivals, arrivals, arrivals)
    verify_module(k, B, W, item, policy_id(policy)).resolve_verify(*VERIFY.pack(
        sentinel=arrivals, top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real=num_real_reqs,
        slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows, host_cache=host_cache,
        device_cache=device_cache, out_rows=out_rows, plan_src=p.src, plan_dst=p.dst, plan_count=p.count,
        arrivals=arrivals, ctas=ctas, block=block, write_plan=int(plan is not None),
        copy=int(mode is ResolveMode.COPY), policy_state=policy_state,
    ))
