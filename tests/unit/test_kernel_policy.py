"""The kernel's replacement policies on CPU: fra's integer spec, the reference against a
hand-built state, the config key, the state the coordinator keeps and what it costs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_hisparse import kernel_policy as kp
from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.coordinator.state import SlotState
from sglang_hisparse.kernel_limits import resolve_smem_bytes
from sglang_hisparse.kernels import ops
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.contract import MissPlan
from sglang_hisparse.kernels.synthetic import make_state
from sglang_hisparse.memory.state_bytes import slot_state_bytes

CUH = Path(__file__).resolve().parents[2] / "jit_kernels" / "resolve.cuh"


def test_lg8_is_a_piecewise_linear_log2_in_eighths():
    x = np.array([1, 2, 3, 6, 7, 8, 10, 11, 2**23 + 5])
    # 8 * floor(log2 x) + the 3 bits after the leading one
    assert kp.lg8(x).tolist() == [0, 8, 12, 20, 22, 24, 26, 27, 8 * 23 + 0]
    big = np.arange(1, 5000)
    assert np.array_equal(ref._lg8(torch.from_numpy(big)).numpy(), kp.lg8(big))
    err = np.log2(big) - kp.lg8(big) / 8  # the chord under log2 (< 0.09) plus 3-bit truncation
    assert np.all((err >= 0) & (err < 0.22))


def test_bucket_numpy_and_torch_agree_and_rank_as_the_score_says():
    rng = np.random.default_rng(0)
    hits, last = rng.integers(0, 256, 4000), rng.integers(0, 9000, 4000)
    pos, n = rng.integers(0, 9000, 4000), 9001
    words = torch.from_numpy((last << 8) | hits).to(torch.int32)
    b = kp.fra_bucket(hits, last, pos, n)
    assert np.array_equal(ref.fra_buckets(words, torch.from_numpy(pos), n).numpy(), b)
    assert b.min() >= 0 and b.max() <= 255
    # more hits: higher; a longer gap or an older token: lower
    assert kp.fra_bucket([1], [9000], [8000], n) < kp.fra_bucket([64], [9000], [8000], n)
    assert kp.fra_bucket([4], [8000], [8000], n) < kp.fra_bucket([4], [9000], [8000], n)
    assert kp.fra_bucket([4], [9000], [10], n) < kp.fra_bucket([4], [9000], [8900], n)
    # an empty slot (-1) is bucket 0 in the kernel and the reference
    assert ref.fra_buckets(torch.tensor([0], dtype=torch.int32), torch.tensor([-1]), n).item() == 0


def test_kernel_constants_match_the_spec():
    src = CUH.read_text() + (CUH.parent / "common.cuh").read_text()

    def const(name):
        return int(re.search(rf"\b{name} = (\d+)", src).group(1))

    assert (const("kFraWHits"), const("kFraWGap"), const("kFraWAge")) == (kp.FRA_W_HITS, kp.FRA_W_GAP, kp.FRA_W_AGE)
    assert (const("kFraShift"), const("kFraOffset")) == (kp.FRA_SHIFT, kp.FRA_OFFSET)
    assert (const("kFraBuckets"), const("kFraHitsMax")) == (kp.FRA_BUCKETS, kp.FRA_HITS_MAX)
    assert (const("kPolicyLru"), const("kPolicyFra")) == (kp.policy_id("lru"), kp.policy_id("fra"))
    assert const("kPolicySlru") == kp.policy_id("slru") == kp.POLICY_SLRU
    assert (const("kSlruCap1"), const("kSlruCap2")) == (kp.SLRU_CAP1, kp.SLRU_CAP2)


def _fra_state():
    """B = 4, n = 10: s0..s3 hold t0..t3 (LRU s0 oldest), t9 in slot B. Words: s0 t0 picked 5
    times, last at n = 9; s1 t1 never; s2 t2 once at n = 9; s3 t3 never."""
    B = 4
    st = make_state(seq_lens=[10], B=B, item=32, max_ctx=16, seed=1)
    st.slot_tokens[0] = torch.tensor([0, 1, 2, 3, 9], dtype=torch.int32)
    st.lru[0] = torch.arange(B, dtype=torch.int16)
    words = torch.tensor([[(9 << 8) | 5, 0, (9 << 8) | 1, 0]], dtype=torch.int32)
    return st, words


def _run(st, top_k, policy, words):
    out = torch.empty(1, len(top_k), dtype=torch.int32)
    plan = MissPlan.empty(1, len(top_k), "cpu")
    ops.resolve(top_k=torch.tensor([top_k], dtype=torch.int32), req_index=torch.tensor([0]),
                seq_lens=st.seq_lens[:1], num_real_reqs=torch.tensor([1], dtype=torch.int32),
                slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru,
                host_rows=st.host_rows, host_cache=st.host_cache, device_cache=st.device_cache,
                out_rows=out, plan=plan, validate=True, policy=policy, policy_state=words)
    return out, plan


def test_fra_reference_keeps_the_frequent_token_lru_evicts():
    # Selection [2, 7, 8] at n = 10: t2 hits, t7 and t8 miss; evictables s0 s1 s3 (LRU order).
    # Buckets (kernel_policy): s0 184 (5 picks, last step), s1 149, s3 150 (never picked).
    st, words = _fra_state()
    assert kp.fra_bucket([5, 0, 0], [9, 0, 0], [0, 1, 3], 10).tolist() == [184, 149, 150]
    out, plan = _run(st, [2, 7, 8], "fra", words)
    rows = st.slot_rows[0]
    # fra: victims s1, s3 (taken in LRU order: t7 -> s1, t8 -> s3); s0 stays.
    assert st.slot_tokens[0].tolist() == [0, 7, 2, 8, 9]
    assert out.tolist() == [[rows[2], rows[1], rows[3]]]
    assert st.lru[0].tolist() == [0, 1, 3, 2]  # remaining evictables | misses | hits
    assert plan.count.tolist() == [2] and plan.dst[0, :2].tolist() == [rows[1], rows[3]]
    assert words.tolist() == [[(9 << 8) | 5, (10 << 8) | 1, (10 << 8) | 2, (10 << 8) | 1]]
    # lru on the same state evicts the two oldest, s0 and s1, and keeps no words.
    st2, _ = _fra_state()
    _run(st2, [2, 7, 8], "lru", None)
    assert st2.slot_tokens[0].tolist() == [7, 8, 2, 3, 9] and st2.lru[0].tolist() == [3, 0, 1, 2]


def test_fra_hits_saturate_and_short_requests_keep_their_words():
    st, words = _fra_state()
    words[0, 2] = (9 << 8) | 255
    _run(st, [2, 9], "fra", words)  # t2 hits, t9 is the newest: no miss
    assert words[0, 2].item() == (10 << 8) | 255 and st.lru[0].tolist() == [0, 1, 3, 2]
    short = make_state(seq_lens=[3], B=4, item=32, max_ctx=16, seed=2)
    w = torch.zeros(1, 4, dtype=torch.int32)
    _run(short, [0, 2], "fra", w)
    assert w.tolist() == [[0, 0, 0, 0]]


def _slru_state(b1: int, b2: int):
    """B = 8, n = 20: slot s holds token s (LRU s0 oldest), t19 in slot B; levels 0 | 1 | 2 cut
    at LRU positions b1, b2."""
    B = 8
    st = make_state(seq_lens=[20], B=B, item=32, max_ctx=32, seed=3)
    st.slot_tokens[0] = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 19], dtype=torch.int32)
    st.lru[0] = torch.arange(B, dtype=torch.int16)
    return st, torch.tensor([[kp.slru_pack(b1, b2, B)]], dtype=torch.int32)


def test_slru_reference_permutes_by_level():
    # Levels: positions 0-3 (level 0), 4-5 (1), 6-7 (2). Selection [1, 4, 6, 10, 11]: hits t1
    # (level 0), t4 (1), t6 (2); misses t10, t11 take the oldest evictables s0, s2 (as lru).
    st, word = _slru_state(4, 6)
    out, plan = _run(st, [1, 4, 6, 10, 11], "slru", word)
    assert st.slot_tokens[0].tolist() == [10, 1, 11, 3, 4, 5, 6, 7, 19]
    # level-0 left [s3] | misses [s0 s2] | level-1 left [s5] | level-0 hits [s1] | level-2 left
    # [s7] | level-1/2 hits [s4 s6]
    assert st.lru[0].tolist() == [3, 0, 2, 5, 1, 7, 4, 6]
    # b1 = max(n0 3, m 2) = 3, b2 = max(m, n0 + n1 = 4) + h0 1 = 5; caps: level 2 <= 5 slots
    # (b2 stays 5), level 1 <= 1 slot (b1 = 4)
    assert kp.slru_unpack(int(word), 8) == (4, 5) and plan.count.tolist() == [2]
    # lru: same victims, the plain order
    st2, _ = _slru_state(4, 6)
    _run(st2, [1, 4, 6, 10, 11], "lru", None)
    assert st2.slot_tokens[0].tolist() == st.slot_tokens[0].tolist()
    assert st2.lru[0].tolist() == [3, 5, 7, 0, 2, 1, 4, 6]


def test_slru_zero_word_is_all_level_zero_and_short_requests_keep_it():
    assert kp.slru_unpack(0, 8) == (8, 8)
    st, word = _slru_state(8, 8)
    assert int(word) == 0
    _run(st, [1, 4, 10], "slru", word)  # all level 0: hits rise to level 1
    assert st.lru[0].tolist() == [2, 3, 5, 6, 7, 0, 1, 4]
    # the two hits would make level 1 [s1 s4]; its cap (1 slot) drops s1 back to level 0
    assert kp.slru_unpack(int(word), 8) == (7, 8)
    short = make_state(seq_lens=[5], B=8, item=32, max_ctx=16, seed=2)
    w = torch.zeros(1, 1, dtype=torch.int32)
    _run(short, [0, 2], "slru", w)
    assert int(w) == 0
    with pytest.raises(ValueError, match=r"policy 'slru': policy_state must be int32 \[1, 1\]"):
        _run(st, [1], "slru", torch.zeros(1, 8, dtype=torch.int32))

    st, words = _fra_state()
    with pytest.raises(ValueError, match="needs policy_state"):
        _run(st, [2], "fra", None)
    with pytest.raises(ValueError, match="keeps no per-slot state"):
        _run(st, [2], "lru", words)
    with pytest.raises(ValueError, match=r"policy_state must be int32 \[1, 4\]"):
        _run(st, [2], "fra", words.long())
    with pytest.raises(ValueError, match="unknown; choose one of"):
        _run(st, [2], "lfu", None)


def test_config_policy_key():
    # slru is the default, with and without speculative decoding
    assert HiSparseConfig.from_json(None).policy == "slru" == HiSparseConfig().policy
    assert HiSparseConfig.from_json("{}", num_draft_tokens=3).policy == "slru"
    cfg = HiSparseConfig.from_json('{"policy": "fra"}')
    assert cfg.policy == "fra" and '"policy": "fra"' in cfg.to_json()
    with pytest.raises(ValueError, match=r"'policy' = \"lfu\" is not a replacement policy; use one of 'lru', 'fra', 'slru'"):
        HiSparseConfig.from_json('{"policy": "lfu"}')
    with pytest.raises(ValueError, match=r"'policy' = 1 is not a replacement policy"):
        HiSparseConfig.from_json('{"policy": 1}')
    with pytest.raises(ValueError, match=r"'policy' = 'fra' with speculative decoding.*implements 'lru' and 'slru' only. Remove 'policy'"):
        HiSparseConfig.from_json('{"policy": "fra"}', num_draft_tokens=3)
    assert HiSparseConfig.from_json('{"policy": "lru"}', num_draft_tokens=3).policy == "lru"


def test_state_bytes_and_smem_count_the_word():
    base = dict(num_layers=78, buffer_size=4096, max_context=131072)
    assert slot_state_bytes(**base, policy="fra") - slot_state_bytes(**base) == 78 * 4096 * 4
    assert resolve_smem_bytes(2048, 4096, 131072, "fra") - resolve_smem_bytes(2048, 4096, 131072) == 9344


def test_slru_costs_one_word_per_request_and_layer():
    base = dict(num_layers=78, buffer_size=4096, max_context=131072)
    assert slot_state_bytes(**base, policy="slru") - slot_state_bytes(**base) == 78 * 4
    assert resolve_smem_bytes(2048, 4096, 131072, "slru") - resolve_smem_bytes(2048, 4096, 131072) == 128
    st = SlotState(num_layers=2, num_reqs=3, buffer_size=4, device="cpu", policy="slru")
    assert st.policy_state.shape == (2, 3, 1)
    st.policy_state.fill_(7)
    st.reset(1)
    assert st.policy_state[:, 1].eq(0).all() and st.policy_state[:, 0].eq(7).all()
    assert HiSparseConfig.from_json('{"policy": "slru"}').policy == "slru"


def test_slot_state_keeps_zeroed_words_for_fra_only():
    assert SlotState(num_layers=2, num_reqs=3, buffer_size=4, device="cpu").policy_state is None
    st = SlotState(num_layers=2, num_reqs=3, buffer_size=4, device="cpu", policy="fra")
    assert st.policy_state.shape == (2, 3, 4) and st.policy_state.dtype == torch.int32
    st.policy_state.fill_(7)
    st.reset(1)
    assert st.policy_state[:, 1].eq(0).all() and st.policy_state[:, 0].eq(7).all()
    st.install(2, torch.arange(5, dtype=torch.int32), 9, resident=True)
    assert st.policy_state[:, 2].eq(0).all()
    # SlotState and state_bytes agree (tests/unit/test_state_bytes.py checks the rest)
    assert st.policy_state.numel() * 4 == 3 * (slot_state_bytes(num_layers=2, buffer_size=4, max_context=0, policy="fra")
                                              - slot_state_bytes(num_layers=2, buffer_size=4, max_context=0))
    with pytest.raises(ValueError, match="verify kernel implements 'lru' and 'slru' only"):
        SlotState(num_layers=1, num_reqs=1, buffer_size=8, device="cpu", num_draft_tokens=2, policy="fra")
    spec = SlotState(num_layers=1, num_reqs=1, buffer_size=8, device="cpu", num_draft_tokens=2, policy="slru")
    assert spec.policy_state.shape == (1, 1, 1)


def test_planner_counts_fra_and_suggests_it():
    from sglang_hisparse import planner
    from sglang_hisparse.presets import load_preset

    model = load_preset("GLM-5.1")
    lru = planner.plan(planner.PlanInputs(model=model, kv_budget_gib=40, policy="lru"))
    fra = planner.plan(planner.PlanInputs(model=model, kv_budget_gib=40, policy="fra"))
    n = 128 * 1024
    extra = planner._state_bytes(fra.inputs, n) - planner._state_bytes(lru.inputs, n)
    assert extra == model.layers * lru.inputs.hot_slots * 4  # one int32 per slot and layer
    assert lru.suggested_config["policy"] == "lru" and fra.suggested_config["policy"] == "fra"
    assert HiSparseConfig.from_dict(lru.suggested_config).policy == "lru"
    assert HiSparseConfig.from_dict(fra.suggested_config).policy == "fra"  # a valid launch config


def test_planner_counts_slru_and_suggests_it():
    from sglang_hisparse import planner
    from sglang_hisparse.presets import load_preset

    model = load_preset("GLM-5.1")
    lru = planner.plan(planner.PlanInputs(model=model, kv_budget_gib=40, policy="lru"))
    slru = planner.plan(planner.PlanInputs(model=model, kv_budget_gib=40))  # the default
    n = 128 * 1024
    assert slru.inputs.policy == "slru"
    assert planner._state_bytes(slru.inputs, n) - planner._state_bytes(lru.inputs, n) == model.layers * 4
    # the default stays out of the emitted config, which a server then runs with slru
    assert "policy" not in slru.suggested_config
    assert HiSparseConfig.from_dict(slru.suggested_config).policy == "slru"


def test_startup_line_says_when_the_policy_is_the_default():
    pytest.importorskip("sglang")
    from sglang_hisparse.sglang_adapter.coordinator import _policy_note

    assert _policy_note("slru").startswith("slru (the default;")
    assert _policy_note("lru") == "lru" and _policy_note("fra") == "fra"
