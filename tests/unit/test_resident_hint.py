"""The resident hint: results never depend on it, an exact hint stays exact (reference and
coordinator), a wrong one heals, and bad hint tensors are rejected with a clear message."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from harness import next_selection, reference_result, scenario  # noqa: E402
from test_coordinator import B, L, Rig, _direct  # noqa: E402

from sglang_hisparse.kernels import ops  # noqa: E402
from sglang_hisparse.kernels.reference import position_bits, resident_hint  # noqa: E402


def _exact(st) -> torch.Tensor:
    return resident_hint(st.slot_tokens, st.lru.shape[1], st.resident.shape[1])


def _same_results(a, b) -> bool:
    (sa, oa, pa), (sb, ob, pb) = a, b
    return (torch.equal(oa, ob) and torch.equal(sa.slot_tokens, sb.slot_tokens)
            and torch.equal(sa.lru, sb.lru) and torch.equal(sa.device_cache, sb.device_cache)
            and torch.equal(pa.count, pb.count) and torch.equal(pa.src, pb.src)
            and torch.equal(pa.dst, pb.dst))


@pytest.mark.parametrize("k,B_,bs", [(8, 16, 5), (64, 128, 9)])
def test_results_do_not_depend_on_the_hint_and_an_exact_one_stays_exact(k, B_, bs) -> None:
    base = reference_result(scenario(k, B_, 32, bs, seed=5))
    for kind in ("exact", "noise", "empty"):
        sc = scenario(k, B_, 32, bs, seed=5, hint=kind)
        got = reference_result(sc)
        assert _same_results(base, got), kind
        if kind == "exact":
            assert torch.equal(got[0].resident, _exact(got[0]))
            sc2 = next_selection(sc, got[0], seed=6)
            st2 = reference_result(sc2)[0]
            assert torch.equal(st2.resident, _exact(st2))


def test_a_wrong_hint_is_put_right_where_tokens_leave_or_enter_the_slots() -> None:
    sc = scenario(64, 128, 32, 9, seed=2, hint="noise")
    before = sc.state.slot_tokens.clone()
    st, _, _ = reference_result(sc)
    words = st.resident.shape[1]
    for b, r in enumerate(sc.req_index.tolist()[: sc.num_real]):
        if int(sc.seq_lens[b]) <= 128:
            assert torch.equal(st.resident[r], sc.state.resident[r])  # short rows: untouched
            continue
        old, new = set(before[r, :128].tolist()), set(st.slot_tokens[r, :128].tolist())
        entered = position_bits(torch.tensor(sorted(new - old)), words)
        left = position_bits(torch.tensor(sorted(old - new - {-1})), words)
        assert torch.equal(st.resident[r] & entered, entered)
        assert int((st.resident[r] & left).abs().sum()) == 0


def test_bad_hint_tensors_are_rejected_with_what_to_fix() -> None:
    sc = scenario(8, 16, 32, 3, seed=1, hint="exact")
    st = sc.state
    kw = dict(top_k=sc.top_k, req_index=sc.req_index, seq_lens=sc.seq_lens,
              num_real_reqs=torch.tensor([sc.num_real], dtype=torch.int32),
              slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru,
              host_rows=st.host_rows, host_cache=st.host_cache, device_cache=st.device_cache,
              out_rows=torch.empty(3, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"resident.shape .*one bit per host_rows column"):
        ops.resolve(**kw, resident=st.resident[:, :-1].contiguous())
    with pytest.raises(ValueError, match="resident has dtype torch.int64"):
        ops.resolve(**kw, resident=st.resident.long())
    with pytest.raises(ValueError, match="early_rows = -1 must be >= 0"):
        ops.resolve(**kw, resident=st.resident, early_rows=-1)


def _assert_hint_exact(rig: Rig) -> None:
    st = rig.core.state
    for layer in range(L):
        want = resident_hint(st.slot_tokens[layer], B, st.resident.shape[2])
        assert torch.equal(st.resident[layer], want), f"layer {layer}"


def test_the_coordinator_keeps_the_hint_exact_through_a_request_lifetime() -> None:
    rig = Rig(shared=None, prefetch=False)
    assert rig.core.state.resident is not None and rig.core.state.resident.shape[2] == 1
    rig.prefill(0, 9)
    rig.prefill(1, 2)
    rig.core.collect_ready()
    _assert_hint_exact(rig)
    _direct(rig, 2, 12)  # long, slots start empty
    _direct(rig, 3, 3)  # short, preloaded
    _assert_hint_exact(rig)
    picks = {0: [[9, 1], [6, 7]], 1: [[2, 0], [1, 2]], 2: [[12, 4], [5, 11]], 3: [[3, 1], [2, 0]]}
    for step in range(4):
        rig.step([0, 1, 2, 3])  # request 1 and 3 grow through their short slots past B
        _assert_hint_exact(rig)
        for layer in range(L):
            top = [[min(p + step, len(rig.ids[r]) - 1) for p in picks[r][layer]] for r in range(4)]
            rig.swap([0, 1, 2, 3], top, layer)
            _assert_hint_exact(rig)
    rig.release(2)
    _assert_hint_exact(rig)
    assert int(rig.core.state.resident[:, 2].abs().sum()) == 0
    for r in (0, 1, 3):
        rig.release(r)
    rig.assert_empty()
