"""Calibrated selections for the end-to-end benchmark, and the table that shows they match.

The toy indexer alone (``e2e_model.BenchModel.select``) is far kinder than a real model: at
its old default (``--churn 0.15``) a B = 2k hot buffer misses ~1 % of selections, where
recorded traces of real models miss 11-17 % (``tests/data/*.npz``, docs/traces.md). This
module supplies a selection process fitted to those traces; the benchmark injects it into the
toy indexer (``BenchModel.select(..., forced=...)``), so the indexer's cost stays what it was
and only *which* positions win changes.

The process, per request and anchor layer (all hashes of (request seed, layer, position), so
a request's selection does not depend on the batch it runs in)::

    contenders   a static pool of ``pool * k`` prompt positions (drawn once from [0, n0 - R))
                 plus the sliding window of the R = ``recent * k`` newest positions
    score(p, t)  sum over time scales T of  w_T * u(p, T, floor((t + phase(p, T)) / T))
                 + recency * exp(-(t - 1 - p) / (tau * k))       u: hashed, uniform in [-1, 1)
    selection    the k contenders with the highest score at step t (seq_len t), in score order

Piecewise-constant noise at several time scales gives what the traces show: most selected
positions were selected at the previous step too, and the rest return after gaps of a few to
hundreds of steps (a heavy-tailed reuse distance), which is what a B = 2k LRU buffer misses.

Scaling to k = 2048 (the traces were recorded at k = 256, ~6K context): the pool and the
window are multiples of k and the recency decay is in units of k, so the fraction of
contenders selected and the score dynamics per step are the same at any k and any context;
only positions are spread over a longer prompt. ``calibration_table`` checks it: it replays
the process at the trace's scale and at the benchmark's (k 2048, 32K and 128K) through the
same simulator (``sglang_hisparse.traces.simulator``, the kernel's LRU rules) and reports miss
rates at B / k = 1 ... 4 and the reuse-distance profile next to the recorded traces'.

    python benchmarks/e2e_selection.py            # print the calibration table (CPU, ~1 min)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hisparse_testing.toy_model import _MASK, _mix  # noqa: E402
from sglang_hisparse.traces.format import Stream, load_trace  # noqa: E402
from sglang_hisparse.traces.simulator import simulate_stream  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRACES = (REPO / "tests/data/smollm2_shakespeare.npz", REPO / "tests/data/smollm2_othello_milton.npz")
#: hot-buffer sizes of the calibration table, in units of k
BUFFER_RATIOS = (1.0, 1.5, 2.0, 3.0, 4.0)
#: reuse-distance bins (steps since the position was last selected): [lo, next lo)
REUSE_BINS = (1, 2, 3, 5, 9, 17, 33, 65, 129)
#: the profile is taken over steps >= this (each lookup then has this much history)
REUSE_FROM_STEP = 128


@dataclass(frozen=True)
class SelectionSpec:
    """The calibrated process (module docstring). ``scales``/``weights``: noise time scales
    in steps and their amplitudes; ``pool``/``recent``: contenders in units of k; ``recency``
    and ``tau``: the newest positions' bonus and its decay (in units of k)."""

    pool: float = 8.0
    recent: float = 1.0
    recency: float = 1.5
    tau: float = 0.5
    scales: tuple[int, ...] = (1, 4, 16, 64)
    weights: tuple[float, ...] = (0.3, 0.6, 0.8, 1.0)

    def recent_len(self, k: int) -> int:
        return max(1, round(self.recent * k))

    def pool_len(self, k: int) -> int:
        return max(1, round(self.pool * k))


def _unit(x: torch.Tensor) -> torch.Tensor:
    return (_mix(x) & 0xFFFF).to(torch.float32) / 32768.0 - 1.0


def _seed_term(seeds: torch.Tensor, layer: int, salt: int) -> torch.Tensor:
    """int64 [bs, 1]: the hash's per-(request, layer) offset."""
    s = seeds.to(torch.int64).reshape(-1, 1)
    return ((s * 0x2545F491 + layer * 0x9E3779B9 + salt * 0x632BE5AB) * 0x85EBCA77) & _MASK


@dataclass
class CalibratedIndexer:
    """The process for one batch of requests (``seeds`` int64 [bs]) and one prompt length
    ``n0``: ``select(layer, n)`` -> int32 [bs, k], the positions selected at seq_len ``n``
    (``n > n0 - recent``), distinct, in score order. The static pools are drawn on first use
    per layer (one [bs, n0] hash and top-k) and kept."""

    spec: SelectionSpec
    seeds: torch.Tensor
    n0: int
    k: int
    _pools: dict[int, torch.Tensor] = field(default_factory=dict)

    def _pool(self, layer: int) -> torch.Tensor:
        pool = self._pools.get(layer)
        if pool is None:
            R, M = self.spec.recent_len(self.k), self.spec.pool_len(self.k)
            span = self.n0 - R
            if span < M:
                raise ValueError(f"prompt {self.n0} too short for a pool of {M} + window {R} positions")
            pos = torch.arange(span, dtype=torch.int64, device=self.seeds.device)
            h = _mix(pos * 0x1B873593 + _seed_term(self.seeds, layer, 1))
            # Unique keys (hash high bits, then the position): one answer on any device.
            key = (h >> 20 << 20) | pos
            pool = torch.topk(key, M, dim=1).indices
            self._pools[layer] = pool
        return pool

    def scores(self, layer: int, n: int, t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions int64 [bs, M + R], scores float32 [bs, M + R]) of the contenders at ``n``
        positions and step time ``t`` (default ``n``; a compressed stack's decode step moves
        ``t`` every token but ``n`` only every ``compress_ratio`` tokens)."""
        t = n if t is None else t
        sp, dev = self.spec, self.seeds.device
        R = sp.recent_len(self.k)
        pool = self._pool(layer)
        recent = (n - 1 - torch.arange(R, dtype=torch.int64, device=dev)).expand(pool.shape[0], R)
        pos = torch.cat([pool, recent], dim=1)
        base = _seed_term(self.seeds, layer, 2)
        score = sp.recency * torch.exp(-(n - 1 - pos).to(torch.float32) / (sp.tau * self.k))
        for i, (T, w) in enumerate(zip(sp.scales, sp.weights, strict=True)):
            h = pos * 0x9E3779B1 + base + i * 0x38495AB5
            phase = _mix(h + 0x1B873593) % T
            epoch = (t + phase) // T
            score = score + w * _unit(h + epoch * 0x4CF5AD43)
        return pos, score

    def select(self, layer: int, n: int, t: int | None = None) -> torch.Tensor:
        pos, score = self.scores(layer, n, t)
        width = max(int(n).bit_length(), 1)
        ranked = torch.round(score * 2**20).to(torch.int64) * (1 << width) + pos
        top = torch.topk(ranked, self.k, dim=1).indices
        return pos.gather(1, top).to(torch.int32)


class SelectionTable:
    """The calibrated selections of one benchmark point, drawn before any mode is timed:
    ``table`` int32 [A, S, bs, k] for anchors ``anchors`` and seq_lens ``n0 + 1 .. n0 + S``
    (every mode of a point runs the same steps, so all of them read this one table; a runner
    with fewer requests reads the first rows, the same requests). Steps past S are drawn on
    demand (same values). ``compress``: tokens per position (DeepSeek-V4's C4 stack: 4): ``n0``
    and the ``n`` of :meth:`get` stay token counts, positions are entries (``n // compress``),
    and the process's time is the token step, so selections change every step."""

    def __init__(self, spec: SelectionSpec, *, seeds: torch.Tensor, n0: int, k: int,
                 anchors: list[int], steps: int, compress: int = 1) -> None:
        self.compress = compress
        self.indexer = CalibratedIndexer(spec, seeds, n0 // compress, k)
        self.n0, self.anchor_slot = n0, {a: i for i, a in enumerate(anchors)}
        table = torch.empty(len(anchors), steps, seeds.shape[0], k, dtype=torch.int32, device=seeds.device)
        for i, a in enumerate(anchors):
            for t in range(steps):
                table[i, t] = self._draw(a, n0 + 1 + t)
        self.table = table

    def _draw(self, layer: int, n: int) -> torch.Tensor:
        if self.compress == 1:
            return self.indexer.select(layer, n)
        return self.indexer.select(layer, n // self.compress, n)

    def get(self, layer: int, n: int, bs: int) -> torch.Tensor:
        """int32 [bs, k]: the selection of anchor ``layer`` at seq_len ``n`` (tokens)."""
        t = n - self.n0 - 1
        if 0 <= t < self.table.shape[1]:
            return self.table[self.anchor_slot[layer], t, :bs]
        return self._draw(layer, n)[:bs]

    def get_all(self, n: int, bs: int) -> torch.Tensor:
        """int32 [A, bs, k]: every anchor's selection at seq_len ``n`` (one copy per step into a
        runner's static input)."""
        t = n - self.n0 - 1
        if 0 <= t < self.table.shape[1]:
            return self.table[:, t, :bs]
        return torch.stack([self._draw(a, n)[:bs] for a in self.anchor_slot])


# -- calibration -------------------------------------------------------------------------------
def _unique(sel: np.ndarray) -> np.ndarray:
    _, first = np.unique(sel, return_index=True)
    return sel[np.sort(first)]


def reuse_profile(streams: list[Stream], from_step: int = REUSE_FROM_STEP) -> dict[str, float]:
    """Share of lookups (distinct selected positions, newest excluded, steps >= ``from_step``)
    by steps since the position was last selected; ``never`` = not in the stream's history."""
    edges = np.array(REUSE_BINS + (10**9,), dtype=np.int64)
    counts = np.zeros(len(REUSE_BINS) + 1, dtype=np.int64)
    for st in streams:
        last = np.full(int(st.seq_lens[-1]) + 1, -(10**9), dtype=np.int64)
        for t in range(len(st)):
            n = int(st.seq_lens[t])
            s = _unique(st.selection(t).astype(np.int64))
            s = s[s != n - 1]
            if t >= from_step:
                d = t - last[s]
                counts[:-1] += np.histogram(d, bins=edges)[0]
                counts[-1] += int((d >= 10**9).sum())
            last[s] = t
    total = max(int(counts.sum()), 1)
    names = [f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in zip(REUSE_BINS, REUSE_BINS[1:], strict=False)]
    names += [f">={REUSE_BINS[-1]}", "never"]
    return {name: float(c) / total for name, c in zip(names, counts, strict=True)}


def lru_miss_rates(streams: list[Stream], k: int, *, initial: str = "prefix",
                   steps: slice | None = None) -> dict[str, float]:
    """LRU (the kernel's rules) miss rate at each B = ratio * k over ``streams`` (optionally
    only the steps in ``steps``)."""
    out = {}
    for ratio in BUFFER_RATIOS:
        B = round(ratio * k)
        miss = look = 0
        for st in streams:
            r = simulate_stream(st, "lru", B, initial=initial)
            per_step = r.misses_per_step if steps is None else r.misses_per_step[steps]
            idx = range(len(st))[steps] if steps is not None else range(len(st))
            miss += int(per_step.sum())
            look += sum(int(np.unique(st.selection(t)).size) for t in idx)
        out[f"{ratio:g}k"] = miss / look if look else 0.0
    return out


def synthetic_streams(spec: SelectionSpec, *, k: int, n0: int, steps: int, requests: int,
                      layers: int = 1, seed0: int = 1000) -> list[Stream]:
    """The process replayed as trace streams: ``requests`` x ``layers`` streams of ``steps``
    steps starting at seq_len ``n0 + 1`` (CPU)."""
    seeds = torch.arange(seed0, seed0 + requests, dtype=torch.int64)
    idx = CalibratedIndexer(spec, seeds, n0, k)
    out = []
    for layer in range(layers):
        sels = [idx.select(layer, n0 + 1 + t).numpy() for t in range(steps)]
        for b in range(requests):
            rows = [s[b] for s in sels]
            offs = np.zeros(steps + 1, dtype=np.int64)
            offs[1:] = np.cumsum([r.size for r in rows])
            seq = np.arange(n0 + 1, n0 + 1 + steps, dtype=np.int32)
            out.append(Stream(b, layer, seq, offs, np.concatenate(rows).astype(np.int32)))
    return out


def calibration_table(spec: SelectionSpec, *, bench_k: int = 2048, contexts: tuple[int, ...] = (32768, 131072),
                      window: tuple[int, int] = (8, 32), quick: bool = False) -> dict:
    """Recorded traces vs the process at the trace's scale and at the benchmark's. ``window``:
    (warm-up, timed) steps of a benchmark mode, for the miss rate the benchmark itself sees
    (PD admission: slots start empty). ``quick``: fewer streams (the smoke test)."""
    rows = []
    for path in TRACES:
        if not path.exists():
            continue
        tr = load_trace(path)
        streams = list(tr.streams())
        if quick:
            streams = streams[:2]
        k = int(tr.header["top_k"])
        rows.append(dict(source=f"trace {path.name}", k=k, context=int(streams[0].seq_lens[0]),
                         lru_miss=lru_miss_rates(streams, k), reuse=reuse_profile(streams)))
    steps = 160 if quick else 256
    synth = synthetic_streams(spec, k=256, n0=6144, steps=steps, requests=2 if quick else 8)
    rows.append(dict(source="calibrated process, trace scale", k=256, context=6144,
                     lru_miss=lru_miss_rates(synth, 256), reuse=reuse_profile(synth)))
    warm, timed = window
    for n in contexts:
        k = bench_k
        long_steps = 40 if quick else 160
        st = synthetic_streams(spec, k=k, n0=n, steps=long_steps, requests=1 if quick else 2)
        st_b = synthetic_streams(spec, k=k, n0=n, steps=warm + timed, requests=1 if quick else 2)
        rows.append(dict(source=f"calibrated process, benchmark scale {n // 1024}K", k=k, context=n,
                         lru_miss=lru_miss_rates(st, k),
                         reuse=reuse_profile(st, from_step=min(REUSE_FROM_STEP, long_steps // 2)),
                         bench_window_miss_2k=lru_miss_rates(st_b, k, initial="empty",
                                                             steps=slice(warm, warm + timed))["2k"]))
    return dict(spec=asdict(spec), buffer_ratios=list(BUFFER_RATIOS), rows=rows,
                note=("lru_miss: the simulator's LRU (the kernel's rules) over every step, slots "
                      "starting with the prefix; bench_window_miss_2k: B = 2k over the benchmark's timed "
                      "steps after its warm-up, slots starting empty as PD admission leaves them; reuse: "
                      f"share of lookups by steps since last selected (steps >= {REUSE_FROM_STEP}, "
                      "or half the stream at benchmark scale)."))


def format_table(table: dict) -> str:
    lines = []
    ratios = [f"{r:g}k" for r in table["buffer_ratios"]]
    lines.append(f"{'source':<46}{'k':>6}{'ctx':>8} " + " ".join(f"B={r:>4}" for r in ratios))
    for row in table["rows"]:
        lines.append(f"{row['source']:<46}{row['k']:>6}{row['context']:>8} "
                     + " ".join(f"{100 * row['lru_miss'][r]:5.1f}%" for r in ratios))
    lines.append("reuse distance (steps since last selected), share of lookups:")
    names = list(table["rows"][0]["reuse"])
    lines.append(f"{'source':<46}" + "".join(f"{n:>8}" for n in names))
    for row in table["rows"]:
        lines.append(f"{row['source']:<46}" + "".join(f"{100 * row['reuse'][n]:7.1f}%" for n in names))
    for row in table["rows"]:
        if "bench_window_miss_2k" in row:
            lines.append(f"{row['source']}: miss at B = 2k over the benchmark's timed window "
                         f"(slots start empty): {100 * row['bench_window_miss_2k']:.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    table = calibration_table(SelectionSpec(), quick=args.quick)
    print(format_table(table))
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
