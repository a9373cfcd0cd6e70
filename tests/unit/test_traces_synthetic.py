"""Synthetic generator: deterministic, valid, and its knobs move the miss rate as documented."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_hisparse.traces.simulator import simulate, simulate_stream
from sglang_hisparse.traces.synthetic import SyntheticSpec, generate

BASE = dict(streams=2, layers=1, prompt_len=400, steps=50, top_k=32, seed=2)


def _lru_misses(**kw):
    return simulate(generate(SyntheticSpec(**{**BASE, **kw})), "lru", [48])["48"]["overall"]["misses"]


def test_deterministic_and_valid():
    a = generate(SyntheticSpec(**BASE))
    b = generate(SyntheticSpec(**BASE))
    np.testing.assert_array_equal(a.positions, b.positions)
    a.validate()
    assert np.all(np.diff(a.offsets) == 32)
    # sinks first, the newest token last (score order of the model)
    first = a.positions[: a.offsets[1]]
    assert first[:4].tolist() == [0, 1, 2, 3] and first[-1] == a.seq_len[0] - 1


def test_drift_and_locality_move_misses():
    assert _lru_misses(drift=0.0) == 0 or _lru_misses(drift=0.0) < _lru_misses(drift=0.1)
    assert _lru_misses(drift=0.02) < _lru_misses(drift=0.2)


def test_per_stream_churn_is_uneven():
    trace = generate(SyntheticSpec(**{**BASE, "streams": 3, "drift": [0.0, 0.05, 0.4]}))
    per = [simulate_stream(st, "lru", 48).misses for st in trace.streams()]
    assert per[0] < per[1] < per[2]
    skewed = SyntheticSpec(**{**BASE, "streams": 8, "churn_skew": 1.0})
    assert len(set(skewed.drifts())) == 8


def test_bad_specs_raise():
    with pytest.raises(ValueError, match="sinks\\+recent=12 must be < top_k=8"):
        generate(SyntheticSpec(top_k=8))
    with pytest.raises(ValueError, match="drift has 1 values for streams=2"):
        generate(SyntheticSpec(streams=2, drift=[0.1]))
    with pytest.raises(ValueError, match="locality=2"):
        generate(SyntheticSpec(locality=2))
