"""The end-to-end benchmark's one remaining A/B change against prefetch, the server's slru
policy over the core's lru, is exact: it changes which rows miss, never which rows a step
reads or what they hold. (The IO-hiding switches this file used to check, sliced anchors,
replay CTAs and a high-priority prefetch stream, were measured no faster under graphs and
deleted: benchmarks/E2E.md "Results".)

Driven through the end-to-end benchmark's batched engine (benchmarks/e2e_engine.py) on CPU
at tiny sizes, calibrated selections (~20 % misses at B = 2k), every sampled output compared
with the oracle bytes and with the lru engine's selections.
"""

from __future__ import annotations

import pytest
import torch

K, B, ITEM, PAGE, N0, BS, STEPS = 8, 16, 64, 8, 160, 5, 6


@pytest.fixture(scope="module")
def engine(import_benchmark):
    return import_benchmark("e2e_engine")


def _run(engine, options: dict, storage: torch.Tensor) -> tuple:
    from e2e_model import BenchModel, ComputeStandIn
    from e2e_points import shared_pattern
    from e2e_selection import SelectionSpec, SelectionTable

    from hisparse_testing.toy_model import ToyModel

    toy = ToyModel(num_layers=6, top_k=K, item_bytes=ITEM, shared=shared_pattern(6, "glm", 4))
    model = BenchModel(toy)
    dev = torch.device("cpu")
    compute = ComputeStandIn(model, max_batch=BS, device=dev)
    table = SelectionTable(SelectionSpec(), seeds=torch.arange(1000, 1000 + BS), n0=N0, k=K,
                           anchors=model.anchors, steps=STEPS + 1)
    runner = engine.HiSparseRunner(model, compute, bs=BS, n=N0, cap=N0 + STEPS + 2, buffer_size=B,
                                   page=PAGE, storage=storage, prefetch=True, skip_io=False, device=dev,
                                   selections=table, core_options=options)
    runner.admit(fill_host=True)
    log = engine.CheckLog()
    for _ in range(STEPS):
        runner.step(check=list(range(BS)), log=log)
    runner.allocator.check_integrity()
    misses = runner.core.telemetry.snapshot().misses
    runner.destroy()
    return log, misses


def test_the_policy_change_is_exact(engine):
    storage = torch.zeros(6, 64 * PAGE * 4, ITEM, dtype=torch.uint8)
    base_log, base_misses = _run(engine, {}, storage)
    log, misses = _run(engine, engine_options(), storage)
    assert not base_log.mismatches and not log.mismatches  # both equal the oracle bytes
    assert base_misses > 0 and misses > 0
    assert set(log.outputs) == set(base_log.outputs) and log.compared == base_log.compared > 0
    for key, (top_k, _) in base_log.outputs.items():
        assert torch.equal(log.outputs[key][0], top_k)  # the same selections, read from other slots


def engine_options() -> dict:
    from e2e_points import IO_HIDING

    assert set(IO_HIDING) == {"slru"}
    return dict(IO_HIDING["slru"])
