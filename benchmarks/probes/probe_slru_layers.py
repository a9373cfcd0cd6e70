"""Why does slru miss more than lru on some (request, layer)? (CPU; issue 49's per-layer guard,
docs/traces.md "The per-layer guard".)

Part 1, per trace and B: every (request, layer) where slru misses more than lru, replayed under
lru and slru in lockstep. Its *extra* misses (positions slru misses and lru hits at the same
step) are classified by the slru level they were evicted from, how often the token had been
selected before, the steps since its last selection and since its eviction; with the layer's
share of first-ever selections, slru's mean level-0 size (against its floor 3B/16) and the mean
residence of an unselected token in level 0 (level-0 size / misses per step) and in lru's whole
evictable part ((B - hits) / misses per step); and whether level 2 protects the wrong tokens:
the share of slru's victims selected again within 8 steps against that of as many of level 2's
oldest evictables (the tokens it kept instead).

Part 2 (``--variants``): rules that lengthen level 0 (smaller level caps, a level-0 floor of c x
the step's misses), each on the given traces at every B: gap closed, worst request and worst
(request, layer) against lru. Run it on the tuning set only: a rule chosen here must not have
looked at a held-aside trace.

    python benchmarks/probes/probe_slru_layers.py tests/data/smollm2_code_8k.npz --out layers.json
    python benchmarks/probes/probe_slru_layers.py --variants <tuning traces> --out variants.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_hisparse.kernel_policy import slru_caps, slru_next  # noqa: E402
from sglang_hisparse.traces import policies  # noqa: E402
from sglang_hisparse.traces.format import load_trace  # noqa: E402
from sglang_hisparse.traces.simulator import prepare, simulate_stream, versus_lru  # noqa: E402

MULTS = (1.5, 2.0, 3.0, 4.0)


SOON = 8  # steps: "selected again soon"


class Traced(policies.SLRU):
    """slru that notes, per evicted token, the level it left from and the step; and per step
    whether its victims and level 2's oldest evictables are selected again within SOON steps."""

    def reset(self, B, max_pos, sels):
        super().reset(B, max_pos, sels)
        self.evicted: dict[int, tuple[int, int]] = {}
        self.level0: list[int] = []
        self.victims_back: list[bool] = []
        self.level2_back: list[bool] = []
        uses: dict[int, list[int]] = {}
        for t, sel in enumerate(sels):
            for x in sel.tolist():
                uses.setdefault(x, []).append(t)
        self.uses = {x: np.array(v) for x, v in uses.items()}

    def _back(self, tok: int, t: int) -> bool:
        u = self.uses.get(tok)
        if u is None:
            return False
        i = int(np.searchsorted(u, t, side="right"))
        return i < u.size and u[i] - t <= SOON

    def step(self, t, sel, n):
        level = np.empty(self.B, np.int64)
        pos = np.arange(self.B)
        level[self.order] = (pos >= self.b1).astype(np.int64) + (pos >= self.b2)
        selected = np.zeros(self.B, dtype=bool)
        slots = self.where[sel]
        selected[slots[slots >= 0]] = True
        kept = self.order[~selected[self.order] & (level[self.order] == 2)]  # oldest first
        before = self.tok.copy()
        m = super().step(t, sel, n)
        gone = [s for s in np.flatnonzero(before != self.tok) if before[s] >= 0]
        for s in gone:
            self.evicted[int(before[s])] = (int(level[s]), t)
            self.victims_back.append(self._back(int(before[s]), t))
        self.level2_back += [self._back(int(before[s]), t) for s in kept[:len(gone)]]
        self.level0.append(self.b1)
        return m


def _q(x) -> list[float]:
    return [float(v) for v in np.percentile(x, [25, 50, 75])] if len(x) else []


def explain(st, B: int) -> dict:
    """Lockstep lru / slru replay of one prepared (stream, layer) at ``B``."""
    t0 = int(np.flatnonzero(st.seq_lens > B)[0])
    work = list(st.work[t0:])
    lru, slru = policies.LRU(), Traced()
    for p in (lru, slru):
        p.reset(B, int(st.seq_lens[-1]), work)
    picks: dict[int, int] = {}
    last: dict[int, int] = {}
    extra, lookups, first, misses, hits = [], 0, 0, [], []
    saved = 0
    for i, sel in enumerate(work):
        lm, sm = lru.where[sel] < 0, slru.where[sel] < 0
        for x in sel[sm & ~lm].tolist():
            lv, te = slru.evicted.get(x, (-1, -1))
            extra.append((lv, picks.get(x, 0), i - last.get(x, 0), i - te))
        saved += int(np.count_nonzero(lm & ~sm))
        misses.append(int(np.count_nonzero(lm)))
        hits.append(sel.size - misses[-1])
        lru.step(i, sel, int(st.seq_lens[t0 + i]))
        slru.step(i, sel, int(st.seq_lens[t0 + i]))
        for x in sel.tolist():
            lookups += 1
            first += x not in picks
            picks[x] = picks.get(x, 0) + 1
            last[x] = i
    e = np.array(extra, dtype=np.int64).reshape(-1, 4)
    m = max(float(np.mean(misses)), 1e-9)
    return {
        "stream": st.stream, "layer": st.layer, "B": B,
        "extra_misses": int(e.shape[0]), "misses_saved": saved,
        "extra_evicted_from_level": [int(np.count_nonzero(e[:, 0] == lv)) for lv in range(3)],
        "extra_picks_before_quartiles": _q(e[:, 1]),
        "extra_picked_3_or_more": float(np.mean(e[:, 1] >= 3)) if e.size else None,
        "extra_steps_since_pick_quartiles": _q(e[:, 2]),
        "extra_steps_since_eviction_quartiles": _q(e[:, 3][e[:, 3] >= 0]),
        "first_selection_share": first / lookups,
        "level0_mean": float(np.mean(slru.level0)), "level0_floor": B - sum(slru_caps(B)),
        "misses_per_step_lru": m,
        "level0_residence_steps": float(np.mean(slru.level0)) / m,
        "lru_residence_steps": (B - float(np.mean(hits))) / m,
        "victims_back_soon": float(np.mean(slru.victims_back)) if slru.victims_back else None,
        "level2_oldest_back_soon": float(np.mean(slru.level2_back)) if slru.level2_back else None,
    }


def _variant(name: str, rule) -> str:
    class V(policies.SLRU):
        def step(self, t, sel, n):
            order = self.order
            hit_at, left, victims = self._take_oldest(sel)
            m = int(victims.size)
            pos = np.arange(self.B)
            level = (pos >= self.b1).astype(np.int64) + (pos >= self.b2)
            n0 = int(np.count_nonzero(~hit_at & (level == 0)))
            n1 = int(np.count_nonzero(~hit_at & (level == 1)))
            h0 = int(np.count_nonzero(hit_at & (level == 0)))
            self.order = np.concatenate((
                order[left & (level == 0)], victims, order[left & (level == 1)],
                order[hit_at & (level == 0)], order[left & (level == 2)], order[hit_at & (level > 0)]))
            self.b1, self.b2 = rule(n0=n0, n1=n1, h0=h0, m=m, buffer=self.B)
            return m

    V.name = name
    policies.POLICIES[name] = V
    return name


def _caps(c1: int, c2: int):
    def rule(*, n0, n1, h0, m, buffer):
        b1, b2 = max(n0, m), max(m, n0 + n1) + h0
        b2 = max(b2, buffer - c2 * buffer // 16)
        return max(b1, b2 - c1 * buffer // 16), b2
    return rule


def _floor(c: int):
    def rule(*, n0, n1, h0, m, buffer):
        b1, b2 = slru_next(n0=n0, n1=n1, h0=h0, m=m, buffer=buffer)
        b1 = max(b1, min(c * m, buffer))
        return b1, max(b2, b1)
    return rule


VARIANTS = {"caps 3/10 (slru)": _caps(3, 10), "caps 3/8": _caps(3, 8), "caps 4/8": _caps(4, 8),
            "caps 5/8": _caps(5, 8), "caps 2/10": _caps(2, 10), "caps 4/10": _caps(4, 10),
            "level 0 >= 2m": _floor(2), "level 0 >= 3m": _floor(3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+")
    p.add_argument("--variants", action="store_true", help="part 2: the level-0 rules (tuning traces only)")
    p.add_argument("--out", help="JSON file")
    a = p.parse_args(argv)
    names = {label: _variant(f"probe:{label}", rule) for label, rule in VARIANTS.items()} if a.variants else {}
    doc = []
    for path in a.traces:
        trace = load_trace(path)
        k = int(trace.header["top_k"])
        streams = prepare(trace)
        for mult in MULTS:
            B = int(mult * k)
            runs = {pol: [simulate_stream(st, pol, B) for st in streams]
                    for pol in ("lru", "slru", "belady", *names.values())}
            gap = sum(r.misses for r in runs["lru"]) - sum(r.misses for r in runs["belady"])
            cell = {"trace": Path(path).name, "B": B, "mult": mult}
            if a.variants:
                cell["variants"] = {
                    label: {"closes": (sum(r.misses for r in runs["lru"]) - sum(r.misses for r in runs[n])) / gap,
                            **versus_lru(runs[n], runs["lru"])} for label, n in names.items()}
                for label, f in cell["variants"].items():
                    w = f["worst_request_layer"]
                    pct = "lru 0" if w["ratio"] is None else f"{100 * (w['ratio'] - 1):+.2f} %"
                    print(f"{cell['trace']} {mult:g}k {label:<16} closes {100 * f['closes']:5.1f} %  worst "
                          f"(request, layer) {pct}  > 1 %: {f['request_layers_worse_1pct']}", flush=True)
            else:
                cell["layers"] = [explain(st, B) for st, s, lr in zip(streams, runs["slru"], runs["lru"], strict=True)
                                  if s.misses > lr.misses]
                for u in cell["layers"]:
                    print(f"{cell['trace']} {mult:g}k ({u['stream']}, {u['layer']}): extra {u['extra_misses']} saved "
                          f"{u['misses_saved']}, from levels {u['extra_evicted_from_level']}, picks before "
                          f"{u['extra_picks_before_quartiles']}, since pick {u['extra_steps_since_pick_quartiles']}, "
                          f"first selections {100 * u['first_selection_share']:.1f} %, level 0 "
                          f"{u['level0_mean']:.0f} (floor {u['level0_floor']}), residence level 0 "
                          f"{u['level0_residence_steps']:.1f} / lru {u['lru_residence_steps']:.1f} steps, back within "
                          f"{SOON}: victims {100 * (u['victims_back_soon'] or 0):.0f} %, level 2's oldest "
                          f"{100 * (u['level2_oldest_back_soon'] or 0):.0f} %", flush=True)
            doc.append(cell)
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
