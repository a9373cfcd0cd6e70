"""End-to-end decode benchmark: HiSparse vs full-KV residency under one HBM budget for KV.

For each context length, in one run and one process:

```
full      every token's KV on the device; the largest batch whose KV fits the budget
sync      HiSparse, shared-index prefetch off (every layer resolves on the compute stream)
prefetch  HiSparse, anchors resolve, shared layers replay the miss plan on a side stream
noio      HiSparse bookkeeping with no host->device copies (ResolveMode.NO_IO, prefetch on):
          the ceiling; its outputs are NOT exact and are not checked
full_nodense, prefetch_nodense
          the same two without the dense stand-in: the toy model's own compute only
```

The HiSparse modes run at one batch: the largest the HBM budget admits, capped by the
pinned host pool this machine can hold (the JSON says which limit bound). Each mode admits
its requests directly (PD path: prompt KV written into the host pool, or into device rows
for full KV), warms up, times ``--steps`` decode steps with CUDA events, then runs
``--check-steps`` checked steps in which sampled requests' attention outputs are compared
bit for bit with the oracle bytes and with the full-KV mode's outputs at the same length.

    python benchmarks/bench_e2e.py --out out/            # full size (H200; see run_e2e_gpu.sh)
    python benchmarks/bench_e2e.py --smoke --out /tmp/s  # tiny, CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_engine import (  # noqa: E402
    CheckLog,
    FullKVRunner,
    HiSparseRunner,
    hisparse_bytes_per_request,
)
from e2e_model import BenchModel, ComputeStandIn  # noqa: E402
from e2e_report import compare_modes, environment, notes, summarize, write_plot  # noqa: E402

from sglang_hisparse.memory.budget import available_host_bytes  # noqa: E402
from sglang_hisparse.memory.host_pool import HostKVPool  # noqa: E402
from sglang_hisparse.memory.paged import ceil_div  # noqa: E402
from sglang_hisparse.testing.toy_model import ToyModel  # noqa: E402

GIB = 2**30
MODES = ("full", "sync", "prefetch", "noio", "full_nodense", "prefetch_nodense")
SMOKE = dict(contexts=[256, 512], layers=4, anchor_every=2, top_k=16, buffer=32, item=128,
             budget_gib=0.0005, host_gib=0.003, warmup=2, steps=3, check_steps=3, heads=2,
             dense_mb=0.0, dense_mflop=0.0, page=16, max_batch=64, device="cpu")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output directory (JSON, plot)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (the test's path)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072], help="prompt lengths")
    ap.add_argument("--layers", type=int, default=8, help="sparse layers L")
    ap.add_argument("--anchor-every", type=int, default=4, help="one indexer (anchor) layer per this many layers")
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--buffer", type=int, default=4096, help="hot slots B per request and layer")
    ap.add_argument("--item", type=int, default=1152, help="bytes per KV row (576 bf16 = 1152)")
    ap.add_argument("--budget-gib", type=float, default=24.0, help="HBM for KV (both modes)")
    ap.add_argument("--host-gib", type=float, default=None,
                    help="pinned host pool (default: min(84, 0.75 x available, available - 10) GiB)")
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per mode")
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--check-requests", type=int, default=4, help="sampled requests per checked step")
    ap.add_argument("--churn", type=float, default=0.15, help="indexer query noise (0.15: ~12%% of top-k new per step)")
    ap.add_argument("--heads", type=int, default=16, help="attention heads per GPU (--attention gather)")
    ap.add_argument("--attention", choices=["bag", "gather"], default="bag",
                    help="timed attention: bag = read each selected row once (fused-kernel traffic); "
                         "gather = materialise rows + 16-head bmm attention")
    ap.add_argument("--dense-mb", type=float, default=1400.0, help="weights streamed per layer (MB)")
    ap.add_argument("--dense-mflop", type=float, default=88.0, help="dense MFLOP per token per layer")
    ap.add_argument("--page", type=int, default=64, help="page size (SGLang DSA uses 64)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--plan-only", action="store_true", help="print the sizes and the machine check, then exit")
    args = ap.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if "full" not in args.modes or "noio" not in args.modes:
        ap.error("--modes must include full and noio (ratios are taken against them)")
    if args.device == "cuda" and not torch.cuda.is_available() and not args.plan_only:
        ap.error("--device cuda but CUDA is not available; use --smoke (CPU) or a GPU machine")
    return args


def build_model(args: argparse.Namespace) -> BenchModel:
    shared = tuple(i % args.anchor_every != 0 for i in range(args.layers))
    toy = ToyModel(num_layers=args.layers, top_k=args.top_k, item_bytes=args.item, shared=shared)
    return BenchModel(toy, churn=args.churn, heads=args.heads, attention=args.attention, dense_mb=args.dense_mb,
                      dense_mflop=args.dense_mflop)


def plan_sizes(args, model: BenchModel) -> dict:
    """Per context: capacity, batches each mode admits, host rows; plus the host pool size."""
    toy, budget = model.toy, int(args.budget_gib * GIB)
    avail_host = available_host_bytes()
    auto_gib = min(84.0, 0.75 * avail_host / GIB, avail_host / GIB - 10.0)
    host_bytes = int((args.host_gib if args.host_gib is not None else auto_gib) * GIB)
    row_bytes = toy.num_layers * toy.item_bytes
    host_pages = host_bytes // (row_bytes * args.page) - 1
    total_steps = args.warmup + args.steps + args.check_steps
    plans = []
    for n in args.contexts:
        cap = n + total_steps + 1
        full_hbm = budget // FullKVRunner.bytes_per_request(model, cap)
        hs_hbm = budget // hisparse_bytes_per_request(model, cap=cap, buffer_size=args.buffer, page=args.page)
        hs_host = host_pages // (ceil_div(cap, args.page) + 1)
        hs = min(hs_hbm, hs_host, args.max_batch)
        limit = "hbm" if hs == hs_hbm else ("host_dram" if hs == hs_host else "max_batch")
        plans.append(dict(context=n, cap=cap, full_batch_admitted=full_hbm,
                          full_batch=min(full_hbm, args.max_batch), hisparse_batch_admitted_hbm=hs_hbm,
                          hisparse_batch_host_limit=hs_host, hisparse_batch=hs, hisparse_limited_by=limit))
    need_pages = max(p["hisparse_batch"] * (ceil_div(p["cap"], args.page) + 1) for p in plans)
    storage_rows = (need_pages + 1) * args.page
    return dict(contexts=plans, host_storage_bytes=toy.num_layers * storage_rows * toy.item_bytes,
                storage_rows=storage_rows, host_available_bytes=avail_host, budget_bytes=budget)


def check_machine(args, model: BenchModel, sizes: dict, device: torch.device) -> None:
    """Print the planned bytes; refuse (SystemExit 3) when the machine cannot hold them."""
    host = sizes["host_storage_bytes"]
    print(f"plan: HBM budget for KV {args.budget_gib:.2f} GiB; pinned host pool {host / GIB:.2f} GiB "
          f"(available {sizes['host_available_bytes'] / GIB:.2f} GiB)")
    for p in sizes["contexts"]:
        print(f"  context {p['context']}: full-KV batch {p['full_batch']}, HiSparse batch {p['hisparse_batch']} "
              f"(HBM admits {p['hisparse_batch_admitted_hbm']}, host pool {p['hisparse_batch_host_limit']}; "
              f"bound by {p['hisparse_limited_by']})")
    if min(min(p["full_batch"], p["hisparse_batch"]) for p in sizes["contexts"]) < 1:
        raise SystemExit("refusing: a mode admits no request at these sizes; raise --budget-gib/--host-gib")
    if host > sizes["host_available_bytes"] - 6 * GIB and not args.smoke:
        raise SystemExit(f"refusing: pinned host pool {host / GIB:.2f} GiB leaves < 6 GiB of the "
                         f"{sizes['host_available_bytes'] / GIB:.2f} GiB available; lower --host-gib")
    if device.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(device).total_memory
        weights = model.toy.num_layers * args.dense_mb * 2**20
        bs = max(p["hisparse_batch"] for p in sizes["contexts"])
        scratch = 4 * bs * args.top_k * args.item + 3 * max(
            p["hisparse_batch"] * p["cap"] * 4 * model.toy.index_dim for p in sizes["contexts"])
        need = sizes["budget_bytes"] + weights + scratch + 2 * GIB
        print(f"  device: KV budget + weights {weights / GIB:.1f} GiB + scratch {scratch / GIB:.1f} GiB "
              f"= {need / GIB:.1f} GiB of {total / GIB:.1f} GiB")
        if need > 0.95 * total:
            raise SystemExit(f"refusing: needs {need / GIB:.1f} GiB of HBM, the GPU has {total / GIB:.1f} GiB")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode: str, runner, args, device: torch.device, check: list[int]) -> dict:
    """Warm up, time ``args.steps`` steps, then the checked steps; return the mode's record."""
    for _ in range(args.warmup):
        runner.step()
    _sync(device)
    tel = getattr(runner, "core", None)
    before = tel.telemetry.snapshot() if tel else None
    t0 = time.perf_counter()
    if device.type == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(args.steps):
            runner.step()
        e1.record()
        e1.synchronize()
        step_ms = e0.elapsed_time(e1) / args.steps
    else:
        for _ in range(args.steps):
            runner.step()
        step_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    after = tel.telemetry.snapshot() if tel else None
    log = CheckLog()
    for _ in range(args.check_steps):
        runner.step(check=check, log=log)
    _sync(device)
    rec = dict(batch=runner.bs, step_ms=step_ms, wall_step_ms=wall_ms,
               tokens_per_s=runner.bs * 1e3 / step_ms, tpot_ms=step_ms,
               checked_outputs=log.compared, oracle_mismatches=log.mismatches[:5],
               topk_churn=sum(log.churn) / len(log.churn) if log.churn else None)
    if before is not None and after is not None:
        sel, miss = after.selected - before.selected, after.misses - before.misses
        rec.update(miss_rate=miss / sel if sel else 0.0,
                   h2d_mb_per_step=(after.h2d_bytes - before.h2d_bytes) / args.steps / 2**20)
    if hasattr(runner, "backup_path"):
        rec["backup_path"] = runner.backup_path
    rec.update(runner.profile())
    rec["exact_vs_oracle"] = None if mode == "noio" else not log.mismatches
    rec["_log"] = log
    return rec


def run_context(args, model, compute, plan: dict, storage, device) -> dict:
    n, cap, results = plan["context"], plan["cap"], {}
    check_full = list(range(min(args.check_requests, plan["full_batch"])))
    filled = False
    for mode in args.modes:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        mem0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        compute.dense_enabled = not mode.endswith("_nodense")
        base = mode.removesuffix("_nodense")
        if base == "full":
            runner = FullKVRunner(model, compute, bs=plan["full_batch"], n=n, cap=cap, device=device)
            runner.admit()
        else:
            runner = HiSparseRunner(model, compute, bs=plan["hisparse_batch"], n=n, cap=cap,
                                    buffer_size=args.buffer, page=args.page, storage=storage,
                                    prefetch=base != "sync", skip_io=base == "noio", device=device)
            runner.admit(fill_host=not filled)
            filled = True
        _sync(device)
        setup_s = time.perf_counter() - t0
        kv_alloc = (torch.cuda.memory_allocated(device) - mem0) if device.type == "cuda" else None
        rec = run_mode(mode, runner, args, device, check_full)
        rec.update(setup_s=setup_s, hbm_kv_alloc_gib=None if kv_alloc is None else kv_alloc / GIB)
        results[mode] = rec
        print(f"  {n:>7} {mode:<16} batch {rec['batch']:>5}  step {rec['step_ms']:8.2f} ms  "
              f"{rec['tokens_per_s']:10.0f} tok/s  miss {rec.get('miss_rate', 0.0):.3f}  "
              f"exact {rec['exact_vs_oracle']}  setup {setup_s:.1f} s", flush=True)
        if hasattr(runner, "destroy"):
            runner.destroy()
        del runner
    compute.dense_enabled = True
    return compare_modes(plan, results, args)


def _report(args, sizes, device, compute, contexts, t_start) -> dict:
    report = dict(config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  sizes={k: v for k, v in sizes.items() if k != "contexts"},
                  environment=environment(device), notes=notes(args, compute),
                  contexts=contexts, total_s=time.perf_counter() - t_start,
                  complete=len(contexts) == len(sizes["contexts"]))
    report["exact"] = all(c["exact"] for c in contexts)
    report["targets_met"] = all(c["targets"]["met"] for c in contexts if c["targets"]["applies"])
    # Written after every context, so a run cut short still leaves what it measured.
    (args.out / "bench_e2e.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_model(args)
    sizes = plan_sizes(args, model)
    check_machine(args, model, sizes, device)
    if args.plan_only:
        return 0
    t_start = time.perf_counter()
    max_bs = max(max(p["full_batch"], p["hisparse_batch"]) for p in sizes["contexts"])
    compute = ComputeStandIn(model, max_batch=max_bs, device=device)
    t0 = time.perf_counter()
    # One pinned host buffer for every HiSparse engine (same rows, same content across modes).
    carrier = HostKVPool(num_layers=args.layers, item_bytes=args.item,
                         capacity_tokens=sizes["storage_rows"] - args.page, page_size=args.page,
                         max_requests=1, max_context=1, device=device)
    print(f"pinned host pool: {carrier.nbytes / GIB:.2f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
    contexts: list[dict] = []
    try:
        for plan in sizes["contexts"]:
            contexts.append(run_context(args, model, compute, plan, carrier.kv, device))
            report = _report(args, sizes, device, compute, contexts, t_start)
    finally:
        _sync(device)
        carrier.destroy()
    print(summarize(report))
    print(write_plot(report, args.out / "bench_e2e.png"))
    print(f"wrote {args.out / 'bench_e2e.json'}")
    return 0 if report["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
