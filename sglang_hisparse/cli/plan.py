"""``python -m sglang_hisparse plan``: should this deployment turn HiSparse on, and how?

Runs anywhere (no GPU, no SGLang, no torch). With no arguments it plans GLM-5.1 on one
8xH200 node at 128K context. It prints, per context length: HBM per request with full KV and
with HiSparse, the largest decode batch each way, the host DRAM HiSparse needs, the
host->device bytes per output token and the link time they cost per step at that batch, and a
recommendation with its reason; then a ready ``--hisparse-config``. The arithmetic and every
default are explained in docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from sglang_hisparse import planner
from sglang_hisparse.cli.inputs import check_output_path, model_config_path, read_model_config
from sglang_hisparse.presets import load_preset, model_from_config, preset_names

DEFAULT_PRESET = "GLM-5.1"
EPILOG = """\
examples:
  python -m sglang_hisparse plan                                   # GLM-5.1, 8xH200, 128K
  python -m sglang_hisparse plan --model DeepSeek-V3.2 --context 32K,64K,128K
  python -m sglang_hisparse plan --model-config /models/GLM-5.2-FP8/config.json --kv-dtype fp8
  python -m sglang_hisparse plan --kv-budget-gib 40 --buffer 6144 --json
  python -m sglang_hisparse plan --trace traces/glm.npz --plot plan.png
  python -m sglang_hisparse plan --context 64K --emit-config       # 2 lines: config JSON, flags

memory is in GiB (2**30 bytes); per-request sizes also in GB (1e9) to compare with published
figures; bandwidth in GB/s (1e9 bytes/s). Exit status: 0 ok, 2 bad input.
"""


def parse_tokens(text: str) -> list[int]:
    """``"128K"``, ``"32k,64k"``, ``"1M"``, ``"131072"`` -> token counts (K = 1024, M = 1024**2)."""
    out = []
    for part in text.replace(" ", "").split(","):
        scale = {"k": 1024, "m": 1024**2}.get(part[-1:].lower(), 1)
        digits = part[:-1] if scale > 1 else part
        try:
            value = float(digits) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--context {text!r}: {part!r} is not a token count; use e.g. 131072, 128K or 32K,64K") from None
        out.append(int(value))
    return out


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="capacity planner: batch, HBM, host DRAM and link time with and without HiSparse",
                       description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = planner.PlanInputs.__dataclass_fields__
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PRESET", help=f"model preset: {', '.join(preset_names())} (default {DEFAULT_PRESET})")
    src.add_argument("--model-config", metavar="PATH", help="a DSA model's HF config.json (or its directory): reads "
                     "num_hidden_layers, kv_lora_rank, qk_rope_head_dim, index_head_dim, index_topk and index "
                     "sharing (index_topk_freq / index_topk_pattern / indexer_types)")
    m.add_argument("--kv-dtype", choices=planner.KV_DTYPES, default=d["kv_dtype"].default,
                   help="KV cache dtype: bf16 = 1152 B rows (SGLang's default on H200), fp8 = 656 B rows (default %(default)s)")
    g = p.add_argument_group("hardware (per GPU unless stated)")
    g.add_argument("--gpu-hbm-gib", type=float, default=d["gpu_hbm_gib"].default, metavar="GIB",
                   help="HBM per GPU in GiB (default %(default)s: H200, 143771 MiB reported)")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--kv-share", type=float, metavar="FRACTION", help="fraction of HBM left for KV after weights, "
                    "activations and CUDA graphs (default: 0.85 - preset weights/(tp*HBM), or 0.25 without a preset)")
    kv.add_argument("--kv-budget-gib", type=float, metavar="GIB", help="KV budget per GPU in GiB (instead of --kv-share)")
    g.add_argument("--tp", type=int, default=d["tp"].default, help="GPUs in the tensor-parallel group (default %(default)s)")
    g.add_argument("--dp-attention", action=argparse.BooleanOptionalAction, default=d["dp_attention"].default,
                   help="each rank serves its own requests (as the published 8xH200 commands do); off: MLA KV is "
                        "replicated on every TP rank (default on)")
    g.add_argument("--host-dram-gib", type=float, default=d["host_dram_gib"].default, metavar="GIB",
                   help="host DRAM per node available for pinned KV, GiB (default %(default)s)")
    g.add_argument("--link-gbps", type=float, default=d["link_gbps"].default, metavar="GB/S",
                   help="host->device bandwidth per GPU for scattered row reads by GPU threads, GB/s (default "
                        "%(default)s: 40-50 GB/s measured on H200, PCIe Gen5 x16; docs/planner.md)")
    w = p.add_argument_group("workload and HiSparse")
    w.add_argument("--context", action="append", type=parse_tokens, metavar="TOKENS",
                   help="context length(s) per request: repeat or comma-separate; K = 1024 (default 128K)")
    w.add_argument("--buffer", type=int, metavar="B", help="hot slots per request per layer, >= top-k "
                   "(default 2*top-k = 4096: SGLang's default; the LRU then keeps last steps' selections)")
    mr = w.add_mutually_exclusive_group()
    mr.add_argument("--miss-rate", type=float, metavar="FRACTION", help="expected fraction of the top-k missing the "
                    "hot buffer per step (default 0.134: the published GLM-5.1 LRU figure)")
    mr.add_argument("--trace", metavar="FILE", help="selection trace (docs/traces.md): the miss rate is simulated "
                    "with LRU at --buffer instead of assumed")
    w.add_argument("--target-step-ms", type=float, default=d["target_step_ms"].default, metavar="MS",
                   help="decode step time to compare the link time against, ms (default %(default)s)")
    w.add_argument("--hisparse-index-layers", choices=("all", "anchors"), default="all",
                   help="layers keeping index-K under HiSparse: all (SGLang 0.5.23) or only index-sharing anchors")
    w.add_argument("--min-gain", type=float, default=planner.DEFAULT_MIN_GAIN, metavar="X",
                   help="recommend HiSparse when it admits at least X times the full-KV batch (default %(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    o.add_argument("--emit-config", action="store_true",
                   help="print only two lines for launch scripts: the --hisparse-config JSON (an empty line when "
                        "the verdict is off) and the other decode server flags, space-separated, no quoting")
    o.add_argument("--plot", metavar="PNG", help="write batch and link time vs context length (needs matplotlib)")
    return p


def _model(args: argparse.Namespace) -> planner.ModelSpec:
    if args.model_config is None:
        return load_preset(args.model or DEFAULT_PRESET)
    path = Path(model_config_path(args.model_config))
    return model_from_config(read_model_config(args.model_config), name=path.parent.name or str(path))


def assumption_notes(args: argparse.Namespace, inputs: planner.PlanInputs) -> list[str]:
    """Why a ``--model-config`` plan differs from the preset of the same shape, in one line.

    A config.json carries the attention shape but not the weight size, so the KV share falls
    back to ``FALLBACK_KV_SHARE`` where the preset derives it from its ``weights_gib``; that is
    the only input that differs (``test_model_config_matches_the_preset`` pins the rest).
    """
    if args.model_config is None or args.kv_share is not None or args.kv_budget_gib is not None:
        return []
    m = inputs.model
    shape = (m.layers, m.kv_lora_rank, m.qk_rope_head_dim, m.index_head_dim, m.index_topk, m.anchors)
    for name in preset_names():
        preset = load_preset(name)
        same = (preset.layers, preset.kv_lora_rank, preset.qk_rope_head_dim, preset.index_head_dim,
                preset.index_topk, preset.anchors) == shape
        if same and preset.weights_gib is not None:
            _, share, _ = replace(inputs, model=preset).kv_budget()
            return [f"KV share differs from the {name} preset (same shape): {planner.FALLBACK_KV_SHARE:.3f} here "
                    f"(config.json has no weight size) vs {share:.3f} there (weights ~{preset.weights_gib:g} GiB); "
                    f"pass --kv-share {share:.3f} or --model {name} to match, or a measured --kv-budget-gib"]
    return [f"KV share {planner.FALLBACK_KV_SHARE:.3f} is a fallback (config.json has no weight size and no "
            f"preset has this shape); pass --kv-share or a measured --kv-budget-gib"]


def _trace_miss_rate(path: str, buffer: int, top_k: int) -> tuple[float, str]:
    """LRU miss rate of a recorded trace at ``buffer`` slots: (rate, where it came from).

    The rate is the simulator's ``long_miss_rate`` (misses per distinct selected position on
    steps past B, where misses can happen). A trace recorded with a different top-k is
    replayed at the same B/top-k ratio, which is what the miss rate depends on.
    """
    try:
        from sglang_hisparse.traces import format as trace_format
        from sglang_hisparse.traces import simulator
    except ImportError as e:
        raise ValueError(f"--trace {path}: the trace simulator is not available ({e}); pass --miss-rate instead.") from None
    try:
        trace = trace_format.load_trace(path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--trace {path}: cannot load a selection trace ({e}); see docs/traces.md.") from None
    trace_k = int(trace.header.get("top_k") or top_k)
    if trace_k > top_k and trace.header.get("sorted_by_score"):
        trace, trace_k = trace.truncated(top_k), top_k
    b_sim = buffer if trace_k == top_k else max(trace_k, round(buffer * trace_k / top_k))
    overall = simulator.simulate(trace, "lru", [b_sim])[str(b_sim)]["overall"]
    if overall["long_miss_rate"] is None:
        raise ValueError(f"--trace {path}: no step is longer than B = {b_sim} tokens, so the trace says nothing "
                         f"about misses; record longer contexts or pass --miss-rate.")
    scaled = f", B scaled by trace top-k {trace_k}/{top_k}" if trace_k != top_k else ""
    return float(overall["long_miss_rate"]), f"LRU on {path} at B={b_sim}{scaled}"


def inputs_from_args(args: argparse.Namespace) -> planner.PlanInputs:
    """Namespace -> validated-later :class:`planner.PlanInputs` (raises ``ValueError``)."""
    model = _model(args)
    contexts = tuple(n for group in (args.context or [[128 * 1024]]) for n in group)
    inputs = planner.PlanInputs(
        model=model, contexts=contexts, kv_dtype=args.kv_dtype, gpu_hbm_gib=args.gpu_hbm_gib,
        kv_share=args.kv_share, kv_budget_gib=args.kv_budget_gib, tp=args.tp, dp_attention=args.dp_attention,
        buffer=args.buffer, host_dram_gib=args.host_dram_gib, link_gbps=args.link_gbps,
        target_step_ms=args.target_step_ms, hisparse_index_layers=args.hisparse_index_layers, min_gain=args.min_gain)
    if args.miss_rate is not None:
        inputs = replace(inputs, miss_rate=args.miss_rate, miss_rate_source="--miss-rate")
    elif args.trace is not None:
        inputs.validate()  # the buffer must be valid before simulating with it
        rate, source = _trace_miss_rate(args.trace, inputs.hot_slots, inputs.top_k)
        inputs = replace(inputs, miss_rate=rate, miss_rate_source=source)
    else:
        inputs = replace(inputs, miss_rate_source="default: published GLM-5.1 LRU figure")
    return inputs


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _gib(b: float) -> str:
    return f"{b / planner.GIB:.2f} GiB"


def _index_line(p: planner.Plan) -> str:
    """Where index-K lives, in words: what one entry is, in how many layers, and why HiSparse keeps it."""
    i, m = p.inputs, p.inputs.model
    full, hs = planner.index_layers(i, False), planner.index_layers(i, True)
    what = (f"{m.index_bytes} B per token per layer (fp8 key of {m.index_head_dim} values + fp32 scale) for the "
            f"whole context: the indexer scores every position each step, so HiSparse does not offload it")
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


def decode_flags(p: planner.Plan) -> tuple[dict[str, int] | None, list[str]]:
    """(``--hisparse-config`` dict or None when the verdict is off, the other decode server flags).

    On: the longest context that turns it on, its batch capped by the binding constraint
    (HBM, host DRAM or link). Off: plain SGLang at the longest context's full-KV batch.
    """
    on = [r for r in p.contexts if r.turn_on]
    if on:
        best = max(on, key=lambda r: r.context)
        return p.suggested_config, ["--enable-hisparse", "--disable-radix-cache",
                                    "--max-running-requests", str(max(best.node_batch_recommended, 1))]
    longest = max(p.contexts, key=lambda r: r.context)
    return None, ["--max-running-requests", str(max(longest.node_batch_full, 1))]


def render(p: planner.Plan, notes: list[str] | tuple[str, ...] = ()) -> str:
    """The terminal report: a header of inputs, one column per context, the verdicts, the flags."""
    i, m = p.inputs, p.inputs.model
    layout = f"TP {i.tp}, {'DP attention' if i.dp_attention else 'KV replicated per rank'}"
    head = [
        f"HiSparse capacity plan: {m.name}, {i.kv_dtype} KV, {i.tp} x {i.gpu_hbm_gib:g} GiB GPUs ({layout})",
        f"  KV rows    {m.kv_bytes(i.kv_dtype)} B/token/layer x {m.layers} layers",
        _index_line(p),
        f"  KV budget  {_gib(p.kv_budget_bytes)} per GPU (share {p.kv_share:.3f}: {p.kv_share_source})",
        f"  HiSparse   top-k {i.top_k}, B = {i.hot_slots}; miss rate {100 * i.miss_rate:.1f} % "
        f"({i.miss_rate_source}); link {i.link_gbps:g} GB/s per GPU; step target {i.target_step_ms:g} ms",
        *(f"  note       {n}" for n in notes),
        "",
    ]
    rows: list[tuple[str, list[str]]] = [
        ("context (tokens)", [_ctx(r.context) for r in p.contexts]),
        ("HBM per request, full KV", [f"{_gib(r.full_bytes_per_request)} ({r.full_bytes_per_request / 1e9:.2f} GB)" for r in p.contexts]),
        ("HBM per request, HiSparse", [f"{_gib(r.hisparse_bytes_per_request)} ({r.hisparse_bytes_per_request / 1e9:.2f} GB)" for r in p.contexts]),
        ("  hot buffers (KV)", [_gib(r.hisparse_kv_bytes_per_request) for r in p.contexts]),
        ("  index-K (whole context)", [_gib(r.hisparse_index_bytes_per_request) for r in p.contexts]),
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
        hs = f"--enable-hisparse --disable-radix-cache --hisparse-config '{cfg}'"
        out = [f"Decode server flags (HiSparse off, plain SGLang): {' '.join(flags)}",
               "A/B anyway, same command plus the HiSparse flags:",
               f"  sglang-hisparse's HiSparse: the plugin installed (SGLANG_PLUGINS unset, or naming 'hisparse') + {hs}",
               "  SGLang's in-tree HiSparse:  the same flags with SGLANG_PLUGINS set to a list without 'hisparse', "
               "e.g. SGLANG_PLUGINS=none (empty means load all; launch_examples/ab_plugin_off.sh does this)"]
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


def _plot(p: planner.Plan, path: str) -> None:
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


def run(args: argparse.Namespace) -> int:
    try:
        check_output_path(args.plot, "--plot")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib: pip install 'sglang-hisparse[plot]' (or pip install matplotlib), "
                  "or drop --plot.", file=sys.stderr)
            return 2
    if args.emit_config and (args.json or args.plot):
        print("error: --emit-config prints only the config and flags; drop --json/--plot (or --emit-config).",
              file=sys.stderr)
        return 2
    try:
        inputs = inputs_from_args(args)
        result = planner.plan(inputs)
        notes = assumption_notes(args, inputs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.emit_config:
        config, flags = decode_flags(result)
        print(json.dumps(config) if config is not None else "")
        print(" ".join(flags))
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        return 0
    if args.json:
        print(json.dumps({**to_json(result), "notes": notes}, indent=2))
    else:
        print(render(result, notes))
    if args.plot:
        _plot(result, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
