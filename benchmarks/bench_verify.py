"""Verify-step resolve benchmark (speculative decoding, W = n+1 rows per request; GPU, JSON out).

Steady-state synthetic verify trace per request (k = 2048): a shared history list L_t of k-1
positions; verify row j selects the window positions base..base+j plus L_t's first k-1-j
entries, and rows j >= 1 swap ``spread*k`` of those for row-specific fresh positions. Each
step replaces ``churn*k`` entries of L_t with positions never resident before, so every step's
union misses exactly ``churn*k + (W-1)*spread*k`` rows (everything else was selected the step
before: hits). Each measurement is a CUDA graph of ``--steps`` back-to-back launches (state
restored between replays, outside the timed region), median of ``--reps`` replays / steps
(bench_resolve.time_graphs, which also spins the GPU up before each replay).

Per config: verify µs (COPY), no-IO µs (bookkeeping only), IO GB/s (union miss bytes / COPY
time) and, in the same run, the ceiling: a plain scattered gather (one warp per row, full grid)
of the same rows from the same pinned host pool (``io_ratio`` = ceiling µs / verify µs).

    python benchmarks/bench_verify.py --out-dir /tmp/verify          # full sweep
    python benchmarks/bench_verify.py --quick --out-dir /tmp/verify  # a few configs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_hisparse.kernels import _jit  # noqa: E402
from sglang_hisparse.kernels.contract import MissPlan, ResolveMode  # noqa: E402
from sglang_hisparse.kernels.verify_ops import resolve_verify  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_resolve import GraphTimer, plan_rows, time_graphs  # noqa: E402

DEV = "cuda"


def make_trace(*, bs, W, k, B, ctx, churn, spread, steps, host_rows_total, seed):
    """State [bs, B+W] + top_k [steps+1, bs, W, k] (step 0: all hits) + misses per step."""
    g = torch.Generator().manual_seed(seed)
    base = ctx - 1  # rows-0 length n0 = ctx; window positions ctx-1 .. ctx+W-2
    slot_tokens = torch.full((bs, B + W), -1, dtype=torch.int32)
    lru = torch.empty(bs, B, dtype=torch.int16)
    top_k = torch.empty(steps + 1, bs, W, k, dtype=torch.int32)
    m_core, m_row = round(churn * k), round(spread * k)
    for r in range(bs):
        perm = torch.randperm(base, generator=g)
        resident, fresh = perm[:B], perm[B:]
        need = steps * (m_core + (W - 1) * m_row)
        if need > fresh.numel():
            raise ValueError(f"ctx {ctx} too short: {need} fresh positions needed")
        slot_tokens[r, :B] = resident.int()
        slot_tokens[r, B:] = torch.arange(base, base + W, dtype=torch.int32)
        lru[r] = torch.randperm(B, generator=g).to(torch.int16)
        hist, nxt = resident[: k - 1].clone(), 0
        for t in range(steps + 1):
            if t:
                at = torch.randperm(k - 1, generator=g)[:m_core]
                hist[at] = fresh[nxt: nxt + m_core]
                nxt += m_core
            for j in range(W):
                row_hist = hist[: k - 1 - j].clone()
                if t and j:
                    at = torch.randperm(k - 1 - j, generator=g)[:m_row]
                    row_hist[at] = fresh[nxt: nxt + m_row]
                    nxt += m_row
                row = torch.cat([torch.arange(base, base + j + 1), row_hist])
                top_k[t, r, j] = row[torch.randperm(k, generator=g)].int()
    rows = (1 + torch.arange(bs * (B + W), dtype=torch.int32)).view(bs, B + W)
    host_rows = torch.randint(0, host_rows_total, (bs, ctx + W), generator=g)
    return dict(slot_tokens=slot_tokens.to(DEV), lru=lru.to(DEV), slot_rows=rows.to(DEV),
                host_rows=host_rows.to(DEV), top_k=top_k.to(DEV),
                misses=bs * (m_core + (W - 1) * m_row))


def bench_config(host_pool, *, bs, W, k, B, item, ctx, churn, spread, steps, reps, block, ctas):
    n = host_pool.numel() // item
    host = host_pool[: n * item].view(n, item)
    tr = make_trace(bs=bs, W=W, k=k, B=B, ctx=ctx, churn=churn, spread=spread, steps=steps,
                    host_rows_total=n, seed=bs + B)
    dev_cache = torch.empty(1 + bs * (B + W), item, dtype=torch.uint8, device=DEV)
    st0, lru0 = tr["slot_tokens"].clone(), tr["lru"].clone()
    req = torch.arange(bs, device=DEV)
    lens = (ctx + torch.arange(W, device=DEV)).repeat(bs, 1).int()
    nr = torch.tensor([bs], dtype=torch.int32, device=DEV)
    out = torch.empty(bs, W, k, dtype=torch.int32, device=DEV)
    plans = [MissPlan.empty(bs, W * k, DEV) for _ in range(steps + 1)]

    def restore():
        tr["slot_tokens"].copy_(st0)
        tr["lru"].copy_(lru0)

    def verify(t, mode=ResolveMode.COPY, plan=None):
        resolve_verify(top_k=tr["top_k"][t], req_index=req, seq_lens=lens, num_real_reqs=nr,
                       slot_tokens=tr["slot_tokens"], slot_rows=tr["slot_rows"], lru=tr["lru"],
                       host_rows=tr["host_rows"], host_cache=host, device_cache=dev_cache,
                       out_rows=out, plan=plan, mode=mode, block_size=block,
                       ctas_per_request=ctas)

    restore()  # record each step's plan once (eager) for the ceiling; check the trace
    for t in range(steps + 1):
        verify(t, plan=plans[t])
    counts = [int(p.count.sum()) for p in plans]
    if counts[0] != 0 or any(c != tr["misses"] for c in counts[1:]):
        raise RuntimeError(f"trace produced misses {counts}, planned {tr['misses']} per step")
    flat = [plan_rows(p) for p in plans[1:]]
    gbytes = tr["misses"] * item / 1e9

    gather = _jit.gather_module(item).gather
    graphs = dict(verify=lambda: GraphTimer(lambda t: verify(t + 1), restore, steps),
                  noio=lambda: GraphTimer(lambda t: verify(t + 1, mode=ResolveMode.NO_IO),
                                          restore, steps))
    if tr["misses"]:
        graphs["ceiling"] = lambda: GraphTimer(
            lambda t: gather(flat[t][0], flat[t][1], host, dev_cache), lambda: None, steps)
    samples = time_graphs(graphs, reps)
    us, noio = statistics.median(samples["verify"]), statistics.median(samples["noio"])
    rec = dict(bs=bs, n=W - 1, W=W, k=k, B=B, item=item, ctx=ctx, churn=churn, spread=spread,
               block=block, ctas=ctas or "auto", union_misses_per_step=tr["misses"],
               verify_us=round(us, 2), noio_us=round(noio, 2))
    if tr["misses"]:
        ceil_us = statistics.median(samples["ceiling"])
        rec.update(io_gbps=round(gbytes / (us * 1e-6), 2), ceiling_us=round(ceil_us, 2),
                   ceiling_gbps=round(gbytes / (ceil_us * 1e-6), 2),
                   io_ratio=round(ceil_us / us, 3))
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=".", help="bench_verify.json is written here")
    ap.add_argument("--quick", action="store_true", help="a few configs only")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--pool-gib", type=float, default=4.0, help="pinned host pool size")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_verify: no CUDA device; nothing measured", file=sys.stderr)
        return 2
    pool = torch.empty(int(args.pool_gib * 2**30), dtype=torch.uint8, pin_memory=True)
    recs, t0 = [], time.time()
    out = Path(args.out_dir) / "bench_verify.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def add(rec):  # rewrite the JSON after every record: a killed run keeps what it measured
        recs.append(rec)
        print(json.dumps(rec), flush=True)
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    steps=args.steps, reps=args.reps, seconds=round(time.time() - t0, 1),
                    note="io_ratio = same-run gather ceiling us / verify us (1.0 = at ceiling)")
        out.write_text(json.dumps(dict(meta=meta, records=recs), indent=1))

    k, n = 2048, 3
    W = n + 1
    common = dict(W=W, k=k, ctx=32768, spread=0.05, steps=args.steps, reps=args.reps,
                  block=args.block)
    grid = [(bs, B, item, c) for bs in (16, 64) for B in (4 * k, (n + 2) * k)
            for item in (656, 1152) for c in (0.0, 0.05, 0.15)]
    if args.quick:
        grid = [(bs, B, 656 if B == 4 * k else 1152, 0.15) for bs in (16, 64)
                for B in (4 * k, (n + 2) * k)]
    for bs, B, item, c in grid:
        add(dict(kind="verify", **bench_config(pool, bs=bs, B=B, item=item, churn=c, ctas=None,
                                               **common)))
    for ctas in (1, 2, 4, 8, 16):  # CTAs per request at batch 16
        add(dict(kind="ctas_sweep", **bench_config(pool, bs=16, B=4 * k, item=656, churn=0.15,
                                                   ctas=ctas, **common)))
    print(f"wrote {out} ({len(recs)} records, {time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
