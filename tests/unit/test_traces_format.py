"""Trace format: round trips (single file and part directories), compaction, validation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sglang_hisparse.traces.format import TraceWriter, load_trace, make_header
from sglang_hisparse.traces.synthetic import SyntheticSpec, generate, write_trace


def _rows(trace):
    return [
        (int(trace.stream[r]), int(trace.layer[r]), int(trace.seq_len[r]),
         trace.positions[trace.offsets[r]: trace.offsets[r + 1]].tolist())
        for r in range(trace.num_rows)
    ]


@pytest.mark.parametrize("name", ["t.npz", "tdir"])
def test_round_trip(tmp_path, name):
    trace = generate(SyntheticSpec(streams=2, layers=2, prompt_len=50, steps=5, top_k=12, sinks=2, recent=3, seed=1))
    path = str(tmp_path / name)
    with TraceWriter(path, trace.header, part_rows=3) as w:  # several parts in directory mode
        for s, layer, n, pos in _rows(trace):
            w.add(s, layer, n, pos)
    back = load_trace(path)
    assert _rows(back) == _rows(trace)
    assert back.header["version"] == 1 and back.header["top_k"] == 12
    assert back.header["source"]["generator"] == "synthetic"
    if name == "tdir":
        assert len(list((tmp_path / name).glob("part-*.npz"))) == 7  # 20 rows / 3 per part


def test_padding_dropped_and_wide_positions_kept(tmp_path):
    path = str(tmp_path / "w.npz")
    with TraceWriter(path, make_header(top_k=4, sorted_by_score=True)) as w:
        w.add_batch([7, 8], 0, [70000, 5], np.array([[69999, 3, -1, 65536], [4, -1, -1, -1]]))
    back = load_trace(path)
    assert _rows(back) == [(7, 0, 70000, [69999, 3, 65536]), (8, 0, 5, [4])]
    assert back.positions.dtype == np.int32


def test_streams_group_and_order(tmp_path):
    path = str(tmp_path / "o.npz")
    with TraceWriter(path, make_header(top_k=2, sorted_by_score=False)) as w:
        w.add(1, 0, 11, [3])  # out of order on purpose
        w.add(0, 0, 10, [1])
        w.add(1, 0, 10, [2])
    sts = list(load_trace(path).streams())
    assert [(s.stream, s.layer, s.seq_lens.tolist()) for s in sts] == [(0, 0, [10]), (1, 0, [10, 11])]
    assert sts[1].selection(0).tolist() == [2] and sts[1].selection(1).tolist() == [3]


def test_truncate_keeps_first_k():
    trace = generate(SyntheticSpec(streams=1, layers=1, prompt_len=60, steps=3, top_k=16))
    cut = trace.truncated(5)
    for r in range(trace.num_rows):
        full = trace.positions[trace.offsets[r]: trace.offsets[r + 1]]
        assert cut.positions[cut.offsets[r]: cut.offsets[r + 1]].tolist() == full[:5].tolist()
    with pytest.raises(ValueError, match="top_k=0"):
        trace.truncated(0)


def test_invalid_traces_raise(tmp_path):
    path = str(tmp_path / "bad.npz")
    with TraceWriter(path, make_header(top_k=2, sorted_by_score=False)) as w:
        w.add(0, 0, 5, [5])  # position == seq_len: not an existing token
    with pytest.raises(ValueError, match=r"outside \[0, seq_len=5\)"):
        load_trace(path)
    with TraceWriter(path, make_header(top_k=2, sorted_by_score=False)) as w:
        w.add(0, 0, 5, [1])
        w.add(0, 0, 5, [2])
    with pytest.raises(ValueError, match="strictly increasing seq_len"):
        load_trace(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(str(tmp_path / "missing.npz"))


def test_version_and_header_checks(tmp_path):
    d = tmp_path / "d"
    trace = generate(SyntheticSpec(streams=1, layers=1, prompt_len=30, steps=2, top_k=8, sinks=2, recent=2))
    write_trace(trace, str(d))
    hdr = json.loads((d / "header.json").read_text())
    hdr["version"] = 99
    (d / "header.json").write_text(json.dumps(hdr))
    with pytest.raises(ValueError, match="version 99 is not supported"):
        load_trace(str(d))
    (d / "header.json").unlink()
    with pytest.raises(ValueError, match="no header.json"):
        load_trace(str(d))
