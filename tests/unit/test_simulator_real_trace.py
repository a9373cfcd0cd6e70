"""The kept real-model trace (SmolLM2-135M oracle top-256 on Hamlet and Macbeth, see
docs/traces.md): the policy ordering the issue targets. (Exact agreement with the reference
kernel on it: test_simulator_reference.py.)"""

from __future__ import annotations

import os

import numpy as np
import pytest

from sglang_hisparse.traces.format import Trace, load_trace
from sglang_hisparse.traces.simulator import simulate

TRACE = os.path.join(os.path.dirname(__file__), "..", "data", "smollm2_shakespeare.npz")
pytestmark = pytest.mark.skipif(not os.path.exists(TRACE), reason="tests/data/smollm2_shakespeare.npz not present")


def _subset(trace: Trace, layers: set[int], streams: set[int]) -> Trace:
    keep = np.flatnonzero(np.isin(trace.layer, list(layers)) & np.isin(trace.stream, list(streams)))
    lens = np.diff(trace.offsets)[keep]
    offs = np.zeros(keep.size + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    pos = np.concatenate([trace.positions[trace.offsets[r]: trace.offsets[r + 1]] for r in keep])
    return Trace(trace.header, trace.stream[keep], trace.layer[keep], trace.seq_len[keep], offs, pos)


@pytest.fixture(scope="module")
def real():
    return load_trace(TRACE)


def test_policy_ordering_on_real_trace(real):
    tr = _subset(real, {12, 22}, {0, 1, 2, 3})
    rate = {p: simulate(tr, p, [512])["512"]["overall"]["miss_rate"]
            for p in ("belady", "lru", "fifo", "random", "topk-only", "fra", "slru")}
    assert rate["belady"] < rate["fra"] < rate["lru"] < min(rate["fifo"], rate["random"])
    assert rate["belady"] < rate["slru"] < rate["lru"]
    assert rate["topk-only"] > 1.5 * rate["lru"]


FRESH = os.path.join(os.path.dirname(__file__), "..", "data", "gemma3_winters_tale_32k.npz")


@pytest.mark.skipif(not os.path.exists(FRESH), reason="tests/data/gemma3_winters_tale_32k.npz not present")
def test_slru_beats_lru_on_every_layer_of_a_second_held_aside_trace():
    # Gemma 3 270M over The Winter's Tale at 32K, recorded after slru was fixed (docs/traces.md):
    # its first 128 steps at B = 2k, each recorded layer on its own.
    tr = load_trace(FRESH)
    for layer in sorted(set(tr.layer.tolist())):
        one = _subset(tr, {layer}, {0})
        keep = np.flatnonzero(np.arange(one.stream.size) < 128)
        part = Trace(one.header, one.stream[keep], one.layer[keep], one.seq_len[keep],
                     one.offsets[: keep.size + 1], one.positions[: one.offsets[keep.size]])
        miss = {p: simulate(part, p, [2048])["2048"]["overall"]["misses"] for p in ("lru", "slru", "belady")}
        assert miss["belady"] < miss["slru"] < miss["lru"], (layer, miss)
