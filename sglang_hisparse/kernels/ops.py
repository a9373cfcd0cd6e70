"""Typed resolve/replay ops: CUDA tensors run the JIT kernels, CPU tensors the reference.

The coordinator calls these everywhere; the CUDA path is CUDA-graph capturable (no host sync,
no allocation once :func:`reserve_workspace` has run for the largest batch, which the first
eager call does implicitly; ``num_real_reqs`` stays on the device). Validation
(``validate=True`` or ``SGLANG_HISPARSE_VALIDATE=1``) reads tensors back and is skipped while
capturing; the shape/dtype checks always run (host-only).
"""

from __future__ import annotations

import torch

from ..kernel_policy import policy_id
from . import reference
from ._jit import replay_module, resolve_module
from .contract import (
    DEFAULT_BLOCK_SIZE,
    MissPlan,
    ResidentRows,
    ResolveMode,
    check_block_size,
    check_plan_shapes,
    check_resident,
    check_resident_rows,
    check_resolve_shapes,
    validate_replay,
    validate_resolve,
    validation_enabled,
)
from .row_layout import TOKEN, RowLayout
from .signature import REPLAY, RESOLVE, RESOLVE_POLICY
from .workspace import ArrivalCounters

__all__ = ["MissPlan", "ResidentRows", "ResolveMode", "reserve_workspace", "resolve", "replay"]


#: Most CTAs one request's misses are spread over.
MAX_CTAS_PER_REQUEST = 32
#: Replay grid: a handful of CTAs, so a side-stream replay overlaps compute.
DEFAULT_REPLAY_CTAS = 8
#: Rows each CTA's fetch warps may hold (with a resident hint, COPY launches only): as many as
#: they hold at 1024 threads (8 warps x 4 rows of 656 B; 8 x 3 = 24 of 1152 B), lowered by the
#: launcher to what fits in shared memory next to the bookkeeping. A quarter of each CTA's warps
#: put every probable miss in flight at once into registers and store each one once the
#: bookkeeping names its destination (docs/kernels.md, "Fetch warps").
FETCH_EARLY_ROWS = 32

_arrivals = ArrivalCounters("resolve", "sglang_hisparse.kernels.ops.reserve_workspace")
_sm_count: dict[torch.device, int] = {}


def reserve_workspace(device: torch.device | str, max_batch: int) -> None:
    """Allocate the per-batch-row arrival counters (int32 zeros) for batches up to ``max_batch``.

    Call before capturing a CUDA graph of a larger batch than any eager call has seen; the
    kernel leaves the counters zeroed after every launch, so one buffer serves all calls.
    """
    _arrivals.reserve(device, max_batch)


def _sms(device: torch.device) -> int:
    if device not in _sm_count:
        _sm_count[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_count[device]


def auto_block_size(bs: int, ctas: int, device: torch.device) -> int:
    """Threads per CTA when the caller (``swap_in_block_size``) leaves it open: 1024 when the
    grid fits one CTA per SM (a 1024-thread CTA takes a whole SM's registers), else 512.

    NOTE: 1024 measured as fast as 512 or faster at batch 1 / 16 / 64 (H200, k 2048, B 4096,
    1152-byte rows: 3-4 % at batch 1 and 64, ``results/resolve_v4_h200.json``); past one CTA per
    SM it runs a second wave (no-IO 39 % slower at batch 64 with 4 CTAs per request,
    ``resolve_v3_h200.json``).
    """
    return 1024 if bs * ctas <= _sms(device) else DEFAULT_BLOCK_SIZE


def default_ctas_per_request(bs: int, device: torch.device) -> int:
    """CTAs per request: about one CTA per SM over the batch, at most ``MAX_CTAS_PER_REQUEST``.

    NOTE: a lone request's misses spread over many SMs (each CTA repeats the bookkeeping in
    shared memory and copies 1/C of the rows), which is what makes batch 1 and uneven batches
    fast. Measured on the H200 (k 2048, B 4096, 1152-byte rows, 15 % churn): batch 16 is flat
    from 4 to 16 CTAs per request (132 us) against 163 us with 1; batch 64 is best at 2 (the
    redundant bookkeeping of 4 per request costs ~4 us more). Two CTAs per SM fit in smem.
    """
    return max(1, min(MAX_CTAS_PER_REQUEST, _sms(device) // max(bs, 1)))


@torch.no_grad()
def resolve(
    *, top_k: torch.Tensor, req_index: torch.Tensor, seq_lens: torch.Tensor,
    num_real_reqs: torch.Tensor, slot_tokens: torch.Tensor, slot_rows: torch.Tensor,
    lru: torch.Tensor, host_rows: torch.Tensor, host_cache: torch.Tensor,
    device_cache: torch.Tensor, out_rows: torch.Tensor, plan: MissPlan | None = None,
    mode: ResolveMode = ResolveMode.COPY, block_size: int | None = None,
    ctas_per_request: int | None = None, validate: bool | None = None,
    resident: torch.Tensor | None = None, early_rows: int | None = None,
    policy: str = "lru", policy_state: torch.Tensor | None = None,
    resident_rows: ResidentRows | None = None, selection_block: int = 0,
    row_layout: RowLayout = TOKEN,
) -> None:
    """Resolve one layer's top-k against the hot buffers; copy misses host -> device.

    Args (bs batch rows, k top-k, R request slots, B hot slots, I bytes per KV row):
        top_k: int32 [bs, k], logical positions, -1 = padding entry (-> out -1).
        req_index, seq_lens: int32|int64 [bs], request slot and length of each row.
        num_real_reqs: int32 [1] device tensor; rows b >= it are padding (out -1, inert).
        slot_tokens: int32 [R, B+1] (one layer's view; mutated), slot_rows: int32 [R, B+1].
        lru: int16 [R, B] (one layer's view; mutated), host_rows: int64 [R, max_ctx].
        host_cache: uint8 [H, I] pinned host; device_cache: uint8 [D, I] (mutated).
        out_rows: int32 [bs, k] (written): device row of each top-k entry.
        plan: optional MissPlan (src int64 [bs, >=k], dst int32 [bs, >=k], count int32 [bs]).
        mode: COPY, or NO_IO (bookkeeping only; timing oracle).
        block_size: CUDA threads per CTA (multiple of 32, <= 1024; default:
            :func:`auto_block_size`).
        ctas_per_request: CTAs sharing one request's copies (default: see
            :func:`default_ctas_per_request`).
        validate: run :func:`validate_resolve` (default: SGLANG_HISPARSE_VALIDATE).
        resident: optional int32 [R, ceil(max_ctx/32)] resident hint (one layer's view;
            mutated; :func:`reference.resident_hint` builds one). With it, each CTA starts
            fetching the rows of selected positions whose bit is clear before its bookkeeping
            has finished; results never depend on it.
        early_rows: rows per CTA the fetch warps may hold in registers (default
            ``FETCH_EARLY_ROWS``; lowered to what fits; 0 = keep the hint, fetch nothing early).
        policy: replacement policy, ``"lru"`` (default), ``"fra"`` or ``"slru"`` (``kernel_policy``).
        policy_state: one layer's view of ``SlotState.policy_state`` (mutated): int32 [R, B]
            for ``"fra"``, [R, 1] for ``"slru"``, None for ``"lru"``.
        resident_rows: optional :class:`ResidentRows`: flagged request slots are fully
            resident and resolve through their page table only (the first level).
        selection_block: 0 (default): ``top_k`` holds positions. > 0 (MiniMax-M3's block
            top-k): ``top_k`` is int32 [bs, k / selection_block] block ids (-1 = none), each
            standing for ``selection_block`` positions; the kernel expands them
            (``reference.expand_blocks``; no expanded top-k in HBM) and ``out_rows`` is [bs, k].
        row_layout: where a row lives in ``device_cache`` (``kernels.row_layout``): ``TOKEN``
            (uint8 [D, I]) or ``C4_PAGED`` (DeepSeek-V4: uint8 [pages, 37440], 592-byte host rows),
            or ``C4_PAGED_HOST`` (those pages on the host side too: ``host_cache`` [pages, 37440]),
            or ``KV_SPLIT_HOST`` (token rows; ``host_cache`` [2H, I/2], MiniMax-M3's K and V apart).
    Semantics: :mod:`sglang_hisparse.kernels.reference` (of the expanded top-k).
    """
    kw = dict(top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real_reqs=num_real_reqs,
              slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows,
              host_cache=host_cache, device_cache=device_cache, out_rows=out_rows)
    # the checks and the validator read token rows: a paged layout is shown as its row view
    checked = {**kw, "device_cache": row_layout.proxy(device_cache, host_cache),
               "host_cache": row_layout.host_proxy(host_cache)}
    if selection_block:
        k_out = out_rows.shape[-1]
        if selection_block < 0 or k_out % selection_block or top_k.dim() != 2 or top_k.shape[1] * selection_block != k_out:
            raise ValueError(
                f"resolve: selection_block = {selection_block} with top_k {tuple(top_k.shape)} and out_rows "
                f"{tuple(out_rows.shape)}: a block selection is int32 [bs, k / selection_block] block ids, "
                f"k = out_rows' columns a multiple of the block size.")
        if not top_k.is_cuda or validation_enabled(validate):
            # the reference path (and the validator) take the expanded positions
            positions = {**kw, "top_k": reference.expand_blocks(top_k, seq_lens, selection_block)}
            if not top_k.is_cuda:
                kw, selection_block = positions, 0
            else:
                validate_resolve(**{**checked, "top_k": positions["top_k"]}, plan=plan)
                _check_pinned(host_cache)
                validate = False
    if early_rows is not None and early_rows < 0:
        raise ValueError(f"early_rows = {early_rows} must be >= 0 (0 = no early fetch).")
    if not top_k.is_cuda:
        reference.resolve(**kw, plan=plan, mode=mode, validate=validate, resident=resident,
                          policy=policy, policy_state=policy_state, resident_rows=resident_rows,
                          row_layout=row_layout)
        return
    if validation_enabled(validate):
        validate_resolve(**checked, plan=plan)
        _check_pinned(host_cache)
    # a block selection's shapes are checked as the [bs, k] positions it stands for (out_rows')
    shaped = {**checked, "top_k": out_rows} if selection_block else checked
    bs, k, B, item = check_resolve_shapes(**shaped, plan=plan)
    check_resident(resident, lru=lru, host_rows=host_rows)
    reference.check_policy_state(policy, policy_state, lru=lru)
    pid = policy_id(policy)
    check_resident_rows(resident_rows, lru=lru, top_k=shaped["top_k"])
    ctas = ctas_per_request or default_ctas_per_request(bs, top_k.device)
    if not 1 <= ctas <= 1024:
        raise ValueError(f"ctas_per_request = {ctas} must be in [1, 1024].")
    stage = -1 if resident is None else FETCH_EARLY_ROWS if early_rows is None else early_rows
    block = check_block_size(block_size or auto_block_size(bs, ctas, top_k.device))
    arrivals = _arrivals.get(top_k.device, bs)
    p = plan if plan is not None else MissPlan(arrivals, arrivals, arrivals)
    record = {} if resident_rows is None else dict(
        rr_flag=resident_rows.flag, rr_pages=resident_rows.pages, rr_ring=resident_rows.ring,
        rr_page=resident_rows.page_size)
    sig = RESOLVE_POLICY if pid else RESOLVE
    resolve_module(k, B, item, policy=pid, blocks=selection_block, rowl=row_layout.kind).resolve(*sig.pack(
        sentinel=arrivals, top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real=num_real_reqs,
        slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows, host_cache=host_cache,
        device_cache=device_cache, out_rows=out_rows, plan_src=p.src, plan_dst=p.dst, plan_count=p.count,
        arrivals=arrivals, resident=resident, **record, ctas=ctas, block=block,
        write_plan=int(plan is not None), copy=int(mode is ResolveMode.COPY), stage_rows=stage,
        **({"policy_state": policy_state} if pid else {}),
    ))


@torch.no_grad()
def replay(
    *, plan: MissPlan, num_real_reqs: torch.Tensor, host_cache: torch.Tensor,
    device_cache: torch.Tensor, ctas: int = DEFAULT_REPLAY_CTAS, block_size: int = 512,
    validate: bool | None = None, row_layout: RowLayout = TOKEN,
) -> None:
    """Repeat a resolve's copies into another layer: ``device_cache[dst] = host_cache[src]``.

    Args: ``plan`` filled by :func:`resolve` (src int64 [bs, k], dst int32 [bs, k], count int32
    [bs]); ``num_real_reqs`` int32 [1] (rows b >= it skipped); ``host_cache`` uint8 [H, I]
    pinned; ``device_cache`` uint8 [D, I] (mutated). ``ctas`` CTAs of ``block_size`` threads
    share all copies of the batch evenly (default 8, small enough to overlap compute).
    ``row_layout``: as for :func:`resolve`.
    """
    if not plan.count.is_cuda:
        reference.replay(plan=plan, num_real_reqs=num_real_reqs, host_cache=host_cache,
                         device_cache=device_cache, validate=validate, row_layout=row_layout)
        return
    if validation_enabled(validate):
        validate_replay(plan=plan, num_real_reqs=num_real_reqs, host_cache=row_layout.host_proxy(host_cache),
                        device_cache=row_layout.proxy(device_cache, host_cache))
        _check_pinned(host_cache)
    elif row_layout.paged:
        row_layout.check_device(device_cache, row_layout.host_item() if row_layout.host_paged else host_cache.shape[1])
    check_plan_shapes(plan)
    block = check_block_size(block_size)
    if not 1 <= ctas <= 65535:
        raise ValueError(f"replay ctas = {ctas} must be in [1, 65535].")
    replay_module(int(row_layout.host_proxy(host_cache).shape[1]), row_layout.kind).replay(*REPLAY.pack(
        plan_src=plan.src, plan_dst=plan.dst, plan_count=plan.count, num_real=num_real_reqs,
        host_cache=host_cache, device_cache=device_cache, ctas=ctas, block=block,
    ))


def _check_pinned(host_cache: torch.Tensor) -> None:
    if host_cache.is_cuda or torch.cuda.is_current_stream_capturing():
        return
    if not host_cache.is_pinned():
        raise ValueError(
            "host_cache is a pageable CPU tensor; the kernels read it from the GPU, so it must be "
            "pinned (allocate it with pin_memory=True or call .pin_memory())."
        )
