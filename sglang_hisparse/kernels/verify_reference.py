"""Pure-torch resolve for a speculative verify step: one resolve for all W rows of a request.

The executable spec, test oracle and CPU fallback of ``jit_kernels/resolve_verify.cuh``
(bit for bit). It extends :mod:`.reference` (the single-row resolve): with ``W = 1`` the two
agree exactly on every valid input.

Lengths (SGLang 0.5.23 target-verify, ``dsa_backend.init_forward_metadata``): with
``s = forward_batch.seq_lens`` (committed tokens) and ``W = speculative_num_draft_tokens``,
the backend passes ``dsa_seqlens_expanded`` whose row ``j`` of request ``r`` is
``s_r + 1 + j``; the W verify tokens are positions ``s_r .. s_r + W - 1``. Here::

    seq_lens[b, j] = n0 + j          n0 = seq_lens[b, 0] = s_r + 1   (= dsa_seqlens_expanded.view(bs, W))
    base = n0 - 1                    first verify-window position
    N    = n0 + W - 1                length of the last row (all positions that exist)

Per real batch row b (request r = req_index[b]), B hot slots, W window slots::

    N <= B  (short)  token p lives in slot p (window tokens too): out = slot_rows[r, p].
                     No IO, no state change, plan count 0.
    N >  B  (long)   window position base + j -> slot B + j (a hit, outside the LRU).
                     Every other selected position p < base, over ALL W rows, forms the
                     union U, resolved once like one single-row step:

        slots     [ 0 .. B-1 : LRU-managed history | B .. B+W-1 : verify window ]
        flat top-k = top_k[b].reshape(W*k)   (row 0's k entries, then row 1's, ...)
        hits       = LRU slots whose token is in U
        misses     = U minus resident, in order of first occurrence in flat top-k
        misses take the oldest evictables; new LRU = rest of evictables | misses | hits

    A position selected by several rows (or twice in one row) hits or misses once and is
    copied once; every row's output stays aligned with its own top-k. A history slot whose
    token is >= base or outside [0, N) is never a hit (stale draft/window content).

Entries -1 produce -1; so do entries outside [0, N) (a caller bug that validation rejects:
row j may only select positions < seq_lens[b, j]). Padding rows (b >= num_real_reqs) write
-1 everywhere and change nothing. The miss plan has ``W*k`` columns and replays with the
unchanged :func:`.reference.replay`. ``B >= W*k`` is required so the union always fits.
"""

from __future__ import annotations

import torch

from .contract import (
    MissPlan,
    ResolveMode,
    _is_capturing,
    _need,
    _same,
    check_plan_shapes,
    check_real_rows,
    check_rows_and_strides,
    check_state_dtypes,
    validation_enabled,
)
from .reference import _first_occurrence_order

__all__ = ["check_verify_shapes", "resolve_verify", "validate_verify"]


def check_verify_shapes(
    *, top_k, req_index, seq_lens, num_real_reqs, slot_tokens, slot_rows, lru,
    host_rows, host_cache, device_cache, out_rows, plan,
) -> tuple[int, int, int, int, int]:
    """Shape/dtype checks with no device read. Returns ``(bs, W, k, B, item_bytes)``.

    ``top_k`` int32 [bs, W, k]; ``req_index`` int32|int64 [bs]; ``seq_lens`` int32|int64
    [bs, W]; ``num_real_reqs`` int32 [1]; ``slot_tokens``/``slot_rows`` int32 [R, B+W];
    ``lru`` int16 [R, B]; ``host_rows`` int64 [R, max_ctx]; ``host_cache``/``device_cache``
    uint8 [H|D, I]; ``out_rows`` int32 [bs, W, k]; ``plan`` src/dst [bs, >= W*k].
    """
    _need("top_k", top_k, (torch.int32,), 3)
    _need("seq_lens", seq_lens, (torch.int32, torch.int64), 2)
    _need("out_rows", out_rows, (torch.int32,), 3)
    check_state_dtypes(
        req_index=req_index, num_real_reqs=num_real_reqs, slot_tokens=slot_tokens,
        slot_rows=slot_rows, lru=lru, host_rows=host_rows, host_cache=host_cache,
        device_cache=device_cache,
    )
    bs, W, k = top_k.shape
    R, B = lru.shape
    _same("num_real_reqs.numel()", num_real_reqs.numel(), 1, "a one-element tensor")
    _same("req_index.shape[0]", req_index.shape[0], bs, "top_k.shape[0] (batch)")
    _same("seq_lens.shape", tuple(seq_lens.shape), (bs, W),
          "top_k.shape[:2] (pass dsa_seqlens_expanded.view(bs, W))")
    _same("out_rows.shape", tuple(out_rows.shape), (bs, W, k), "top_k.shape")
    _same("slot_tokens.shape", tuple(slot_tokens.shape), (R, B + W), "(lru.shape[0], B + W)")
    _same("slot_rows.shape", tuple(slot_rows.shape), (R, B + W), "(lru.shape[0], B + W)")
    _same("host_rows.shape[0]", host_rows.shape[0], R, "lru.shape[0] (request slots)")
    if W < 1 or k < 1:
        raise ValueError(f"top_k has shape {tuple(top_k.shape)}; W and k must be >= 1.")
    if B < W * k:
        raise ValueError(
            f"lru has B = {B} slots but a verify step selects up to W*k = {W}*{k} = {W * k} "
            f"positions: the union must fit, so set device_buffer_size >= {W * k} "
            f"((speculative_num_draft_tokens) * top_k)."
        )
    item = check_rows_and_strides(
        top_k=top_k, out_rows=out_rows, slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru,
        host_rows=host_rows, host_cache=host_cache, device_cache=device_cache,
    )
    for name, t in (("top_k", top_k), ("out_rows", out_rows)):
        if t.stride(1) != k:
            raise ValueError(f"{name} rows of one request must be contiguous (stride {t.stride()}).")
    if plan is not None:
        check_plan_shapes(plan, bs=bs, k=W * k)
    return bs, W, k, B, item


def validate_verify(**kw) -> None:
    """Full check of :func:`resolve_verify` inputs (host syncs; value checks skipped in capture).

    Value rules: ``0 <= num_real_reqs <= bs``; real rows' ``req_index`` in ``[0, R)`` and
    unique; ``seq_lens[b, 0] >= 1``, ``seq_lens[b, j] == seq_lens[b, 0] + j`` and
    ``seq_lens[b, W-1] <= host_rows.shape[1]``; ``top_k[b, j, i]`` is -1 or in
    ``[0, seq_lens[b, j])``.
    """
    bs, W, _, _, _ = check_verify_shapes(**kw)
    top_k = kw["top_k"]
    if _is_capturing(top_k) or bs == 0:
        return
    nr, req, lens, max_ctx = check_real_rows(kw, bs)
    if not nr:
        return
    steps = lens - lens[:, :1]
    if not torch.equal(steps, torch.arange(W).expand(nr, W)):
        b = int((steps != torch.arange(W)).any(1).nonzero()[0])
        raise ValueError(
            f"seq_lens[{b}] = {lens[b].tolist()}: verify row j must have length seq_lens[b, 0] + j "
            f"(SGLang's dsa_seqlens_expanded for one request, viewed as [bs, W])."
        )
    if lens[:, 0].min() < 1 or lens[:, -1].max() > max_ctx:
        raise ValueError(f"seq_lens {lens.tolist()} outside [1, {max_ctx}] (host_rows.shape[1]).")
    tk = top_k[:nr].long().cpu()
    bad = (tk < -1) | (tk >= lens[:, :, None])
    if bool(bad.any()):
        b, j, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"top_k[{b}, {j}, {i}] = {int(tk[b, j, i])} is outside [0, seq_len={int(lens[b, j])}) "
            f"and not -1 (padding). Verify row {j} may only select tokens before its own length."
        )


def _resolve_long(*, b, r, n0, flat, st, plan, copy) -> torch.Tensor:
    """Union resolve of one long request; returns the device row of each flat entry."""
    slot_tokens, slot_rows, lru = st["slot_tokens"], st["slot_rows"], st["lru"]
    B, W = lru.shape[1], slot_tokens.shape[1] - lru.shape[1]
    base, N = n0 - 1, n0 + W - 1
    dev = flat.device
    hist = (flat >= 0) & (flat < base)
    window = (flat >= base) & (flat < N)
    tokens = slot_tokens[r, :B].long()
    # Dense position -> slot map over [0, base); only history tokens can be hits.
    lookup = torch.full((max(base, 1),), -1, dtype=torch.long, device=dev)
    live = (tokens >= 0) & (tokens < base)
    lookup[tokens[live]] = torch.arange(B, device=dev)[live]

    union = _first_occurrence_order(flat[hist])
    selected = torch.zeros(max(base, 1), dtype=torch.bool, device=dev)
    selected[union] = True
    old_lru = lru[r].long()
    tok = tokens[old_lru]
    is_hit = (tok >= 0) & (tok < base) & selected[tok.clamp(0, max(base, 1) - 1)]
    evictable, hits = old_lru[~is_hit], old_lru[is_hit]

    misses = union[lookup[union] < 0]
    m = misses.numel()
    victims = evictable[:m]
    src = st["host_rows"][r, misses]
    dst = slot_rows[r, victims].long()
    if copy and m:
        dc, hc = st["device_cache"], st["host_cache"]
        dc[dst] = hc[src.to(hc.device)].to(dc.device)
    slot_tokens[r, victims] = misses.to(slot_tokens.dtype)
    lookup[misses] = victims
    lru[r] = torch.cat([evictable[m:], victims, hits]).to(lru.dtype)

    slot = torch.where(window, B + flat - base, lookup[flat.clamp(0, max(base, 1) - 1)])
    rows = slot_rows[r, slot.clamp(0, B + W - 1)]
    if plan is not None:
        plan.src[b, :m] = src
        plan.dst[b, :m] = dst.to(plan.dst.dtype)
        plan.count[b] = m
    return torch.where(hist | window, rows, -1)


@torch.no_grad()
def resolve_verify(
    *, top_k, req_index, seq_lens, num_real_reqs, slot_tokens, slot_rows, lru, host_rows,
    host_cache, device_cache, out_rows, plan: MissPlan | None = None,
    mode: ResolveMode = ResolveMode.COPY, validate: bool | None = None,
) -> None:
    """Resolve one layer's verify-step selections, all W rows of a request at once.

    See the module docstring for the semantics; shapes in :func:`check_verify_shapes`.
    Mutates ``slot_tokens`` [R, B+W] int32 (history slots only), ``lru`` [R, B] int16,
    ``device_cache`` [D, I] uint8 (unless ``mode`` is NO_IO), ``out_rows`` [bs, W, k] int32
    and ``plan`` (src/dst [bs, >= W*k], count [bs]) if given.
    """
    kw = dict(top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real_reqs=num_real_reqs,
              slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows,
              host_cache=host_cache, device_cache=device_cache, out_rows=out_rows, plan=plan)
    if validation_enabled(validate):
        validate_verify(**kw)
    else:
        check_verify_shapes(**kw)
    bs, W, k = top_k.shape
    if bs == 0:
        return
    B = lru.shape[1]
    nr = int(num_real_reqs.reshape(-1)[0])
    reqs = req_index.tolist()
    n0s = seq_lens[:, 0].tolist()
    out_rows[nr:] = -1
    if plan is not None:
        plan.count[:] = 0
    st = dict(slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows,
              host_cache=host_cache, device_cache=device_cache)
    for b in range(min(nr, bs)):
        r, n0 = int(reqs[b]), int(n0s[b])
        flat = top_k[b].reshape(-1).long()
        N = n0 + W - 1
        if N <= B:
            valid = (flat >= 0) & (flat < N)
            res = torch.where(valid, slot_rows[r, flat.clamp(0, B - 1)], -1)
        else:
            res = _resolve_long(b=b, r=r, n0=n0, flat=flat, st=st, plan=plan,
                                copy=mode is ResolveMode.COPY)
        out_rows[b] = res.view(W, k).to(out_rows.dtype)


# --- synthetic verify states (tests and benchmarks) ---------------------------------------

def make_verify_state(*, seq_lens: list[int], B: int, W: int, item: int, max_ctx: int | None = None,
                      device: str | torch.device = "cpu", pin: bool = False, seed: int = 0):
    """A :class:`~.synthetic.HotState` with ``[R, B+W]`` slots for rows-0 lengths ``seq_lens``.

    Long requests (``n0 + W - 1 > B``): history slots hold distinct positions ``< n0 - 1`` in a
    random LRU order (-1 when fewer exist), window slot ``B + j`` holds ``n0 - 1 + j``. Short
    ones hold token p in slot p. Device row of slot s of request r: ``1 + r*(B+W) + s``.
    """
    from .synthetic import HotState

    g = torch.Generator().manual_seed(seed)
    R = len(seq_lens)
    max_ctx = max_ctx or max(seq_lens) + W
    st = torch.full((R, B + W), -1, dtype=torch.int32)
    lru = torch.arange(B, dtype=torch.int16).repeat(R, 1)
    for r, n0 in enumerate(seq_lens):
        base, N = n0 - 1, n0 + W - 1
        if N <= B:
            st[r, :N] = torch.arange(N, dtype=torch.int32)
            continue
        h = min(base, B)
        st[r, :h] = torch.randperm(base, generator=g)[:h].to(torch.int32)
        st[r, B:] = torch.arange(base, N, dtype=torch.int32)
        lru[r] = torch.randperm(B, generator=g).to(torch.int16)
    rows = (1 + torch.arange(R * (B + W), dtype=torch.int32)).view(R, B + W)
    H = R * max_ctx
    host_rows = torch.randperm(H, generator=g).view(R, max_ctx)
    host_cache = torch.randint(0, 256, (H, item), generator=g, dtype=torch.uint8)
    device_cache = torch.randint(0, 256, (1 + R * (B + W), item), generator=g, dtype=torch.uint8)
    if pin:
        host_cache = host_cache.pin_memory()
    dev = torch.device(device)
    return HotState(st.to(dev), rows.to(dev), lru.to(dev), host_rows.to(dev), host_cache,
                    device_cache.to(dev), torch.tensor(seq_lens, dtype=torch.int64))


def make_verify_topk(state, req_index: list[int], *, W: int, k: int, churn: float,
                     spread: float = 0.5, pad_entries: int = 0, seed: int = 0) -> torch.Tensor:
    """int32 [bs, W, k] verify selections; ``state.seq_lens`` holds the rows-0 lengths.

    Long request, row j: the window positions it can see (``base .. base+j``), ``churn*k``
    misses drawn from a per-request pool of ``(1+spread)*churn*k`` cold positions (so rows
    overlap: the union misses ~``(1+spread)*churn*k``), the rest resident history positions;
    the last ``pad_entries`` are -1; then shuffled. Short request: random positions < length.
    """
    g = torch.Generator().manual_seed(seed)
    B = state.lru.shape[1]
    tokens = state.slot_tokens.cpu()
    out = torch.full((len(req_index), W, k), -1, dtype=torch.int32)
    for b, r in enumerate(req_index):
        n0 = int(state.seq_lens[r])
        base = n0 - 1
        if n0 + W - 1 <= B:
            for j in range(W):
                out[b, j] = torch.randint(0, n0 + j, (k,), generator=g).to(torch.int32)
            continue
        hist = tokens[r, :B].long()
        hist = hist[(hist >= 0) & (hist < base)]
        is_res = torch.zeros(base, dtype=torch.bool)
        is_res[hist] = True
        cold = (~is_res).nonzero().flatten()
        pool = cold[torch.randperm(cold.numel(), generator=g)[: round((1 + spread) * churn * k)]]
        for j in range(W):
            n_miss = min(round(churn * k), pool.numel(), k - 1 - j)
            miss = pool[torch.randperm(pool.numel(), generator=g)[:n_miss]]
            n_hot = k - 1 - j - n_miss
            pick = (torch.randperm(hist.numel(), generator=g)[:n_hot] if hist.numel() >= n_hot
                    else torch.randint(0, max(hist.numel(), 1), (n_hot,), generator=g))
            hot = hist[pick] if hist.numel() else torch.full((n_hot,), base, dtype=torch.long)
            row = torch.cat([torch.arange(base, base + j + 1), miss, hot])
            if pad_entries:
                row[k - pad_entries:] = -1
            out[b, j] = row[torch.randperm(k, generator=g)].to(torch.int32)
    return out.to(state.slot_tokens.device)
