"""No host sync per decode step: the CPU guard (``hisparse_testing.sync_guard``) and the harness
under it.

SGLang's page_size-1 decode takes its ids with ``alloc(bs)``, which also maps fresh device
rows; ``rebind`` hands them back and needs the ids on the CPU. The allocator keeps the copy
(``cpu_ids_of``), so the coordinator's per-step calls read nothing from the device. The GPU
form of the same check (``torch.cuda.set_sync_debug_mode("error")``) is
tests/unit/test_harness_cuda.py::test_per_step_calls_do_not_sync_on_cuda.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse_testing.engine import DecodeEngine, EngineSizes
from hisparse_testing.scenario import ScenarioSpec, run_scenario
from hisparse_testing.sync_guard import DeviceReadError, device_side, forbid_device_reads
from hisparse_testing.toy_model import ToyModel
from sglang_hisparse.memory.allocator import DualSpaceAllocator

MODEL = ToyModel(num_layers=3, top_k=4, item_bytes=32, shared=(False, True, False))


def test_marked_tensors_raise_on_reads_only_inside_the_guard() -> None:
    x = device_side(torch.tensor([3, 1, 2]))
    y = (x + 1)[torch.tensor([0, 2])]  # derived on the "device": still marked
    assert y.tolist() == [4, 3]  # outside the guard: a plain tensor
    with forbid_device_reads():
        z = torch.where(y > 3, y, torch.zeros_like(y))  # device-side math is fine
        for read in (lambda: y.cpu(), lambda: y.tolist(), lambda: int(y[0]), lambda: bool(y[0]),
                     lambda: y[0].item(), lambda: torch.equal(y, z), lambda: y.nonzero(),
                     lambda: torch.unique(y), lambda: y[y > 3]):
            with pytest.raises(DeviceReadError, match="device-side tensor"):
                read()
        assert torch.tensor([1, 2]).tolist() == [1, 2]  # host-side tensors read as usual


def test_cpu_ids_of_is_the_latest_alloc_only() -> None:
    a = DualSpaceAllocator(16, host_to_device_ratio=2)
    first = a.alloc(2)
    assert a.cpu_ids_of(first) is a.last_alloc_cpu and a.cpu_ids_of(device_side(first)) is a.last_alloc_cpu
    assert a.cpu_ids_of(first.clone()) is None and a.cpu_ids_of(first[:1]) is None
    second = a.alloc(1)
    assert a.cpu_ids_of(first) is None and a.cpu_ids_of(second).tolist() == second.tolist()
    assert a.cpu_ids_of(a.alloc_decode(torch.tensor([9]), torch.tensor([4]))) is None
    a.clear()
    assert a.cpu_ids_of(second) is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_harness_decode_steps_read_nothing_back(page_size: int) -> None:
    """Random lifecycles (staging, PD admission, long and short requests, aborts, retracts)
    with the per-step calls guarded: page 1 takes decode ids with alloc(bs), page 4 with
    alloc_decode. Before the allocator kept alloc's CPU copy for the caller, rebind read the
    ids back (``logical_ids.cpu()``) on every page-1 step."""
    sizes = EngineSizes(num_reqs=5, buffer_size=8, device_rows=256, max_ctx=64, page_size=page_size)
    engine = DecodeEngine(MODEL, sizes, skip_io=False, max_batch=8, decode_alloc_rows=True,
                          guard_device_reads=True)
    try:  # close: with CUDA present the host pool is pinned, and a freed pinned range stays registered
        stats = run_scenario(engine, random.Random(3), ScenarioSpec(num_requests=10, max_prompt=30, max_new=14))
    finally:
        engine.close()
    assert stats.checked_outputs > 0 and stats.long_requests > 0


def test_the_guard_catches_rebind_reading_ids_back() -> None:
    """Ids whose CPU copy the caller does not pass (here: a copy of alloc's result, as the
    adapter passed none before) make rebind read them back, which the guard reports."""
    sizes = EngineSizes(num_reqs=2, buffer_size=8, device_rows=64, max_ctx=32, page_size=1)
    engine = DecodeEngine(MODEL, sizes, decode_alloc_rows=True, guard_device_reads=True)
    a = engine.allocator
    ids = a.alloc(1).clone()
    try:
        with pytest.raises(DeviceReadError, match="cpu"), forbid_device_reads():
            a.rebind(device_side(ids), device_side(torch.tensor([5])), logical_ids_cpu=a.cpu_ids_of(ids))
    finally:
        engine.close()
