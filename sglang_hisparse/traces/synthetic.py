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
This model has no scores beyond the selection, so its traces carry no next-best ranks.

``ScoreSpec`` / ``generate_scored`` is a second model, a *score process* that does: every token
has a score each step, the top ``k`` are the selection and the next ``m`` the next-best ranks
(a version-2 trace). A token's score is a static importance (heavy hitters), a dynamic part that
follows an AR(1) process from step to step (correlation ``rho``: a token just below the cut is a
likelier next pick than one far below it) and a recency bonus; the first ``sinks`` tokens are
always selected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .format import Trace, TraceWriter, make_header
from .ranks import RANK_ARRAYS


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
    """Write an in-memory ``Trace`` (any source, with or without ranks) with ``TraceWriter``."""
    with TraceWriter(path, trace.header) as w:
        for r in range(trace.num_rows):
            nb = None
            if trace.rank_offsets is not None and trace.ranks is not None:
                nb = trace.ranks[trace.rank_offsets[r] : trace.rank_offsets[r + 1]]
            w.add(int(trace.stream[r]), int(trace.layer[r]), int(trace.seq_len[r]),
                  trace.positions[trace.offsets[r] : trace.offsets[r + 1]], nb)


@dataclass(frozen=True)
class ScoreSpec:
    """A score process (module docstring). Per (stream, layer) and step of length ``n``, token
    ``p`` scores ``heavy * a_p + x_p(t) + recency * exp(-(n - 1 - p) / local) + jitter * e_p(t)``:
    ``a_p`` ~ N(0, 1) fixed per token, ``x_p(t + 1) = rho * x_p(t) + sqrt(1 - rho^2) * N(0, 1)``
    (stationary unit variance; a new token starts from the stationary law), ``e_p(t)`` ~ N(0, 1)
    fresh each step (one-step spikes: picks that rarely return). ``next_best`` = m ranks per row
    (0: a version-1 trace without them)."""

    streams: int = 4
    layers: int = 2
    prompt_len: int = 1024
    steps: int = 64
    top_k: int = 64
    next_best: int = 64
    sinks: int = 4
    rho: float = 0.9
    heavy: float = 1.0
    recency: float = 3.0
    local: float = 32.0
    jitter: float = 0.0
    seed: int = 0

    def check(self) -> None:
        for name in ("streams", "layers", "prompt_len", "steps", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"synthetic {name}={getattr(self, name)} must be >= 1")
        if self.jitter < 0 or self.heavy < 0:
            raise ValueError(f"synthetic jitter={self.jitter}, heavy={self.heavy} must be >= 0 (standard deviations)")
        if self.next_best < 0 or self.sinks < 0:
            raise ValueError(f"synthetic next_best={self.next_best}, sinks={self.sinks} must be >= 0")
        if self.sinks >= self.top_k:
            raise ValueError(f"synthetic sinks={self.sinks} must be < top_k={self.top_k}: leave room for the scored picks")
        if self.top_k + self.next_best > self.prompt_len:
            raise ValueError(
                f"synthetic top_k + next_best = {self.top_k + self.next_best} must be <= prompt_len={self.prompt_len}: "
                "the context must hold the selection and its next-best"
            )
        if not 0.0 <= self.rho < 1.0:
            raise ValueError(f"synthetic rho={self.rho} must be in [0, 1): the step-to-step score correlation")
        if self.local <= 0:
            raise ValueError(f"synthetic local={self.local} must be > 0 (tokens: the recency bonus's decay length)")


def _scored_rows(spec: ScoreSpec, rng) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Rows (seq_len, selection in score order, next-best in rank order) of one (stream, layer)."""
    n_max = spec.prompt_len + spec.steps
    a = rng.standard_normal(n_max)
    x = rng.standard_normal(n_max)
    keep = float(np.sqrt(1.0 - spec.rho ** 2))
    want = spec.top_k - spec.sinks + spec.next_best
    rows = []
    for t in range(spec.steps):
        n = spec.prompt_len + 1 + t
        if t:
            x[:n - 1] = spec.rho * x[:n - 1] + keep * rng.standard_normal(n - 1)  # token n-1 starts stationary
        age = (n - 1) - np.arange(spec.sinks, n)
        score = spec.heavy * a[spec.sinks:n] + x[spec.sinks:n] + spec.recency * np.exp(-age / spec.local)
        if spec.jitter:
            score = score + spec.jitter * rng.standard_normal(score.size)  # one-step spikes
        top = np.argpartition(-score, want - 1)[:want]
        top = top[np.argsort(-score[top], kind="stable")] + spec.sinks
        k = spec.top_k - spec.sinks
        sel = np.concatenate((np.arange(spec.sinks), top[:k])).astype(np.int32)
        rows.append((n, sel, top[k:].astype(np.int32)))
    return rows


def generate_scored(spec: ScoreSpec, path: str | None = None) -> Trace:
    """Build a score-process trace (in memory, and written to ``path`` when given)."""
    spec.check()
    source = {"generator": "synthetic-scores", **spec.__dict__}
    header = make_header(top_k=spec.top_k, sorted_by_score=True, source=source,
                         next_best=spec.next_best or None)
    cols: dict[str, list] = {"stream": [], "layer": [], "seq_len": [], "sel": [], "nb": []}
    for s in range(spec.streams):
        for layer_id in range(spec.layers):
            rng = np.random.default_rng([spec.seed, s, layer_id, 1])
            for n, sel, nb in _scored_rows(spec, rng):
                for key, v in zip(cols, (s, layer_id, n, sel, nb), strict=True):
                    cols[key].append(v)

    def csr(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        offs = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([r.size for r in rows], out=offs[1:])
        return offs, np.concatenate(rows).astype(np.int32)

    offsets, positions = csr(cols["sel"])
    ranked = dict(zip(RANK_ARRAYS, csr(cols["nb"]), strict=True)) if spec.next_best else {}
    trace = Trace(header=header, stream=np.array(cols["stream"], np.int64), layer=np.array(cols["layer"], np.int32),
                  seq_len=np.array(cols["seq_len"], np.int32), offsets=offsets, positions=positions, **ranked)
    if path is not None:
        write_trace(trace, path)
    return trace
