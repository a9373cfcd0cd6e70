"""What one bench_e2e run measures: its points (model shape x context x selection x batch),
each point's modes and its sizes under the KV budget.

```
(in this order)
main          every --layers x --contexts: full KV at the largest batch its KV budget admits,
              HiSparse (sync / prefetch / no-IO oracle / each --io-hiding change) at the largest
              batch the same budget admits, capped by the pinned host pool
node          a serving node's proportion (--node-preset, default glm-5.1): the preset's layers and
              anchors at the first context, the KV budget one GPU of its 8-GPU node has after weights
toy           the first main shape and context with the old toy indexer (--churn): labelled variant
low_pressure  the first shape and context at each --low-pressure batch b: full KV and HiSparse
              both at b, with a budget that holds b requests' full KV (HBM is not short)
ramp          the first shape and context, concurrency 1, 2, 4, ... up to the HiSparse batch and
              back (--ramp-steps timed steps per level), per step: step time (and, with
              residency, resident/hot counts and free rows); full KV runs the levels it holds
```

HiSparse's device rows are the KV budget's (less its per-request state), at least its hot
buffers: room that pressure-driven residency (issue 29) can use; always-hot modes leave it
unused, as a server's pool would be. Once the core has residency, every HiSparse mode runs
``residency="always_hot"`` (today's behaviour, the "before") and ``pressure`` modes are added:
main points (high pressure, same batch), low-pressure points and the ramp.

Anchor rule ``glm`` (default): SGLang's ``index_topk_freq = 4`` offset rule as GLM-5.2 uses it
(presets/glm-5.2.json): layer l computes its own top-k iff ``max(l - 1, 0) % 4 == 0``, i.e.
layers 0, 1, 5, 9, ...: 21 anchors of 78, 16 of 61. ``every``: one anchor per ``--anchor-every``.

KV budget ``auto`` (default), per main point: the largest HiSparse batch the host pool holds,
less one request, times HiSparse's HBM per request, so HBM (not host DRAM) bounds HiSparse's
batch by one request; raised to one request's full KV when that is larger (then full KV runs
one request and HiSparse is host-bound: the JSON's ``hisparse_limited_by`` says so).
"""

from __future__ import annotations

import argparse

import torch
from e2e_engine import FullKVRunner, hisparse_bytes_per_request, hot_rows
from e2e_model import BenchModel, V4Resident

from hisparse_testing.toy_model import ToyModel
from sglang_hisparse.config import DEFAULT_RESIDENCY_WATERMARK
from sglang_hisparse.kernels.row_layout import C4_PAGED
from sglang_hisparse.memory.paged import ceil_div

GIB = 2**30
#: HiSparseCore options of the residency modes (issue 29); ``watermark``: fraction of device rows
#: kept free, the server's default (``residency_watermark``)
RESIDENCY = {"always_hot": dict(residency="always_hot"),
             "pressure": dict(residency="pressure", watermark=DEFAULT_RESIDENCY_WATERMARK)}


def residency_supported() -> bool:
    """Whether this checkout's HiSparseCore has pressure-driven residency (issue 29)."""
    import inspect

    from sglang_hisparse.coordinator.core import HiSparseCore

    return "residency" in inspect.signature(HiSparseCore.__init__).parameters
BASE_MODES = ("full", "sync", "prefetch", "noio", "full_nodense", "prefetch_nodense")
#: --io-hiding changes: HiSparseCore options of a ``prefetch+<name>`` mode (one at a time). The
#: IO-hiding options this A/B decided against (a high-priority prefetch stream, 4-32 CTAs per
#: replay, sliced anchors: 0.83-1.00x at every main point, benchmarks/E2E.md "Results") were
#: deleted from the core; the policy A/B stays: the server's default slru against the core's lru.
IO_HIDING = {
    "slru": dict(policy="slru"),
}


def shared_pattern(layers: int, rule: str, every: int) -> tuple[bool, ...]:
    """Per layer: True = reuses the previous anchor's top-k."""
    if rule == "glm":
        return tuple(max(i - 1, 0) % 4 != 0 for i in range(layers))
    return tuple(i % every != 0 for i in range(layers))


#: DeepSeek-V4's C4 indexer key: 128 fp8 values + one fp32 scale = 132 B = 33 float32
V4_INDEX_DIM = 33
V4_COMPRESS_RATIO = 4


def build_model(args: argparse.Namespace, layers: int, *, churn: float | None = None,
                anchors: tuple[int, ...] | None = None) -> BenchModel:
    """``anchors``: the layers with their own indexer (default: ``--anchor-rule``)."""
    churn = args.churn if churn is None else churn
    if getattr(args, "stack", "dsa") == "v4":
        # every C4 layer computes its own top-k (V4 shares no indexer output)
        toy = ToyModel(num_layers=layers, top_k=args.top_k, item_bytes=args.item, index_dim=V4_INDEX_DIM)
        return BenchModel(toy, churn=churn, heads=args.heads, attention=args.attention,
                          dense_mb=args.dense_mb, dense_mflop=args.dense_mflop,
                          compress_ratio=V4_COMPRESS_RATIO, row_layout=C4_PAGED,
                          resident=V4Resident(window=args.v4_window), one_pass_scores=True)
    shared = (shared_pattern(layers, args.anchor_rule, args.anchor_every) if anchors is None
              else tuple(i not in anchors for i in range(layers)))
    toy = ToyModel(num_layers=layers, top_k=args.top_k, item_bytes=args.item, shared=shared)
    # one_pass_scores: with calibrated selections the indexer reads each gathered key once
    # (one bmm, as a fused indexer does) instead of D elementwise passes
    return BenchModel(toy, churn=churn, heads=args.heads, one_pass_scores=True,
                      attention=args.attention, dense_mb=args.dense_mb, dense_mflop=args.dense_mflop)


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


def build_points(args: argparse.Namespace) -> list[dict]:
    base = list(args.modes)
    io = [f"prefetch+{name}" for name in args.io_hiding]
    res = ["pressure"] if args.residency else []
    # groups: the modes whose runners are alive together and timed in interleaved rounds
    # (e2e_measure.run_group). Main: the headline group, then every change against prefetch in
    # one A/B group (prefetch's runner carries over; the others are freed between the groups).
    ab = [m for m in io + res if "prefetch" in base]
    points = [dict(kind="main", label=f"{L}L {_ctx(n)}", layers=L, context=n,
                   selection=args.selection, modes=base + io + res,
                   groups=[list(base)] + ([["prefetch"] + ab] if ab else []))
              for L in args.layers for n in args.contexts]
    L0, n0 = args.layers[0], args.contexts[0]
    node = node_point(args, n0)
    if node is not None:
        points.append(node)
    for b in args.low_pressure:
        points.append(dict(kind="low_pressure", label=f"{L0}L {_ctx(n0)} batch {b}", layers=L0,
                           context=n0, selection=args.selection, batch=b,
                           modes=["full", "prefetch", "noio"] + res,
                           # each HiSparse mode beside plugin-off, two runners alive at once: a
                           # low-pressure runner holds every request's KV, and three of them at
                           # batch 16 (36 GiB each) ran the H200 out of HBM
                           groups=[["full", m] for m in ["prefetch", "noio"] + res]))
    if args.ramp_steps > 0:
        points.append(dict(kind="ramp", label=f"{L0}L {_ctx(n0)} ramp", layers=L0, context=n0,
                           selection=args.selection, modes=["full", "prefetch"] + res))
    # the labelled old-toy variant last: the least needed if a time limit cuts the run short
    if args.toy_variant and args.selection != "toy":
        points.append(dict(kind="toy", label=f"{L0}L {_ctx(n0)} toy churn {args.churn}", layers=L0,
                           context=n0, selection="toy", modes=["full", "prefetch", "noio"],
                           groups=[["full", "prefetch", "noio"]]))
    kinds = getattr(args, "kinds", None)
    return [p for p in points if not kinds or p["kind"] in kinds]


def node_point(args: argparse.Namespace, context: int) -> dict | None:
    """A main-like point in a serving node's proportion (``--node-preset``): the preset model's
    layers and anchors, and the KV budget one GPU of its 8-GPU node has after the weights
    (``planner.PlanInputs.kv_budget``: SGLang's static memory fraction less weights / 8, of
    ``--node-hbm-gib``). Full KV, prefetch and no-IO in one group."""
    name = getattr(args, "node_preset", None)
    if not name or name == "none" or getattr(args, "stack", "dsa") != "dsa":
        return None
    from sglang_hisparse.planner import PlanInputs
    from sglang_hisparse.presets import load_preset

    spec = load_preset(name)
    budget, share, source = PlanInputs(model=spec, gpu_hbm_gib=args.node_hbm_gib).kv_budget()
    modes = ["full", "prefetch", "noio"]
    return dict(kind="node", label=f"{spec.name} node {spec.layers}L {_ctx(context)}", layers=spec.layers,
                context=context, selection=args.selection, anchors=list(spec.anchors), budget_bytes=budget,
                budget_source=f"{spec.name}, 8 GPUs: {share:.3f} of {args.node_hbm_gib:g} GiB ({source})",
                modes=modes, groups=[modes])


def point_model(args: argparse.Namespace, point: dict, cache: dict) -> BenchModel:
    """The point's model (cached by layers and anchors; a toy-selection point builds its own)."""
    anchors = tuple(point["anchors"]) if point.get("anchors") is not None else None
    if point["selection"] == "toy":
        return build_model(args, point["layers"], anchors=anchors)
    key = (point["layers"], anchors)
    if key not in cache:
        cache[key] = build_model(args, point["layers"], anchors=anchors)
    return cache[key]


def runner_steps(args: argparse.Namespace, point: dict) -> int:
    """Decode steps one runner of ``point`` takes at most: warm-up, the checked steps at build,
    its groups' rounds, the profiled steps and the checked ones after them (sizes the context
    capacity and the selection table)."""
    groups = point.get("groups") or [point["modes"]]
    most = max(sum(m in g for g in groups) for m in point["modes"])
    per_group = args.repeats * (args.block_warmup + args.steps)
    # (the profile's steps twice: once traced, once with events around each replay)
    return args.warmup + most * per_group + 2 * args.profile_steps + 1 + 2 * args.check_steps


def peak_runners(point: dict) -> int:
    """Runners alive at once (a mode's runner lives from its first group to its last)."""
    groups = point.get("groups") or [[m] for m in point["modes"]]
    first = {m: min(i for i, g in enumerate(groups) if m in g) for g0 in groups for m in g0}
    last = {m: max(i for i, g in enumerate(groups) if m in g) for g0 in groups for m in g0}
    return max(sum(first[m] <= i <= last[m] for m in first) for i in range(len(groups)))


def host_rows_for(host_bytes: int, layers: int, item: int, page: int) -> int:
    """Rows per layer of a ``layers``-layer view of the pinned pool (a multiple of ``page``)."""
    return host_bytes // (layers * item) // page * page


def plan_point(args: argparse.Namespace, point: dict, model: BenchModel, host_bytes: int) -> dict:
    """Batches, budget and bounds of one point (see the module docstring)."""
    n, page = point["context"], args.page
    # (a point without modes, e.g. bench_residency_ab's, runs its own schedule)
    total_steps = runner_steps(args, point) if point.get("modes") and point["kind"] != "ramp" else (
        args.warmup + args.steps + args.check_steps)
    if point["kind"] == "ramp":
        # at most 2 * 11 + 1 levels (batch <= 1024), each one untimed step (a new level's graph
        # is captured there), ramp_steps timed and one checked step
        total_steps = max(total_steps, args.warmup + 23 * (args.ramp_steps + 2))
    cap_tokens = n + total_steps + 1
    # the index space's capacity per request: entries (tokens unless the stack compresses)
    cap = ceil_div(cap_tokens, model.compress_ratio)
    per_full = FullKVRunner.bytes_per_request(model, cap)
    per_hs = hisparse_bytes_per_request(model, cap=cap, buffer_size=args.buffer, page=page)
    host_pages = host_rows_for(host_bytes, model.toy.num_layers, args.item, page) // page - 1
    hs_host = max(host_pages // (ceil_div(cap, page) + 1), 0)
    if point["kind"] == "low_pressure":
        b = point["batch"]
        # HBM not short for either mode: b requests' full KV, or b fully resident HiSparse
        # requests (rows + index keys on every layer + slot state) with the pressure mode's
        # watermark still free, whichever is larger.
        L, D, rb = model.toy.num_layers, model.toy.index_dim, model.device_row_bytes
        capp = ceil_div(cap, page) * page
        extra = 0 if model.resident is None else model.resident.bytes_per_request(cap_tokens)
        per_res = capp * (L * rb + L * 4 * D + 24) + (L * 6 + 4) * (args.buffer + 1) + extra
        spare = 1.0 - RESIDENCY["pressure"]["watermark"]
        budget = int(b * max(per_full, per_res) / spare) + 2 * page * L * rb
        full_bs = hs = b
        limit = "fixed batch"
        hs_hbm = budget // per_hs
        if hs_host < b:
            limit = "host_dram (refused)"
    else:
        if point["kind"] == "node":
            budget = max(point["budget_bytes"], per_full)
        elif args.budget_gib == "auto":
            budget = max(per_full, max(hs_host - 1, 1) * per_hs)
        else:
            budget = int(float(args.budget_gib) * GIB)
        full_bs = min(budget // per_full, args.max_batch)
        hs_hbm = budget // per_hs
        hs = min(hs_hbm, hs_host, args.max_batch)
        limit = "hbm" if hs == hs_hbm else ("host_dram" if hs == hs_host else "max_batch")
    row = model.toy.num_layers * model.device_row_bytes  # one entry's KV, every layer
    state = per_hs - row * hot_rows(args.buffer, page)  # HiSparse's non-row bytes per request
    device_rows = max((budget - hs * state) // row, 0)
    return dict(context=n, layers=model.toy.num_layers, cap=cap, cap_tokens=cap_tokens, runner_steps=total_steps,
                peak_runners=peak_runners(point) if point.get("modes") and point["kind"] != "ramp" else 1,
                compress_ratio=model.compress_ratio, budget_bytes=budget, budget_gib=budget / GIB,
                hisparse_device_rows=device_rows,
                full_bytes_per_request=per_full, hisparse_bytes_per_request=per_hs,
                full_batch_admitted=budget // per_full, full_batch=full_bs,
                hisparse_batch_admitted_hbm=hs_hbm, hisparse_batch_host_limit=hs_host,
                hisparse_batch=hs, hisparse_limited_by=limit)


def check_point(args: argparse.Namespace, model: BenchModel, plan: dict, device: torch.device,
                weight_bytes: int) -> None:
    """Refuse (ValueError, with the figures) a point the machine cannot hold."""
    if min(plan["full_batch"], plan["hisparse_batch"]) < 1:
        raise ValueError(f"a mode admits no request (full {plan['full_batch']}, HiSparse "
                         f"{plan['hisparse_batch']}); raise --budget-gib/--host-gib")
    if plan["hisparse_batch"] > plan["hisparse_batch_host_limit"]:
        raise ValueError(f"the pinned pool holds {plan['hisparse_batch_host_limit']} requests, "
                         f"the point needs {plan['hisparse_batch']}")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        bs = max(plan["hisparse_batch"], plan["full_batch"])
        scratch = 4 * bs * args.top_k * args.item + 3 * bs * plan["cap"] * 4 * model.toy.index_dim
        # every runner alive at once holds its own KV budget (and a graph pool)
        need = plan["peak_runners"] * (plan["budget_bytes"] + GIB // 2) + weight_bytes + scratch + 2 * GIB
        plan["device_need_gib"] = need / GIB
        if need > 0.95 * total:
            raise ValueError(f"needs {need / GIB:.1f} GiB of HBM, the GPU has {total / GIB:.1f} GiB")


def describe(point: dict, plan: dict) -> str:
    return (f"{point['label']}: KV budget {plan['budget_gib']:.2f} GiB; full-KV batch {plan['full_batch']}, "
            f"HiSparse {plan['hisparse_batch']} (HBM admits {plan['hisparse_batch_admitted_hbm']}, host pool "
            f"{plan['hisparse_batch_host_limit']}; bound by {plan['hisparse_limited_by']})")
