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
from dataclasses import replace
from pathlib import Path

from sglang_hisparse import planner
from sglang_hisparse.cli.inputs import check_output_path, model_config_path, read_model_config
from sglang_hisparse.cli.plan_report import decode_flags, plot, render, to_json
from sglang_hisparse.kernel_policy import POLICIES, SERVING_POLICY, VERIFY_POLICIES
from sglang_hisparse.presets import load_preset, model_from_config, preset_names

DEFAULT_PRESET = "GLM-5.1"
EPILOG = """\
examples:
  python -m sglang_hisparse plan                                   # GLM-5.1, 8xH200, 128K
  python -m sglang_hisparse plan --model DeepSeek-V3.2 --context 32K,64K,128K
  python -m sglang_hisparse plan --model DeepSeek-V4-Flash --context 32K,128K  # fp8 C4 entries
  python -m sglang_hisparse plan --model-config /models/GLM-5.2-FP8/config.json --kv-dtype fp8
  python -m sglang_hisparse plan --kv-budget-gib 40 --buffer 6144 --json
  python -m sglang_hisparse plan --trace traces/glm.npz --plot plan.png
  python -m sglang_hisparse plan --context 64K --emit-config       # 2 lines: config JSON, flags

memory is in GiB (2**30 bytes); per-request sizes also in GB (1e9) to compare with published
figures; bandwidth in GB/s (1e9 bytes/s). Exit status: 0 ok, 2 bad input.
"""


def _one_count(text: str) -> int:
    """``--shared-prefix``: one token count (K / M suffixes as ``--context``)."""
    counts = parse_tokens(text)
    if len(counts) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one token count, e.g. 25600 or 25K")
    return counts[0]


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
        if not math.isfinite(value) or not value.is_integer():
            raise argparse.ArgumentTypeError(
                f"--context {text!r}: {part!r} is not a whole number of tokens; use e.g. 131072, 128K or 1.5K")
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
                     "sharing (index_topk_freq / index_topk_pattern / indexer_types); or a MiniMax-M3 config.json "
                     "(sparse_attention_config, head_dim): its sparse layers' K/V of one head per rank, top-k = "
                     "the blocks a step selects x block size; or a DeepSeek-V4 config.json (compress_ratios, "
                     "sliding_window, index_topk): its C4 layers' entries, one per 4 tokens")
    m.add_argument("--kv-dtype", choices=planner.KV_DTYPES, default=None,
                   help="KV cache dtype: bf16 = 1152 B rows (SGLang's default on H200), fp8 = 656 B rows (default "
                        f"{d['kv_dtype'].default}; fp8 for DeepSeek-V4, whose C4 pool stores fp8 only)")
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
    w.add_argument("--shared-prefix", type=_one_count, default=0, metavar="TOKENS",
                   help="prompt tokens every request shares (a system prompt; the radix cache on, its default): "
                        "held once per GPU, in HBM with full KV and in host DRAM with HiSparse (default 0)")
    w.add_argument("--buffer", type=int, metavar="B", help="hot slots per request per layer, >= top-k "
                   "(default 2*top-k = 4096: SGLang's default; the LRU then keeps last steps' selections)")
    w.add_argument("--policy", choices=POLICIES, default=SERVING_POLICY,
                   help=f"hot-buffer replacement policy (--hisparse-config \"policy\"; default {SERVING_POLICY}, "
                        "what a server runs when the config names none, with or without speculative decoding; "
                        f"speculative decoding takes {' or '.join(VERIFY_POLICIES)}): fra keeps "
                        "one int32 per slot and layer more, slru one per request and layer; --trace is "
                        "simulated with it (docs/traces.md)")
    mr = w.add_mutually_exclusive_group()
    mr.add_argument("--miss-rate", type=float, metavar="FRACTION", help="expected fraction of the top-k missing the "
                    "hot buffer per step (default 0.134: the published GLM-5.1 LRU figure)")
    mr.add_argument("--trace", metavar="FILE", help="selection trace (docs/traces.md): the miss rate is simulated "
                    "with --policy at --buffer instead of assumed")
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


def _trace_miss_rate(path: str, buffer: int, top_k: int, policy: str = "lru") -> tuple[float, str]:
    """``policy``'s miss rate of a recorded trace at ``buffer`` slots: (rate, where it came from).

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
    except (OSError, ValueError) as e:
        raise ValueError(f"--trace {path}: cannot load a selection trace ({e}); see docs/traces.md.") from None
    # load_trace checked the header's top_k: absent, or an integer >= 1
    trace_k = trace.header.get("top_k") or top_k
    if trace_k > top_k and trace.header.get("sorted_by_score"):
        trace, trace_k = trace.truncated(top_k), top_k
    b_sim = buffer if trace_k == top_k else max(trace_k, round(buffer * trace_k / top_k))
    overall = simulator.simulate(trace, policy, [b_sim])[str(b_sim)]["overall"]
    if overall["long_miss_rate"] is None:
        raise ValueError(f"--trace {path}: no step is longer than B = {b_sim} tokens, so the trace says nothing "
                         f"about misses; record longer contexts or pass --miss-rate.")
    scaled = f", B scaled by trace top-k {trace_k}/{top_k}" if trace_k != top_k else ""
    return float(overall["long_miss_rate"]), f"{policy.upper()} on {path} at B={b_sim}{scaled}"


def inputs_from_args(args: argparse.Namespace) -> planner.PlanInputs:
    """Namespace -> validated-later :class:`planner.PlanInputs` (raises ``ValueError``)."""
    model = _model(args)
    contexts = tuple(n for group in (args.context or [[128 * 1024]]) for n in group)
    inputs = planner.PlanInputs(
        model=model, contexts=contexts, kv_dtype=args.kv_dtype or model.default_kv_dtype, gpu_hbm_gib=args.gpu_hbm_gib,
        kv_share=args.kv_share, kv_budget_gib=args.kv_budget_gib, tp=args.tp, dp_attention=args.dp_attention,
        buffer=args.buffer, host_dram_gib=args.host_dram_gib, link_gbps=args.link_gbps,
        target_step_ms=args.target_step_ms, hisparse_index_layers=args.hisparse_index_layers, min_gain=args.min_gain,
        policy=args.policy, shared_prefix=args.shared_prefix)
    if args.miss_rate is not None:
        inputs = replace(inputs, miss_rate=args.miss_rate, miss_rate_source="--miss-rate")
    elif args.trace is not None:
        inputs.validate()  # the buffer must be valid before simulating with it
        rate, source = _trace_miss_rate(args.trace, inputs.hot_slots, inputs.top_k, inputs.policy)
        inputs = replace(inputs, miss_rate=rate, miss_rate_source=source)
    else:
        inputs = replace(inputs, miss_rate_source="default: published GLM-5.1 LRU figure")
    return inputs


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
        plot(result, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
