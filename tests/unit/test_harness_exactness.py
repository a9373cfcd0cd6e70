"""Exactness harness: random lifecycles through the coordinator give bit-identical attention.

Each scenario runs requests through staging or PD direct admission, decode steps (padded
like CUDA-graph batches), aborts (while staging and while decoding), retractions and
finishes; every step's attention output is compared bit for bit with the all-resident
model, and afterwards every allocator/pool must be empty and consistent. In total the
configurations below run well over 200 request lifecycles.
"""

from __future__ import annotations

import random

import pytest

import sglang_hisparse.coordinator.step as step_module
from sglang_hisparse.testing.engine import DecodeEngine, EngineSizes, Mismatch, ToyRequest
from sglang_hisparse.testing.scenario import ScenarioSpec, ScenarioStats, run_scenario
from sglang_hisparse.testing.toy_model import ToyModel

# (model, sizes): small B/k/I, 3-4 layers with index sharing, page sizes 1 and 4
CONFIGS = {
    "L4-k4-B8-I32-p1": (
        ToyModel(num_layers=4, top_k=4, item_bytes=32, shared=(False, True, True, False)),
        EngineSizes(num_reqs=6, buffer_size=8, device_rows=256, max_ctx=64, page_size=1),
    ),
    "L3-k8-B16-I64-p4": (
        ToyModel(num_layers=3, top_k=8, item_bytes=64, shared=(False, True, False)),
        EngineSizes(num_reqs=5, buffer_size=16, device_rows=320, max_ctx=96, page_size=4),
    ),
    "L4-k6-B12-I48-p2": (
        ToyModel(num_layers=4, top_k=6, item_bytes=48, shared=(False, False, True, True)),
        EngineSizes(num_reqs=6, buffer_size=12, device_rows=256, max_ctx=80, page_size=2),
    ),
}
SEEDS = 6


def _total(stats: list[ScenarioStats], name: str) -> int:
    return sum(getattr(s, name) for s in stats)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_random_lifecycles_are_exact_and_leak_free(config: str, prefetch: bool) -> None:
    model, sizes = CONFIGS[config]
    spec = ScenarioSpec(max_prompt=sizes.max_ctx // 2, max_new=sizes.buffer_size + 4)
    stats = []
    for seed in range(SEEDS):
        engine = DecodeEngine(
            model, sizes, prefetch=prefetch, skip_io=False, max_batch=8, decode_alloc_rows=seed % 2 == 1
        )
        assert engine.core.prefetch_enabled is prefetch
        stats.append(run_scenario(engine, random.Random(1000 * seed + len(config)), spec))
    # 3 configs x 2 modes x this >= 200 lifecycles in total
    assert _total(stats, "lifecycles") >= 34
    assert _total(stats, "checked_outputs") > 0
    assert _total(stats, "long_requests") > 0
    assert _total(stats, "directs") > 0
    assert _total(stats, "retracts") + _total(stats, "aborts") > 0


def test_every_path_is_exercised() -> None:
    """One busier scenario that is guaranteed to hit staging aborts, aborts and retracts."""
    model, sizes = CONFIGS["L4-k4-B8-I32-p1"]
    spec = ScenarioSpec(num_requests=24, p_abort_staging=0.3, p_abort=0.15, p_retract=0.2, max_new=20)
    engine = DecodeEngine(model, sizes, prefetch=True, skip_io=False)
    stats = run_scenario(engine, random.Random(7), spec)
    assert stats.staging_aborts and stats.aborts and stats.retracts and stats.directs
    snap = engine.core.telemetry.snapshot()
    assert snap.misses > 0 and 0.0 < snap.hit_rate < 1.0
    assert snap.backup_tokens > 0 and snap.staged_requests > 0


def _long_run(engine: DecodeEngine, steps: int = 12) -> None:
    engine.prefill(ToyRequest(rid=0, seed=5, prompt_len=30, max_new=steps))
    engine.admit_direct(ToyRequest(rid=1, seed=6, prompt_len=25, max_new=steps, direct=True))
    engine.collect()
    for _ in range(steps):
        engine.step()


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
def test_harness_detects_a_missing_backup(monkeypatch: pytest.MonkeyPatch, prefetch: bool) -> None:
    """The oracle is sensitive: dropping the write-through backup corrupts later misses."""
    monkeypatch.setattr(step_module.StepMapper, "_backup", lambda self, rs, slots, pos: None)
    model, sizes = CONFIGS["L4-k4-B8-I32-p1"]
    with pytest.raises(Mismatch):
        _long_run(DecodeEngine(model, sizes, prefetch=prefetch, skip_io=False))


def test_skip_io_outputs_are_invalid_but_bookkeeping_is_not() -> None:
    """SKIP_IO copies no miss bytes: the oracle must notice; counters still count misses."""
    model, sizes = CONFIGS["L4-k4-B8-I32-p1"]
    engine = DecodeEngine(model, sizes, prefetch=True, skip_io=True)
    with pytest.raises(Mismatch):
        _long_run(engine)
    assert engine.core.telemetry.snapshot().misses > 0
