"""How much of the LRU -> Belady gap can segmented LRU close on a trace, tuned on that trace
itself? (CPU; docs/traces.md, "A bound".) A hindsight bound, run deliberately on held-aside
traces: no shipped setting may come from it.

Levels 0..L-1 over the LRU array (the kernel's slru for L = 3): victims are the oldest
evictables, a miss enters level 0, a hit rises one level, each level keeps its remaining
evictables ahead of what enters it, levels 1..L-1 capped at the given fractions of B. Every
cap setting of a grid, at B = ``--mult`` x k, against lru, fra, slru and belady.

    python benchmarks/probes/probe_policy_bound.py tests/data/smollm2_code_8k.npz --out bound.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_hisparse.traces import policies  # noqa: E402
from sglang_hisparse.traces.format import load_trace  # noqa: E402
from sglang_hisparse.traces.simulator import prepare, simulate_stream  # noqa: E402


class Levels(policies.SLRU):
    """Segmented LRU with ``len(caps) + 1`` levels; ``caps[i]``: level i+1's share of B (the
    victims and the miss bookkeeping are slru's)."""

    caps: tuple[float, ...] = (0.5,)

    def reset(self, B, max_pos, sels):
        super().reset(B, max_pos, sels)
        self.starts = [B] * len(self.caps)  # first LRU position of levels 1..L-1
        self.capn = [int(c * B) for c in self.caps]

    def step(self, t, sel, n):
        order = self.order
        hit_at, left, victims = self._take_oldest(sel)
        pos = np.arange(self.B)
        level = sum((pos >= s).astype(np.int64) for s in self.starts)
        top = len(self.caps)
        parts, sizes = [], []
        for lv in range(top + 1):
            entering = victims if lv == 0 else order[hit_at & (level == lv - 1)] if lv < top \
                else order[hit_at & (level >= lv - 1)]
            rest = order[left & (level == lv)]
            parts += [rest, entering]
            sizes.append(rest.size + entering.size)
        self.order = np.concatenate(parts)
        starts = np.cumsum(sizes)[:-1].tolist()
        hi = self.B
        for i in range(top - 1, -1, -1):  # caps from the top level down
            starts[i] = max(starts[i], hi - self.capn[i])
            hi = starts[i]
        self.starts = starts
        return int(victims.size)


def grid() -> list[tuple[float, ...]]:
    two = [(c,) for c in (0.3, 0.5, 0.7, 0.85, 0.9)]
    three = [(a, b) for a in (0.0625, 0.125, 0.1875, 0.25, 0.375, 0.5)
             for b in (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875) if a + b <= 0.9375]
    return two + three


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+")
    p.add_argument("--mult", type=int, default=2, help="B in units of the trace's k (default 2)")
    p.add_argument("--out", help="JSON file")
    a = p.parse_args(argv)
    names = []
    for caps in grid():
        name = "levels:" + "/".join(f"{c:g}" for c in caps)
        policies.POLICIES[name] = type("L", (Levels,), {"name": name, "caps": caps})
        names.append(name)
    doc = []
    for path in a.traces:
        trace = load_trace(path)
        B = a.mult * int(trace.header["top_k"])
        streams = prepare(trace)
        misses = {pol: sum(simulate_stream(st, pol, B).misses for st in streams)
                  for pol in ["lru", "belady", "fra", "slru", *names]}
        gap = misses["lru"] - misses["belady"]
        closes = {pol: (misses["lru"] - v) / gap for pol, v in misses.items()}
        best = max(names, key=closes.get)
        doc.append({"trace": Path(path).name, "B": B, "misses": misses, "closes": closes, "best": best})
        print(f"{Path(path).name} B={B}: fra {100 * closes['fra']:.0f} %, slru {100 * closes['slru']:.0f} %, "
              f"best of {len(names)} cap settings {best} {100 * closes[best]:.0f} %", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
