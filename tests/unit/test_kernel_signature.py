"""The kernels' launch signatures (kernels/signature.py): the wrapper text they generate is the
text the kernels were built from (the same build hash), and a launch's named arguments land in
the launcher's order, absent optional ones filled, wrong names refused."""

from __future__ import annotations

import pytest

from sglang_hisparse.kernels import _jit
from sglang_hisparse.kernels.signature import REPLAY, RESOLVE, RESOLVE_POLICY, VERIFY

# The wrappers' text as the launchers in jit_kernels/*.cuh take it (written out once more here
# on purpose: a change to a signature must change this test and the launcher together).
_RESOLVE_ARGS = (
    "TensorView top_k, TensorView req_index, TensorView seq_lens, TensorView num_real, "
    "TensorView slot_tokens, TensorView slot_rows, TensorView lru, TensorView host_rows, "
    "TensorView host_cache, TensorView device_cache, TensorView out_rows, TensorView plan_src, "
    "TensorView plan_dst, TensorView plan_count, TensorView arrivals, TensorView resident, "
    "TensorView rr_flag, TensorView rr_pages, TensorView rr_ring, int64_t rr_page, "
    "int64_t ctas, int64_t block, int64_t write_plan, int64_t copy, int64_t stage_rows"
)
_RESOLVE_CALL = (
    "top_k, req_index, seq_lens, num_real, slot_tokens, slot_rows, lru, host_rows, host_cache, "
    "device_cache, out_rows, plan_src, plan_dst, plan_count, arrivals, resident, rr_flag, "
    "rr_pages, rr_ring, rr_page, ctas, block, write_plan, copy, stage_rows"
)
_VERIFY_ARGS = (
    "TensorView top_k, TensorView req_index, TensorView seq_lens, TensorView num_real, "
    "TensorView slot_tokens, TensorView slot_rows, TensorView lru, TensorView host_rows, "
    "TensorView host_cache, TensorView device_cache, TensorView out_rows, TensorView plan_src, "
    "TensorView plan_dst, TensorView plan_count, TensorView arrivals, int64_t ctas, "
    "int64_t block, int64_t write_plan, int64_t copy, TensorView policy_state"
)
_VERIFY_CALL = (
    "top_k, req_index, seq_lens, num_real, slot_tokens, slot_rows, lru, host_rows, host_cache, "
    "device_cache, out_rows, plan_src, plan_dst, plan_count, arrivals, ctas, block, write_plan, copy, "
    "policy_state"
)
_REPLAY_ARGS = (
    "TensorView plan_src, TensorView plan_dst, TensorView plan_count, TensorView num_real, "
    "TensorView host_cache, TensorView device_cache, int64_t ctas, int64_t block"
)
_REPLAY_CALL = "plan_src, plan_dst, plan_count, num_real, host_cache, device_cache, ctas, block"


def test_generated_wrapper_text_is_the_launchers():
    assert (RESOLVE.args, RESOLVE.call) == (_RESOLVE_ARGS, _RESOLVE_CALL)
    assert (VERIFY.args, VERIFY.call) == (_VERIFY_ARGS, _VERIFY_CALL)
    assert (REPLAY.args, REPLAY.call) == (_REPLAY_ARGS, _REPLAY_CALL)
    assert RESOLVE_POLICY.args == _RESOLVE_ARGS + ", TensorView policy_state"
    assert RESOLVE_POLICY.call == _RESOLVE_CALL + ", &policy_state"  # the launcher takes a pointer
    assert (_jit._RESOLVE_ARGS, _jit._VERIFY_CALL) == (_RESOLVE_ARGS, _VERIFY_CALL)


def _named(sig, **over):
    return {n: f"<{n}>" for n in sig.names} | over


def test_pack_orders_named_arguments_and_fills_the_absent_ones():
    values = _named(RESOLVE)
    for n in ("resident", "rr_flag", "rr_pages", "rr_ring", "rr_page"):
        del values[n]
    out = RESOLVE.pack(sentinel="<sentinel>", **values)
    assert len(out) == len(RESOLVE.params) == 25
    got = dict(zip(RESOLVE.names, out, strict=True))
    assert got["top_k"] == "<top_k>" and got["stage_rows"] == "<stage_rows>"
    assert [got[n] for n in ("resident", "rr_flag", "rr_pages", "rr_ring")] == ["<sentinel>"] * 4
    assert got["rr_page"] == 0  # no resident selection record
    # explicit None is absent too (a launch passes resident=None without a hint)
    assert RESOLVE.pack(sentinel="s", **_named(RESOLVE, resident=None))[RESOLVE.names.index("resident")] == "s"


def test_pack_refuses_a_missing_or_unknown_argument():
    with pytest.raises(TypeError, match="'ctas' is required"):
        RESOLVE.pack(sentinel="s", **{k: v for k, v in _named(RESOLVE).items() if k != "ctas"})
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['ctaz'\]"):
        REPLAY.pack(**_named(REPLAY), ctaz=8)
    with pytest.raises(TypeError, match="no sentinel"):
        VERIFY.pack(**_named(VERIFY, policy_state=None))
    with pytest.raises(TypeError, match="'policy_state' is required"):  # a policy build needs its state
        RESOLVE_POLICY.pack(sentinel="s", **_named(RESOLVE_POLICY, policy_state=None))
