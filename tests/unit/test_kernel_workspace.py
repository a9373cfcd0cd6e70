"""Arrival counters shared by the multi-CTA resolve and verify ops."""

import torch

from sglang_hisparse.kernels.workspace import MIN_ROWS, ArrivalCounters


def test_reserve_then_grow_keeps_zeros():
    w = ArrivalCounters("resolve", "reserve_workspace")
    w.reserve("cpu", 10)
    first = w.get(torch.device("cpu"), 10)
    assert first.numel() == MIN_ROWS and first.dtype == torch.int32 and not first.any()
    assert w.get(torch.device("cpu"), MIN_ROWS) is first  # no reallocation within capacity
    bigger = w.get(torch.device("cpu"), MIN_ROWS + 1)
    assert bigger.numel() == MIN_ROWS + 1 and not bigger.any()


def test_unindexed_cuda_name_is_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert ArrivalCounters._key("cuda") == torch.device("cuda", 3)
    assert ArrivalCounters._key("cuda:1") == torch.device("cuda", 1)
