"""The pure-torch resolve/replay reference against hand-built hot-buffer states (CPU)."""

from __future__ import annotations

import pytest
import torch

from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.contract import MissPlan, ResolveMode
from sglang_hisparse.kernels.synthetic import make_state, make_topk

ITEM = 32  # item bytes: small rows keep the byte checks readable


def worked_state(n: int = 31):
    """The issue's example: B = 8, slots s0..s7 hold t10..t17 (LRU s0 oldest), t30 in slot B."""
    B = 8
    st = make_state(seq_lens=[n], B=B, item=ITEM, max_ctx=64, seed=1)
    st.slot_tokens[0, :B] = torch.arange(10, 18, dtype=torch.int32)
    st.slot_tokens[0, B] = n - 1
    st.lru[0] = torch.arange(B, dtype=torch.int16)
    return st


def run(st, top_k, *, req=None, nr=None, mode=ResolveMode.COPY, plan=True):
    top_k = torch.tensor(top_k, dtype=torch.int32) if not torch.is_tensor(top_k) else top_k
    bs, k = top_k.shape
    req = list(range(bs)) if req is None else req
    out = torch.full((bs, k), 12345, dtype=torch.int32)
    p = MissPlan.empty(bs, k, "cpu") if plan else None
    ref.resolve(
        top_k=top_k, req_index=torch.tensor(req, dtype=torch.int64),
        seq_lens=st.seq_lens[req] if req else torch.zeros(0, dtype=torch.int64),
        num_real_reqs=torch.tensor([bs if nr is None else nr], dtype=torch.int32),
        slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru, host_rows=st.host_rows,
        host_cache=st.host_cache, device_cache=st.device_cache, out_rows=out, plan=p, mode=mode,
        validate=True,
    )
    return out, p


def test_worked_example():
    st = worked_state()
    before = st.clone()
    out, plan = run(st, [[12, 16, 25, 30]])
    rows = st.slot_rows[0]
    # t12 in s2 and t16 in s6 hit; t25 takes the oldest evictable s0; t30 -> slot B (8).
    assert out.tolist() == [[rows[2], rows[6], rows[0], rows[8]]]
    assert st.lru[0].tolist() == [1, 3, 4, 5, 7, 0, 2, 6]
    assert st.slot_tokens[0].tolist() == [25, 11, 12, 13, 14, 15, 16, 17, 30]
    assert plan.count.tolist() == [1]
    assert plan.src[0, 0] == st.host_rows[0, 25] and plan.dst[0, 0] == rows[0]
    assert torch.equal(st.device_cache[rows[0]], st.host_cache[st.host_rows[0, 25]])
    untouched = torch.ones(st.device_cache.shape[0], dtype=torch.bool)
    untouched[rows[0]] = False
    assert torch.equal(st.device_cache[untouched], before.device_cache[untouched])


def test_duplicates_copy_once_in_first_occurrence_order():
    st = worked_state()
    out, plan = run(st, [[26, 25, 12, 26, 25, 30]])
    rows = st.slot_rows[0]
    # Misses in first-occurrence order: t26 -> s0, t25 -> s1; each copied once.
    assert out.tolist() == [[rows[0], rows[1], rows[2], rows[0], rows[1], rows[8]]]
    assert plan.count.tolist() == [2]
    assert plan.dst[0, :2].tolist() == [rows[0], rows[1]]
    assert st.lru[0].tolist() == [3, 4, 5, 6, 7, 0, 1, 2]


def test_padding_rows_and_entries():
    st = make_state(seq_lens=[31, 40], B=8, item=ITEM, max_ctx=64, seed=2)
    before = st.clone()
    tk = make_topk(st, [0, 1], k=4, churn=0.5, seed=3)
    tk[0, 3] = -1
    out, plan = run(st, tk, nr=1)
    assert out[0, 3] == -1 and (out[0, :3] >= 0).all()
    assert out[1].tolist() == [-1] * 4  # padding row: -1, no state change
    assert plan.count[1] == 0
    assert torch.equal(st.slot_tokens[1], before.slot_tokens[1])
    assert torch.equal(st.lru[1], before.lru[1])


def test_short_request_is_identity_and_inert():
    st = make_state(seq_lens=[6], B=8, item=ITEM, max_ctx=64, seed=4)
    before = st.clone()
    out, plan = run(st, [[5, 0, 3, -1]])
    rows = st.slot_rows[0]
    assert out.tolist() == [[rows[5], rows[0], rows[3], -1]]
    assert plan.count.tolist() == [0]
    for a, b in ((st.slot_tokens, before.slot_tokens), (st.lru, before.lru),
                 (st.device_cache, before.device_cache)):
        assert torch.equal(a, b)


def test_exactly_b_tokens_is_short():
    st = make_state(seq_lens=[8], B=8, item=ITEM, max_ctx=64, seed=4)
    out, plan = run(st, [[7, 1, 2, 3]])
    assert out[0, 0] == st.slot_rows[0, 7] and plan.count[0] == 0


def test_empty_batch():
    st = worked_state()
    before = st.clone()
    out, plan = run(st, torch.zeros(0, 4, dtype=torch.int32), req=[])
    assert out.shape == (0, 4) and torch.equal(st.lru, before.lru)


def test_no_io_does_bookkeeping_only():
    st = worked_state()
    before = st.clone()
    run(st, [[12, 16, 25, 30]], mode=ResolveMode.NO_IO)
    assert torch.equal(st.device_cache, before.device_cache)
    assert st.lru[0].tolist() == [1, 3, 4, 5, 7, 0, 2, 6]


def test_all_hits_keep_hits_in_old_order():
    st = worked_state()
    st.lru[0] = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.int16)
    _, plan = run(st, [[10, 17, 13, 30]])
    # Evictables (s6 s5 s4 s2 s1) keep their order, then hits s7 s3 s0 in old relative order.
    assert st.lru[0].tolist() == [6, 5, 4, 2, 1, 7, 3, 0] and plan.count[0] == 0


def test_replay_repeats_copies_on_another_layer():
    st = make_state(seq_lens=[50, 9, 70], B=16, item=ITEM, max_ctx=80, seed=5)
    tk = make_topk(st, [0, 1, 2], k=8, churn=0.5, dup_frac=0.25, seed=6)
    _, plan = run(st, tk)
    assert plan.count.tolist()[1] == 0 and plan.count[0] > 0
    other_host = torch.randint(0, 256, st.host_cache.shape, dtype=torch.uint8)
    other_dev = torch.zeros_like(st.device_cache)
    ref.replay(plan=plan, num_real_reqs=torch.tensor([3], dtype=torch.int32),
               host_cache=other_host, device_cache=other_dev, validate=True)
    for b in range(3):
        for j in range(int(plan.count[b])):
            assert torch.equal(other_dev[plan.dst[b, j]], other_host[plan.src[b, j]])
    assert int((other_dev.sum(1) > 0).sum()) <= int(plan.count.sum())


def make_consistent(st):
    """Fill each resident slot's device row with its position's host bytes."""
    R, B1 = st.slot_tokens.shape
    for r in range(R):
        for s in range(B1):
            p = int(st.slot_tokens[r, s])
            if p >= 0:
                st.device_cache[st.slot_rows[r, s]] = st.host_cache[st.host_rows[r, p]]


@pytest.mark.parametrize("seed", range(4))
def test_random_steps_keep_invariants(seed):
    B, k, reqs = 16, 8, [3, 0, 1, 2]
    st = make_state(seq_lens=[40, 17, 12, 90], B=B, item=ITEM, max_ctx=96, seed=seed)
    make_consistent(st)
    for step in range(4):
        tk = make_topk(st, reqs, k=k, churn=0.4, dup_frac=0.2, seed=seed * 10 + step)
        out, _ = run(st, tk, req=reqs)
        for b, r in enumerate(reqs):
            assert sorted(st.lru[r].tolist()) == list(range(B))
            for i in range(k):
                p = int(tk[b, i])
                slot = (st.slot_rows[r] == out[b, i]).nonzero().flatten()
                assert slot.numel() == 1 and int(st.slot_tokens[r, slot[0]]) == p
                # Exactness: the row handed to attention holds this position's KV bytes.
                assert torch.equal(st.device_cache[out[b, i]], st.host_cache[st.host_rows[r, p]])


def test_validation_rejects_bad_positions_and_shapes():
    st = worked_state()
    with pytest.raises(ValueError, match=r"top_k\[0, 1\] = 31 is outside \[0, seq_len=31\)"):
        run(st, [[12, 31, 25, 30]])
    with pytest.raises(ValueError, match="B must be >= k"):
        run(st, [[1] * 9])
    with pytest.raises(ValueError, match="top_k has dtype torch.int64"):
        ref.resolve(top_k=torch.zeros(1, 4, dtype=torch.int64), req_index=torch.zeros(1),
                    seq_lens=None, num_real_reqs=None, slot_tokens=None, slot_rows=None,
                    lru=None, host_rows=None, host_cache=None, device_cache=None, out_rows=None)


def test_ops_dispatch_cpu_tensors_to_the_reference():
    from sglang_hisparse.kernels import ops

    a, b = worked_state(), worked_state()
    out_a, _ = run(a, [[12, 16, 25, 30]])
    out_b = torch.empty_like(out_a)
    ops.resolve(top_k=torch.tensor([[12, 16, 25, 30]], dtype=torch.int32),
                req_index=torch.tensor([0]), seq_lens=b.seq_lens[[0]],
                num_real_reqs=torch.tensor([1], dtype=torch.int32), slot_tokens=b.slot_tokens,
                slot_rows=b.slot_rows, lru=b.lru, host_rows=b.host_rows, host_cache=b.host_cache,
                device_cache=b.device_cache, out_rows=out_b)
    assert torch.equal(out_a, out_b) and torch.equal(a.lru, b.lru)
