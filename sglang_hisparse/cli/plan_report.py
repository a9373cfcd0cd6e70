"""What ``python -m sglang_hisparse plan`` prints: the table, the JSON, the flags and the plot.

Split from ``cli/plan.py`` (which parses the arguments and builds the inputs) so that each
file holds one of the two nouns: inputs there, report here.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from typing import Any

from sglang_hisparse import planner


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _gib(b: float) -> str:
    return f"{b / planner.GIB:.2f} GiB"


def _index_line(p: planner.Plan) -> str:
    """Where index-K lives, in words: what one entry is, in how many layers, and why HiSparse keeps it."""
    i, m = p.inputs, p.inputs.model
    full, hs = planner.index_layers(i, False), planner.index_layers(i, True)
    if m.family == "minimax-m3":
        dense = m.dense_layers * m.kv_bytes(i.kv_dtype)
        index = m.device_bytes_per_token(i.kv_dtype) - dense
        return (f"  on device  {index} B per token of index cache ({m.index_head_dim}-wide keys in {m.layers} sparse "
                f"layers, values in {m.index_value_layers}) and {dense} B of the {m.dense_layers} dense layers' K/V, "
                f"for the whole context, in both modes")
    per = "C4 entry" if m.family == "deepseek-v4" else "token"
    what = (f"{m.index_bytes} B per {per} per layer (fp8 key of {m.index_head_dim} values + fp32 scale) for the "
            f"whole context: the indexer scores every position each step, so HiSparse does not offload it")
    if m.family == "deepseek-v4":
        return (f"  index-K    {what}; in the {m.layers} C4 layers (each runs its own indexer). On device in both "
                f"modes too: the {m.c128_layers} C128 layers' entries (one per 128 tokens) and every layer's "
                f"{m.window}-token window ({m.window_layers} layers), {m.kv_bytes(i.kv_dtype)} B each")
    if full == m.layers:
        where = f"in all {m.layers} layers (each runs its own indexer); the same under HiSparse"
    elif hs == m.layers:
        where = (f"in the {full} of {m.layers} layers that run their own indexer (the others share an anchor's "
                 f"selection); in all {m.layers} under HiSparse (SGLang 0.5.23 keeps every layer's index-K "
                 f"with --enable-hisparse)")
    else:
        where = (f"in the {full} of {m.layers} layers that run their own indexer (the others share an anchor's "
                 f"selection); the same under HiSparse (--hisparse-index-layers anchors)")
    return f"  index-K    {what}; {where}"


def decode_flags(p: planner.Plan) -> tuple[dict[str, int | str] | None, list[str]]:
    """(``--hisparse-config`` dict or None when the verdict is off, the other decode server flags).

    On: the longest context that turns it on, its batch capped by the binding constraint
    (HBM, host DRAM or link). Off: plain SGLang at the longest context's full-KV batch.
    """
    on = [r for r in p.contexts if r.turn_on]
    if on:
        best = max(on, key=lambda r: r.context)
        return p.suggested_config, ["--enable-hisparse",
                                    "--max-running-requests", str(max(best.node_batch_recommended, 1))]
    longest = max(p.contexts, key=lambda r: r.context)
    return None, ["--max-running-requests", str(max(longest.node_batch_full, 1))]


def render(p: planner.Plan, notes: list[str] | tuple[str, ...] = ()) -> str:
    """The terminal report: a header of inputs, one column per context, the verdicts, the flags."""
    i, m = p.inputs, p.inputs.model
    layout = f"TP {i.tp}, {'DP attention' if i.dp_attention else 'KV replicated per rank'}"
    if m.family == "minimax-m3":
        layout = f"TP {i.tp}, one KV head per rank"
    head = [
        f"HiSparse capacity plan: {m.name}, {i.kv_dtype} KV, {i.tp} x {i.gpu_hbm_gib:g} GiB GPUs ({layout})",
        (f"  KV rows    {m.kv_bytes(i.kv_dtype)} B per C4 entry (one per {m.compress_ratio} tokens) x {m.layers} C4 "
         f"layers on the device, {m.host_row_bytes(i.kv_dtype)} B per entry in host DRAM"
         if m.family == "deepseek-v4" else
         f"  KV rows    {m.kv_bytes(i.kv_dtype)} B/token/layer x {m.layers} layers"
         + (" (MiniMax-M3's sparse layers: K then V of one head per rank)" if m.family == "minimax-m3" else "")),
        _index_line(p),
        f"  KV budget  {_gib(p.kv_budget_bytes)} per GPU (share {p.kv_share:.3f}: {p.kv_share_source})",
        f"  HiSparse   top-k {i.top_k}, B = {i.hot_slots}; miss rate {100 * i.miss_rate:.1f} % "
        f"({i.miss_rate_source}); link {i.link_gbps:g} GB/s per GPU; step target {i.target_step_ms:g} ms",
        *([f"  Shared     {i.shared_prefix} prefix tokens per request held once per GPU (radix cache): in HBM "
           f"with full KV, in host DRAM with HiSparse"] if i.shared_prefix else []),
        *(f"  note       {n}" for n in notes),
        "",
    ]
    rows: list[tuple[str, list[str]]] = [
        ("context (tokens)", [_ctx(r.context) for r in p.contexts]),
        ("HBM per request, full KV", [f"{_gib(r.full_bytes_per_request)} ({r.full_bytes_per_request / 1e9:.2f} GB)" for r in p.contexts]),
        ("HBM per request, HiSparse", [f"{_gib(r.hisparse_bytes_per_request)} ({r.hisparse_bytes_per_request / 1e9:.2f} GB)" for r in p.contexts]),
        ("  hot buffers (KV)", [_gib(r.hisparse_kv_bytes_per_request) for r in p.contexts]),
        ({"minimax-m3": "  index cache + dense KV", "deepseek-v4": "  index-K, C128, windows"}.get(
            m.family, "  index-K (whole context)"),
         [_gib(r.hisparse_index_bytes_per_request) for r in p.contexts]),
        ("  coordinator state", [f"{r.hisparse_state_bytes_per_request / 1e6:.1f} MB" for r in p.contexts]),
        ("decode batch per node, full KV", [str(r.node_batch_full) for r in p.contexts]),
        ("decode batch per node, HiSparse", [f"{r.node_batch_hisparse} ({r.limited_by}-bound)" for r in p.contexts]),
        ("  link allows (fits the step)", ["-" if r.node_batch_link is None else str(r.node_batch_link) for r in p.contexts]),
        ("  recommended batch", [f"{r.node_batch_recommended} ({r.bound_by}-bound)" for r in p.contexts]),
        ("host DRAM needed per node", [f"{r.host_dram_node_bytes / planner.GIB:.0f} of {i.host_dram_gib:g} GiB" for r in p.contexts]),
        ("host->device per output token", [f"{r.h2d_bytes_per_token / 1e6:.1f} MB" for r in p.contexts]),
        ("link time per step (all layers)", [f"{r.io_ms_per_step:.1f} ms" for r in p.contexts]),
        ("  on the critical path, prefetch", [f"{r.io_exposed_ms_per_step:.1f} ms" for r in p.contexts]),
        (f"fits a {i.target_step_ms:g} ms step", ["yes" if r.io_fits else "NO" for r in p.contexts]),
        ("gain (HiSparse / full batch)", ["inf" if math.isinf(r.gain) else f"{r.gain:.1f}x" for r in p.contexts]),
        ("verdict", ["ON" if r.turn_on else "off" for r in p.contexts]),
    ]
    label_w = max(len(label) for label, _ in rows)
    col_w = [max(len(vals[c]) for _, vals in rows) for c in range(len(p.contexts))]
    table = [f"{label:<{label_w}}  " + "  ".join(f"{v:>{w}}" for v, w in zip(vals, col_w, strict=True)) for label, vals in rows]
    table.insert(1, "-" * len(table[0]))
    why = [f"  {_ctx(r.context):>6}: {'turn it on' if r.turn_on else 'leave it off'}: {r.reason}" for r in p.contexts]
    below = (f"not worth it below ~{p.break_even_context} tokens of context" if p.break_even_context
             else "never worth it for this model")
    config, flags = decode_flags(p)
    cfg = json.dumps(p.suggested_config)
    if config is not None:
        best = max((r for r in p.contexts if r.turn_on), key=lambda r: r.context)
        verdict = (f"turn it on for {_ctx(best.context)} contexts (why: above), at most "
                   f"{best.node_batch_recommended} requests per node ({best.bound_by}-bound); {below}.")
        out = [f"Decode server flags: {' '.join(flags)} --hisparse-config '{cfg}'"]
    else:
        verdict = f"leave it off (why: above); {below}."
        hs = f"--enable-hisparse --hisparse-config '{cfg}'"
        out = [f"Decode server flags (HiSparse off, plain SGLang): {' '.join(flags)}",
               "A/B anyway, same command plus the HiSparse flags:",
               f"  sglang-hisparse's HiSparse: the plugin installed (SGLANG_PLUGINS unset, or naming 'hisparse') + {hs}",
               "  SGLang's in-tree HiSparse:  the same flags plus --disable-radix-cache (it requires it) with "
               "SGLANG_PLUGINS set to a list without 'hisparse', e.g. SGLANG_PLUGINS=none (empty means load all; "
               "launch_examples/ab_plugin_off.sh does both)"]
    return "\n".join(head + table + ["", "Why:", *why, "", f"Recommendation: {verdict}", *out])


def to_json(p: planner.Plan) -> dict[str, Any]:
    """JSON-safe dict of the plan (bytes as integers, ``inf`` gain as null)."""
    out = asdict(p)
    i, m = p.inputs, p.inputs.model
    out["inputs"]["model"]["anchors"] = ",".join(map(str, m.anchors))  # one line, not 78
    config, flags = decode_flags(p)
    out["server_flags"] = {"hisparse_config": config, "flags": flags}
    out["derived"] = {"kv_row_bytes": m.kv_bytes(i.kv_dtype), "index_row_bytes": m.index_bytes,
                      "anchor_layers": len(m.anchors), "top_k": i.top_k, "hot_slots": i.hot_slots,
                      "index_layers_full": planner.index_layers(i, False),
                      "index_layers_hisparse": planner.index_layers(i, True)}
    for row, r in zip(out["contexts"], p.contexts, strict=True):
        row["hisparse_bytes_per_request"] = r.hisparse_bytes_per_request
        row["gain"] = None if math.isinf(r.gain) else r.gain
    return out


def plot(p: planner.Plan, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    top = max(256 * 1024, 2 * max(p.inputs.contexts))
    grid = sorted({2**e for e in range(13, 30) if 2**e <= top} | set(p.inputs.contexts))
    sweep = planner.plan(replace(p.inputs, contexts=tuple(grid))).contexts
    xs = [r.context for r in sweep]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    ax1.plot(xs, [r.node_batch_full for r in sweep], "o-", label="full KV on GPU")
    ax1.plot(xs, [r.node_batch_hisparse for r in sweep], "s-", label=f"HiSparse (B={p.inputs.hot_slots})")
    ax1.set_ylabel("largest decode batch per node")
    ax1.set_title(f"{p.inputs.model.name}, {p.inputs.kv_dtype} KV, {p.inputs.tp} x {p.inputs.gpu_hbm_gib:g} GiB")
    ax1.legend()
    ax2.plot(xs, [r.io_ms_per_step for r in sweep], "s-", label="link time per step, all layers")
    ax2.plot(xs, [r.io_exposed_ms_per_step for r in sweep], "^--", label="on the critical path with prefetch")
    ax2.axhline(p.inputs.target_step_ms, color="gray", ls=":", label="step target")
    ax2.set_ylabel(f"ms per step at the HiSparse batch ({p.inputs.link_gbps:g} GB/s)")
    ax2.set_xlabel("context length (tokens)")
    ax2.set_xscale("log", base=2)
    ax2.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _ctx(int(x))))
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
