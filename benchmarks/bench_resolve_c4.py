"""DeepSeek-V4's C4 row layouts through the resolve and replay kernels: the C4 builds (entries
paged as FlashMLA reads them, ``kernels.row_layout.C4_PAGED``; with the host rows in the same
pages, ``C4_PAGED_HOST``, as SGLang's PD transfer writes them) against the token build on the
same 592-byte rows and against the same-run gather ceiling, in one run (issue 31).

```
python benchmarks/bench_resolve_c4.py --out /tmp/c4      # H200, ~1 min after the builds
```

Per batch (1 / 16 / 64) and churn (0 / 5 / 15 % of a row's 511 non-newest entries fresh each
step): V4's C4 selection, top-512 compressed entries of a 32K-token context (8192 entries), B
1024, host rows of 592 B (584 used). A cycle of 20 selections per row is captured in a CUDA
graph and replayed, so both builds resolve the same misses every step. Timed with CUDA events
over the graph's 20 resolves (median of ``--reps`` replays, per resolve):

```
token   the token build: device rows [D, 592] (the layout a flat C4 pool would have)
c4      the C4 build: device rows paged, 64 entries per 37440-byte page (data, then tails)
c4 host the C4 build with the host rows in the same pages (a miss reads 576 + 8 B apart)
gather  the ceiling: each step's misses copied by the plain scattered gather (token rows)
replay  the copy-only replay of one step's plan into another layer, token and C4 builds
```

in NO_IO (bookkeeping only) and COPY modes. The C4 build's out rows, slot tokens and LRU are
compared with the token build's, and its device entries (read through the layout) with the
token build's rows, bit for bit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_resolve import plan_rows  # noqa: E402
from bench_resolve_blocks import (  # noqa: E402
    STEPS_PER_GRAPH,
    _selections,
    graph_us,
    grid_arguments,
    record_plans,
    run_grid,
)

from hisparse_testing.engine import warm_and_capture  # noqa: E402
from sglang_hisparse.kernels import _jit, ops  # noqa: E402
from sglang_hisparse.kernels.contract import MissPlan, ResolveMode  # noqa: E402
from sglang_hisparse.kernels.row_layout import C4_PAGED, C4_PAGED_HOST, TOKEN  # noqa: E402
from sglang_hisparse.kernels.synthetic import make_state  # noqa: E402

ITEM = C4_PAGED.host_item()


def _paged(token_cache: torch.Tensor) -> torch.Tensor:
    rows = token_cache.shape[0]
    paged = torch.zeros((-(-rows // 64), C4_PAGED.page_bytes), dtype=torch.uint8, device=token_cache.device)
    C4_PAGED.write(paged, torch.arange(rows, device=token_cache.device), token_cache)
    return paged


def run(bs: int, churn: float, args) -> dict:
    k, B, n = args.top_k, args.buffer, args.entries
    g = torch.Generator().manual_seed(bs * 100 + int(churn * 100))
    st = make_state(seq_lens=[n] * bs, B=B, item=ITEM, max_ctx=n + 64, pin=True, seed=bs)
    dev = torch.device("cuda")
    per_row = [_selections(n, k, 1, churn, g) for _ in range(bs)]
    sels = [torch.stack([s[j] for s in per_row]).to(dev) for j in range(STEPS_PER_GRAPH)]
    lens = torch.full((bs,), n, dtype=torch.int64, device=dev)
    req = torch.arange(bs, dtype=torch.int64, device=dev)
    nr = torch.tensor([bs], dtype=torch.int32, device=dev)
    base = {name: getattr(st, name).to(dev) for name in ("slot_tokens", "slot_rows", "lru", "host_rows")}
    token_cache = st.device_cache.to(dev)
    out = torch.empty(bs, k, dtype=torch.int32, device=dev)
    plan = MissPlan.empty(bs, k, dev)
    rec: dict = dict(batch=bs, churn=churn)
    finals, steady = {}, None
    paged_host = _paged(st.host_cache).pin_memory()
    for mode in (ResolveMode.NO_IO, ResolveMode.COPY):
        for layout in (TOKEN, C4_PAGED, C4_PAGED_HOST):
            state = {name: t.clone() for name, t in base.items()}
            dc = token_cache.clone() if layout is TOKEN else _paged(token_cache)
            hc = paged_host if layout.host_paged else st.host_cache

            def steps(state=state, dc=dc, hc=hc, mode=mode, layout=layout) -> None:
                for i in range(STEPS_PER_GRAPH):
                    ops.resolve(top_k=sels[i], req_index=req, seq_lens=lens, num_real_reqs=nr,
                                slot_tokens=state["slot_tokens"], slot_rows=state["slot_rows"], lru=state["lru"],
                                host_rows=state["host_rows"], host_cache=hc, device_cache=dc,
                                out_rows=out, plan=plan, mode=mode, validate=False, row_layout=layout)

            graph = warm_and_capture(steps)
            graph.replay()
            rec[f"{mode.name.lower()}_{layout.name}_us"] = graph_us(graph, args.reps)
            rows = torch.arange(token_cache.shape[0], device=dev)
            finals[(mode, layout.name)] = (out.clone(), state["slot_tokens"].clone(), state["lru"].clone(),
                                           layout.read(dc, rows)[:, :584].clone())
            if mode is ResolveMode.COPY:
                rec["misses_per_row"] = round(float(plan.count.float().mean()), 1)
                if layout is C4_PAGED:
                    steady = ({name: t.clone() for name, t in state.items()}, dc.clone())
        a = finals[(mode, "token")]
        rec[f"{mode.name.lower()}_exact"] = all(
            torch.equal(x, y) for name in ("c4_paged", "c4_paged_host") for x, y in zip(a, finals[(mode, name)], strict=True))
    rec.update(_copies(steady, sels, req, lens, nr, st.host_cache, k, args, paged_host))
    for mode in ("no_io", "copy"):
        rec[f"{mode}_c4_over_token"] = round(rec[f"{mode}_c4_paged_us"] / rec[f"{mode}_token_us"], 4)
        rec[f"{mode}_host_paged_over_c4"] = round(rec[f"{mode}_c4_paged_host_us"] / rec[f"{mode}_c4_paged_us"], 4)
    if rec.get("gather_us"):
        rec["copy_c4_over_gather"] = round(rec["copy_c4_paged_us"] / rec["gather_us"], 3)
    return rec


def _copies(steady, sels, req, lens, nr, host_cache, k: int, args, paged_host) -> dict:
    """Each step's plan recorded eagerly from the C4 build's steady state; the gather ceiling
    over those rows, and the replay of the same plans (token and C4 builds) into other buffers."""
    _, dc = steady
    dev = req.device
    plans = record_plans(steady, sels, req, lens, nr, host_cache, k, row_layout=C4_PAGED)
    flat = [plan_rows(p) for p in plans]
    rows = sum(int(f[0].numel()) for f in flat) / STEPS_PER_GRAPH
    if not rows:
        return dict(gather_us=None, copied_rows_per_step=0)
    token_dst = torch.zeros((dc.shape[0] * 64, ITEM), dtype=torch.uint8, device=dev)
    gather = _jit.gather_module(ITEM).gather
    rec = dict(copied_rows_per_step=round(rows, 1))
    rec["gather_us"] = graph_us(warm_and_capture(lambda: [gather(s, d, host_cache, token_dst) for s, d in flat]),
                                args.reps)
    rec["gather_gbps"] = round(rows * ITEM / (rec["gather_us"] * 1e-6) / 1e9, 2)
    paged_dst, host_paged_dst = torch.zeros_like(dc), torch.zeros_like(dc)
    for name, layout, target in (("token", TOKEN, token_dst), ("c4_paged", C4_PAGED, paged_dst),
                                 ("c4_paged_host", C4_PAGED_HOST, host_paged_dst)):
        hc = paged_host if layout.host_paged else host_cache
        graph = warm_and_capture(lambda layout=layout, target=target, hc=hc: [
            ops.replay(plan=p, num_real_reqs=nr, host_cache=hc, device_cache=target, row_layout=layout)
            for p in plans])
        rec[f"replay_{name}_us"] = graph_us(graph, args.reps)
    rows_all = torch.arange(token_dst.shape[0], device=dev)
    rec["replay_exact"] = all(torch.equal(C4_PAGED.read(t, rows_all)[:, :584], token_dst[:, :584])
                              for t in (paged_dst, host_paged_dst))
    rec["replay_c4_over_token"] = round(rec["replay_c4_paged_us"] / rec["replay_token_us"], 3)
    rec["replay_host_paged_over_c4"] = round(rec["replay_c4_paged_host_us"] / rec["replay_c4_paged_us"], 3)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    grid_arguments(ap, top_k=512, buffer=1024)  # DeepSeek-V4's 512 compressed entries
    ap.add_argument("--entries", type=int, default=8192, help="compressed entries of a request (32K tokens / 4)")
    args = ap.parse_args(argv)
    return run_grid(run, args, "bench_resolve_c4", ("no_io_exact", "copy_exact", "replay_exact"))

if __name__ == "__main__":
    sys.exit(main())
