"""Pure-torch resolve and replay: the executable spec, the test oracle and the CPU fallback.

Works on CPU or CUDA tensors (it reads ``num_real_reqs`` and per-row scalars back to the
host, so it is not capturable). The CUDA kernels in ``jit_kernels/resolve.cuh`` match it
bit for bit; ``sglang_hisparse.kernels.ops`` dispatches CPU tensors here.

Resolve, per real batch row b (request r = req_index[b], n = seq_lens[b], B hot slots)::

    n <= B  (short)  token p lives in slot p (the newest, n-1, too): out = slot_rows[r, p].
                     No IO, no state change, plan count 0.
    n >  B  (long)   newest n-1 -> slot B, a hit.  For the other selected positions:

        old LRU   [ s0  s1  s2  s3  s4  s5  s6  s7 ]   (oldest -> newest)
        selected         ^hit           ^hit          misses m1, m2 (top-k order)
        evictable [ s0 s1 s3 s4 s5 s7 ]   (old order)   hits [ s2 s6 ]
        m1 -> s0, m2 -> s1  (oldest evictables; host row copied into their device rows)
        new LRU   [ s3 s4 s5 s7 | s0 s1 | s2 s6 ]   rest of evictables | misses | hits

    Duplicate positions resolve to one slot and are copied once (the first occurrence
    in top-k order fixes the miss order). A slot whose token is n-1 or outside [0, n)
    is never a hit (the newest lives in slot B).

Padding rows (b >= num_real_reqs) and padding entries (-1) produce -1.

Resident hint (optional, ``resident`` int32 [R, ceil(host_rows.shape[1] / 32)]): bit p of row r
says "some history slot (< B) of request r holds position p". The kernel fetches the rows of
selected positions whose bit is clear before its bookkeeping has proved them misses; outputs
and state never depend on it. A long row updates it as ``(old & ~evicted) | misses`` (the
tokens that left and entered the slots), which keeps an exact hint exact. A wrong bit costs
at most a wasted early fetch or a late copy per selection, and is put right when its position
is evicted (cleared) or missed and loaded (set). :func:`resident_hint` builds an exact one.
"""

from __future__ import annotations

import torch

from .contract import (
    MissPlan,
    ResolveMode,
    check_plan_shapes,
    check_resident,
    check_resolve_shapes,
    validate_replay,
    validate_resolve,
    validation_enabled,
)

__all__ = ["MissPlan", "ResolveMode", "resolve", "replay", "resident_hint", "position_bits",
           "int32_bits"]


def _pack_bits(pos: torch.Tensor, words: int) -> torch.Tensor:
    """int64 [words] (values < 2**32): bit p & 31 of word p >> 5 set for each p in 1-D ``pos``
    (entries outside [0, 32*words) ignored)."""
    mask = torch.zeros(32 * words, dtype=torch.bool, device=pos.device)
    pos = pos.long()
    mask[pos[(pos >= 0) & (pos < 32 * words)]] = True
    shifts = torch.arange(32, device=pos.device, dtype=torch.int64)
    return (mask.view(words, 32).long() << shifts).sum(-1)


def int32_bits(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> the int32 tensor with the same 32 bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def position_bits(positions: torch.Tensor, words: int) -> torch.Tensor:
    """int32 [words]: the bit of every position in 1-D ``positions`` set (others ignored)."""
    return int32_bits(_pack_bits(positions, words))


def resident_hint(slot_tokens: torch.Tensor, buffer_size: int, words: int) -> torch.Tensor:
    """The exact resident hint of ``slot_tokens`` [R, >=B] (history slots 0..B-1): int32
    [R, words], bit p of row r set iff some slot s < B of r holds position p."""
    rows = [_pack_bits(t, words) for t in slot_tokens[:, :buffer_size]]
    if not rows:
        return torch.zeros(0, words, dtype=torch.int32, device=slot_tokens.device)
    return int32_bits(torch.stack(rows))


def _first_occurrence_order(pos: torch.Tensor) -> torch.Tensor:
    """Unique values of 1-D ``pos`` in the order of their first occurrence."""
    if pos.numel() == 0:
        return pos
    uniq, inv = torch.unique(pos, return_inverse=True)
    idx = torch.arange(pos.numel(), device=pos.device)
    first = torch.full((uniq.numel(),), pos.numel(), dtype=torch.long, device=pos.device)
    first.scatter_reduce_(0, inv, idx, reduce="amin")
    return uniq[torch.argsort(first)]


def _resolve_long(
    *, b, r, n, sel_row, slot_tokens, slot_rows, lru, host_rows, host_cache, device_cache,
    out_rows, plan, copy, resident=None,
) -> None:
    B = lru.shape[1]
    dev = sel_row.device
    valid = sel_row >= 0
    pos = sel_row.long()
    tokens = slot_tokens[r, :B].long()
    # Dense position -> slot map over [0, n); only tokens that can be hits enter it.
    lookup = torch.full((n,), -1, dtype=torch.long, device=dev)
    live = (tokens >= 0) & (tokens < n - 1)
    lookup[tokens[live]] = torch.arange(B, device=dev)[live]

    sel = _first_occurrence_order(pos[valid & (pos != n - 1)])
    selected = torch.zeros(n, dtype=torch.bool, device=dev)
    selected[sel] = True

    old_lru = lru[r].long()
    tok_in_lru = tokens[old_lru]
    is_hit = (tok_in_lru >= 0) & (tok_in_lru < n - 1)
    is_hit &= selected[tok_in_lru.clamp(0, n - 1)]
    evictable, hits = old_lru[~is_hit], old_lru[is_hit]

    misses = sel[lookup[sel] < 0]
    m = misses.numel()
    victims = evictable[:m]
    src = host_rows[r, misses]
    dst = slot_rows[r, victims].long()
    if copy and m:
        device_cache[dst] = host_cache[src.to(host_cache.device)].to(device_cache.device)
    if resident is not None:
        words = resident.shape[1]
        old = resident[r].long() & 0xFFFFFFFF
        loaded = _pack_bits(misses, words)
        resident[r] = int32_bits((old & ~_pack_bits(tokens[victims], words)) | loaded)
    slot_tokens[r, victims] = misses.to(slot_tokens.dtype)
    lookup[misses] = victims
    lru[r] = torch.cat([evictable[m:], victims, hits]).to(lru.dtype)

    slot = torch.where(pos == n - 1, torch.full_like(pos, B), lookup[pos.clamp(0, n - 1)])
    out_rows[b] = torch.where(valid, slot_rows[r, slot.clamp(0, B)], -1).to(out_rows.dtype)
    if plan is not None:
        plan.src[b, :m] = src
        plan.dst[b, :m] = dst.to(plan.dst.dtype)
        plan.count[b] = m


@torch.no_grad()
def resolve(
    *, top_k, req_index, seq_lens, num_real_reqs, slot_tokens, slot_rows, lru, host_rows,
    host_cache, device_cache, out_rows, plan: MissPlan | None = None,
    mode: ResolveMode = ResolveMode.COPY, validate: bool | None = None,
    resident: torch.Tensor | None = None,
) -> None:
    """Resolve one layer's top-k selections against the hot buffers (see module docstring).

    Mutates ``slot_tokens`` [R, B+1] int32, ``lru`` [R, B] int16, ``device_cache`` [D, I]
    uint8 (unless ``mode`` is NO_IO), ``out_rows`` [bs, k] int32, ``plan`` and ``resident``
    (if given).
    Shapes/dtypes of every argument: ``sglang_hisparse.kernels.contract``.
    """
    kw = dict(top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real_reqs=num_real_reqs,
              slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows,
              host_cache=host_cache, device_cache=device_cache, out_rows=out_rows, plan=plan)
    if validation_enabled(validate):
        validate_resolve(**kw)
    else:
        check_resolve_shapes(**kw)
    check_resident(resident, lru=lru, host_rows=host_rows)
    bs = top_k.shape[0]
    if bs == 0:
        return
    B = lru.shape[1]
    nr = int(num_real_reqs.reshape(-1)[0])
    reqs = req_index.tolist()
    lens = seq_lens.tolist()
    out_rows[nr:] = -1
    if plan is not None:
        plan.count[:] = 0
    for b in range(min(nr, bs)):
        r, n = int(reqs[b]), int(lens[b])
        sel_row = top_k[b]
        if n <= B:
            p = sel_row.long()
            rows = slot_rows[r, p.clamp(0, B)]
            out_rows[b] = torch.where(p >= 0, rows, -1).to(out_rows.dtype)
            continue
        _resolve_long(
            b=b, r=r, n=n, sel_row=sel_row, slot_tokens=slot_tokens, slot_rows=slot_rows,
            lru=lru, host_rows=host_rows, host_cache=host_cache, device_cache=device_cache,
            out_rows=out_rows, plan=plan, copy=mode is ResolveMode.COPY, resident=resident,
        )


@torch.no_grad()
def replay(*, plan: MissPlan, num_real_reqs, host_cache, device_cache,
           validate: bool | None = None) -> None:
    """Repeat a resolve's copies for another layer: ``device_cache[dst] = host_cache[src]``.

    ``plan`` is a :class:`MissPlan` filled by :func:`resolve` ([bs, k] src int64 / dst int32,
    count int32 [bs]); rows ``b >= num_real_reqs`` (int32 [1]) are skipped. ``host_cache``
    uint8 [H, I], ``device_cache`` uint8 [D, I].
    """
    if validation_enabled(validate):
        validate_replay(plan=plan, num_real_reqs=num_real_reqs, host_cache=host_cache,
                        device_cache=device_cache)
    else:
        check_plan_shapes(plan)
    bs, k = plan.src.shape
    if bs == 0:
        return
    nr = min(int(num_real_reqs.reshape(-1)[0]), bs)
    cnt = plan.count[:nr].long()
    cols = torch.arange(k, device=cnt.device)[None, :] < cnt[:, None]
    src = plan.src[:nr][cols]
    dst = plan.dst[:nr][cols].long()
    if src.numel():
        device_cache[dst] = host_cache[src.to(host_cache.device)].to(device_cache.device)
