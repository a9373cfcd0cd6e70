"""Exactness harness with speculative verify steps (EAGLE / MTP chains), on CPU.

Random lifecycles (staging and PD admission, short and long requests, aborts, retractions,
CUDA-graph-style padding) where every decode step is a verify round of W rows: prepare ->
per-layer 3-D ``swap_in`` -> commit with random accept lengths 0..n per request. Every verify
row's attention output is compared bit for bit with the all-resident model (each round's
draft KV salted, so stale or lost KV shows), and afterwards every allocator, pool and
window is empty. Well over 100 lifecycles with spec in total.
"""

from __future__ import annotations

import random

import pytest

import sglang_hisparse.coordinator.spec as spec_module
from hisparse_testing.engine import EngineSizes, Mismatch
from hisparse_testing.scenario import (
    ScenarioSpec,
    ScenarioStats,
    ci_seed,
    replay_note,
    run_scenario,
)
from hisparse_testing.spec_engine import SpecDecodeEngine
from hisparse_testing.toy_model import ToyModel

# (model, sizes, W): B >= W*k; index sharing so prefetch groups replay the verify plan
CONFIGS = {
    "L3-k4-B12-W3": (
        ToyModel(num_layers=3, top_k=4, item_bytes=32, shared=(False, True, False)),
        EngineSizes(num_reqs=6, buffer_size=12, device_rows=384, max_ctx=96), 3,
    ),
    "L4-k3-B8-W2": (
        ToyModel(num_layers=4, top_k=3, item_bytes=16, shared=(False, True, True, False)),
        EngineSizes(num_reqs=5, buffer_size=8, device_rows=320, max_ctx=80), 2,
    ),
    "L2-k4-B20-W4": (
        ToyModel(num_layers=2, top_k=4, item_bytes=48, shared=(False, True)),
        EngineSizes(num_reqs=6, buffer_size=20, device_rows=448, max_ctx=112), 4,
    ),
}
SEEDS = 10
BASE_SEED = ci_seed()
# W = 1 (one verify row) and pages > 1 (a rejected draft in the accepted token's page stays the
# request's; later pages are freed), each at a couple of seeds
EDGE = {
    "W1-p1": (ToyModel(num_layers=3, top_k=4, item_bytes=16, shared=(False, True, False)),
              EngineSizes(num_reqs=5, buffer_size=8, device_rows=320, max_ctx=80), 1),
    "W1-p4": (ToyModel(num_layers=3, top_k=4, item_bytes=16, shared=(False, True, False)),
              EngineSizes(num_reqs=5, buffer_size=8, device_rows=320, max_ctx=80, page_size=4), 1),
    "W2-p2": (ToyModel(num_layers=3, top_k=4, item_bytes=16, shared=(False, True, False)),
              EngineSizes(num_reqs=5, buffer_size=8, device_rows=384, max_ctx=80, page_size=2), 2),
    "W3-p8": (ToyModel(num_layers=2, top_k=4, item_bytes=16, shared=(False, True)),
              EngineSizes(num_reqs=5, buffer_size=12, device_rows=512, max_ctx=96, page_size=8), 3),
}


@pytest.fixture(scope="module", autouse=True)
def _report():
    print(f"\nspec harness base seed {BASE_SEED} (replay: HISPARSE_TEST_SEED={BASE_SEED})")
    yield
SPEC = ScenarioSpec(num_requests=6, p_abort_staging=0.08, p_abort=0.06, p_retract=0.08)


def _total(stats: list[ScenarioStats], name: str) -> int:
    return sum(getattr(s, name) for s in stats)


def _engine(config: str, seed: int, prefetch: bool) -> SpecDecodeEngine:
    model, sizes, W = CONFIGS[config]
    return SpecDecodeEngine(
        model, sizes, num_draft_tokens=W, prefetch=prefetch, skip_io=False, max_batch=8,
        decode_alloc_rows=seed % 2 == 1, accept_seed=seed,
    )


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_random_spec_lifecycles_are_exact_and_leak_free(config: str, prefetch: bool) -> None:
    _, sizes, _ = CONFIGS[config]
    spec = ScenarioSpec(**{**SPEC.__dict__, "max_prompt": sizes.max_ctx // 2, "max_new": sizes.buffer_size + 8})
    stats, accepted, rounds = [], 0, 0
    for seed in range(SEEDS):
        engine = _engine(config, seed, prefetch)
        assert engine.core.prefetch_enabled is prefetch
        try:
            stats.append(run_scenario(engine, random.Random(BASE_SEED + 7000 * seed + len(config)), spec))
        except AssertionError as e:
            e.add_note(replay_note(BASE_SEED, f"tests/unit/test_spec_harness.py::test_random_spec_lifecycles_are_exact_and_leak_free[{config}]"))
            raise
        accepted, rounds = accepted + engine.accepted, rounds + engine.verified
    # 3 configs x 2 modes x this >= 100 lifecycles in total
    assert _total(stats, "lifecycles") >= 34
    assert _total(stats, "checked_outputs") > 0 and rounds > 0
    assert _total(stats, "long_requests") > 0 and _total(stats, "directs") > 0
    assert _total(stats, "retracts") > 0 and _total(stats, "aborts") + _total(stats, "staging_aborts") > 0
    assert rounds < accepted < rounds * CONFIGS[config][2]  # partial acceptance happened


@pytest.mark.parametrize("config", sorted(EDGE))
def test_spec_edges_w1_and_paged(config: str) -> None:
    model, sizes, W = EDGE[config]
    spec = ScenarioSpec(**{**SPEC.__dict__, "max_prompt": sizes.max_ctx // 2, "max_new": sizes.buffer_size + 8})
    lifecycles = accepted = rounds = 0
    for seed in range(2):
        engine = SpecDecodeEngine(model, sizes, num_draft_tokens=W, prefetch=seed == 0, skip_io=False, max_batch=8,
                                  decode_alloc_rows=seed == 1, accept_seed=BASE_SEED + seed)
        try:
            stats = run_scenario(engine, random.Random(BASE_SEED + 300 * seed), spec)
        except AssertionError as e:
            e.add_note(replay_note(BASE_SEED, f"tests/unit/test_spec_harness.py::test_spec_edges_w1_and_paged[{config}]"))
            raise
        lifecycles += stats.lifecycles
        accepted, rounds = accepted + engine.accepted, rounds + engine.verified
        assert stats.checked_outputs > 0
    assert lifecycles >= 8 and rounds > 0
    if W == 1:
        assert accepted == rounds  # one row: every round commits exactly one token
    else:
        assert rounds < accepted < rounds * W


def test_harness_detects_a_lost_write_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepted tokens not written to host come back wrong once they are missed."""
    monkeypatch.setattr(spec_module.transfer, "to_host", lambda ctx, dev_rows, host_rows: None)
    with pytest.raises(Mismatch):
        for seed in range(SEEDS):
            run_scenario(_engine("L3-k4-B12-W3", seed, True), random.Random(seed), SPEC)


def test_w_too_large_for_the_buffer_is_named() -> None:
    model, sizes, _ = CONFIGS["L3-k4-B12-W3"]
    with pytest.raises(ValueError, match=r"'device_buffer_size' = 12 must be >= speculative_num_draft_tokens \* top_k = 4 \* 4 = 16.*at least 16"):
        SpecDecodeEngine(model, sizes, num_draft_tokens=4, skip_io=False)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_spec_lifecycles_are_exact_under_slru(config: str) -> None:
    # The verify kernel's slru: the union's victims are lru's, the new LRU keeps the levels;
    # outputs stay exact through every lifecycle with its word per request and layer.
    model, sizes, W = CONFIGS[config]
    spec = ScenarioSpec(**{**SPEC.__dict__, "max_prompt": sizes.max_ctx // 2, "max_new": sizes.buffer_size + 8})
    stats = []
    for seed in range(2):
        engine = SpecDecodeEngine(model, sizes, num_draft_tokens=W, prefetch=True, skip_io=False,
                                  max_batch=8, accept_seed=seed, policy="slru")
        assert engine.core.state.policy_state is not None
        try:
            stats.append(run_scenario(engine, random.Random(BASE_SEED + 9100 * seed + len(config)), spec))
        except AssertionError as e:
            e.add_note(replay_note(BASE_SEED, f"tests/unit/test_spec_harness.py::test_spec_lifecycles_are_exact_under_slru[{config}]"))
            raise
    assert _total(stats, "checked_outputs") > 0 and _total(stats, "long_requests") > 0
