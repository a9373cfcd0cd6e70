"""Replay a selection trace through a replacement policy: misses, miss rates, bytes moved.

Per (stream, layer) the hot-buffer rules of docs/architecture.md apply, exactly as in the
resolve kernel:

* step with ``seq_len n <= B``: every token sits in its own slot; no misses.
* the newest token ``n - 1`` lives in the reserved slot ``B`` and always hits.
* the first step with ``n > B`` finds slots ``0..B-1`` holding tokens ``0..B-1`` (or empty,
  with ``initial="empty"``, for streams that start long: PD direct admission).
* later steps: the policy places the misses (``policies.py``).

Counting: a *lookup* is one distinct selected position of one step (duplicates count
once; the newest token counts, as a hit). ``miss_rate = misses / lookups``; the ``long_*``
figures restrict both to steps with ``n > B`` (where misses can happen). Bytes per token
= misses × item bytes / decode steps, per layer, and summed over the trace's layers.
Per-stream rates (all layers of one request) are reported too: one stream is one request,
the unit the policy targets in docs/traces.md are stated on.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .format import Stream, Trace
from .policies import make_policy

DEFAULT_ITEM_BYTES = (656, 1152)


def _unique_in_order(sel: np.ndarray) -> np.ndarray:
    """Distinct entries of ``sel`` in first-occurrence order (int64)."""
    if sel.size < 2:
        return sel.astype(np.int64)
    _, first = np.unique(sel, return_index=True)
    return sel[np.sort(first)].astype(np.int64)


@dataclass
class StreamResult:
    """Counts of one (stream, layer) replay."""

    stream: int
    layer: int
    steps: int
    long_steps: int
    lookups: int
    long_lookups: int
    misses: int
    misses_per_step: np.ndarray = field(repr=False)


@dataclass(frozen=True)
class PreparedStream:
    """One (stream, layer) with every row de-duplicated once, for any policy and ``B``.

    ``lookups`` int64 [T] (distinct positions per step, newest included); ``work[t]`` int64:
    the step's distinct positions in first-occurrence (top-k) order without the newest token,
    what ``Policy.step`` takes. Neither depends on ``B``: only the first long step does.
    ``next_best[t]`` int64 (version-2 traces, else None): the step's next-best in rank order,
    without its selected positions and its newest token (what ``Rank.use_ranks`` takes).
    """

    stream: int
    layer: int
    seq_lens: np.ndarray
    lookups: np.ndarray
    work: tuple[np.ndarray, ...] = field(repr=False)
    next_best: tuple[np.ndarray, ...] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.seq_lens.shape[0])


def prepare_stream(st: Stream | PreparedStream) -> PreparedStream:
    """De-duplicate each row of ``st`` once (a prepared stream is returned as it is)."""
    if isinstance(st, PreparedStream):
        return st
    sels = [_unique_in_order(st.selection(t)) for t in range(len(st))]
    newest = st.seq_lens.astype(np.int64) - 1
    next_best = None
    if st.has_ranks:
        nbs = (_unique_in_order(st.next_best(t)) for t in range(len(st)))
        next_best = tuple(b[(b != n) & ~np.isin(b, s)] for b, s, n in zip(nbs, sels, newest, strict=True))
    return PreparedStream(
        stream=st.stream,
        layer=st.layer,
        seq_lens=st.seq_lens,
        lookups=np.array([s.size for s in sels], dtype=np.int64),
        work=tuple(s[s != n] for s, n in zip(sels, newest, strict=True)),
        next_best=next_best,
    )


def prepare(trace: Trace, *, top_k: int | None = None) -> list[PreparedStream]:
    """Every (stream, layer) of ``trace`` (first ``top_k`` positions per row), prepared once."""
    if top_k is not None:
        trace = trace.truncated(top_k)
    return [prepare_stream(st) for st in trace.streams()]


INITIAL = ("prefix", "empty")


def simulate_stream(
    st: Stream | PreparedStream, policy_name: str, B: int, *, seed: int = 0, initial: str = "prefix"
) -> StreamResult:
    """Replay one (stream, layer). Returns counts; ``misses_per_step`` int64 [T].

    ``initial="empty"`` models PD direct admission: a stream whose *first* step is already
    longer than ``B`` starts with empty slots (a stream that grows past ``B`` while decoding
    still finds tokens ``0..B-1``, as the coordinator keeps them). Pass a
    :class:`PreparedStream` to replay one stream under several policies or buffer sizes
    without de-duplicating its rows again.
    """
    if initial not in INITIAL:
        raise ValueError(f"--initial {initial!r}: choose one of {INITIAL}")
    if B < 1:
        raise ValueError(f"--buffer {B}: the hot buffer needs at least one slot")
    ps = prepare_stream(st)
    T = len(ps)
    per_step = np.zeros(T, dtype=np.int64)
    long = np.flatnonzero(ps.seq_lens > B)
    if long.size:
        t0 = int(long[0])
        # Short steps after a long one cannot happen within one stream (seq_len increases).
        work = list(ps.work[t0:])
        policy = make_policy(policy_name, seed=seed + ps.stream * 1009 + ps.layer)
        if policy.needs_ranks:
            if ps.next_best is None:
                raise ValueError(no_ranks(policy_name))
            policy.use_ranks(list(ps.next_best[t0:]))
        policy.reset(B, int(ps.seq_lens[-1]), work)
        if initial == "empty" and t0 == 0:
            policy.clear()
        for i, s in enumerate(work):
            per_step[t0 + i] = policy.step(i, s, int(ps.seq_lens[t0 + i]))
    return StreamResult(
        stream=ps.stream,
        layer=ps.layer,
        steps=T,
        long_steps=int(long.size),
        lookups=int(ps.lookups.sum()),
        long_lookups=int(ps.lookups[long].sum()),
        misses=int(per_step.sum()),
        misses_per_step=per_step,
    )


def no_ranks(policy: str) -> str:
    """Why ``policy`` cannot replay a trace without next-best ranks, and what to do."""
    return (f"--policy {policy} reads the indexer's next-best ranks, and this trace has none (format "
            "version 1: every recorded trace so far); record one with ranks (`record-trace --next-best M`, or "
            "LiveTraceRecorder(next_best=M) fed the indexer's ordered top-(k + M)) or generate one "
            "(synthetic.generate_scored), or pick a rank-blind policy (lru, slru, fra, ...)")


def _rate(a: int, b: int) -> float | None:
    return a / b if b else None


def summarize(
    results: Sequence[StreamResult], *, item_bytes: Iterable[int] = DEFAULT_ITEM_BYTES
) -> dict:
    """Per-layer and overall figures (JSON-ready) from stream results of one policy and B."""
    by_layer: dict[int, list[StreamResult]] = defaultdict(list)
    for r in results:
        by_layer[r.layer].append(r)
    items = [int(i) for i in item_bytes]

    def block(rs: list[StreamResult]) -> dict:
        lk = sum(r.lookups for r in rs)
        ll = sum(r.long_lookups for r in rs)
        ms = sum(r.misses for r in rs)
        return {
            "steps": sum(r.steps for r in rs),
            "long_steps": sum(r.long_steps for r in rs),
            "lookups": lk,
            "misses": ms,
            "miss_rate": _rate(ms, lk),
            "long_miss_rate": _rate(ms, ll),
        }

    layers = {}
    for layer in sorted(by_layer):
        b = block(by_layer[layer])
        b["misses_per_step"] = _rate(b["misses"], b["steps"])
        b["bytes_per_token"] = {str(i): _rate(b["misses"] * i, b["steps"]) for i in items}
        layers[str(layer)] = b
    by_stream: dict[int, list[StreamResult]] = defaultdict(list)
    for r in results:
        by_stream[r.stream].append(r)
    streams = {}
    for sid in sorted(by_stream):
        b = block(by_stream[sid])
        streams[str(sid)] = {k: b[k] for k in ("lookups", "misses", "miss_rate", "long_miss_rate")}
    overall = block(list(results))
    # A decode token crosses every layer once: sum the per-layer bytes per token.
    overall["bytes_per_token"] = {
        str(i): sum(v["bytes_per_token"][str(i)] or 0.0 for v in layers.values()) for i in items
    }
    return {"overall": overall, "layers": layers, "streams": streams}


def _against(misses: int, base: int) -> dict:
    # ratio None: the baseline missed nothing and the policy did (infinitely worse).
    ratio = misses / base if base else (None if misses else 1.0)
    return {"misses": misses, "lru_misses": base, "ratio": ratio}


def _worse_key(misses: int, base: int) -> tuple[float, int]:
    """Sort key, larger = worse against the baseline: the ratio, then the excess misses."""
    if not base:
        return (float("inf") if misses else 1.0, misses)
    return (misses / base, misses - base)


def versus_lru(results: Sequence[StreamResult], lru: Sequence[StreamResult]) -> dict:
    """The per-layer guard: a policy's worst request and worst (request, layer) against lru.

    ``results`` and ``lru`` are the replays of the same prepared streams (one entry per
    (stream, layer), same order) under the policy and under ``lru`` at one ``B``. A request is a
    stream with all its layers. Returns (JSON-ready)::

        worst_request        {"stream", "misses", "lru_misses", "ratio"}   ratio = misses / lru_misses
        worst_request_layer  {"stream", "layer", "misses", "lru_misses", "ratio"}
        request_layers, request_layers_worse (misses > lru's), request_layers_worse_1pct (> 1.01x)

    "Worst" is the largest ratio (ties: the most excess misses, then the lowest ids); a ratio is
    ``None`` where lru missed nothing and the policy did. Both ``None`` with no streams.
    """
    if len(results) != len(lru):
        raise ValueError(f"versus_lru: {len(results)} replays against {len(lru)} of lru; replay the same streams")
    per_req: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    units = []
    for r, b in zip(results, lru, strict=True):
        if (r.stream, r.layer) != (b.stream, b.layer):
            raise ValueError(
                f"versus_lru: stream {r.stream} layer {r.layer} is held against stream {b.stream} layer "
                f"{b.layer} of lru; replay the same streams in the same order"
            )
        per_req[r.stream][0] += r.misses
        per_req[r.stream][1] += b.misses
        units.append((r.stream, r.layer, r.misses, b.misses))
    worst_req = worst_unit = None
    if units:
        sid = max(sorted(per_req), key=lambda s: _worse_key(*per_req[s]))
        worst_req = {"stream": sid, **_against(*per_req[sid])}
        s, layer, mi, ba = max(sorted(units), key=lambda u: _worse_key(u[2], u[3]))
        worst_unit = {"stream": s, "layer": layer, **_against(mi, ba)}
    return {
        "worst_request": worst_req,
        "worst_request_layer": worst_unit,
        "request_layers": len(units),
        "request_layers_worse": sum(mi > ba for _, _, mi, ba in units),
        "request_layers_worse_1pct": sum(mi > 1.01 * ba for _, _, mi, ba in units),
    }


def simulate(
    trace: Trace | Sequence[PreparedStream],
    policy: str,
    buffers: Sequence[int],
    *,
    top_k: int | None = None,
    seed: int = 0,
    item_bytes: Iterable[int] = DEFAULT_ITEM_BYTES,
    initial: str = "prefix",
    guard: bool = False,
    lru_runs: dict[tuple[int, str], list[StreamResult]] | None = None,
) -> dict:
    """Simulate ``policy`` for each buffer size; returns ``{"B": summary, ...}`` (JSON-ready).

    ``trace`` may be the output of :func:`prepare` (then ``top_k`` must be None: it was
    applied there), so a sweep over policies de-duplicates each row once. ``guard=True`` adds
    ``summary["vs_lru"]`` (:func:`versus_lru`; not for ``lru`` itself), replaying lru too;
    ``lru_runs``, a dict the caller shares across calls on the same streams, keeps lru's
    replays per ``(B, initial)`` so a sweep of policies replays lru once per B.
    """
    make_policy(policy)  # fail fast on a bad name
    if isinstance(trace, Trace):
        streams = prepare(trace, top_k=top_k)
    elif top_k is not None:
        raise ValueError("top_k applies when the trace is prepared: pass it to prepare()")
    else:
        streams = list(trace)
    memo = {} if lru_runs is None else lru_runs

    def lru_of(B: int) -> list[StreamResult]:
        if (B, initial) not in memo:
            memo[(B, initial)] = [simulate_stream(st, "lru", B, initial=initial) for st in streams]
        return memo[(B, initial)]

    out = {}
    for B in buffers:
        B = int(B)
        results = (lru_of(B) if policy == "lru" else
                   [simulate_stream(st, policy, B, seed=seed, initial=initial) for st in streams])
        out[str(B)] = summarize(results, item_bytes=item_bytes)
        if guard and policy != "lru":
            out[str(B)]["vs_lru"] = versus_lru(results, lru_of(B))
    return out
