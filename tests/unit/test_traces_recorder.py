"""LiveTraceRecorder on CPU tensors: per-request sampling, slot reuse, auto mode, env."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_hisparse.traces.format import load_trace
from sglang_hisparse.traces.recorder import LiveTraceRecorder


def _drive(rec, steps, slots, start, k=4, layers=(0, 1), explicit=True):
    """Decode ``steps`` steps of requests in ``slots`` starting at lengths ``start``."""
    for t in range(steps):
        lens = [s + t for s in start]
        if explicit:
            rec.begin_step(slots, lens)
        ri = torch.tensor(slots, dtype=torch.int32)
        sl = torch.tensor(lens, dtype=torch.int64)
        tk = torch.stack([torch.arange(k, dtype=torch.int32) + (n - k) for n in lens])
        tk[:, -1] = -1  # padding entry
        for layer in layers:
            rec.record(layer_id=layer, req_index=ri, seq_lens=sl, top_k=tk)


def test_records_every_step_of_sampled_requests(tmp_path):
    rec = LiveTraceRecorder(str(tmp_path), sample=1.0)
    _drive(rec, 5, [3, 7], [10, 20])
    rec.close()
    tr = load_trace(rec.path)
    sts = list(tr.streams())
    assert [(s.stream, s.layer, s.seq_lens.tolist()) for s in sts] == [
        (0, 0, [10, 11, 12, 13, 14]), (0, 1, [10, 11, 12, 13, 14]),
        (1, 0, [20, 21, 22, 23, 24]), (1, 1, [20, 21, 22, 23, 24]),
    ]
    assert sts[2].selection(0).tolist() == [16, 17, 18]  # -1 padding dropped
    assert tr.header["source"]["recorder"] == "live" and tr.header["top_k"] == 3


def test_slot_reuse_starts_a_new_stream_and_cap_applies(tmp_path):
    rec = LiveTraceRecorder(str(tmp_path), sample=1.0, max_rows=1)
    _drive(rec, 3, [0, 1], [10, 30])   # only one request recorded at a time
    rec.release(0)
    _drive(rec, 2, [0], [5])           # slot 0 reused: a new request (new stream)
    rec.close()
    keys = sorted({(s.stream, int(s.seq_lens[0])) for s in load_trace(rec.path).streams()})
    assert keys == [(0, 10), (1, 5)]


def test_sample_zero_records_nothing_and_auto_mode(tmp_path):
    rec = LiveTraceRecorder(str(tmp_path / "a"), sample=0.0)
    _drive(rec, 3, [0], [10])
    rec.close()
    assert load_trace(rec.path).num_rows == 0
    auto = LiveTraceRecorder(str(tmp_path / "b"), sample=1.0)
    _drive(auto, 3, [2, 5], [10, 40], explicit=False)  # no begin_step: batch read back
    auto.close()
    assert load_trace(auto.path).num_rows == 12


def test_from_env(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_HISPARSE_RECORD_TRACE", raising=False)
    assert LiveTraceRecorder.from_env() is None
    monkeypatch.setenv("SGLANG_HISPARSE_RECORD_TRACE", str(tmp_path))
    monkeypatch.setenv("SGLANG_HISPARSE_RECORD_SAMPLE", "0.5")
    rec = LiveTraceRecorder.from_env()
    assert rec is not None and rec.sample == 0.5 and rec.path.startswith(str(tmp_path))
    rec.close()
    with pytest.raises(ValueError, match="RECORD_SAMPLE=2.0"):
        LiveTraceRecorder(str(tmp_path), sample=2.0)


def test_from_env_next_best(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_HISPARSE_RECORD_TRACE", str(tmp_path))
    monkeypatch.setenv("SGLANG_HISPARSE_RECORD_SAMPLE", "1")
    monkeypatch.delenv("SGLANG_HISPARSE_RECORD_NEXT_BEST", raising=False)
    plain = LiveTraceRecorder.from_env(ranked=True)  # unset: no ranks even for a caller that has them
    assert plain is not None and plain.next_best == 0
    plain.close()
    assert load_trace(plain.path).header["version"] == 1

    monkeypatch.setenv("SGLANG_HISPARSE_RECORD_NEXT_BEST", "2")
    rec = LiveTraceRecorder.from_env(ranked=True)  # a caller passing the ordered top-(k + m)
    assert rec is not None and rec.next_best == 2
    ri, sl = torch.tensor([0], dtype=torch.int32), torch.tensor([10])
    # ordered top-(k + m) of a 10-token context, k = 3: selection 9, 8, 7; next-best 6, 5
    rec.record(layer_id=0, req_index=ri, seq_lens=sl, top_k=torch.tensor([[9, 8, 7, 6, 5]], dtype=torch.int32), k=3)
    rec.close()
    tr = load_trace(rec.path)
    st = next(tr.streams())
    assert (tr.header["version"], tr.header["next_best"]) == (2, 2)
    assert st.selection(0).tolist() == [9, 8, 7] and st.next_best(0).tolist() == [6, 5]

    # the coordinator today: no ranks to pass, so version 1, a warning, and the ask kept in source
    with caplog.at_level("WARNING", logger="sglang_hisparse.traces.recorder"):
        blind = LiveTraceRecorder.from_env()
    assert blind is not None and blind.next_best == 0
    assert "SGLANG_HISPARSE_RECORD_NEXT_BEST=2 is ignored" in caplog.text
    blind.close()
    header = load_trace(blind.path).header
    assert header["version"] == 1 and header["source"]["next_best_requested"] == 2
    assert len({plain.path, rec.path, blind.path}) == 3  # same pid and second: still three directories

    monkeypatch.setenv("SGLANG_HISPARSE_RECORD_NEXT_BEST", "-3")
    with pytest.raises(ValueError, match=r"SGLANG_HISPARSE_RECORD_NEXT_BEST='-3' must be an integer >= 0"):
        LiveTraceRecorder.from_env(ranked=True)


def test_header_exists_before_close(tmp_path):
    rec = LiveTraceRecorder(str(tmp_path), sample=1.0)
    assert load_trace(rec.path).num_rows == 0  # loadable right away (crash safety)
    _drive(rec, 2, [0], [9])
    rec.flush()
    assert np.unique(load_trace(rec.path).layer).tolist() == [0, 1]
    rec.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the pinned non_blocking copy path")
def test_cuda_tensors_pinned_async_path(tmp_path):
    rec = LiveTraceRecorder(str(tmp_path), sample=1.0)
    for t in range(4):
        rec.begin_step([1, 2], [30 + t, 50 + t])
        tk = torch.arange(8, dtype=torch.int32, device="cuda").repeat(2, 1) + t
        for layer in range(3):
            rec.record(layer_id=layer, req_index=torch.tensor([1, 2], device="cuda"),
                       seq_lens=torch.tensor([30 + t, 50 + t], device="cuda"), top_k=tk)
    rec.close()
    tr = load_trace(rec.path)
    assert tr.num_rows == 24
    st = next(iter(tr.streams()))
    assert st.selection(3).tolist() == list(range(3, 11))
