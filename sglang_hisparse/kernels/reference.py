"""Pure-torch resolve and replay: the executable spec, the test oracle and the CPU fallback.

Works on CPU or CUDA tensors (it reads ``num_real_reqs`` and per-row scalars back to the
host, so it is not capturable). The CUDA kernels ``jit_kernels/resolve.cuh`` (decode) and
``jit_kernels/resolve_verify.cuh`` (speculative verify) match it bit for bit;
``sglang_hisparse.kernels.ops`` and ``.verify_ops`` dispatch CPU tensors here.

One algorithm with a **window** of W query rows per request: a decode step is W = 1
(:func:`resolve`: top_k [bs, k], seq_lens [bs], slots [R, B+1]); a speculative verify step
resolves the union of its W = n+1 rows once (:func:`resolve_verify`: top_k [bs, W, k],
seq_lens [bs, W] with row j's length ``n0 + j``, slots [R, B+W]). Per real batch row b
(request r = req_index[b], B hot slots)::

    n0 = seq_lens[b] (decode) or seq_lens[b, 0] (verify)
    base = n0 - 1       first window position (decode: the newest token)
    N    = n0 + W - 1   length of the last row (all positions that exist)

    N <= B  (short)  token p lives in slot p (window tokens too): out = slot_rows[r, p].
                     No IO, no state change, plan count 0.
    N >  B  (long)   window position base + j -> slot B + j (a hit, outside the LRU).
                     Every other selected position p < base, over all W rows, forms the
                     union U, resolved once:

        slots     [ 0 .. B-1 : LRU-managed history | B .. B+W-1 : window ]
        flat top-k = top_k[b].reshape(W*k)   (row 0's k entries, then row 1's, ...)

        old LRU   [ s0  s1  s2  s3  s4  s5  s6  s7 ]   (oldest -> newest)
        selected         ^hit           ^hit          misses m1, m2 (flat top-k order)
        evictable [ s0 s1 s3 s4 s5 s7 ]   (old order)   hits [ s2 s6 ]
        m1 -> s0, m2 -> s1  (oldest evictables; host row copied into their device rows)
        new LRU   [ s3 s4 s5 s7 | s0 s1 | s2 s6 ]   rest of evictables | misses | hits

    A position selected twice (by several rows or twice in one row) hits or misses once and
    is copied once; the first occurrence in flat top-k order fixes the miss order. Every
    row's output stays aligned with its own top-k. A history slot whose token is >= base or
    outside [0, N) is never a hit (the newest token / stale window content).

Entries -1 produce -1; so do entries outside [0, N) (a caller bug that validation rejects:
row j may only select positions < its own length). Padding rows (b >= num_real_reqs) write
-1 everywhere and change nothing. The miss plan has ``W*k`` columns and replays with
:func:`replay`. ``B >= W*k`` is required so that the union always fits.

Verify lengths (SGLang 0.5.23 target-verify, ``dsa_backend.init_forward_metadata``): with
``s = forward_batch.seq_lens`` (committed tokens) and ``W = speculative_num_draft_tokens``,
``dsa_seqlens_expanded`` row ``j`` of request ``r`` is ``s_r + 1 + j``: the W verify tokens
are positions ``s_r .. s_r + W - 1`` and ``seq_lens = dsa_seqlens_expanded.view(bs, W)``.

First level, fully resident requests (decode only, optional ``resident_rows``, a
``contract.ResidentRows``; ``"residency": "pressure"``): a request slot whose ``flag`` is set
keeps a device row for every position, so its row b resolves to
``pages[r, p // ps] * ps + p % ps`` for ``0 <= p < n`` (-1 otherwise) and returns: no
membership test, no LRU update, no host read, plan count 0. It writes only its selection
record, ``slot_tokens[r, ring*k : ring*k+k]`` (``p`` for ``0 <= p < n-1``, else -1), which
the shrink to a hot buffer reads. One launch serves a batch mixing resident and hot requests.

Resident hint (decode only, optional ``resident`` int32 [R, ceil(host_rows.shape[1] / 32)]):
bit p of row r says "some history slot (< B) of request r holds position p". The kernel
fetches the rows of selected positions whose bit is clear before its bookkeeping has proved
them misses; outputs and state never depend on it. A long row updates it as
``(old & ~evicted) | misses`` (the tokens that left and entered the slots), which keeps an
exact hint exact. A wrong bit costs at most a wasted early fetch or a late copy per
selection, and is put right when its position is evicted (cleared) or missed and loaded
(set). :func:`resident_hint` builds an exact one.

Replacement policy (decode only, optional ``policy="fra"`` with ``policy_state`` int32 [R, B]
or ``policy="slru"`` with int32 [R, 1]; ``sglang_hisparse.kernel_policy`` is the spec of both).
slru takes the same victims as lru and permutes the new LRU by level (its boundaries in the
one word). fra: the victims are the ``m`` evictable slots with
the smallest ``(bucket, old LRU position)`` instead of the ``m`` oldest, still taking the misses
in old LRU order, and the new LRU is ``remaining evictables | victims | hits`` as above. A long
row then sets each hit slot's word to ``(n << 8) | min(hits + 1, 255)`` and each victim's to
``(n << 8) | 1``; short rows change nothing. ``policy="lru"`` (the default) is the rule above.
"""

from __future__ import annotations

import torch

from ..kernel_policy import (
    FRA_BUCKETS,
    FRA_HITS_MAX,
    FRA_OFFSET,
    FRA_SHIFT,
    FRA_W_AGE,
    FRA_W_GAP,
    FRA_W_HITS,
    POLICY_FRA,
    POLICY_SLRU,
    VERIFY_POLICIES,
    policy_id,
    slru_next,
    slru_pack,
    slru_unpack,
    state_width,
)
from .contract import (
    MissPlan,
    ResidentRows,
    ResolveMode,
    check_plan_shapes,
    check_resident,
    check_resident_rows,
    check_resolve_shapes,
    check_verify_shapes,
    validate_replay,
    validate_resolve,
    validate_verify,
    validation_enabled,
)
from .row_layout import TOKEN, RowLayout

__all__ = ["MissPlan", "ResolveMode", "resolve", "resolve_verify", "replay", "resident_hint",
           "position_bits", "int32_bits", "expand_blocks"]


def expand_blocks(top_k_blocks: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block top-k (MiniMax-M3, docs/v4-m3.md) as the positions a resolve takes: block ``b`` of
    request ``i`` stands for positions ``b * block_size .. b * block_size + block_size - 1``;
    positions at or past ``seq_lens[i]`` and those of a -1 block are -1.

    top_k_blocks: int32 [bs, n_blocks] (-1 = none); seq_lens: int [bs] (tokens); returns int32
    [bs, n_blocks * block_size], blocks in their given order, positions ascending in a block.
    The spec of the in-kernel expansion; on CUDA this reference is also the path until the
    kernel takes a ``Blocks`` selection."""
    if block_size < 1:
        raise ValueError(f"expand_blocks: block_size = {block_size} must be >= 1.")
    blocks = top_k_blocks.to(torch.int64)
    offs = torch.arange(block_size, device=blocks.device, dtype=torch.int64)
    pos = (blocks[:, :, None] * block_size + offs).reshape(blocks.shape[0], -1)
    valid = (blocks >= 0).repeat_interleave(block_size, dim=1) & (pos < seq_lens.to(torch.int64)[:, None])
    return torch.where(valid, pos, torch.full_like(pos, -1)).to(torch.int32)


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
    [R, words], bit p of row r set iff some slot s < B of r holds position p (positions outside
    [0, 32*words) ignored). All rows at once, no host sync (a shrink builds each layer's hint
    with it inside ``map_last_loc``)."""
    R, P = slot_tokens.shape[0], 32 * words
    t = slot_tokens[:, :buffer_size].to(torch.int64)
    mask = torch.zeros(R, P + 1, dtype=torch.bool, device=slot_tokens.device)
    mask.scatter_(1, torch.where((t >= 0) & (t < P), t, P), True)  # column P: the ignored ones
    shifts = torch.arange(32, device=slot_tokens.device, dtype=torch.int64)
    return int32_bits((mask[:, :P].view(R, words, 32).to(torch.int64) << shifts).sum(-1))


def _lg8(x: torch.Tensor) -> torch.Tensor:
    """``kernel_policy.lg8`` in torch: 8 * floor(log2 x) + the 3 bits after x's leading one."""
    x = x.long()
    e = torch.frexp(x.double()).exponent.long() - 1  # exact for x < 2**53
    return 8 * e + (((x << 3) >> e) & 7)


def fra_buckets(words: torch.Tensor, tokens: torch.Tensor, n: int) -> torch.Tensor:
    """fra's bucket (int64, ``kernel_policy``) of slots with policy ``words`` holding ``tokens``
    (-1 = empty: bucket 0) at length ``n``."""
    w, pos = words.long(), tokens.long()
    s = (FRA_W_HITS * _lg8(1 + (w & 0xFF)) - FRA_W_GAP * _lg8(1 + (n - (w >> 8)).clamp(min=0))
         - FRA_W_AGE * _lg8((n - pos).clamp(min=1)))
    return torch.where(pos < 0, 0, ((s >> FRA_SHIFT) + FRA_OFFSET).clamp(0, FRA_BUCKETS - 1))


def _first_occurrence_order(pos: torch.Tensor) -> torch.Tensor:
    """Unique values of 1-D ``pos`` in the order of their first occurrence."""
    if pos.numel() == 0:
        return pos
    uniq, inv = torch.unique(pos, return_inverse=True)
    idx = torch.arange(pos.numel(), device=pos.device)
    first = torch.full((uniq.numel(),), pos.numel(), dtype=torch.long, device=pos.device)
    first.scatter_reduce_(0, inv, idx, reduce="amin")
    return uniq[torch.argsort(first)]


def _resolve_long(*, b, r, n0, W, flat, st, plan, copy, resident=None, policy=None) -> torch.Tensor:
    """Union resolve of one long request (``n0 + W - 1 > B``) over its flat top-k (int64
    [W*k]); mutates the state in ``st`` and returns the device row of each flat entry.
    ``policy``: None (lru) or (policy id, one layer's policy_state)."""
    pid, policy_state = policy if policy is not None else (0, None)
    slot_tokens, slot_rows, lru = st["slot_tokens"], st["slot_rows"], st["lru"]
    B = lru.shape[1]
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
    victims, rest = evictable[:m], evictable[m:]
    if pid == POLICY_FRA and m:
        # fra: the m smallest (bucket, old LRU position), taken in old LRU order.
        E = evictable.numel()
        key = fra_buckets(policy_state[r, evictable], tokens[evictable], n0) * E
        key = key + torch.arange(E, device=dev)
        chosen = torch.zeros(E, dtype=torch.bool, device=dev)
        chosen[torch.topk(key, m, largest=False).indices] = True
        victims, rest = evictable[chosen], evictable[~chosen]
    src = st["host_rows"][r, misses]
    dst = slot_rows[r, victims].long()
    if copy and m:
        dc, hc = st["device_cache"], st["host_cache"]
        st["row_layout"].write(dc, dst, st["row_layout"].host_read(hc, src))
    if resident is not None:
        words = resident.shape[1]
        old = resident[r].long() & 0xFFFFFFFF
        loaded = _pack_bits(misses, words)
        resident[r] = int32_bits((old & ~_pack_bits(tokens[victims], words)) | loaded)
    slot_tokens[r, victims] = misses.to(slot_tokens.dtype)
    lookup[misses] = victims
    if pid == POLICY_SLRU:
        lru[r] = _slru_order(old_lru, is_hit, victims, m, policy_state, r).to(lru.dtype)
    else:
        lru[r] = torch.cat([rest, victims, hits]).to(lru.dtype)
    if pid == POLICY_FRA:
        bumped = ((policy_state[r, hits] & 0xFF) + 1).clamp(max=FRA_HITS_MAX)
        policy_state[r, hits] = ((n0 << 8) | bumped).to(policy_state.dtype)
        policy_state[r, victims] = (n0 << 8) | 1

    slot = torch.where(window, B + flat - base, lookup[flat.clamp(0, max(base, 1) - 1)])
    rows = slot_rows[r, slot.clamp(0, B + W - 1)]
    if plan is not None:
        plan.src[b, :m] = src
        plan.dst[b, :m] = dst.to(plan.dst.dtype)
        plan.count[b] = m
    return torch.where(hist | window, rows, -1)


def _slru_order(old_lru: torch.Tensor, is_hit: torch.Tensor, victims: torch.Tensor, m: int,
                policy_state: torch.Tensor, r: int) -> torch.Tensor:
    """slru's new LRU array (``kernel_policy``): level-0 evictables left | misses | level-1
    evictables left | level-0 hits | level-2 evictables left | level-1/2 hits; sets the new
    boundaries in ``policy_state[r, 0]``. ``victims`` are the m oldest evictables."""
    B = old_lru.numel()
    b1, b2 = slru_unpack(int(policy_state[r, 0]), B)
    pos = torch.arange(B, device=old_lru.device)
    level = (pos >= b1).long() + (pos >= b2).long()
    ev = ~is_hit
    ev_rank = torch.cumsum(ev.long(), 0) - 1
    left = ev & (ev_rank >= m)  # evictables the misses did not take
    n0, n1 = int((ev & (level == 0)).sum()), int((ev & (level == 1)).sum())
    h0 = int((is_hit & (level == 0)).sum())
    parts = [old_lru[left & (level == 0)], victims, old_lru[left & (level == 1)],
             old_lru[is_hit & (level == 0)], old_lru[left & (level == 2)], old_lru[is_hit & (level > 0)]]
    nb1, nb2 = slru_next(n0=n0, n1=n1, h0=h0, m=m, buffer=B)
    policy_state[r, 0] = slru_pack(nb1, nb2, B)
    return torch.cat(parts)


def _resolve_resident(*, r: int, n: int, flat: torch.Tensor, rr: ResidentRows,
                      slot_tokens: torch.Tensor) -> torch.Tensor:
    """First level: a fully resident request (decode, W = 1). Each selected position
    ``0 <= p < n`` maps to ``pages[r, p // ps] * ps + p % ps``; nothing else moves. The selection
    (``p < n-1``, others -1) is recorded in slot_tokens block ``ring`` (see ``ResidentRows``)."""
    ps, k = rr.page_size, flat.numel()
    valid = (flat >= 0) & (flat < n)
    p = flat.clamp(0, max(n - 1, 0))
    rows = rr.pages[r, p // ps].long() * ps + p % ps
    ring = int(rr.ring.reshape(-1)[0])
    slot_tokens[r, ring * k : ring * k + k] = torch.where(
        valid & (flat < n - 1), flat, -1).to(slot_tokens.dtype)
    return torch.where(valid, rows, -1)


def _resolve_window(kw: dict, *, W: int, n0s: list[int], plan: MissPlan | None, copy: bool,
                    resident: torch.Tensor | None, resident_rows: ResidentRows | None = None,
                    policy: tuple[int, torch.Tensor] | None = None) -> None:
    """The batch loop of both flavours; ``kw["top_k"]``/``kw["out_rows"]`` are [bs, W, k] views
    and ``n0s`` the rows-0 lengths of the real rows."""
    top_k, out_rows, lru, slot_rows = kw["top_k"], kw["out_rows"], kw["lru"], kw["slot_rows"]
    bs, _, k = top_k.shape
    B = lru.shape[1]
    nr = int(kw["num_real_reqs"].reshape(-1)[0])
    reqs = kw["req_index"].tolist()
    out_rows[nr:] = -1
    if plan is not None:
        plan.count[:] = 0
    st = {name: kw[name] for name in ("slot_tokens", "slot_rows", "lru", "host_rows",
                                       "host_cache", "device_cache")}
    st["row_layout"] = kw.get("row_layout", TOKEN)
    flags = resident_rows.flag.tolist() if resident_rows is not None else None
    for b in range(min(nr, bs)):
        r, n0 = int(reqs[b]), int(n0s[b])
        flat = top_k[b].reshape(-1).long()
        N = n0 + W - 1
        if flags is not None and flags[r]:
            res = _resolve_resident(r=r, n=n0, flat=flat, rr=resident_rows,
                                    slot_tokens=kw["slot_tokens"])
            # plan count stays 0 (cleared above): nothing to replay
        elif N <= B:
            valid = (flat >= 0) & (flat < N)
            res = torch.where(valid, slot_rows[r, flat.clamp(0, B - 1)], -1)
        else:
            res = _resolve_long(b=b, r=r, n0=n0, W=W, flat=flat, st=st, plan=plan, copy=copy,
                                resident=resident, policy=policy)
        out_rows[b] = res.view(W, k).to(out_rows.dtype)


@torch.no_grad()
def resolve(
    *, top_k, req_index, seq_lens, num_real_reqs, slot_tokens, slot_rows, lru, host_rows,
    host_cache, device_cache, out_rows, plan: MissPlan | None = None,
    mode: ResolveMode = ResolveMode.COPY, validate: bool | None = None,
    resident: torch.Tensor | None = None, resident_rows: ResidentRows | None = None,
    policy: str = "lru", policy_state: torch.Tensor | None = None, row_layout: RowLayout = TOKEN,
) -> None:
    """Resolve one layer's decode-step top-k (window W = 1; see the module docstring).

    Mutates ``slot_tokens`` [R, B+1] int32, ``lru`` [R, B] int16, ``device_cache`` [D, I]
    uint8 (unless ``mode`` is NO_IO), ``out_rows`` [bs, k] int32, ``plan`` and ``resident``
    (if given), and ``policy_state`` (int32 [R, B] for ``policy="fra"``, [R, 1] for "slru"; one
    layer's view).
    ``resident_rows`` (optional :class:`ResidentRows`): requests flagged in it
    resolve through their page table first and touch nothing but their selection record.
    Shapes/dtypes of every argument: ``sglang_hisparse.kernels.contract``; ``row_layout``: where
    a row lives in ``device_cache`` (``kernels.row_layout``; the checks read its row view).
    """
    kw = dict(top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real_reqs=num_real_reqs,
              slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows,
              host_cache=host_cache, device_cache=device_cache, out_rows=out_rows, plan=plan)
    checked = {**kw, "device_cache": row_layout.proxy(device_cache, host_cache),
               "host_cache": row_layout.host_proxy(host_cache)}
    if validation_enabled(validate):
        validate_resolve(**checked)
    else:
        check_resolve_shapes(**checked)
    kw["row_layout"] = row_layout
    check_resident(resident, lru=lru, host_rows=host_rows)
    check_policy_state(policy, policy_state, lru=lru)
    check_resident_rows(resident_rows, lru=lru, top_k=top_k)
    if top_k.shape[0] == 0:
        return
    kw.update(top_k=top_k[:, None, :], out_rows=out_rows[:, None, :])
    _resolve_window(kw, W=1, n0s=seq_lens.tolist(), plan=plan, copy=mode is ResolveMode.COPY,
                    resident=resident, resident_rows=resident_rows,
                    policy=(policy_id(policy), policy_state) if policy_id(policy) else None)


def check_verify_policy(policy: str, policy_state: torch.Tensor | None, *, lru: torch.Tensor) -> None:
    """:func:`check_policy_state` for the verify kernel, which implements
    ``kernel_policy.VERIFY_POLICIES`` only."""
    if policy not in VERIFY_POLICIES:
        raise ValueError(f"policy {policy!r}: the verify kernel implements "
                         f"{' and '.join(repr(p) for p in VERIFY_POLICIES)} only")
    check_policy_state(policy, policy_state, lru=lru)


def check_policy_state(policy: str, policy_state: torch.Tensor | None, *, lru: torch.Tensor) -> None:
    """``policy`` is known and ``policy_state`` fits it: None for lru, int32 [R, S] with
    ``S = kernel_policy.state_width`` (B for fra, 1 for slru), unit stride in S, on ``lru``'s
    device otherwise. Host-only checks."""
    pid = policy_id(policy)
    if pid == 0:
        if policy_state is not None:
            raise ValueError("policy_state is given but policy is 'lru', which keeps no per-slot state")
        return
    if policy_state is None:
        raise ValueError(f"policy {policy!r} needs policy_state, int32 [R, S] (one layer's view; "
                         f"S = kernel_policy.state_width)")
    want = [lru.shape[0], state_width(policy, lru.shape[1])]
    if (policy_state.dtype != torch.int32 or list(policy_state.shape) != want
            or policy_state.device != lru.device or policy_state.stride(-1) != 1):
        raise ValueError(
            f"policy {policy!r}: policy_state must be int32 {want} on {lru.device} with unit stride "
            f"(one layer's view of SlotState.policy_state); got {policy_state.dtype} "
            f"{list(policy_state.shape)} on {policy_state.device}"
        )


@torch.no_grad()
def resolve_verify(
    *, top_k, req_index, seq_lens, num_real_reqs, slot_tokens, slot_rows, lru, host_rows,
    host_cache, device_cache, out_rows, plan: MissPlan | None = None,
    mode: ResolveMode = ResolveMode.COPY, validate: bool | None = None,
    policy: str = "lru", policy_state: torch.Tensor | None = None,
) -> None:
    """Resolve one layer's verify-step selections, all W rows of a request at once (the module
    docstring's window W = top_k.shape[1]; shapes in :func:`.contract.check_verify_shapes`).

    Mutates ``slot_tokens`` [R, B+W] int32 (history slots only), ``lru`` [R, B] int16,
    ``device_cache`` [D, I] uint8 (unless ``mode`` is NO_IO), ``out_rows`` [bs, W, k] int32
    and ``plan`` (src/dst [bs, >= W*k], count [bs]) if given; with ``policy="slru"`` also its
    ``policy_state`` int32 [R, 1] (the union's victims are lru's, the new LRU keeps the levels).
    """
    check_verify_policy(policy, policy_state, lru=lru)
    kw = dict(top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real_reqs=num_real_reqs,
              slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows,
              host_cache=host_cache, device_cache=device_cache, out_rows=out_rows, plan=plan)
    if validation_enabled(validate):
        validate_verify(**kw)
    else:
        check_verify_shapes(**kw)
    if top_k.shape[0] == 0:
        return
    _resolve_window(kw, W=top_k.shape[1], n0s=seq_lens[:, 0].tolist(), plan=plan,
                    copy=mode is ResolveMode.COPY, resident=None,
                    policy=(POLICY_SLRU, policy_state) if policy == "slru" else None)


@torch.no_grad()
def replay(*, plan: MissPlan, num_real_reqs, host_cache, device_cache,
           validate: bool | None = None, row_layout: RowLayout = TOKEN) -> None:
    """Repeat a resolve's copies for another layer: ``device_cache[dst] = host_cache[src]``.

    ``plan`` is a :class:`MissPlan` filled by :func:`resolve` ([bs, k] src int64 / dst int32,
    count int32 [bs]); rows ``b >= num_real_reqs`` (int32 [1]) are skipped. ``host_cache``
    uint8 [H, I], ``device_cache`` uint8 [D, I].
    """
    if validation_enabled(validate):
        validate_replay(plan=plan, num_real_reqs=num_real_reqs, host_cache=row_layout.host_proxy(host_cache),
                        device_cache=row_layout.proxy(device_cache, host_cache))
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
        row_layout.write(device_cache, dst, row_layout.host_read(host_cache, src))
