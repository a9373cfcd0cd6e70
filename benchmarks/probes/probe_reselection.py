"""Does how often a resident token was picked predict its return? (CPU; docs/traces.md, slru.)

Replays recorded traces under the kernel's lru at B = 2k and, at every long step, takes each
resident token that is not selected: its class is the number of times it was selected since it
entered its slot (1, 2, >= 3; the prefix tokens placed at the first long step are left out), its
outcome whether it is selected again within the next ``--horizon`` steps.

    python benchmarks/probes/probe_reselection.py tests/data/smollm2_shakespeare.npz ... --out r.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_hisparse.traces.format import load_trace  # noqa: E402
from sglang_hisparse.traces.policies import LRU  # noqa: E402
from sglang_hisparse.traces.simulator import PreparedStream, prepare  # noqa: E402

CLASSES = ("1", "2", ">=3")


def stream_counts(st: PreparedStream, B: int, horizon: int, acc: dict[str, list[int]]) -> None:
    work, n = st.work, st.seq_lens
    T = len(work)
    long = np.flatnonzero(n > B)
    if long.size == 0:
        return
    start = int(long[0])
    maxp = int(n.max()) + 1
    pol = LRU()
    pol.reset(B, maxp, list(work[start:]))
    picks = np.zeros(B, dtype=np.int64)  # selections since the slot's token entered (prefix: 0)
    ahead = np.zeros(maxp, dtype=np.int64)  # selections of each position in (t, t + horizon]
    for u in range(start + 1, min(start + 1 + horizon, T)):
        ahead[work[u]] += 1
    for t in range(start, T):
        sel = work[t]
        slots = pol.where[sel]
        hit = slots >= 0
        resident = pol.tok.copy()
        unselected = resident >= 0
        unselected[slots[hit]] = False
        for i, name in enumerate(CLASSES):
            cls = picks == i + 1 if i < 2 else picks >= 3
            toks = resident[unselected & cls]
            acc[name][0] += int(toks.size)
            acc[name][1] += int(np.count_nonzero(ahead[toks]))
        pol.step(t - start, sel, int(n[t]))
        picks[slots[hit]] += 1
        picks[pol.where[sel[~hit]]] = 1
        if t + 1 < T:
            ahead[work[t + 1]] -= 1
        if t + 1 + horizon < T:
            ahead[work[t + 1 + horizon]] += 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+")
    p.add_argument("--horizon", type=int, default=16, help="steps ahead (default 16)")
    p.add_argument("--mult", type=int, default=2, help="B in units of the trace's k (default 2)")
    p.add_argument("--out", help="JSON file")
    a = p.parse_args(argv)
    acc = {c: [0, 0] for c in CLASSES}
    for path in a.traces:
        trace = load_trace(path)
        B = a.mult * int(trace.header["top_k"])
        for st in prepare(trace):
            stream_counts(st, B, a.horizon, acc)
    doc = {"traces": [Path(t).name for t in a.traces], "horizon": a.horizon, "B_over_k": a.mult,
           "classes": {c: {"samples": s, "reselected": r, "rate": r / s if s else None}
                       for c, (s, r) in acc.items()}}
    for c, v in doc["classes"].items():
        print(f"picked {c} since entering: {v['samples']} samples, selected again within "
              f"{a.horizon} steps {100 * (v['rate'] or 0):.1f} %")
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
