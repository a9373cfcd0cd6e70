"""``python -m sglang_hisparse simulate``: replay a selection trace through replacement policies."""

from __future__ import annotations

import argparse
import json
import sys

from ..traces.policies import POLICIES, RANK_POLICIES, make_policy

DESCRIPTION = """\
Replay a selection trace (docs/traces.md) through a hot-buffer replacement policy and
report, per layer and overall, the miss rate and host->device bytes per decoded token for
each buffer size B. The hot-buffer rules are the kernel's (docs/architecture.md), so `lru`
reproduces the resolve kernel's misses exactly."""

EPILOG = f"""\
policies: {", ".join(sorted(POLICIES))}, lrfu:LAMBDA; with ranks (a version-2 trace)
  {", ".join(sorted(RANK_POLICIES))}, rank:M; or "all" (the rank policies too when the trace has ranks).
  lru        the kernel: hits ranked ahead of fresh misses
  lru-plain  hits and misses renewed in top-k order
  fifo / random (seeded) / topk-only (only the last selection stays)
  belady     offline optimum on the same trace (a lower bound)
  fra        the kernel's --hisparse-config "policy": "fra" (frequency, recency, token age)
  slru       the kernel's --hisparse-config "policy": "slru" (segmented LRU, three levels)
  fra-float  fra's first proposal in floating point (comparison only)
  lrfu       ours: recency weighted by selection frequency (lrfu:0.25 = default decay)
  lru-2      ours: evict by second-to-last selection
  rank       ours (simulator only): slru whose victims skip the step's next-best ranks (rank:M: the first M)
example:
  python -m sglang_hisparse simulate --trace tests/data/smollm2_shakespeare.npz --policy all \\
      --buffer 256 --buffer 512 --buffer 1024 --json sim.json --plot sim.png"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help="replay a selection trace: miss rate and bytes/token per policy and buffer size",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", required=True, help="trace file (.npz) or trace directory")
    p.add_argument("--policy", action="append", required=True, help="policy name (repeatable, or 'all')")
    p.add_argument("--buffer", type=int, action="append", required=True, help="hot slots B (repeatable)")
    p.add_argument("--top-k", type=int, default=None, help="keep the first K recorded positions per step")
    p.add_argument(
        "--item-bytes", type=int, action="append", default=None, help="bytes per KV row (default 656 and 1152)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy (default 0)")
    p.add_argument(
        "--initial",
        choices=("prefix", "empty"),
        default="prefix",
        help="buffer of a request that starts longer than B: tokens 0..B-1 (local prefill, "
        "default) or empty (PD direct admission)",
    )
    p.add_argument("--json", default=None, help="write all figures to this JSON file")
    p.add_argument("--plot", default=None, help="write a miss-rate-vs-B plot (needs matplotlib)")
    return p


def _policies(names: list[str], ranked: bool = False) -> list[str]:
    """The named policies, "all" expanded (with the rank policies when the trace has ranks)."""
    every = sorted(POLICIES) + (sorted(RANK_POLICIES) if ranked else [])
    out: list[str] = []
    for n in names:
        out += every if n == "all" else [n]
    return list(dict.fromkeys(out))


def _plot(results: dict, path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'sglang-hisparse[plot]'); no plot written"
    fig, ax = plt.subplots(figsize=(6, 4))
    for pol, per_b in results.items():
        bs = sorted(per_b, key=int)
        ax.plot([int(b) for b in bs], [per_b[b]["overall"]["long_miss_rate"] for b in bs], marker="o", label=pol)
    ax.set_xlabel("hot buffer slots B")
    ax.set_ylabel("miss rate (steps with seq_len > B)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _fmt(x: float | None, pct: bool = True) -> str:
    if x is None:
        return "-"
    return f"{100 * x:6.2f}%" if pct else f"{x:10.1f}"


def _vs(d: dict) -> str:
    """``misses/lru_misses (+x.xx %)`` of one guard entry."""
    r = d["ratio"]
    pct = "lru 0" if r is None else f"{100 * (r - 1):+.2f} %"
    return f"{d['misses']}/{d['lru_misses']} ({pct})"


def _guard_lines(results: dict) -> list[str]:
    """The per-layer guard table: each policy's worst request and worst (request, layer) vs lru."""
    rows = [(pol, b, s["vs_lru"]) for pol, per_b in results.items() for b, s in per_b.items() if "vs_lru" in s]
    if not rows:
        return []
    out = ["against lru (misses policy/lru): worst request, worst (request, layer), request-layers worse / > 1 %",
           f"{'policy':<12}{'B':>7}  {'worst request':<32}{'worst (request, layer)':<40}worse  > 1 %  of"]
    for pol, b, g in rows:
        wr, wu = g["worst_request"], g["worst_request_layer"]
        req = "-" if wr is None else f"{wr['stream']}: {_vs(wr)}"
        unit = "-" if wu is None else f"({wu['stream']}, {wu['layer']}): {_vs(wu)}"
        out.append(f"{pol:<12}{b:>7}  {req:<32}{unit:<40}{g['request_layers_worse']:>5}  "
                   f"{g['request_layers_worse_1pct']:>5}  {g['request_layers']}")
    return out


def run(args: argparse.Namespace) -> int:
    from ..traces.format import load_trace
    from ..traces.simulator import DEFAULT_ITEM_BYTES, no_ranks, prepare, simulate
    from .inputs import check_output_path

    items = args.item_bytes or list(DEFAULT_ITEM_BYTES)
    bad = [i for i in items if i <= 0 or i % 16]
    try:
        if bad:
            raise ValueError(f"--item-bytes {bad}: KV row sizes are positive multiples of 16 (e.g. 656, 1152)")
        check_output_path(args.json, "--json")
        check_output_path(args.plot, "--plot")
        try:
            trace = load_trace(args.trace)
        except (ValueError, OSError) as e:
            raise ValueError(f"--trace {args.trace}: {e}") from None
        policies = _policies(args.policy, trace.has_ranks)
        for pol in policies:
            if make_policy(pol).needs_ranks and not trace.has_ranks:  # a bad name or trace fails before any work
                raise ValueError(no_ranks(pol))
        # Each row is de-duplicated once for every policy and B (prepare), not per replay.
        streams = prepare(trace, top_k=args.top_k)
        lru_runs: dict = {}  # lru replayed once per B for every policy's guard
        results = {
            pol: simulate(streams, pol, args.buffer, seed=args.seed, item_bytes=items, initial=args.initial,
                          guard=True, lru_runs=lru_runs)
            for pol in policies
        }
    except ValueError as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    print(f"{'policy':<12}{'B':>7}{'miss rate':>11}{'long miss':>11}  bytes/token " + " ".join(f"@{i}" for i in items))
    for pol, per_b in results.items():
        for b, s in per_b.items():
            o = s["overall"]
            bpt = " ".join(_fmt(o["bytes_per_token"][str(i)], pct=False) for i in items)
            print(f"{pol:<12}{b:>7}{_fmt(o['miss_rate']):>11}{_fmt(o['long_miss_rate']):>11}  {bpt}")
    guard = _guard_lines(results)
    if guard:
        print("\n" + "\n".join(guard))
    if args.json:
        doc = {
            "trace": args.trace,
            "header": trace.header,
            "top_k": args.top_k,
            "item_bytes": items,
            "seed": args.seed,
            "initial": args.initial,
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        why = _plot(results, args.plot, f"{args.trace} (top-k {args.top_k or trace.header.get('top_k')})")
        if why:
            print(f"simulate: {why}", file=sys.stderr)
        else:
            print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="simulate")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    return run(parser.parse_args(["simulate", *(argv if argv is not None else sys.argv[1:])]))


if __name__ == "__main__":
    raise SystemExit(main())
