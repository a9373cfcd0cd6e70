"""The IO-hiding switches of HiSparseCore are exact: sliced anchors, replay CTAs and stream
priority change when the bytes move, never which rows a step reads or what they hold.

Driven through the end-to-end benchmark's batched engine (benchmarks/e2e_engine.py) on CPU
at tiny sizes, calibrated selections (~20 % misses at B = 2k), every sampled output compared
with the oracle bytes and with the unswitched engine's, plus the slice bookkeeping itself.
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


@pytest.mark.parametrize("options", [dict(anchor_slices=2), dict(anchor_slices=3), dict(anchor_slices=8),
                                     dict(replay_ctas=16), dict(prefetch_priority=-1)],
                         ids=lambda o: next(iter(o)) + str(next(iter(o.values()))))
def test_switch_is_exact(engine, options):
    storage = torch.zeros(6, 64 * PAGE * 4, ITEM, dtype=torch.uint8)
    base_log, base_misses = _run(engine, {}, storage)
    log, misses = _run(engine, options, storage)
    assert not base_log.mismatches and not log.mismatches  # both equal the oracle bytes
    assert base_misses > 0 and misses == base_misses
    assert set(log.outputs) == set(base_log.outputs) and log.compared == base_log.compared > 0
    for key, (top_k, out) in base_log.outputs.items():
        assert torch.equal(log.outputs[key][0], top_k) and torch.equal(log.outputs[key][1], out)


def test_slices_cover_the_batch_and_count_real_rows(engine):
    """5 rows in 3 slices [0,1) [1,3) [3,5); with 4 real rows the last slice has 1."""
    from sglang_hisparse.coordinator.resolver import Resolver

    seen: list[tuple[int, int]] = []

    class Probe(Resolver):
        def __init__(self) -> None:  # only what _resolve_sliced reads
            from sglang_hisparse.coordinator.streams import Streams

            self.ctx = type("Ctx", (), {"streams": Streams(torch.device("cpu")), "device": torch.device("cpu")})()
            self.anchor_slices = 3
            self.num_real_reqs = torch.tensor([4], dtype=torch.int32)
            self._slice_real = torch.zeros(3, dtype=torch.int32)
            self.slice_events = [self.ctx.streams.new_event() for _ in range(3)]
            self._slice_bounds = {}

    probe, reals = Probe(), []
    probe._resolve_sliced(5, 3, lambda a, b, nr: reals.append(int(nr)), lambda a, b: seen.append((a, b)))
    assert seen == [(0, 1), (1, 3), (3, 5)] and reals == [1, 2, 1]
    with pytest.raises(ValueError, match="anchor_slices"):
        Resolver.__init__(Probe(), Probe().ctx, num_real_reqs=torch.zeros(1), max_batch=1,
                          shared_index_layers=None, anchor_slices=0)
