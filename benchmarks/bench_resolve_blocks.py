"""MiniMax-M3's block top-k through the resolve kernel: the block build (block ids expanded in
the kernel) against the token build on the same positions, in one run (issue 31).

```
python benchmarks/bench_resolve_blocks.py --out /tmp/b      # H200, ~1 min after the builds
```

Per batch (1 / 16 / 64) and block churn (0 / 5 / 15 % of a row's blocks replaced per step):
M3's selection, 16 blocks of 128 positions (k 2048), B 4096, 1152-byte rows, 32K context. A
cycle of 20 selections per row (each with its own fresh blocks) is captured in a CUDA graph
and replayed, so both builds resolve the same misses every step (``misses_per_row``). Timed
with CUDA events over the graph's 20 resolves, median of ``--reps`` replays, per resolve, for

```
token       the token build on positions expanded beforehand (the expansion not timed)
token+exp   the same plus reference.expand_blocks in torch (what swap_in_blocks did before the
            block build: an expanded [bs, k] index tensor in HBM per layer)
block       the block build on the block ids (no expanded tensor)
block_split the block build over the host rows' K and V halves in separate arrays (KV_SPLIT_HOST:
            MiniMax-M3 served PD, ROWL 3)
```

in NO_IO (bookkeeping only) and COPY modes. Every block-build result is compared bit for bit
with the token build's on the same inputs (out rows, slot tokens, LRU, device rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the test support (hisparse_testing/) is not installed: it imports from the checkout's root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hisparse_testing.engine import warm_and_capture
from sglang_hisparse.kernels import ops
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.contract import MissPlan, ResolveMode
from sglang_hisparse.kernels.row_layout import KV_SPLIT_HOST, TOKEN
from sglang_hisparse.kernels.synthetic import make_state

#: resolves per captured graph: one cycle of selections, replayed
STEPS_PER_GRAPH = 20


def record_plans(steady, sels, req, lens, nr, host_cache, k: int, **resolve_kw) -> list[MissPlan]:
    """One miss plan per step of the cycle, resolved eagerly (COPY) from ``steady`` = (state
    dict, device cache), which it advances; ``resolve_kw``: the build's extra ``ops.resolve``
    arguments (``selection_block``, ``row_layout``)."""
    state, dc = steady
    bs, dev = req.shape[0], req.device
    out = torch.empty(bs, k, dtype=torch.int32, device=dev)
    plans = []
    for i in range(STEPS_PER_GRAPH):
        plan = MissPlan.empty(bs, k, dev)
        ops.resolve(top_k=sels[i], req_index=req, seq_lens=lens, num_real_reqs=nr,
                    slot_tokens=state["slot_tokens"], slot_rows=state["slot_rows"], lru=state["lru"],
                    host_rows=state["host_rows"], host_cache=host_cache, device_cache=dc, out_rows=out,
                    plan=plan, mode=ResolveMode.COPY, validate=False, **resolve_kw)
        plans.append(plan)
    return plans


def grid_arguments(ap: argparse.ArgumentParser, *, top_k: int, buffer: int) -> None:
    """The flags both block and C4 benchmarks take: output, batches, churns, k, B, replays."""
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--churns", type=float, nargs="+", default=[0.0, 0.05, 0.15])
    ap.add_argument("--top-k", type=int, default=top_k)
    ap.add_argument("--buffer", type=int, default=buffer)
    ap.add_argument("--reps", type=int, default=30)


def graph_us(graph: torch.cuda.CUDAGraph, reps: int, per: int = STEPS_PER_GRAPH) -> float:
    """Median over ``reps`` replays of ``graph`` (CUDA events), per one of its ``per`` steps, µs."""
    times = []
    for _ in range(reps):
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        graph.replay()
        s1.record()
        torch.cuda.synchronize()
        times.append(s0.elapsed_time(s1) * 1e3 / per)
    return round(statistics.median(times), 2)


def run_grid(run, args, name: str, exact_keys: tuple[str, ...]) -> int:
    """``run(bs, churn, args)`` over the batches x churns, one JSON line each, the report to
    ``args.out / f"{name}.json"``; 0 when every record's ``exact_keys`` hold (absent: true)."""
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for bs in args.batches:
        for churn in args.churns:
            r = run(bs, churn, args)
            rows.append(r)
            print(json.dumps(r), flush=True)
    report = dict(config={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  device=torch.cuda.get_device_name(), rows=rows)
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=1))
    return 0 if all(r.get(key, True) for r in rows for key in exact_keys) else 1


def _selections(n: int, nb: int, block: int, churn: float, g: torch.Generator) -> list[torch.Tensor]:
    """STEPS_PER_GRAPH selections of ``nb`` distinct blocks of a row of ``n`` tokens: the newest
    block and ``nb - 1 - swap`` others in every step, plus ``swap = round(churn * (nb - 1))``
    blocks of a step's own, never in another step of the cycle (so the cycle's blocks outgrow
    the hot buffer and the fresh ones miss)."""
    have = -(-n // block)
    swap = round(churn * (nb - 1))
    perm = torch.randperm(have - 1, generator=g)
    base = torch.cat([perm[: nb - 1 - swap], torch.tensor([have - 1])])
    pool = perm[nb - 1 - swap:]
    if pool.numel() < swap * STEPS_PER_GRAPH:
        raise ValueError(f"--context {n} has too few blocks for churn {churn}; raise --context.")
    return [torch.cat([pool[swap * j : swap * (j + 1)], base]).to(torch.int32) for j in range(STEPS_PER_GRAPH)]


def _ceiling(steady, sel_blocks, req, lens, nr, host_cache, block: int, k: int, args) -> dict:
    """The same-run ceiling: each step's misses (recorded eagerly from the block build's steady
    state, one plan per step of the cycle) copied by the plain scattered gather
    (``_jit.gather_module``, one warp per row, full grid), captured and timed as the resolves."""
    from bench_resolve import plan_rows

    from sglang_hisparse.kernels import _jit

    _, dc = steady
    flat = [plan_rows(p) for p in record_plans(steady, sel_blocks, req, lens, nr, host_cache, k,
                                                 selection_block=block)]
    rows = sum(int(f[0].numel()) for f in flat) / STEPS_PER_GRAPH
    if not rows:
        return dict(ceiling_us=None, ceiling_rows_per_step=0)
    gather = _jit.gather_module(args.item).gather
    us = graph_us(warm_and_capture(lambda: [gather(f[0], f[1], host_cache, dc) for f in flat]), args.reps)
    return dict(ceiling_us=round(us, 2), ceiling_rows_per_step=round(rows, 1),
                ceiling_gbps=round(rows * args.item / (us * 1e-6) / 1e9, 2))


def run(bs: int, churn: float, args) -> dict:
    k, B, item, block, n = args.top_k, args.buffer, args.item, args.block, args.context
    g = torch.Generator().manual_seed(bs * 100 + int(churn * 100))
    st = make_state(seq_lens=[n] * bs, B=B, item=item, max_ctx=n + 64, pin=True, seed=bs)
    dev = torch.device("cuda")
    nb = k // block
    per_row = [_selections(n, nb, block, churn, g) for _ in range(bs)]
    sel_blocks = [torch.stack([sel[j] for sel in per_row]).to(dev) for j in range(STEPS_PER_GRAPH)]
    lens = torch.full((bs,), n, dtype=torch.int64, device=dev)
    sel_pos = [ref.expand_blocks(b, lens, block) for b in sel_blocks]
    req = torch.arange(bs, dtype=torch.int64, device=dev)
    nr = torch.tensor([bs], dtype=torch.int32, device=dev)
    base = {name: getattr(st, name).to(dev) for name in ("slot_tokens", "slot_rows", "lru", "host_rows")}
    dcache = st.device_cache.to(dev)
    out = torch.empty(bs, k, dtype=torch.int32, device=dev)
    plan = MissPlan.empty(bs, k, dev)
    rec: dict = dict(batch=bs, churn=churn)
    finals = {}
    # the host rows' K and V halves in separate arrays (KV_SPLIT_HOST, MiniMax-M3 served PD)
    half = item // 2
    split_host = torch.cat([st.host_cache[:, :half], st.host_cache[:, half:]]).contiguous().pin_memory()
    for mode in (ResolveMode.NO_IO, ResolveMode.COPY):
        for variant in ("token", "token+exp", "block", "block_split"):
            state = {name: t.clone() for name, t in base.items()}
            dc = dcache.clone()

            def steps(state=state, dc=dc, mode=mode, variant=variant) -> None:
                for i in range(STEPS_PER_GRAPH):
                    layout, hc = (KV_SPLIT_HOST, split_host) if variant == "block_split" else (TOKEN, st.host_cache)
                    if variant.startswith("block"):
                        tk, blk = sel_blocks[i], block
                    elif variant == "token+exp":
                        tk, blk = ref.expand_blocks(sel_blocks[i], lens, block), 0
                    else:
                        tk, blk = sel_pos[i], 0
                    ops.resolve(top_k=tk, req_index=req, seq_lens=lens, num_real_reqs=nr,
                                slot_tokens=state["slot_tokens"], slot_rows=state["slot_rows"], lru=state["lru"],
                                host_rows=state["host_rows"], host_cache=hc, device_cache=dc,
                                out_rows=out, plan=plan, mode=mode, validate=False, selection_block=blk,
                                row_layout=layout)

            # NOTE: a CUDA graph of STEPS_PER_GRAPH resolves (A, B, A, ...), replayed: GPU time
            # without the Python launch gaps a single small launch would be timed with.
            graph = warm_and_capture(steps)
            graph.replay()
            rec[f"{mode.name.lower()}_{variant}_us"] = graph_us(graph, args.reps)
            if mode is ResolveMode.COPY and variant == "block":
                # misses of the graph's last resolve (a steady step of the cycle), per batch row
                rec["misses_per_row"] = round(float(plan.count.float().mean()), 1)
            finals[(mode, variant)] = (out.clone(), state["slot_tokens"].clone(), state["lru"].clone(), dc.clone())
            if mode is ResolveMode.COPY and variant == "block":
                steady = ({name: t.clone() for name, t in state.items()}, dc.clone())
        a = finals[(mode, "token")]
        rec[f"{mode.name.lower()}_exact"] = all(
            torch.equal(x, y) for v in ("block", "block_split") for x, y in zip(a, finals[(mode, v)], strict=True))
    rec.update(_ceiling(steady, sel_blocks, req, lens, nr, st.host_cache, block, k, args))
    rec["copy_block_over_ceiling"] = (round(rec["copy_block_us"] / rec["ceiling_us"], 3)
                                      if rec.get("ceiling_us") else None)
    for mode in ("no_io", "copy"):
        rec[f"{mode}_block_over_token"] = round(rec[f"{mode}_block_us"] / rec[f"{mode}_token_us"], 4)
        rec[f"{mode}_block_over_token_exp"] = round(rec[f"{mode}_block_us"] / rec[f"{mode}_token+exp_us"], 4)
        rec[f"{mode}_split_over_block"] = round(rec[f"{mode}_block_split_us"] / rec[f"{mode}_block_us"], 4)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    grid_arguments(ap, top_k=2048, buffer=4096)
    ap.add_argument("--block", type=int, default=128, help="positions per block (MiniMax-M3: 128)")
    ap.add_argument("--item", type=int, default=1152)
    ap.add_argument("--context", type=int, default=32768)
    args = ap.parse_args(argv)
    return run_grid(run, args, "bench_resolve_blocks", ("no_io_exact", "copy_exact"))

if __name__ == "__main__":
    sys.exit(main())
