"""What could next-best ranks buy on the recorded traces, which have none? (CPU; issue 49,
docs/traces.md "`rank`".) No decision uses it: it is run deliberately on every set.

Retention: the ``rank`` policy replayed with *oracle* ranks, the next-best of step t being the
positions that the next ``h`` selections pick and step t does not (first-use order, at most k):
what rank-aware retention would close if the indexer's ranks named exactly the tokens about to
be picked (h = 1), or the next four steps' (h = 4). Not a strict bound on the real policy (real
next-best also hold tokens picked later, and miss some), but the figure a perfect next-step
predictor of k tokens reaches.

Prefetch (``--prefetch``, traces with ranks): of each policy's misses at step t + 1, the share
whose token was among step t's next-best and not resident then: what a lookahead prefetch of the
next-best, and no retention rule, could take off the critical path.

    python benchmarks/probes/probe_rank_oracle.py --tuning <traces> --held-aside <traces> --out o.json
    python benchmarks/probes/probe_rank_oracle.py --prefetch scored.npz --out p.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_hisparse.traces.format import load_trace  # noqa: E402
from sglang_hisparse.traces.policies import make_policy  # noqa: E402
from sglang_hisparse.traces.simulator import PreparedStream, prepare, simulate_stream  # noqa: E402

MULTS = (1.5, 2.0, 3.0, 4.0)
HORIZONS = (1, 4)


def with_oracle_ranks(ps: PreparedStream, horizon: int, m: int) -> PreparedStream:
    """``ps`` whose next-best at step t are the first ``m`` positions the next ``horizon`` steps
    select and step t does not (newest tokens excluded), in first-use order."""
    newest = ps.seq_lens.astype(np.int64) - 1
    out = []
    for t in range(len(ps)):
        nxt = ps.work[t + 1 : t + 1 + horizon]
        c = np.concatenate(nxt) if nxt else np.zeros(0, np.int64)
        _, first = np.unique(c, return_index=True)
        c = c[np.sort(first)]
        out.append(c[~np.isin(c, ps.work[t]) & (c != newest[t])][:m])
    return dataclasses.replace(ps, next_best=tuple(out))


def retention(path: str) -> dict:
    trace = load_trace(path)
    k = int(trace.header["top_k"])
    streams = prepare(trace)
    oracles = {h: [with_oracle_ranks(st, h, k) for st in streams] for h in HORIZONS}
    cells = {}
    for mult in MULTS:
        B = int(mult * k)
        miss = {p: sum(simulate_stream(st, p, B).misses for st in streams) for p in ("lru", "slru", "belady")}
        for h, sts in oracles.items():
            miss[f"rank, oracle h={h}"] = sum(simulate_stream(st, "rank", B).misses for st in sts)
        gap = miss["lru"] - miss["belady"]
        cells[str(B)] = {"mult": mult, "misses": miss,
                         "closes": {p: (miss["lru"] - v) / gap if gap else None for p, v in miss.items()}}
    return {"trace": Path(path).name, "k": k, "B": cells}


def prefetch_share(path: str, policies=("lru", "slru", "rank", "belady")) -> dict:
    trace = load_trace(path)
    if not trace.has_ranks:
        raise ValueError(f"{path}: --prefetch needs a trace with next-best ranks")
    k = int(trace.header["top_k"])
    streams = prepare(trace)
    cells = {}
    for mult in MULTS:
        B = int(mult * k)
        row = {}
        for pol in policies:
            total = ahead = 0
            for st in streams:
                t0 = int(np.flatnonzero(st.seq_lens > B)[0])
                work, nbs = list(st.work[t0:]), list(st.next_best[t0:])
                p = make_policy(pol)
                if p.needs_ranks:
                    p.use_ranks(nbs)
                p.reset(B, int(st.seq_lens[-1]), work)
                prev_nb = None
                for i, sel in enumerate(work):
                    miss = sel[p.where[sel] < 0]
                    if prev_nb is not None:
                        total += miss.size
                        ahead += int(np.count_nonzero(np.isin(miss, prev_nb)))
                    # what a prefetch could fetch for step i + 1: step i's next-best not resident now
                    prev_nb = nbs[i][p.where[nbs[i]] < 0]
                    p.step(i, sel, int(st.seq_lens[t0 + i]))
            row[pol] = {"misses": total, "in_previous_next_best_not_resident": ahead / total if total else None}
        cells[str(B)] = {"mult": mult, **row}
    return {"trace": Path(path).name, "k": k, "B": cells}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for role in ("tuning", "held-aside", "held-aside-2"):
        p.add_argument(f"--{role}", nargs="*", default=[])
    p.add_argument("--prefetch", nargs="*", default=[], help="traces with ranks: the prefetch share")
    p.add_argument("--out", help="JSON file")
    a = p.parse_args(argv)
    doc: dict = {"retention": [], "prefetch": []}
    for role in ("tuning", "held_aside", "held_aside_2"):
        for path in getattr(a, role):
            r = retention(path)
            r["role"] = role.replace("_", "-")
            doc["retention"].append(r)
            for c in r["B"].values():
                cl = c["closes"]
                print(f"{r['role']} {r['trace']} {c['mult']:g}k: slru {100 * cl['slru']:.0f} %, rank with oracle ranks "
                      + ", ".join(f"h={h} {100 * cl[f'rank, oracle h={h}']:.0f} %" for h in HORIZONS), flush=True)
    for path in a.prefetch:
        r = prefetch_share(path)
        doc["prefetch"].append(r)
        for c in r["B"].values():
            print(f"{r['trace']} {c['mult']:g}k: misses in the previous step's next-best, not resident then: "
                  + ", ".join(f"{pol} {100 * c[pol]['in_previous_next_best_not_resident']:.0f} %"
                              for pol in ("lru", "slru", "rank", "belady")), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
