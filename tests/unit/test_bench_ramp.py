"""The end-to-end benchmark's ramp (benchmarks/e2e_ramp.py) on CPU at tiny sizes: requests
join at the current length and leave newest first, every checked output equals the oracle,
the allocator is whole after the ramp, and full KV runs only the levels it holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

K, B, ITEM, PAGE, N0 = 8, 16, 64, 8, 160


@pytest.fixture(scope="module")
def ramp(import_benchmark):
    return import_benchmark("e2e_ramp")


def test_levels_rise_and_fall(ramp):
    assert ramp.ramp_levels(1) == [1]
    assert ramp.ramp_levels(5) == [1, 2, 4, 5, 4, 2, 1]
    assert ramp.ramp_levels(8) == [1, 2, 4, 8, 4, 2, 1]


def test_ramp_is_exact_and_leaves_nothing_behind(ramp):
    from e2e_engine import FullKVRunner, HiSparseRunner
    from e2e_model import BenchModel, ComputeStandIn
    from e2e_points import shared_pattern
    from e2e_selection import SelectionSpec, SelectionTable

    from hisparse_testing.toy_model import ToyModel

    toy = ToyModel(num_layers=5, top_k=K, item_bytes=ITEM, shared=shared_pattern(5, "glm", 4))
    model, dev = BenchModel(toy), torch.device("cpu")
    compute = ComputeStandIn(model, max_batch=4, device=dev)
    args = SimpleNamespace(warmup=1, ramp_steps=1)  # not an SGLang object: the benchmark's parsed CLI flags
    levels = ramp.ramp_levels(4)
    cap = N0 + ramp.ramp_total_steps(args, 4) + 2
    table = SelectionTable(SelectionSpec(), seeds=torch.arange(1000, 1004), n0=N0, k=K,
                           anchors=model.anchors, steps=cap - N0)
    storage = torch.zeros(5, 128 * PAGE, ITEM, dtype=torch.uint8)
    hs = HiSparseRunner(model, compute, bs=4, n=N0, cap=cap, buffer_size=B, page=PAGE, storage=storage,
                        prefetch=True, skip_io=False, device=dev, selections=table)
    hs.start_empty()
    rec = ramp.run_ramp_mode(hs, levels, args, dev)
    assert [s["c"] for s in rec["steps"]] == levels and rec["exact_vs_oracle"] and rec["checked_outputs"] > 0
    hs.set_concurrency(0)  # everyone leaves: every row and id is back
    hs.allocator.check_integrity()
    assert hs.allocator.available_size() == hs.allocator.size_device
    hs.destroy()
    full = FullKVRunner(model, compute, bs=2, n=N0, cap=cap, device=dev, selections=table)
    full.admit()
    rec = ramp.run_ramp_mode(full, levels, args, dev)
    assert [s["c"] for s in rec["steps"]] == [1, 2, 2, 1] and rec["exact_vs_oracle"]
