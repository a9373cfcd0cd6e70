"""The pure-torch verify resolve (one resolve for all W rows) against hand-built states (CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.contract import MissPlan, ResolveMode
from sglang_hisparse.kernels.synthetic import (
    HotState,
    make_state,
    make_topk,
    make_verify_state,
    make_verify_topk,
)

ITEM = 32


def hand_state(n0: int = 31, W: int = 3, B: int = 8):
    """B = 8 history slots s0..s7 hold t10..t17 (LRU s0 oldest); window t30.. in slots 8.."""
    st = make_verify_state(seq_lens=[n0], B=B, W=W, item=ITEM, max_ctx=64, seed=1)
    st.slot_tokens[0, :B] = torch.arange(10, 18, dtype=torch.int32)
    st.slot_tokens[0, B:] = torch.arange(n0 - 1, n0 - 1 + W, dtype=torch.int32)
    st.lru[0] = torch.arange(B, dtype=torch.int16)
    return st


def run(st, top_k, *, req=None, nr=None, mode=ResolveMode.COPY, plan=True, validate=True):
    top_k = torch.tensor(top_k, dtype=torch.int32) if not torch.is_tensor(top_k) else top_k
    bs, W, k = top_k.shape
    req = list(range(bs)) if req is None else req
    n0 = st.seq_lens[req] if req else torch.zeros(0, dtype=torch.int64)
    out = torch.full((bs, W, k), 12345, dtype=torch.int32)
    p = MissPlan.empty(bs, W * k, "cpu") if plan else None
    ref.resolve_verify(
        top_k=top_k, req_index=torch.tensor(req, dtype=torch.int64),
        seq_lens=n0[:, None] + torch.arange(W), num_real_reqs=torch.tensor(
            [bs if nr is None else nr], dtype=torch.int32),
        slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru, host_rows=st.host_rows,
        host_cache=st.host_cache, device_cache=st.device_cache, out_rows=out, plan=p, mode=mode,
        validate=validate,
    )
    return out, p


def test_shared_position_and_window_tokens():
    st = hand_state()  # n0 = 31: window t30 t31 t32 in slots 8 9 10; rows see < 31, < 32, < 33
    before = st.clone()
    # t25 is selected by rows 0 and 1 (one miss, one copy); row 1 reads t31 (its own draft),
    # row 2 reads t31 (row 1's draft token) and t32.
    out, plan = run(st, [[[12, 25], [25, 31], [31, 32]]])
    rows = st.slot_rows[0]
    assert out[0].tolist() == [[rows[2], rows[0]], [rows[0], rows[9]], [rows[9], rows[10]]]
    # Union {12, 25}: s2 hits, t25 takes the oldest evictable s0; window untouched.
    assert st.lru[0].tolist() == [1, 3, 4, 5, 6, 7, 0, 2]
    assert st.slot_tokens[0].tolist() == [25, 11, 12, 13, 14, 15, 16, 17, 30, 31, 32]
    assert plan.count.tolist() == [1]
    assert (plan.src[0, 0], plan.dst[0, 0]) == (st.host_rows[0, 25], rows[0])
    assert torch.equal(st.device_cache[rows[0]], st.host_cache[st.host_rows[0, 25]])
    moved = torch.zeros(st.device_cache.shape[0], dtype=torch.bool)
    moved[rows[0]] = True
    assert torch.equal(st.device_cache[~moved], before.device_cache[~moved])


def test_miss_order_is_first_occurrence_rows_then_topk():
    st = hand_state()
    # Flattened: row 0 [26, 12], row 1 [27, 26], row 2 [25, 16]: misses t26, t27, t25 in that
    # order take s0, s1, s3 (s2 holds t12, a hit; s6 holds t16, a hit).
    out, plan = run(st, [[[26, 12], [27, 26], [25, 16]]])
    rows = st.slot_rows[0]
    assert out[0].tolist() == [[rows[0], rows[2]], [rows[1], rows[0]], [rows[3], rows[6]]]
    assert plan.count.tolist() == [3]
    assert plan.dst[0, :3].tolist() == [rows[0], rows[1], rows[3]]
    assert plan.src[0, :3].tolist() == st.host_rows[0, [26, 27, 25]].tolist()
    # rest of evictables | misses (s0 s1 s3) | hits (s2 s6, old order)
    assert st.lru[0].tolist() == [4, 5, 7, 0, 1, 3, 2, 6]


def test_stale_window_content_in_history_is_never_a_hit():
    st = hand_state()
    st.slot_tokens[0, 4] = 31  # a draft token left in a history slot: not a valid copy of t31
    out, plan = run(st, [[[12, 30], [31, 12], [32, 31]]])
    rows = st.slot_rows[0]
    assert out[0].tolist() == [[rows[2], rows[8]], [rows[9], rows[2]], [rows[10], rows[9]]]
    assert plan.count.tolist() == [0]
    assert st.lru[0].tolist() == [0, 1, 3, 4, 5, 6, 7, 2]


def test_identical_rows_agree_with_single_row_resolve():
    W, B, k = 3, 16, 4
    vst = make_verify_state(seq_lens=[40, 50], B=B, W=W, item=ITEM, seed=5)
    # The single-row state: the same history slots, slot B = the newest (= window slot B).
    sst = HotState(vst.slot_tokens[:, : B + 1].clone(), vst.slot_rows[:, : B + 1].clone(),
                   vst.lru.clone(), vst.host_rows, vst.host_cache, vst.device_cache.clone(),
                   vst.seq_lens)
    one = make_topk(sst, [0, 1], k=k, churn=0.5, dup_frac=0.25, seed=6)
    out_s = torch.empty(2, k, dtype=torch.int32)
    plan_s = MissPlan.empty(2, k, "cpu")
    ref.resolve(top_k=one, req_index=torch.tensor([0, 1]), seq_lens=sst.seq_lens,
                num_real_reqs=torch.tensor([2], dtype=torch.int32), slot_tokens=sst.slot_tokens,
                slot_rows=sst.slot_rows, lru=sst.lru, host_rows=sst.host_rows,
                host_cache=sst.host_cache, device_cache=sst.device_cache, out_rows=out_s,
                plan=plan_s, validate=True)
    out_v, plan_v = run(vst, one[:, None, :].expand(2, W, k).contiguous())
    for j in range(W):
        assert torch.equal(out_v[:, j], out_s)
    assert torch.equal(vst.lru, sst.lru)
    assert torch.equal(vst.slot_tokens[:, : B + 1], sst.slot_tokens)
    assert torch.equal(plan_v.count, plan_s.count)
    for b in range(2):
        c = int(plan_s.count[b])
        assert torch.equal(plan_v.src[b, :c], plan_s.src[b, :c])
        assert torch.equal(plan_v.dst[b, :c], plan_s.dst[b, :c])
    assert torch.equal(vst.device_cache, sst.device_cache)


@pytest.mark.parametrize("seed", range(6))
def test_w1_equals_single_row_resolve_bit_for_bit(seed):
    B, k = 32, 8
    lens = [20, 33, 60, 90, 33]  # short, just long, long
    st = make_state(seq_lens=lens, B=B, item=ITEM, seed=seed)
    req = [4, 0, 2, 3, 1]
    tk = make_topk(st, req, k=k, churn=0.4, dup_frac=0.2, pad_entries=1, seed=seed)
    a, b = st.clone(), st.clone()
    kw = dict(req_index=torch.tensor(req, dtype=torch.int32), num_real_reqs=torch.tensor(
        [4], dtype=torch.int32), host_cache=st.host_cache)
    out_s, plan_s = torch.empty(5, k, dtype=torch.int32), MissPlan.empty(5, k, "cpu")
    ref.resolve(top_k=tk, seq_lens=st.seq_lens[req], slot_tokens=a.slot_tokens,
                slot_rows=a.slot_rows, lru=a.lru, host_rows=a.host_rows,
                device_cache=a.device_cache, out_rows=out_s, plan=plan_s, validate=True, **kw)
    out_v, plan_v = torch.empty(5, 1, k, dtype=torch.int32), MissPlan.empty(5, k, "cpu")
    ref.resolve_verify(top_k=tk[:, None], seq_lens=st.seq_lens[req][:, None],
                        slot_tokens=b.slot_tokens, slot_rows=b.slot_rows, lru=b.lru,
                        host_rows=b.host_rows, device_cache=b.device_cache, out_rows=out_v,
                        plan=plan_v, validate=True, **kw)
    assert torch.equal(out_v[:, 0], out_s)
    for x, y in ((a.slot_tokens, b.slot_tokens), (a.lru, b.lru), (a.device_cache, b.device_cache),
                 (plan_s.count, plan_v.count)):
        assert torch.equal(x, y)
    for r in range(5):
        c = int(plan_s.count[r])
        assert torch.equal(plan_s.src[r, :c], plan_v.src[r, :c])
        assert torch.equal(plan_s.dst[r, :c], plan_v.dst[r, :c])


def naive_verify(tokens, lru, n0, W, rows):
    """Independent list-based model of one long request: returns (out, tokens, lru, misses)."""
    B, base = len(lru), n0 - 1
    tokens, lru = list(tokens), list(lru)
    where = {t: s for s, t in enumerate(tokens[:B]) if 0 <= t < base}
    union = []
    for row in rows:
        for p in row:
            if 0 <= p < base and p not in union:
                union.append(p)
    hits = [s for s in lru if tokens[s] in union and 0 <= tokens[s] < base]
    evict = [s for s in lru if s not in hits]
    misses = [p for p in union if p not in where]
    for p, s in zip(misses, evict[: len(misses)], strict=True):
        tokens[s], where[p] = p, s
    new_lru = evict[len(misses):] + evict[: len(misses)] + hits
    out = [[-1 if p < 0 else (B + p - base if p >= base else where[p]) for p in row] for row in rows]
    return out, tokens, new_lru, misses


@pytest.mark.parametrize("W", [2, 4])
def test_random_long_requests_match_naive_model(W):
    B, k = 24, 5
    rnd = random.Random(W)
    for it in range(25):
        lens = [rnd.randint(B - W + 2, 80) for _ in range(3)]
        st = make_verify_state(seq_lens=lens, B=B, W=W, item=ITEM, seed=it)
        tk = make_verify_topk(st, [0, 1, 2], W=W, k=k, churn=rnd.random(), seed=it,
                                   pad_entries=it % 2)
        before = st.clone()
        out, plan = run(st, tk)
        for r, n0 in enumerate(lens):
            o, tok, lru, miss = naive_verify(before.slot_tokens[r].tolist(),
                                             before.lru[r].tolist(), n0, W, tk[r].tolist())
            slot_rows = st.slot_rows[r].tolist()
            assert out[r].tolist() == [[-1 if s < 0 else slot_rows[s] for s in row] for row in o]
            assert st.slot_tokens[r].tolist() == tok and st.lru[r].tolist() == lru
            assert plan.count[r] == len(miss)
            assert plan.src[r, : len(miss)].tolist() == st.host_rows[r, miss].tolist()


def test_padding_rows_short_and_transition_requests():
    W, B, k = 3, 12, 4
    # rows-0 lengths: short (8+2 <= 12), transition (11+2 > 12 while n0 <= B), long
    st = make_verify_state(seq_lens=[8, 11, 40, 40], B=B, W=W, item=ITEM, seed=3)
    before = st.clone()
    tk = make_verify_topk(st, [0, 1, 2, 3], W=W, k=k, churn=0.5, seed=4)
    tk[1, 2, 3] = -1
    out, plan = run(st, tk, nr=3)
    rows = st.slot_rows
    assert out[0].tolist() == [[int(rows[0, p]) for p in row] for row in tk[0].tolist()]
    assert torch.equal(st.slot_tokens[0], before.slot_tokens[0]) and plan.count[0] == 0
    assert out[1, 2, 3] == -1 and (out[1, :, :3] > 0).all() and (out[2] > 0).all()
    # Transition: window t10 t11 t12 in slots 12 13 14, history t0..t9 with two empty slots.
    win = [(j, i) for j in range(W) for i in range(k) if tk[1, j, i] >= 10]
    assert len(win) >= W - 1
    assert all(out[1, j, i] == rows[1, 12 + tk[1, j, i] - 10] for j, i in win)
    assert out[3].tolist() == [[-1] * k] * W  # padding row: -1, nothing changes
    assert plan.count[3] == 0
    assert torch.equal(st.slot_tokens[3], before.slot_tokens[3])
    assert torch.equal(st.lru[3], before.lru[3])


def test_empty_batch_and_no_io_mode():
    st = hand_state()
    before = st.clone()
    out, plan = run(st, torch.zeros(0, 3, 2, dtype=torch.int32), req=[])
    assert out.shape == (0, 3, 2)
    out, plan = run(st, [[[26, 12], [27, 26], [25, 16]]], mode=ResolveMode.NO_IO)
    assert plan.count.tolist() == [3]
    assert torch.equal(st.device_cache, before.device_cache)  # bookkeeping only


def test_plan_replays_for_a_shared_index_layer():
    W, B, k = 4, 24, 5
    st = make_verify_state(seq_lens=[30, 50, 70], B=B, W=W, item=ITEM, seed=8)
    tk = make_verify_topk(st, [2, 0, 1], W=W, k=k, churn=0.6, seed=9)
    other = st.clone()  # a layer sharing the index: same slots, different KV bytes
    other.host_cache = torch.randint(0, 256, st.host_cache.shape, dtype=torch.uint8)
    twin = other.clone()
    _, plan = run(st, tk, req=[2, 0, 1])
    assert int(plan.count.sum()) > 0
    ref.replay(plan=plan, num_real_reqs=torch.tensor([3], dtype=torch.int32),
               host_cache=other.host_cache, device_cache=other.device_cache, validate=True)
    run(twin, tk, req=[2, 0, 1])  # resolving the other layer directly gives the same bytes
    assert torch.equal(other.device_cache, twin.device_cache)


@pytest.mark.parametrize("case, match", [
    ("small_B", "device_buffer_size >= 6"),
    ("lens", "length seq_lens"),
    ("future", r"top_k\[0, 0, 1\] = 31"),
    ("slots", "slot_tokens.shape"),
])
def test_validation_names_the_problem(case, match):
    st = hand_state()
    tk = torch.tensor([[[12, 25], [25, 31], [31, 32]]], dtype=torch.int32)
    kw = dict(top_k=tk, req_index=torch.tensor([0]), seq_lens=torch.tensor([[31, 32, 33]]),
              num_real_reqs=torch.tensor([1], dtype=torch.int32), slot_tokens=st.slot_tokens,
              slot_rows=st.slot_rows, lru=st.lru, host_rows=st.host_rows,
              host_cache=st.host_cache, device_cache=st.device_cache,
              out_rows=torch.empty(1, 3, 2, dtype=torch.int32), validate=True)
    if case == "small_B":
        kw["lru"] = st.lru[:, :5]
        kw["slot_tokens"], kw["slot_rows"] = st.slot_tokens[:, :8], st.slot_rows[:, :8]
    elif case == "lens":
        kw["seq_lens"] = torch.tensor([[31, 31, 33]])
    elif case == "future":
        kw["top_k"] = torch.tensor([[[12, 31], [25, 31], [31, 32]]], dtype=torch.int32)
    else:
        kw["slot_tokens"] = st.slot_tokens[:, :9]
    with pytest.raises(ValueError, match=match):
        ref.resolve_verify(**kw)


def test_op_dispatches_cpu_tensors_to_the_reference():
    from sglang_hisparse.kernels import verify_ops

    a, b = hand_state(), hand_state()
    tk = torch.tensor([[[26, 12], [27, 26], [25, 16]]], dtype=torch.int32)
    out_ref, _ = run(a, tk)
    out = torch.empty(1, 3, 2, dtype=torch.int32)
    verify_ops.resolve_verify(
        top_k=tk, req_index=torch.tensor([0]), seq_lens=torch.tensor([[31, 32, 33]]),
        num_real_reqs=torch.tensor([1], dtype=torch.int32), slot_tokens=b.slot_tokens,
        slot_rows=b.slot_rows, lru=b.lru, host_rows=b.host_rows, host_cache=b.host_cache,
        device_cache=b.device_cache, out_rows=out, validate=True)
    assert torch.equal(out, out_ref) and torch.equal(a.lru, b.lru)


def test_default_verify_ctas_fill_one_resident_wave(monkeypatch):
    """The verify grid (Python, like the decode op's): SMs x CTAs per SM over the batch, in
    [1, MAX_CTAS_PER_REQUEST]; the occupancy is asked once per (device, shape, block, policy)."""
    from sglang_hisparse.kernels import ops, verify_ops

    dev = torch.device("cuda", 0)
    monkeypatch.setattr(ops, "_sms", lambda device: 132)
    monkeypatch.setattr(verify_ops, "_sms", lambda device: 132)
    monkeypatch.setattr(verify_ops, "_ctas_per_sm", {(dev, 64, 256, 4, 656, 512, 0): 2})  # (.., policy)
    shape = dict(k=64, B=256, W=4, item=656, block=512, device=dev)
    assert verify_ops.default_verify_ctas(1, **shape) == ops.MAX_CTAS_PER_REQUEST
    assert verify_ops.default_verify_ctas(16, **shape) == 132 * 2 // 16
    assert verify_ops.default_verify_ctas(300, **shape) == 1
    assert verify_ops.default_verify_ctas(0, **shape) == ops.MAX_CTAS_PER_REQUEST


def test_every_kernel_source_keys_the_jit_cache():
    """Each .cuh under jit_kernels/ is hashed into every build's cache key (so an edit to one
    rebuilds), and the verify op builds through _jit like the others."""
    from pathlib import Path

    from sglang_hisparse.kernels import _jit, verify_ops

    root = Path(__file__).resolve().parents[2] / "jit_kernels"
    assert set(_jit._SOURCES) == {p.name for p in root.glob("*.cuh")}
    assert verify_ops.verify_module is _jit.verify_module
