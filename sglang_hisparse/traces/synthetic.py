"""Synthetic selection traces with tunable locality, drift and per-request churn.

Each (stream, layer) keeps a *working set* that models what sparse attention keeps picking:

* ``sinks`` first positions, selected on every step (attention sinks);
* the ``recent`` newest positions (local window; the newest token included);
* a drifting *hot set* filling the rest of the ``top_k``: on each step a fraction ``drift``
  of it is replaced. A replacement lands near an existing hot position (within
  ``spread`` tokens) with probability ``locality``, else uniformly in the context.

``drift`` may be one number or one per stream: uneven churn across a batch (some requests
miss a lot, most little) is what the kernel benchmark needs. ``churn_skew > 0`` draws each
stream's drift as ``drift * lognormal(0, churn_skew)`` instead.

Selections are written in "score" order: sinks, hot set (oldest members first), window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .format import Trace, TraceWriter, make_header


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape and behaviour of a synthetic trace (see module docstring for the model)."""

    streams: int = 4
    layers: int = 2
    prompt_len: int = 1024
    steps: int = 64
    top_k: int = 64
    sinks: int = 4
    recent: int = 8
    drift: float | Sequence[float] = 0.05
    churn_skew: float = 0.0
    locality: float = 0.8
    spread: int = 32
    seed: int = 0

    def check(self) -> None:
        for name in ("streams", "layers", "prompt_len", "steps", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"synthetic {name}={getattr(self, name)} must be >= 1")
        if self.sinks + self.recent >= self.top_k:
            raise ValueError(
                f"synthetic sinks+recent={self.sinks + self.recent} must be < top_k={self.top_k}: "
                "leave room for the drifting hot set"
            )
        if not 0.0 <= self.locality <= 1.0:
            raise ValueError(f"synthetic locality={self.locality} must be in [0, 1]")
        drifts = self.drifts()
        if any(not 0.0 <= d <= 1.0 for d in drifts):
            raise ValueError(f"synthetic drift values {drifts} must lie in [0, 1]")

    def drifts(self) -> list[float]:
        if isinstance(self.drift, (int, float)):
            base = [float(self.drift)] * self.streams
        else:
            base = [float(d) for d in self.drift]
            if len(base) != self.streams:
                raise ValueError(f"synthetic drift has {len(base)} values for streams={self.streams}; give one each")
        if self.churn_skew > 0:
            rng = np.random.default_rng(self.seed + 7)
            base = [min(1.0, d * float(rng.lognormal(0.0, self.churn_skew))) for d in base]
        return base


def _new_positions(rng, hot: np.ndarray, count: int, n: int, locality: float, spread: int) -> np.ndarray:
    near = rng.random(count) < locality
    anchors = hot[rng.integers(0, hot.size, count)] if hot.size else np.zeros(count, np.int64)
    offs = rng.integers(-spread, spread + 1, count)
    pos = np.where(near, anchors + offs, rng.integers(0, n, count))
    return np.clip(pos, 0, n - 1)


def _distinct(rng, hot: np.ndarray, n: int, sinks: int, recent: int) -> np.ndarray:
    """Re-draw hot members that repeat or overlap the sinks/window, keeping the width k."""
    lo, hi = sinks, max(n - recent, sinks + 1)
    for _ in range(16):
        _, first = np.unique(hot, return_index=True)
        bad = np.ones(hot.size, dtype=bool)
        bad[first] = False
        bad |= (hot < lo) | (hot >= hi)
        if not bad.any():
            break
        hot[bad] = rng.integers(lo, hi, int(bad.sum()))
    return hot


def _stream_layer(spec: SyntheticSpec, drift: float, rng) -> list[tuple[int, np.ndarray]]:
    """Rows (seq_len, selection) for one (stream, layer)."""
    rows = []
    n0 = spec.prompt_len + 1
    hot_size = spec.top_k - spec.sinks - spec.recent
    hot = rng.choice(np.arange(spec.sinks, n0 - spec.recent), size=min(hot_size, n0 - spec.recent - spec.sinks), replace=False)
    for t in range(spec.steps):
        n = n0 + t
        if t:
            replace = rng.random(hot.size) < drift
            if replace.any():
                hot = hot.copy()
                hot[replace] = _new_positions(rng, hot, int(replace.sum()), n, spec.locality, spec.spread)
                # Replaced members become the newest (lowest-score) entries of the hot set.
                hot = np.concatenate((hot[~replace], hot[replace]))
            hot = _distinct(rng, hot, n, spec.sinks, spec.recent)
        sel = np.concatenate((np.arange(min(spec.sinks, n)), hot, np.arange(max(n - spec.recent, 0), n)))
        _, first = np.unique(sel, return_index=True)
        sel = sel[np.sort(first)][: spec.top_k]
        rows.append((n, sel.astype(np.int32)))
    return rows


def generate(spec: SyntheticSpec, path: str | None = None) -> Trace:
    """Build the trace (in memory, and written to ``path`` when given)."""
    spec.check()
    drifts = spec.drifts()
    source = {"generator": "synthetic", **{k: v for k, v in spec.__dict__.items() if k != "drift"}, "drift": drifts}
    header = make_header(top_k=spec.top_k, sorted_by_score=True, source=source)
    stream, layer, seq_len, lens, pos = [], [], [], [], []
    for s in range(spec.streams):
        for layer_id in range(spec.layers):
            rng = np.random.default_rng([spec.seed, s, layer_id])
            for n, sel in _stream_layer(spec, drifts[s], rng):
                stream.append(s)
                layer.append(layer_id)
                seq_len.append(n)
                lens.append(sel.size)
                pos.append(sel)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    trace = Trace(
        header=header,
        stream=np.array(stream, np.int64),
        layer=np.array(layer, np.int32),
        seq_len=np.array(seq_len, np.int32),
        offsets=offsets,
        positions=np.concatenate(pos).astype(np.int32),
    )
    if path is not None:
        write_trace(trace, path)
    return trace


def write_trace(trace: Trace, path: str) -> None:
    """Write an in-memory ``Trace`` (any source) with ``TraceWriter``."""
    with TraceWriter(path, trace.header) as w:
        for r in range(trace.num_rows):
            w.add(int(trace.stream[r]), int(trace.layer[r]), int(trace.seq_len[r]),
                  trace.positions[trace.offsets[r] : trace.offsets[r + 1]])
