"""Trace format version 2 (next-best ranks, issue 49): round trips, old traces unchanged, the
recorder's ordered top-(k + m), the score-process generator, and clear refusals of malformed
rank arrays."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_hisparse.traces.format import TraceWriter, load_trace, make_header
from sglang_hisparse.traces.ranks import split_ranked
from sglang_hisparse.traces.recorder import LiveTraceRecorder
from sglang_hisparse.traces.synthetic import ScoreSpec, generate_scored, write_trace

DATA = Path(__file__).resolve().parents[1] / "data"


def _rows(trace):
    out = []
    for r in range(trace.num_rows):
        nb = None
        if trace.has_ranks:
            nb = trace.ranks[trace.rank_offsets[r]: trace.rank_offsets[r + 1]].tolist()
        out.append((int(trace.stream[r]), int(trace.layer[r]), int(trace.seq_len[r]),
                    trace.positions[trace.offsets[r]: trace.offsets[r + 1]].tolist(), nb))
    return out


SMALL = ScoreSpec(streams=2, layers=2, prompt_len=40, steps=5, top_k=8, next_best=4, sinks=2, seed=3)


@pytest.mark.parametrize("name", ["t.npz", "tdir"])
def test_round_trip_with_ranks(tmp_path, name):
    trace = generate_scored(SMALL)
    path = str(tmp_path / name)
    with TraceWriter(path, trace.header, part_rows=3) as w:  # several parts in directory mode
        for s, layer, n, pos, nb in _rows(trace):
            w.add(s, layer, n, pos, nb)
    back = load_trace(path)
    assert _rows(back) == _rows(trace)
    assert (back.header["version"], back.header["next_best"], back.header["top_k"]) == (2, 4, 8)
    st = next(back.streams())
    assert st.has_ranks and st.next_best(0).tolist() == _rows(trace)[0][4]


def test_a_row_may_carry_fewer_ranks_and_padding_is_dropped(tmp_path):
    path = str(tmp_path / "p.npz")
    with TraceWriter(path, make_header(top_k=3, sorted_by_score=True, next_best=3)) as w:
        w.add(0, 0, 10, [9, 1, 2], [5, -1, -1])
        w.add(0, 0, 11, [10, 1])           # no ranks at all: an empty row of them
        w.add_batch([1], 0, [4], np.array([[3, 0, -1]]), np.array([[2, 1, -1]]))
    back = load_trace(path)
    assert [r[4] for r in _rows(back)] == [[5], [], [2, 1]]


def test_old_traces_load_unchanged_and_are_version_1(tmp_path):
    # A writer without next_best writes version 1: the arrays of before, no rank arrays.
    path = tmp_path / "old.npz"
    with TraceWriter(str(path), make_header(top_k=2, sorted_by_score=True)) as w:
        w.add(0, 0, 5, [4, 1])
    with zipfile.ZipFile(path) as z:
        assert sorted(z.namelist()) == sorted(f"{a}.npy" for a in
                                              ("header", "stream", "layer", "seq_len", "offsets", "positions"))
    old = load_trace(str(path))
    assert old.header["version"] == 1 and not old.has_ranks and "next_best" not in old.header
    st = next(old.streams())
    assert not st.has_ranks
    with pytest.raises(ValueError, match="no next-best ranks"):
        st.next_best(0)
    real = load_trace(str(DATA / "smollm2_othello_milton.npz"))  # a recorded trace of before
    assert real.header["version"] == 1 and not real.has_ranks and real.num_rows == 2560


def test_truncation_moves_the_dropped_tail_into_the_ranks():
    trace = generate_scored(SMALL)
    cut = trace.truncated(5)
    assert cut.header["top_k"] == 5 and cut.header["next_best"] == 4 + 3
    for full, short in zip(_rows(trace), _rows(cut), strict=True):
        assert short[3] == full[3][:5] and short[4] == full[3][5:] + full[4]
    cut.validate()
    unsorted = type(trace)(dict(trace.header, sorted_by_score=False), trace.stream, trace.layer, trace.seq_len,
                           trace.offsets, trace.positions, trace.rank_offsets, trace.ranks)
    with pytest.raises(ValueError, match="not in score order"):
        unsorted.truncated(5)


def test_writer_refuses_malformed_ranks(tmp_path):
    with TraceWriter(str(tmp_path / "v1.npz"), make_header(top_k=2, sorted_by_score=True)) as w:
        with pytest.raises(ValueError, match=r"trace without ranks \(version 1\).*next_best=M"):
            w.add(0, 0, 5, [4], [3])
    w = TraceWriter(str(tmp_path / "v2.npz"), make_header(top_k=2, sorted_by_score=True, next_best=2))
    with pytest.raises(ValueError, match="3 next-best ranks, more than the header's next_best=2"):
        w.add(0, 0, 9, [8], [1, 2, 3])
    with pytest.raises(ValueError, match="both selected and next-best"):
        w.add(0, 0, 9, [8, 1], [1])
    with pytest.raises(ValueError, match="repeats"):
        w.add(0, 0, 9, [8], [2, 2])
    with pytest.raises(ValueError, match=r"outside \[0, seq_len=9\)"):
        w.add(0, 0, 9, [8], [9])
    with pytest.raises(ValueError, match="1-D integer"):
        w.add(0, 0, 9, [8], np.array([[1], [2]]))
    with pytest.raises(ValueError, match=r"expected \[1, m\]"):
        w.add_batch([0], 0, [9], np.array([[8, 1]]), np.array([1, 2]))
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="needs header 'next_best' = m, an integer >= 0"):
            TraceWriter(str(tmp_path / "x.npz"), make_header(top_k=2, sorted_by_score=True, next_best=bad))


def test_split_ranked():
    sel, nb = split_ranked(np.array([[5, 4, 3, 2, 1]]), 3)
    assert sel.tolist() == [[5, 4, 3]] and nb.tolist() == [[2, 1]]
    for bad in (0, 6, True, 2.0):
        with pytest.raises(ValueError, match=r"selection width k=.* must be an integer in \[1, 5\]"):
            split_ranked(np.arange(5), bad)


def _rewrite(path: Path, out: Path, *, header=None, drop=(), replace=None):
    """Copy a .npz trace with its header, arrays dropped or replaced (a damaged file)."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if k not in drop}
    if header is not None:
        arrays["header"] = np.array(json.dumps(header))
    arrays.update(replace or {})
    np.savez(out, **arrays)
    return str(out)


def test_loader_refuses_malformed_rank_arrays(tmp_path):
    good = tmp_path / "g.npz"
    generate_scored(SMALL, str(good))
    hdr = load_trace(str(good)).header
    cases = [
        (dict(drop=("ranks",)), "version 2 .* lacks \\['ranks'\\]"),
        (dict(header={**hdr, "version": 1}), "'next_best' = 4 in a version-1 trace"),
        (dict(header={k: v for k, v in hdr.items() if k != "next_best"} | {"version": 1}), "its header is version 1"),
        (dict(header={**hdr, "next_best": True}), "needs header 'next_best' = m"),
        (dict(header={**hdr, "next_best": 2}), "more than the header's next_best=2"),
        (dict(replace={"rank_offsets": np.zeros(3, np.int64)}), "'rank_offsets' must have 21 entries"),
        (dict(replace={"ranks": np.zeros((2, 2), np.int32)}), "array 'ranks' is int32 of shape \\(2, 2\\)"),
    ]
    for i, (kw, msg) in enumerate(cases):
        with pytest.raises(ValueError, match=msg):
            load_trace(_rewrite(good, tmp_path / f"bad{i}.npz", **kw))
    # A next-best equal to a selected position of its row, and one past seq_len.
    tr = load_trace(str(good))
    ranks = tr.ranks.copy()
    ranks[0] = tr.positions[0]
    with pytest.raises(ValueError, match="row 0: position .* both selected and next-best"):
        load_trace(_rewrite(good, tmp_path / "both.npz", replace={"ranks": ranks}))
    ranks[0] = 10_000
    with pytest.raises(ValueError, match=r"next-best position 10000 \(row 0\) is outside"):
        load_trace(_rewrite(good, tmp_path / "far.npz", replace={"ranks": ranks}))
    ranks[0] = tr.ranks[1]
    with pytest.raises(ValueError, match="row 0: next-best position .* repeats"):
        load_trace(_rewrite(good, tmp_path / "dup.npz", replace={"ranks": ranks}))


def test_recorder_takes_the_ordered_top_k_plus_m(tmp_path):
    rec = LiveTraceRecorder(str(tmp_path), sample=1.0, next_best=2)
    for t in range(3):
        n = 20 + t
        ordered = torch.tensor([[n - 1, 0, 5, n - 2, -1], [n - 1, 1, 2, 3, 4]], dtype=torch.int32)
        rec.begin_step([0, 1], [n, n + 10])
        rec.record(layer_id=0, req_index=torch.tensor([0, 1]), seq_lens=torch.tensor([n, n + 10]),
                   top_k=ordered, k=3)
    rec.close()
    tr = load_trace(rec.path)
    assert tr.header["version"] == 2 and tr.header["next_best"] == 2
    sts = list(tr.streams())
    assert sts[0].selection(0).tolist() == [19, 0, 5] and sts[0].next_best(0).tolist() == [18]
    assert sts[1].selection(2).tolist() == [21, 1, 2] and sts[1].next_best(2).tolist() == [3, 4]
    plain = LiveTraceRecorder(str(tmp_path / "plain"), sample=1.0)
    with pytest.raises(ValueError, match="next_best=M"):
        plain.record(layer_id=0, req_index=torch.tensor([0]), seq_lens=torch.tensor([9]),
                     top_k=torch.zeros(1, 4, dtype=torch.int32), k=2)
    plain.close()
    with pytest.raises(ValueError, match="3 next-best ranks, more than this recorder's next_best=2"):
        rec2 = LiveTraceRecorder(str(tmp_path / "r2"), sample=1.0, next_best=2)
        rec2.record(layer_id=0, req_index=torch.tensor([0]), seq_lens=torch.tensor([9]),
                    top_k=torch.zeros(1, 5, dtype=torch.int32), k=2)
    rec2.close()
    with pytest.raises(ValueError, match="next_best=-1"):
        LiveTraceRecorder(str(tmp_path / "r3"), next_best=-1)


def test_score_process_generator():
    a = generate_scored(SMALL)
    assert _rows(a) == _rows(generate_scored(SMALL))  # seeded
    a.validate()
    assert all(len(r[3]) == 8 and len(r[4]) == 4 and r[3][:2] == [0, 1] for r in _rows(a))  # sinks first
    plain = generate_scored(ScoreSpec(**{**SMALL.__dict__, "next_best": 0}))
    assert plain.header["version"] == 1 and not plain.has_ranks
    assert [r[3] for r in _rows(plain)] == [r[3] for r in _rows(a)]  # the same selections
    with pytest.raises(ValueError, match="rho=1.0 must be in"):
        generate_scored(ScoreSpec(rho=1.0))
    with pytest.raises(ValueError, match="top_k \\+ next_best = 80 must be <= prompt_len=50"):
        generate_scored(ScoreSpec(prompt_len=50, top_k=40, next_best=40))


def test_write_trace_keeps_ranks(tmp_path):
    trace = generate_scored(SMALL)
    write_trace(trace, str(tmp_path / "w"))
    assert _rows(load_trace(str(tmp_path / "w"))) == _rows(trace)
