"""Cross-mode comparison, environment, notes, the terminal summary and the plot of bench_e2e."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

#: contexts at which the issue's "HiSparse with prefetch >= 3x full KV" target is judged
THROUGHPUT_TARGET_CONTEXT = 32768
THROUGHPUT_TARGET = 3.0
ORACLE_TARGET = 0.80


def _same_outputs(a, b) -> tuple[int, list[str]]:
    """Compare two CheckLogs on their common (request, length, layer) keys."""
    problems, common = [], sorted(set(a.outputs) & set(b.outputs))
    for key in common:
        (ta, oa), (tb, ob) = a.outputs[key], b.outputs[key]
        if not torch.equal(ta, tb):
            problems.append(f"{key}: top-k differs between modes")
        elif not torch.equal(oa, ob):
            problems.append(f"{key}: attention output differs")
    return len(common), problems


def compare_modes(plan: dict, results: dict, args) -> dict:
    """Per context: exactness (vs oracle, vs full KV), exposed IO, ratios, targets."""
    full, noio = results["full"], results["noio"]
    exact = full["exact_vs_oracle"] is not False
    for mode, rec in results.items():
        if mode in ("full", "noio"):
            continue
        n_cmp, problems = _same_outputs(full["_log"], rec["_log"])
        rec["compared_with_full"] = n_cmp
        rec["exact_vs_full"] = n_cmp > 0 and not problems
        rec["full_mismatches"] = problems[:5]
        if not mode.endswith("_nodense"):
            rec["exposed_io_us_per_token"] = (rec["step_ms"] - noio["step_ms"]) * 1e3 / rec["batch"]
        exact = exact and bool(rec["exact_vs_oracle"]) and rec["exact_vs_full"]
    for rec in results.values():
        rec.pop("_log", None)
    ratios, targets = {}, {"applies": False, "met": True}
    if "prefetch" in results:
        pf = results["prefetch"]
        ratios = dict(prefetch_over_full=pf["tokens_per_s"] / full["tokens_per_s"],
                      prefetch_over_noio=pf["tokens_per_s"] / noio["tokens_per_s"],
                      batch_ratio=pf["batch"] / full["batch"])
        if "sync" in results:
            ratios["sync_over_full"] = results["sync"]["tokens_per_s"] / full["tokens_per_s"]
            ratios["sync_over_noio"] = results["sync"]["tokens_per_s"] / noio["tokens_per_s"]
        if "full_nodense" in results and "prefetch_nodense" in results:
            ratios["prefetch_over_full_no_dense"] = (
                results["prefetch_nodense"]["tokens_per_s"] / results["full_nodense"]["tokens_per_s"])
        vs_full = plan["context"] != THROUGHPUT_TARGET_CONTEXT or ratios["prefetch_over_full"] >= THROUGHPUT_TARGET
        vs_noio = ratios["prefetch_over_noio"] >= ORACLE_TARGET
        targets = dict(applies=not args.smoke,
                       prefetch_over_full=f">= {THROUGHPUT_TARGET} at {THROUGHPUT_TARGET_CONTEXT}",
                       prefetch_over_noio=f">= {ORACLE_TARGET}",
                       met_vs_full=vs_full, met_vs_noio=vs_noio, met=vs_full and vs_noio)
    return dict(plan, modes=results, ratios=ratios, targets=targets, exact=exact)


def environment(device: torch.device) -> dict:
    env = dict(torch=torch.__version__, python=platform.python_version(), device=str(device),
               cuda=torch.version.cuda)
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return env


def notes(args, compute) -> list[str]:
    """What the numbers mean (mirrored in benchmarks/E2E.md)."""
    return [
        "Toy DSA model (sglang_hisparse.testing.toy_model) driven exactly as the exactness harness "
        "does; KV bytes are a hash of (request, position, layer), so any row can be recomputed.",
        f"{args.layers} layers, one indexer anchor per {args.anchor_every} layers (the others reuse "
        f"the anchor's top-k); k={args.top_k}, B={args.buffer}, {args.item}-byte KV rows, page {args.page}.",
        "Throughput ratio vs full KV = batch ratio x (full-KV step time / HiSparse step time). Per-token "
        "work (indexer over all n keys, sparse attention over k rows) grows with the batch; only the "
        "dense stand-in is batch-independent. The ratio therefore depends on how large the "
        "batch-independent share of a step is, which the toy model does not have by itself.",
        f"Dense stand-in per layer: streams {args.dense_mb:.0f} MB of bf16 weights (DeepSeek-V3.2 on "
        f"8 GPUs: 32 local experts under EP8, or 1/8 of all 256 under TP8, x 3 x 7168 x 2048 fp8 "
        f"bytes = 1.41 GB, all touched at decode batches) and {args.dense_mflop:.0f} MFLOP per token (8 routed experts' GEMMs / 8 GPUs). "
        f"Weights ({compute.weight_bytes / 2**30:.1f} GiB) are outside the KV budget, as in a server.",
        ("Timed attention (--attention bag): one embedding_bag sum over the k selected rows viewed as "
         "bf16, i.e. each row read once, the memory traffic of a fused sparse MLA kernel over "
         f"{args.item}-byte rows; the {args.heads}-head math "
         f"(~{2 * args.heads * args.top_k * (args.item // 2 + min(512, args.item // 2)) / 1e6:.0f} MFLOP "
         "per request and layer) is left out. "
         "--attention gather materialises the rows and runs bmm attention (~4x the traffic)."
         if args.attention == "bag" else
         f"Timed attention (--attention gather): materialises the k rows and runs {args.heads}-head "
         "MLA-shaped bmm attention (QK 576 dims, PV 512); ~4x the traffic of a fused sparse MLA kernel."),
        "Indexer: D=8 float32 keys gathered through the token table, elementwise scores and an int64 "
        "topk (~0.5 KB of traffic per token and anchor); the real DSA indexer reads ~132 B per token "
        "(128-dim fp8 keys) but does 64 heads of math. indexer_ms / attention_ms / dense_standin_ms are "
        "each component alone at the mode's batch; the rest of step_ms is KV/key writes, coordinator "
        "work, IO and launch gaps.",
        "full_nodense / prefetch_nodense: the same modes with the dense stand-in off (the toy's own "
        "compute only); ratios.prefetch_over_full_no_dense is the throughput ratio without it.",
        "Both modes run eagerly (no CUDA graphs). modes.*.backup_path says how HiSparse's per-step "
        "write-through backup ran: with the synchronous fallback the host waits for the previous "
        "step once per layer per step (the no-IO oracle pays it too; full KV has no backup).",
        "exposed_io_us_per_token = (mode step - no-IO step) / batch; for sync it also includes the "
        "shared layers' own resolve bookkeeping (with prefetch those layers only wait for a replay).",
        "Exactness: on --check-steps steps after timing, sampled requests' toy attention outputs "
        "(float32 sum of the resolved rows' bytes) are compared bit for bit with the oracle bytes and "
        "with the full-KV mode's outputs at the same request, length and layer.",
        "miss_rate: misses / selected entries over the timed steps (telemetry); topk_churn: fraction "
        "of an anchor's top-k not selected at the previous step (sampled requests); h2d_mb_per_step: "
        "miss bytes per step over all layers (for noio: the bytes it skipped).",
        "HiSparse batch sizing counts hot rows (B+1 page-rounded, every layer), the logical-space "
        "indexer keys, mapping/host_rows/req_to_token entries and slot state per request; "
        "hbm_kv_alloc_gib is what the mode actually allocated.",
    ]


def summarize(report: dict) -> str:
    lines = [f"== bench_e2e ({report['environment'].get('gpu', report['environment']['device'])}, "
             f"KV budget {report['config']['budget_gib']} GiB) =="]
    head = f"{'ctx':>7} {'mode':<17}{'batch':>6}{'step ms':>9}{'tok/s':>10}{'exp.IO us/tok':>14}{'miss':>7}  exact"
    lines.append(head)
    for c in report["contexts"]:
        for mode, r in c["modes"].items():
            io = r.get("exposed_io_us_per_token")
            ex = r["exact_vs_oracle"] if mode in ("full", "noio") else (r["exact_vs_oracle"] and r["exact_vs_full"])
            lines.append(f"{c['context']:>7} {mode:<17}{r['batch']:>6}{r['step_ms']:>9.2f}{r['tokens_per_s']:>10.0f}"
                         f"{'' if io is None else f'{io:.2f}':>14}{r.get('miss_rate', 0.0):>7.3f}  {ex}")
        rt = c["ratios"]
        if rt:
            nd = rt.get("prefetch_over_full_no_dense")
            if nd is not None:
                lines.append(f"        without the dense stand-in: prefetch/full {nd:.2f}x")
            lines.append(f"        prefetch/full {rt['prefetch_over_full']:.2f}x (batch {rt['batch_ratio']:.2f}x), "
                         f"prefetch/noio {rt['prefetch_over_noio']:.2f}; targets met: {c['targets']['met']}; "
                         f"HiSparse batch bound by {c['hisparse_limited_by']} (HBM admits "
                         f"{c['hisparse_batch_admitted_hbm']}, full KV {c['full_batch_admitted']})")
    lines.append(f"exact: {report['exact']}  targets met: {report['targets_met']}  total {report['total_s']:.0f} s")
    return "\n".join(lines)


def write_plot(report: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: plot skipped (the JSON has every figure)"
    ctxs = report["contexts"]
    modes = list(ctxs[0]["modes"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(ctxs))]
        axes[0].bar(xs, [c["modes"][mode]["tokens_per_s"] for c in ctxs], width, label=mode)
        axes[1].bar(xs, [c["modes"][mode]["batch"] for c in ctxs], width, label=mode)
    for ax, title in zip(axes, ("decode tokens/s", "batch admitted"), strict=True):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ctxs))])
        ax.set_xticklabels([f"{c['context'] // 1024}K" for c in ctxs])
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"HiSparse vs full KV, KV budget {report['config']['budget_gib']} GiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot: {path}"
