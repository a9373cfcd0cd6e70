"""Telemetry: device counters without syncs until reported, and the periodic log line."""

from __future__ import annotations

import logging

import torch

from sglang_hisparse.telemetry import Telemetry, TelemetrySnapshot, format_line


def test_resolve_counts_real_rows_only_and_bytes_include_replays() -> None:
    tel = Telemetry(torch.device("cpu"))
    top_k = torch.tensor([[3, 5, -1], [1, 2, 4]], dtype=torch.int32)
    miss = torch.tensor([1, 3], dtype=torch.int32)
    real = torch.tensor([True, False])  # row 1 is CUDA-graph padding
    tel.add_resolve(top_k=top_k, miss_count=miss, real_mask=real, item_bytes=656, copies=3)
    tel.add_step()
    tel.add_backup(2, 2 * 656 * 4)
    tel.add_staging(100)
    tel.add_direct(7, 7 * 656 * 4)
    snap = tel.snapshot()
    assert (snap.selected, snap.misses) == (2, 1)
    assert snap.h2d_bytes == 656 * 3 + 7 * 656 * 4
    assert snap.hit_rate == 0.5 and snap.misses_per_step == 1.0
    assert (snap.backup_tokens, snap.staged_requests, snap.staged_tokens) == (2, 1, 100)
    assert snap.as_dict()["hit_rate"] == 0.5


def test_log_line_reports_the_interval_then_the_totals() -> None:
    prev = TelemetrySnapshot(10, 1000, 100, 10**9, 5, 0, 1, 50, 0, 0)
    now = TelemetrySnapshot(20, 3000, 200, 3 * 10**9, 15, 0, 3, 150, 1, 4)
    line = format_line(now, prev, elapsed_s=2.0)
    assert line.startswith("HiSparse: hit rate 95.00%, 10.0 misses/step, 2.000 GB host->device (1.00 GB/s)")
    assert "staged 2 reqs, backed up 10 tokens" in line
    assert "totals: hit rate 93.33%, 3.000 GB moved, 3 staged, 1 direct" in line


def test_maybe_log_respects_the_interval(caplog) -> None:
    tel = Telemetry(torch.device("cpu"), log_interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="sglang_hisparse"):
        tel.maybe_log()  # interval 0 = off
        assert not caplog.records
        tel.log_interval_s = 1e-9
        tel.add_step()
        tel.maybe_log()
    assert "HiSparse: hit rate" in caplog.text
