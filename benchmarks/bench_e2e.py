"""End-to-end decode benchmark: HiSparse vs full-KV residency (plugin off) under one HBM budget.

Per point (``e2e_points``: model shape x context x selection x batch), in one run and one
process, one mode after another:

```
full      plugin off: every token's KV on the device; the largest batch whose KV fits the budget
sync      HiSparse, shared-index prefetch off (every layer resolves on the compute stream)
prefetch  HiSparse, anchors resolve, shared layers replay the miss plan on a side stream
noio      HiSparse bookkeeping with no host->device copies (ResolveMode.NO_IO, prefetch on):
          the ceiling; its outputs are NOT exact and are not checked
prefetch+<change>
          prefetch with one IO-hiding change (--io-hiding; e2e_points.IO_HIDING)
full_nodense, prefetch_nodense
          the same two without the dense stand-in: the toy model's own compute only
```

Selections are the calibrated process of ``e2e_selection`` (fitted to recorded traces of
real models; its calibration table goes into the JSON) unless ``--selection toy``. Each mode
admits its requests directly (PD path), warms up, times ``--steps`` decode steps with CUDA
events (one per step), then runs ``--check-steps`` checked steps in which sampled requests'
attention outputs are compared bit for bit with the oracle bytes and with full KV's.

    python benchmarks/bench_e2e.py --out out/            # full size (H200; see run_e2e_gpu.sh)
    python benchmarks/bench_e2e.py --smoke --out /tmp/s  # tiny, CPU, seconds

``--stack v4`` runs DeepSeek-V4-Flash's shape instead (E2E.md "DeepSeek-V4"): its 21 C4 layers
through HiSparse (top-512 of the compressed entries, one per 4 tokens, in C4 pages), the
sliding windows and C128 entries resident in both modes; its defaults are ``V4_DEFAULTS``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_engine import CheckLog, FullKVRunner, HiSparseRunner  # noqa: E402
from e2e_measure import finish_mode, hbm_ceiling, link_ceiling, run_group, sync  # noqa: E402
from e2e_model import ATTENTIONS, ComputeStandIn  # noqa: E402
from e2e_plot import write_plot  # noqa: E402
from e2e_points import (  # noqa: E402
    BASE_MODES,
    GIB,
    IO_HIDING,
    RESIDENCY,
    build_points,
    check_point,
    describe,
    host_rows_for,
    plan_point,
    point_model,
    residency_supported,
)
from e2e_ramp import ramp_total_steps, run_ramp_point  # noqa: E402
from e2e_report import (  # noqa: E402
    attention_roofline,
    compare_modes,
    environment,
    notes,
    sanity,
    summarize,
    tables,
)
from e2e_selection import SelectionSpec, SelectionTable, calibration_table  # noqa: E402

from sglang_hisparse.memory.budget import available_host_bytes  # noqa: E402
from sglang_hisparse.memory.host_pool import HostKVPool  # noqa: E402

SMOKE = dict(contexts=[256, 512], layers=[6], top_k=16, buffer=32, item=128, budget_gib="auto",
             host_gib=0.003, warmup=2, steps=3, repeats=2, block_warmup=1, profile_steps=0, node_preset="none",
             check_steps=2, check_requests=2, heads=2,
             dense_mb=0.0, dense_mflop=0.0, page=16, max_batch=64, device="cpu",
             io_hiding=["slru"], low_pressure=[2], ramp_steps=1)


#: --stack v4: DeepSeek-V4-Flash (43 layers: 21 C4, 20 C128, 2 window-only; index_topk 512,
#: window 128). Dense stand-in per C4 layer = two of V4-Flash's 43 layers on one of 8 GPUs:
#: 284 B params (fp8) / 8 / 43 x 2 ~ 1650 MB streamed; 88 MFLOP, the DSA default's share
#: scaled by active parameters per layer (13 B / 43 against 37 B / 61), x 2.
V4_DEFAULTS = dict(layers=[21], top_k=512, buffer=1024, item=592, page=64, dense_mb=1650.0, attention="bag",
                   dense_mflop=88.0, anchor_rule="every", anchor_every=1, io_hiding=[],
                   ramp_steps=0, toy_variant=False, modes=["full", "prefetch", "noio"])
SMOKE_V4 = dict(contexts=[1024, 2048], layers=[3], top_k=16, buffer=32, item=592, page=64,
                host_gib=0.012, v4_window=8, io_hiding=[], low_pressure=[2], ramp_steps=0,
                toy_variant=False)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output directory (JSON, plot)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (the test's path)")
    ap.add_argument("--stack", choices=["dsa", "v4"], default="dsa",
                    help="dsa: DeepSeek-V3.2 / GLM-5.x MLA layers (default); v4: DeepSeek-V4-Flash's C4 "
                         "layers, compressed 4 tokens per entry (sets V4_DEFAULTS unless given)")
    ap.add_argument("--v4-window", type=int, default=128, help="--stack v4: sliding window (tokens)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072], help="prompt lengths")
    ap.add_argument("--layers", type=int, nargs="+", default=[61, 78], help="sparse layers L (one point each)")
    ap.add_argument("--anchor-rule", choices=["glm", "every"], default="glm",
                    help="glm: GLM-5.2's pattern (anchor iff max(l-1,0) %% 4 == 0); every: --anchor-every")
    ap.add_argument("--anchor-every", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--buffer", type=int, default=4096, help="hot slots B per request and layer")
    ap.add_argument("--item", type=int, default=1152, help="bytes per KV row (576 bf16 = 1152)")
    ap.add_argument("--budget-gib", default="auto", help="HBM for KV (both modes), or auto (e2e_points)")
    ap.add_argument("--host-gib", type=float, default=None,
                    help="pinned host pool (default: min(84, 0.75 x available, available - 10) GiB)")
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps after a runner is built "
                    "(the first captures its CUDA graph)")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per mode and round")
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved rounds per group (A B C, C B A, A B C): their spread is the noise")
    ap.add_argument("--block-warmup", type=int, default=2,
                    help="untimed steps before each mode's timed steps in a round (after another runner ran)")
    ap.add_argument("--profile-steps", type=int, default=3,
                    help="steps per mode under torch.profiler for the GPU's busy time (0: none)")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="replay each step's forward from a CUDA graph (CUDA only; --no-graphs: eager, "
                         "whose points are then invalid by the sanity lines)")
    ap.add_argument("--node-preset", default="glm-5.1",
                    help="a point in this preset's serving-node proportion: its layers and anchors, the KV "
                         "room one GPU of its 8-GPU node has after weights (none: no such point)")
    ap.add_argument("--node-hbm-gib", type=float, default=139.8, help="HBM per GPU of that node (H200: 139.8)")
    ap.add_argument("--kinds", nargs="+", choices=["main", "node", "low_pressure", "ramp", "toy"], default=None,
                    help="run only these kinds of point (default: all)")
    ap.add_argument("--check-steps", type=int, default=2)
    ap.add_argument("--check-requests", type=int, default=2, help="sampled requests per checked step")
    ap.add_argument("--selection", choices=["calibrated", "toy"], default="calibrated",
                    help="calibrated: e2e_selection's process (fitted to recorded traces); toy: the toy indexer")
    ap.add_argument("--churn", type=float, default=0.15, help="toy indexer query noise (--selection toy)")
    ap.add_argument("--toy-variant", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the first shape/context with --selection toy (labelled variant)")
    ap.add_argument("--io-hiding", nargs="*", default=["slru"],
                    choices=sorted(IO_HIDING), help="prefetch+<change> modes, one change each")
    ap.add_argument("--low-pressure", type=int, nargs="*", default=[1, 4, 16],
                    help="batches at which full KV and HiSparse run side by side, budget = their full KV")
    ap.add_argument("--ramp-steps", type=int, default=2,
                    help="timed steps per ramp level (0: no ramp point)")
    ap.add_argument("--residency", action=argparse.BooleanOptionalAction, default=None,
                    help="pressure / always_hot modes (issue 29); default: when the core has them")
    ap.add_argument("--calibration", type=Path, default=None,
                    help="calibration table JSON to embed (python benchmarks/e2e_selection.py --json); "
                         "default: compute the quick one")
    ap.add_argument("--heads", type=int, default=16,
                    help="attention heads per GPU (DeepSeek-V3.2 / GLM-5.x: 128 heads over TP 8)")
    ap.add_argument("--attention", choices=list(ATTENTIONS), default="sparse_mla",
                    help="timed attention: sparse_mla = real sparse MLA decode (Triton; e2e_attention); "
                         "bag = read each selected row once (a stand-in with the kernel's traffic); "
                         "gather = materialise rows + bmm attention")
    ap.add_argument("--dense-mb", type=float, default=1400.0, help="weights streamed per layer (MB)")
    ap.add_argument("--dense-mflop", type=float, default=88.0, help="dense MFLOP per token per layer")
    ap.add_argument("--page", type=int, default=64, help="page size (SGLang DSA uses 64)")
    ap.add_argument("--modes", nargs="+", default=["full", "sync", "prefetch", "noio"], choices=BASE_MODES)
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="skip the points not started this many seconds after the start (0: none)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--plan-only", action="store_true", help="print the sizes and the machine check, then exit")
    if "--stack" in (argv if argv is not None else sys.argv[1:]) or any(
            a.startswith("--stack=") for a in (argv if argv is not None else sys.argv[1:])):
        # a --stack v4 run takes V4's shape for every flag the command line leaves unset
        pre, _ = ap.parse_known_args(argv)
        if pre.stack == "v4":
            ap.set_defaults(**V4_DEFAULTS)
    args = ap.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.modes = list(BASE_MODES)
        if args.stack == "v4":
            for key, value in SMOKE_V4.items():
                setattr(args, key, value)
            args.modes = ["full", "prefetch", "noio", "full_nodense", "prefetch_nodense"]
    if args.stack == "v4":
        if args.page != 64 or args.item != 592:
            ap.error("--stack v4: C4 pages hold 64 entries of 592-byte host rows; leave --page and --item unset")
        if args.ramp_steps or args.attention != "bag":
            ap.error("--stack v4: no ramp (--ramp-steps 0) and --attention bag only")
    if args.attention == "sparse_mla" and args.device == "cuda" and args.item != 1152 and not args.plan_only:
        ap.error(f"--attention sparse_mla reads MLA rows of 576 bf16 (--item 1152), not {args.item} B; "
                 "use --attention bag for other rows")
    if args.repeats < 2:
        ap.error("--repeats must be >= 2: the rounds' spread is the noise every comparison is read against")
    if "full" not in args.modes or "noio" not in args.modes:
        ap.error("--modes must include full and noio (ratios are taken against them)")
    if args.budget_gib != "auto":
        try:
            float(args.budget_gib)
        except ValueError:
            ap.error(f"--budget-gib {args.budget_gib!r}: a number of GiB or auto")
    if args.residency is None:
        args.residency = residency_supported()
    elif args.residency and not residency_supported():
        ap.error("--residency: this checkout's HiSparseCore has no residency option yet")
    if args.device == "cuda" and not torch.cuda.is_available() and not args.plan_only:
        ap.error("--device cuda but CUDA is not available; use --smoke (CPU) or a GPU machine")
    return args


def host_pool_bytes(args) -> int:
    avail = available_host_bytes()
    auto_gib = min(84.0, 0.75 * avail / GIB, avail / GIB - 10.0)
    return int((args.host_gib if args.host_gib is not None else auto_gib) * GIB)


def make_runner(mode: str, point: dict, plan: dict, model, compute, storage, selections, args, device):
    base, _, change = mode.split("#")[0].removesuffix("_nodense").partition("+")
    n, cap = point["context"], plan["cap"]
    if base == "full":
        return FullKVRunner(model, compute, bs=plan["full_batch"], n=n, cap=cap, device=device,
                            selections=selections)
    return HiSparseRunner(model, compute, bs=plan["hisparse_batch"], n=n, cap=cap,
                          buffer_size=args.buffer, page=args.page, storage=storage,
                          prefetch=base != "sync", skip_io=base == "noio", device=device,
                          selections=selections, core_options=core_options(base, change, args),
                          device_rows=plan["hisparse_device_rows"])


def core_options(base: str, change: str, args) -> dict:
    """HiSparseCore options of a mode: its IO-hiding change, and with residency in the core
    ``pressure`` for the pressure modes and ``always_hot`` (today's behaviour) for the rest."""
    options = dict(IO_HIDING[change]) if change else {}
    if args.residency:
        options.update(RESIDENCY["pressure" if base == "pressure" else "always_hot"])
    return options


def _build(mode: str, point: dict, plan: dict, model, compute, storage, selections, args, device,
           filled: bool, check: list[int]):
    """A mode's runner, admitted, graphs on (CUDA), warmed up (the first step captures) and
    checked (every mode of the point checks the same steps here, so their outputs compare)."""
    runner = make_runner(mode, point, plan, model, compute, storage, selections, args, device)
    if isinstance(runner, FullKVRunner):
        runner.admit()
    else:
        runner.admit(fill_host=not filled)
    runner.dense = not mode.endswith("_nodense")
    runner.graphs = args.graphs and device.type == "cuda"
    for _ in range(args.warmup):
        runner.step()
    runner.check_log = CheckLog()
    for _ in range(args.check_steps):
        runner.step(check=check, log=runner.check_log)
    sync(device)
    return runner


def run_point(args, point: dict, plan: dict, model, compute, storage, device) -> dict:
    """The point's groups in order (e2e_points.build_points): a mode's runner is built at its
    first group and finished (profiled, checked, freed) after its last; its headline figures are
    its first group's rounds, every group's rounds are in ``groups``."""
    results: dict[str, dict] = {}
    check_full = list(range(min(args.check_requests, plan["full_batch"])))
    selections = None
    t0 = time.perf_counter()
    ramp = point["kind"] == "ramp"
    steps = ramp_total_steps(args, plan["hisparse_batch"]) if ramp else plan["runner_steps"]
    if point["selection"] == "calibrated":
        bs = max(plan["full_batch"], plan["hisparse_batch"])
        seeds = torch.arange(1000, 1000 + bs, dtype=torch.int64, device=device)
        selections = SelectionTable(SelectionSpec(), seeds=seeds, n0=point["context"], k=args.top_k,
                                    anchors=model.anchors, steps=steps, compress=model.compress_ratio)
    sel_s = time.perf_counter() - t0
    if ramp:
        out = run_ramp_point(args, point, plan, model, compute, storage, selections, device,
                             options=lambda mode: core_options(mode, "", args))
        return dict(out, selection_table_s=sel_s)
    ceiling = link_ceiling(storage, args.item, device)
    hbm = hbm_ceiling(device)
    attention = attention_roofline(compute, plan, args, device, hbm)
    groups = point["groups"]
    last_use = {m: max(i for i, g in enumerate(groups) if m in g) for g in groups for m in g}
    runners: dict[str, object] = {}
    headline: dict[str, object] = {}
    group_recs: list[dict] = []
    filled = False
    try:
        for gi, group in enumerate(groups):
            for mode in group:
                if mode in runners or mode in results:
                    continue
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                mem0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                t1 = time.perf_counter()
                try:
                    runners[mode] = _build(mode, point, plan, model, compute, storage, selections, args,
                                           device, filled, check_full)
                except Exception as exc:  # one failed mode must not lose the others
                    if mode in ("full", "noio"):
                        raise
                    print(f"  {point['label']} {mode}: FAILED {exc!r}", flush=True)
                    results[mode] = dict(error=repr(exc), trace=traceback.format_exc()[-2000:])
                    continue
                filled = filled or not isinstance(runners[mode], FullKVRunner)
                kv = (torch.cuda.memory_allocated(device) - mem0) / GIB if device.type == "cuda" else None
                runners[mode]._setup = dict(setup_s=time.perf_counter() - t1, hbm_kv_alloc_gib=kv)
                print(f"  {point['label']} {mode}: built, batch {runners[mode].bs}, "
                      f"{runners[mode].captures} graphs captured, {time.perf_counter() - t1:.1f} s", flush=True)
            alive = [m for m in group if m in runners]
            print(f"  {point['label']} group {gi + 1}/{len(groups)}: {' '.join(alive)}, interleaved rounds", flush=True)
            samples = run_group(alive, runners, args, device)
            rec = {}
            for m in alive:
                fig = samples[m].figures()
                fig.pop("step_ms_per_step")
                rec[m] = fig
                headline.setdefault(m, samples[m])
            group_recs.append(rec)
            for m in alive:
                if last_use[m] != gi:
                    continue
                runner = runners.pop(m)
                try:
                    results[m] = finish_mode(m, runner, headline[m], args, device, check_full)
                    results[m].update(runner._setup)
                except Exception as exc:
                    if m in ("full", "noio"):
                        raise
                    results[m] = dict(error=repr(exc), trace=traceback.format_exc()[-2000:])
                finally:
                    if hasattr(runner, "destroy"):
                        runner.destroy()
                    del runner
                r = results[m]
                if "error" not in r:
                    gp = r.get("gpu_profile") or {}
                    gap = gp.get("host_gap_share")
                    print(f"  {point['label']:<22} {m:<18} batch {r['batch']:>5}  step {r['step_ms']:8.2f} ms  "
                          f"{r['tokens_per_s']:10.0f} tok/s  miss {r.get('miss_rate', 0.0):.3f}  "
                          f"spread {100 * (r['spread'] or 0):.1f} %  host gap "
                          f"{'-' if gap is None else f'{100 * gap:.1f} %'}  exact {r['exact_vs_oracle']}", flush=True)
    finally:
        for runner in runners.values():
            if hasattr(runner, "destroy"):
                runner.destroy()
        runners.clear()
    out = compare_modes(plan, results, args, ceiling=ceiling)
    out["groups"] = [dict(modes=g, rounds=r) for g, r in zip(groups, group_recs, strict=False)]
    out["hbm_ceiling"] = hbm
    out["attention_roofline"] = attention
    out["sanity"] = sanity(point, out, attention)
    out["valid"] = all(out["sanity"].values())
    return dict(point, **out, selection_table_s=sel_s)


def _report(args, host_bytes, device, points, calibration, t_start, planned: int) -> dict:
    report = dict(config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  host_pool_bytes=host_bytes, environment=environment(device), notes=notes(args),
                  calibration=calibration, points=points, total_s=time.perf_counter() - t_start,
                  complete=len(points) == planned)
    report["tables"] = tables(points)
    report["exact"] = all(p.get("exact", False) for p in points)
    report["targets_met"] = all(p["targets"]["met"] for p in points if p.get("targets", {}).get("applies"))
    # Written after every point, so a run cut short still leaves what it measured.
    (args.out / "bench_e2e.json").write_text(json.dumps(report, indent=2))
    return report


def load_calibration(args) -> dict | None:
    if args.calibration is not None and args.calibration.exists():
        return json.loads(args.calibration.read_text())
    try:
        ratio = 4 if args.stack == "v4" else 1  # the process runs over entries
        return calibration_table(SelectionSpec(), bench_k=args.top_k, contexts=tuple(c // ratio for c in args.contexts),
                                 window=(args.warmup, args.steps), quick=True)
    except Exception as exc:
        return dict(error=repr(exc))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    host_bytes = host_pool_bytes(args)
    points = build_points(args)
    models: dict = {}
    plans = []
    print(f"plan: pinned host pool {host_bytes / GIB:.2f} GiB (available {available_host_bytes() / GIB:.2f} GiB)")
    for p in points:
        model = point_model(args, p, models)
        plan = plan_point(args, p, model, host_bytes)
        plans.append(plan)
        print("  " + describe(p, plan))
    if host_bytes > available_host_bytes() - 6 * GIB and not args.smoke:
        raise SystemExit(f"refusing: pinned host pool {host_bytes / GIB:.2f} GiB leaves < 6 GiB; lower --host-gib")
    if args.plan_only:
        return 0
    t_start = time.perf_counter()
    calibration = load_calibration(args)
    t0 = time.perf_counter()
    # One pinned buffer for every point: each views it as [L, rows, I] for its own L.
    rows = host_bytes // args.item // args.page * args.page
    carrier = HostKVPool(num_layers=1, item_bytes=args.item, capacity_tokens=rows - args.page,
                         page_size=args.page, max_requests=1, max_context=1, device=device)
    flat = carrier.kv.view(-1)
    print(f"pinned host pool: {carrier.nbytes / GIB:.2f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
    done: list[dict] = []
    computes: dict[int, ComputeStandIn] = {}
    try:
        for p, plan in zip(points, plans, strict=True):
            L = p["layers"]
            if args.deadline_s and time.perf_counter() - t_start > args.deadline_s:
                # past the deadline: record the point as skipped so the JSON, summary and plot
                # still get written (a wall-clock kill would leave neither summary nor plot)
                print(f"point {p['label']} skipped: past --deadline-s {args.deadline_s}", flush=True)
                done.append(dict(p, plan=plan, error=f"skipped: past --deadline-s {args.deadline_s}", exact=False))
                report = _report(args, host_bytes, device, done, calibration, t_start, len(points))
                continue
            model = point_model(args, p, models)
            try:
                if L not in computes:
                    computes.clear()
                    gc.collect()
                    max_bs = max(max(q["full_batch"], q["hisparse_batch"]) for q, pp in zip(plans, points, strict=True)
                                 if pp["layers"] == L)
                    computes[L] = ComputeStandIn(model, max_batch=max(max_bs, 1), device=device)
                compute = computes[L]
                compute.model = model
                check_point(args, model, plan, device, compute.weight_bytes // max(L, 1) * min(L, 4))
                hrows = host_rows_for(flat.numel(), L, args.item, args.page)
                storage = flat[: L * hrows * args.item].view(L, hrows, args.item)
                done.append(run_point(args, p, plan, model, compute, storage, device))
            except Exception as exc:  # a failed point is recorded; the others still run
                print(f"point {p['label']} FAILED: {exc!r}", flush=True)
                done.append(dict(p, plan=plan, error=repr(exc), trace=traceback.format_exc()[-3000:],
                                 exact=False))
            report = _report(args, host_bytes, device, done, calibration, t_start, len(points))
    finally:
        sync(device)
        computes.clear()
        carrier.destroy()
    print(summarize(report))
    try:
        print(write_plot(report, args.out / "bench_e2e.png"))
    except Exception as exc:  # the JSON holds every figure; a plot bug must not cost the run
        print(f"plot failed: {exc!r}")
    print(f"wrote {args.out / 'bench_e2e.json'}")
    return 0 if report["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
