"""Every simulator policy on recorded traces at B = 1.5k, 2k, 3k, 4k (k = the trace's top-k;
``--mult`` changes the list): miss rates, the share of the LRU -> Belady gap a policy closes (all
requests, and its worst request), and the per-layer guard: its worst request and worst (request,
layer) against LRU, with the miss counts. CPU only; the tables in docs/traces.md come from here.

    python benchmarks/policy_eval.py --tuning tests/data/smollm2_shakespeare.npz ... \\
        --held-aside tests/data/gemma3_lear_32k.npz ... --json policy_eval.json [--plot eval.png]

A request is one trace stream (all its recorded layers together). "closes" = (lru - p) /
(lru - belady) in misses; "worst vs lru" = max over requests of (p - lru) / lru (negative:
better than LRU on every request); the guard table gives the worst request and the worst
(request, layer) as misses policy / misses lru (``simulator.versus_lru``).

Which traces are which (docs/traces.md, "Traces"): tuning = smollm2_shakespeare,
smollm2_othello_milton, gemma3_twelfth_16k, smollm2_stdlib_code_8k; held aside =
smollm2_code_8k, smollm2_tempest_romeo_8k, gemma3_code_16k, gemma3_lear_32k; held aside 2 =
smollm2_caesar_sonnets_8k, smollm2_licenses_8k, gemma3_inspect_16k, gemma3_pydoc_topics_16k,
gemma3_winters_tale_32k. Decisions look at the tuning set only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_hisparse.traces.format import load_trace  # noqa: E402
from sglang_hisparse.traces.policies import POLICIES  # noqa: E402
from sglang_hisparse.traces.simulator import prepare, simulate_stream, versus_lru  # noqa: E402
from sglang_hisparse.traces.synthetic import ScoreSpec, generate_scored  # noqa: E402

MULTS = (1.5, 2.0, 3.0, 4.0)
SHOWN = ("fifo", "random", "lru-plain", "lru", "lru-2", "lrfu", "fra-float", "fra", "slru", "belady")
#: the kernel's policies besides lru, then the simulator's rank policies (traces with ranks):
#: their gap closed, worst request and request-layers
KERNEL = ("fra", "slru")
RANKED = ("rank:64", "rank:128", "rank")
#: ``--scored``: score-process traces with ranks (synthetic.generate_scored), k 256 (the recorded
#: SmolLM2 traces' k) and m = k: "persistent" scores (rho 0.95, no spikes; slru does worse than
#: lru there) and two with one-step spikes (jitter 1), where slru closes 19-33 % of the gap at
#: 1.5k-2k as on the recorded traces (chosen on slru's figures, not rank's)
SCORED = tuple(ScoreSpec(streams=2, layers=3, prompt_len=6144, steps=256, top_k=256, next_best=256,
                         rho=rho, jitter=jitter, heavy=heavy, seed=11)
               for rho, jitter, heavy in ((0.95, 0.0, 1.0), (0.98, 1.0, 2.0), (0.99, 1.0, 1.5)))


def evaluate(path: str, mults=MULTS) -> dict:
    trace = load_trace(path)
    k = int(trace.header["top_k"])
    t0 = time.perf_counter()
    streams = prepare(trace)
    res: dict = {"trace": Path(path).name, "k": k, "source": trace.header.get("source"), "B": {}}
    for mult in mults:
        B = int(mult * k)
        per: dict[str, dict[int, int]] = {}
        runs: dict[str, list] = {}  # StreamResult per (stream, layer)
        lookups = 0
        for pol in sorted(POLICIES) + (list(RANKED) if trace.has_ranks else []):
            d: dict[int, int] = {}
            runs[pol] = []
            for st in streams:
                r = simulate_stream(st, pol, B)
                d[st.stream] = d.get(st.stream, 0) + r.misses
                runs[pol].append(r)
                if pol == "lru":
                    lookups += r.long_lookups
            per[pol] = d
        units = {pol: [r.misses for r in rs] for pol, rs in runs.items()}
        lru, opt = per["lru"], per["belady"]
        row = {}
        for pol, d in per.items():
            tot = sum(d.values())
            gap = sum(lru.values()) - sum(opt.values())
            row[pol] = {
                "misses": tot,
                "long_miss_rate": tot / lookups if lookups else None,
                "closes": (sum(lru.values()) - tot) / gap if gap else None,
                # None where no request has a gap (or lru misses nothing): nothing to close
                "closes_worst_request": min(((lru[s] - d[s]) / (lru[s] - opt[s]) for s in d if lru[s] > opt[s]),
                                            default=None),
                "worst_vs_lru": max(((d[s] - lru[s]) / lru[s] for s in d if lru[s]), default=None),
                "request_layers_worse_than_lru": sum(a > b for a, b in zip(units[pol], units["lru"], strict=True)),
                "request_layers": len(units[pol]),
                "per_request": d,
                "vs_lru": versus_lru(runs[pol], runs["lru"]),
            }
        res["B"][str(B)] = row
    res["seconds"] = time.perf_counter() - t0
    return res


def table(results: list[dict]) -> str:
    """Miss rates of every shown policy, then per kernel policy (and rank policy, on traces with
    ranks): the gap it closes (all requests / worst request), its worst request against lru, and
    request-layers where it misses more."""
    ranked = [p for p in RANKED if all(p in row for r in results for row in r["B"].values())]
    shown, kernel = (*SHOWN, *ranked), (*KERNEL, *ranked)
    head = ("| trace | B | " + " | ".join(shown) + " | "
            + " | ".join(f"{p} closes (all / worst req.), worst req. vs lru, req.-layers > lru" for p in kernel) + " |")
    lines = [head, "|" + "---|" * (len(shown) + 2 + len(kernel))]
    for r in results:
        for B, row in r["B"].items():
            cells = [_pct(row[p]["long_miss_rate"], ".1f") for p in shown]
            for p in kernel:
                f = row[p]
                cells.append(f"{_pct(f['closes'], '.0f')} / {_pct(f['closes_worst_request'], '.0f')}, "
                             f"{_pct(f['worst_vs_lru'], '+.1f')}, "
                             f"{f['request_layers_worse_than_lru']} of {f['request_layers']}")
            lines.append(f"| {r['trace'].removesuffix('.npz')} | {_mult(B, r['k'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(x: float | None, fmt: str) -> str:
    return "-" if x is None else f"{100 * x:{fmt}} %"


def _mult(B, k) -> str:
    return f"{int(B) / k:g}k"


def _vs(d: dict | None, unit: bool) -> str:
    if d is None:
        return "-"
    who = f"({d['stream']}, {d['layer']})" if unit else f"{d['stream']}"
    pct = "lru 0" if d["ratio"] is None else f"{100 * (d['ratio'] - 1):+.2f} %"
    return f"{who}: {d['misses']} / {d['lru_misses']} ({pct})"


def guard_table(results: list[dict], policies=KERNEL) -> str:
    """The per-layer guard: per trace, B and kernel policy (and rank policy, on traces with
    ranks), its worst request and worst (request, layer) against lru (misses policy / misses
    lru), and how many request-layers miss more than lru / more than 1.01x lru's."""
    policies = (*policies, *(p for p in RANKED if all(p in row for r in results for row in r["B"].values())))
    lines = ["| trace | B | policy | worst request | worst (request, layer) | req.-layers > lru | > 1 % |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        for B, row in r["B"].items():
            for p in policies:
                g = row[p]["vs_lru"]
                lines.append(f"| {r['trace'].removesuffix('.npz')} | {_mult(B, r['k'])} | {p} | "
                             f"{_vs(g['worst_request'], False)} | {_vs(g['worst_request_layer'], True)} | "
                             f"{g['request_layers_worse']} of {g['request_layers']} | {g['request_layers_worse_1pct']} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(results), 5)
    rows = (len(results) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat[len(results):]:
        ax.set_visible(False)
    for ax, r in zip(axes.flat, results, strict=False):  # (the grid may have spare cells)
        bs = sorted(r["B"], key=int)
        for p in (q for q in ("fifo", "lru", "fra", "slru", "rank", "belady") if q in r["B"][bs[0]]):
            ax.plot([int(b) / r["k"] for b in bs], [100 * r["B"][b][p]["long_miss_rate"] for b in bs],
                    marker="o", label=p)
        ax.set_title(f"{r['role']}: {r['trace'].removesuffix('.npz')}", fontsize=8)
        ax.set_xlabel("B / k")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("miss rate, %")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tuning", nargs="*", default=[])
    p.add_argument("--held-aside", nargs="*", default=[],
                   help="traces no tuning decision looked at")
    p.add_argument("--held-aside-2", nargs="*", default=[],
                   help="a second held-aside set, recorded after the policies were fixed")
    p.add_argument("--synthetic", nargs="*", default=[],
                   help="synthetic traces (with ranks: the rank policies are evaluated too)")
    p.add_argument("--scored", default=None, metavar="DIR",
                   help="write the score-process traces of SCORED (with ranks) into DIR and evaluate "
                        "them as synthetic traces")
    p.add_argument("--mult", type=float, nargs="+", default=list(MULTS),
                   help="buffer sizes in units of each trace's k (default 1.5 2 3 4)")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    results = []
    synthetic = list(a.synthetic)
    if a.scored:
        Path(a.scored).mkdir(parents=True, exist_ok=True)
        for spec in SCORED:
            path = str(Path(a.scored) / f"scored_rho{spec.rho:g}_jitter{spec.jitter:g}_heavy{spec.heavy:g}.npz")
            generate_scored(spec, path)
            synthetic.append(path)
    roles = (("tuning", a.tuning), ("held-aside", a.held_aside), ("held-aside-2", a.held_aside_2),
             ("synthetic", synthetic))
    for role, paths in roles:
        for path in paths:
            r = evaluate(path, a.mult)
            r["role"] = role
            results.append(r)
            print(f"{role} {r['trace']}: {r['seconds']:.1f} s", file=sys.stderr)
    Path(a.json).write_text(json.dumps(results, indent=1))
    for role, paths in roles:
        if paths:
            print(f"\n{role}:\n" + table([r for r in results if r["role"] == role]))
            print(f"\n{role}, against lru:\n" + guard_table([r for r in results if r["role"] == role]))
    if a.plot:
        plot(results, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
