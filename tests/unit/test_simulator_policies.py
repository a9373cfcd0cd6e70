"""Simulator rules and policies on hand-built streams with exact miss counts."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_hisparse.traces.format import Stream
from sglang_hisparse.traces.policies import POLICIES, make_policy
from sglang_hisparse.traces.simulator import (
    prepare,
    prepare_stream,
    simulate,
    simulate_stream,
    summarize,
)
from sglang_hisparse.traces.synthetic import SyntheticSpec, generate


def _stream(seq_lens, sels):
    offs = np.zeros(len(sels) + 1, np.int64)
    np.cumsum([len(s) for s in sels], out=offs[1:])
    return Stream(0, 0, np.array(seq_lens, np.int32), offs, np.concatenate([np.array(s, np.int32) for s in sels]))


# B = 4. First long step n=6: slots s0..s3 hold tokens 0..3, LRU [s0 s1 s2 s3].
#  n=6 sel [5 2 4 0]: 5 newest (hit); 2, 0 hit; 4 misses -> oldest evictable s1.
#        LRU [s3 | s1 | s0 s2]  (rest of evictables | misses | hits in old order)
#  n=7 sel [5 1 3]: 5 was the newest, written through: miss; 1 evicted: miss; 3 hit.
#        evictables [s1 s0 s2] -> s1 <- 5, s0 <- 1.  LRU [s2 | s1 s0 | s3]
#  n=8 sel [4 0 2]: 4, 0 evicted: misses into s1, s0; 2 hit.
HAND = _stream([6, 7, 8], [[5, 2, 4, 0], [5, 1, 3], [4, 0, 2]])


def test_lru_hand_built_exact():
    assert simulate_stream(HAND, "lru", 4).misses_per_step.tolist() == [1, 2, 2]


def test_topk_only_keeps_only_last_selection():
    # after step 1 only {2, 4, 0} stay; step 2 misses all of {5, 1, 3}; step 3 all of {4, 0, 2}
    assert simulate_stream(HAND, "topk-only", 4).misses_per_step.tolist() == [1, 3, 3]


def test_kernel_order_vs_plain_order():
    # B=3, LRU [s0 s1 s2] = tokens 0 1 2.
    # n=5 sel [1 3]: 1 hits s1, 3 misses into s0.
    #     kernel [s2 | s0(3) | s1(1)]  hits ranked ahead of the fresh miss
    #     plain  [s2 | s1(1) s0(3)]    both renewed in top-k order
    # n=6 sel [4 0]: two misses take the two oldest: kernel evicts 2 and 3, plain 2 and 1.
    # n=7 sel [3]: kernel misses, plain hits.
    st = _stream([5, 6, 7], [[1, 3], [4, 0], [3]])
    assert simulate_stream(st, "lru", 3).misses_per_step.tolist() == [1, 2, 1]
    assert simulate_stream(st, "lru-plain", 3).misses_per_step.tolist() == [1, 2, 0]
    # fifo: hits do not refresh: queue [s1 s2 s0(3)] after n=5; n=6 evicts 1 and 2; n=7 hits 3.
    assert simulate_stream(st, "fifo", 3).misses_per_step.tolist() == [1, 2, 0]


def test_short_requests_and_newest_never_miss():
    short = _stream([3, 4, 5], [[0, 2], [3, 1], [4, 0, 1, 2, 3]])
    for name in POLICIES:
        assert simulate_stream(short, name, 5).misses == 0
    newest_only = _stream([100, 101, 102], [[99], [100, 100], [101]])
    for name in POLICIES:
        assert simulate_stream(newest_only, name, 4).misses == 0


def test_first_long_step_holds_prefix_tokens():
    # A stream that starts long (a long prompt): tokens 0..B-1 are resident, the rest miss.
    st = _stream([50], [[0, 1, 10, 20, 49]])
    assert simulate_stream(st, "lru", 4).misses == 2  # 10 and 20; 49 is the newest


def test_selection_larger_than_buffer_raises():
    st = _stream([20], [[10, 11, 12, 13, 14]])
    with pytest.raises(ValueError, match="more than the buffer's 4 slots"):
        simulate_stream(st, "lru", 4)


def test_unknown_policy_raises():
    with pytest.raises(ValueError, match="--policy 'nope' is unknown"):
        make_policy("nope")
    with pytest.raises(ValueError, match="lrfu:LAMBDA"):
        make_policy("lrfu:x")
    assert make_policy("lrfu:0.5").lam == 0.5


def test_belady_is_a_lower_bound_and_random_is_seeded():
    trace = generate(SyntheticSpec(streams=3, layers=2, prompt_len=300, steps=60, top_k=32,
                                   drift=0.2, locality=0.5, seed=4))
    rates = {p: simulate(trace, p, [48])["48"]["overall"]["misses"] for p in POLICIES}
    assert all(rates["belady"] <= v for v in rates.values()), rates
    assert rates["topk-only"] >= rates["lru"]
    a = simulate(trace, "random", [48], seed=1)["48"]["overall"]["misses"]
    assert a == simulate(trace, "random", [48], seed=1)["48"]["overall"]["misses"]


def test_prepared_streams_give_the_same_figures_as_raw_ones():
    # prepare() de-duplicates each row once; every policy and B then replays the same rows.
    trace = generate(SyntheticSpec(streams=2, layers=2, prompt_len=200, steps=40, top_k=24,
                                   drift=0.3, locality=0.5, seed=7))
    prepared = prepare(trace)
    for p in POLICIES:
        assert simulate(prepared, p, [24, 40]) == simulate(trace, p, [24, 40]), p
    assert simulate(prepare(trace, top_k=8), "lru", [16]) == simulate(trace, "lru", [16], top_k=8)
    with pytest.raises(ValueError, match="prepare"):
        simulate(prepared, "lru", [16], top_k=8)
    ps = prepare_stream(HAND)
    assert ps.lookups.tolist() == [4, 3, 3] and ps.work[0].tolist() == [2, 4, 0]  # newest 5 dropped
    assert prepare_stream(ps) is ps


def test_summary_figures():
    r = simulate_stream(HAND, "lru", 4)
    s = summarize([r], item_bytes=[656])
    o = s["overall"]
    assert (o["lookups"], o["misses"], o["steps"], o["long_steps"]) == (10, 5, 3, 3)
    assert o["miss_rate"] == pytest.approx(0.5)
    assert s["layers"]["0"]["bytes_per_token"]["656"] == pytest.approx(5 * 656 / 3)
    assert o["bytes_per_token"]["656"] == pytest.approx(5 * 656 / 3)


def test_fra_keeps_frequent_tokens_that_lru_evicts():
    # B=3, slots hold tokens 0 1 2. Token 1 is picked on steps 0-2 (hits 3, last 2).
    # step 3 (n=13) sel [5 6]: two misses take s0, s2.      LRU [s1 | s0(5) s2(6)]
    # step 4 (n=14) sel [7]: lru evicts the oldest: token 1. fra scores
    #   token 1: 0.8*log2(4) - log2(3) - 0.3*log2(13) = -1.10
    #   token 5: 0.8*log2(2) - log2(2) - 0.3*log2(9)  = -1.15  <- lowest: evicted
    #   token 6: 0.8*log2(2) - log2(2) - 0.3*log2(8)  = -1.10
    # step 5 (n=15) sel [1]: lru misses, fra hits.
    st = _stream([10, 11, 12, 13, 14, 15], [[1], [1], [1], [5, 6], [7], [1]])
    assert simulate_stream(st, "lru", 3).misses_per_step.tolist() == [0, 0, 0, 2, 1, 1]
    assert simulate_stream(st, "fra", 3).misses_per_step.tolist() == [0, 0, 0, 2, 1, 0]
