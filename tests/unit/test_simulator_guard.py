"""The per-layer guard (issue 49): a policy's worst request and worst (request, layer) against
lru, exact ids and counts, in the simulator, `simulate` and `policy_eval`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sglang_hisparse.cli import simulate as cli
from sglang_hisparse.traces.format import load_trace
from sglang_hisparse.traces.simulator import (
    StreamResult,
    prepare,
    simulate,
    simulate_stream,
    versus_lru,
)
from sglang_hisparse.traces.synthetic import SyntheticSpec, generate


def _runs(units):
    """StreamResults of (stream, layer, misses) triples (the guard reads only these)."""
    return [StreamResult(s, layer, 1, 1, 1, 1, m, np.zeros(1, np.int64)) for s, layer, m in units]


def test_worst_request_and_request_layer_exact():
    # request 0: layers 1, 2 miss 110 + 90 = 200 against lru's 100 + 100 (1.00x; layer 1 1.10x);
    # request 1: 150 + 40 = 190 against 100 + 80 (1.056x; layer 1 1.5x, layer 2 0.5x).
    pol = _runs([(0, 1, 110), (0, 2, 90), (1, 1, 150), (1, 2, 40)])
    lru = _runs([(0, 1, 100), (0, 2, 100), (1, 1, 100), (1, 2, 80)])
    g = versus_lru(pol, lru)
    assert g["worst_request"] == {"stream": 1, "misses": 190, "lru_misses": 180, "ratio": pytest.approx(190 / 180)}
    assert g["worst_request_layer"] == {"stream": 1, "layer": 1, "misses": 150, "lru_misses": 100, "ratio": 1.5}
    assert (g["request_layers"], g["request_layers_worse"], g["request_layers_worse_1pct"]) == (4, 2, 2)


def test_ties_and_a_layer_lru_never_missed():
    # (0, 1) and (0, 2) both 1.02x: the one with more excess misses is the worst, 102 vs 51.
    g = versus_lru(_runs([(0, 1, 51), (0, 2, 102)]), _runs([(0, 1, 50), (0, 2, 100)]))
    assert (g["worst_request_layer"]["layer"], g["request_layers_worse_1pct"]) == (2, 2)
    # lru missed nothing on (3, 0) and the policy did: ratio None, and worse than any finite one.
    g = versus_lru(_runs([(2, 0, 200), (3, 0, 1)]), _runs([(2, 0, 100), (3, 0, 0)]))
    assert g["worst_request_layer"] == {"stream": 3, "layer": 0, "misses": 1, "lru_misses": 0, "ratio": None}
    assert versus_lru(_runs([(0, 0, 0)]), _runs([(0, 0, 0)]))["worst_request"]["ratio"] == 1.0
    empty = versus_lru([], [])
    assert empty["worst_request"] is None and empty["request_layers"] == 0


def test_mismatched_replays_are_refused():
    with pytest.raises(ValueError, match="replay the same streams"):
        versus_lru(_runs([(0, 0, 1)]), _runs([(0, 0, 1), (0, 1, 1)]))
    with pytest.raises(ValueError, match="stream 0 layer 1 is held against stream 0 layer 0"):
        versus_lru(_runs([(0, 1, 1)]), _runs([(0, 0, 1)]))


def _trace(tmp_path):
    path = str(tmp_path / "t.npz")
    generate(SyntheticSpec(streams=2, layers=2, prompt_len=200, steps=30, top_k=32, drift=0.3,
                           locality=0.5, seed=3), path)
    return path


def test_simulate_guard_memoizes_lru(tmp_path):
    streams = prepare(load_trace(_trace(tmp_path)))
    memo: dict = {}
    s = simulate(streams, "slru", [40, 48], guard=True, lru_runs=memo)
    assert set(memo) == {(40, "prefix"), (48, "prefix")}
    lru = simulate(streams, "lru", [40], guard=True, lru_runs=memo)
    assert "vs_lru" not in lru["40"] and lru["40"]["overall"]["misses"] == sum(r.misses for r in memo[(40, "prefix")])
    assert s["40"]["vs_lru"] == versus_lru([simulate_stream(st, "slru", 40) for st in streams], memo[(40, "prefix")])
    assert "vs_lru" not in simulate(streams, "slru", [40])["40"]  # off by default: the planner pays nothing


def test_cli_prints_and_writes_the_guard(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["--trace", _trace(tmp_path), "--policy", "slru", "--policy", "lru",
                     "--buffer", "40", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    g = doc["results"]["slru"]["40"]["vs_lru"]
    assert "vs_lru" not in doc["results"]["lru"]["40"]
    assert g["request_layers"] == 4 and set(g["worst_request_layer"]) == {"stream", "layer", "misses", "lru_misses",
                                                                          "ratio"}
    text = capsys.readouterr().out
    wu = g["worst_request_layer"]
    assert "worst (request, layer)" in text
    assert f"({wu['stream']}, {wu['layer']}): {wu['misses']}/{wu['lru_misses']}" in text


def test_policy_eval_reports_the_guard(tmp_path, import_benchmark):
    ev = import_benchmark("policy_eval")
    r = ev.evaluate(_trace(tmp_path), (1.5, 2.0))
    assert set(r["B"]) == {"48", "64"}
    row = r["B"]["48"]
    g = row["slru"]["vs_lru"]
    assert g["request_layers"] == 4
    sid = g["worst_request"]["stream"]  # per_request: the same counts by stream
    assert (g["worst_request"]["misses"], g["worst_request"]["lru_misses"]) == (
        row["slru"]["per_request"][sid], row["lru"]["per_request"][sid])
    table = ev.guard_table([r])
    assert "| t | 1.5k | slru |" in table and "| t | 2k | fra |" in table
