"""Prefix (radix) cache end to end: a shared system prefix and a multi-turn agent (issue 30).

What it answers (docs/prefix-cache.md section 10): with SGLang's radix cache on, how many prompt
tokens does a HiSparse decode worker still compute, what does a prefix hit cost it (load-back of
host rows, device-to-device copies), what time to first token do later requests see, against
the radix cache off and against the plugin off with the radix cache on, and are the outputs
still exact?

```
python benchmarks/bench_prefix.py --out /tmp/p             # the H200 run (~3 min; kernels built)
python benchmarks/bench_prefix.py --smoke --out /tmp/p     # tiny, CPU, seconds (the test's path)
```

Workloads (each request prefilled alone, as it arrives):

```
shared   --convs conversations on one --prefix-tokens system prompt, each with its own
         --suffix-tokens and --shared-output decode steps; all prefilled, then all decode together
agent    --turns turns of one conversation: --first-tokens, then each turn adds the previous
         turn's --agent-output tokens and --new-tokens of its own; each turn decodes alone
```

Modes, each on a fresh engine of the same sizes (one HBM budget, ``--budget-gib``):

```
radix_off   HiSparse, radix cache off: every prompt computed whole
radix       HiSparse + radix cache, residency from --residency (default "pressure", the
            plugin's default): matched pages held, missing ones loaded back from host rows
radix_hot   the same with "always_hot" (SGLang's in-tree behaviour): every later turn loads
            its whole prefix back, the worst case of the load-back
```

The engine is the exactness harness's ``DecodeEngine`` (``hisparse_testing/engine.py``) on the
GPU at these sizes: the real allocator, coordinator, kernels, staging and the toy radix tree with
SGLang's call protocol; the first ``--check-steps`` decode steps of every request group are
compared with the all-resident oracle. The model's prefill compute is a timed stand-in
(:class:`PrefillStandIn`): bf16 GEMMs of exactly the FLOPs a DSA layer stack spends on the
computed tokens (``--dense-mflop`` + ``--attn-mflop`` per token per layer, and the anchors'
indexer over every earlier key). Time to first token (TTFT) of a request = its prefill in the
engine (allocation, tree match, ``prepare_prefix``'s load-back, KV writes) + the stand-in.
**Plugin off + radix** computes the same tokens as ``radix`` (same tree) and neither loads
nor stages: its TTFT is reported as the same run's stand-in + KV-write time of those tokens
(``full_radix_ttft_ms``), without the load-back. Decode steps run the harness's per-request
Python loop (identical in every mode): decode time here is an upper bound and is reported,
not compared with the plugin off (``bench_e2e`` does that, batched).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

# the test support (hisparse_testing/) is not installed: it imports from the checkout's root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hisparse_testing.engine import (
    DecodeEngine,
    EngineSizes,
    Mismatch,
    ReqStatus,
    ToyRequest,
)
from hisparse_testing.toy_model import ToyModel
from sglang_hisparse.config import DEFAULT_RESIDENCY_WATERMARK

MODES = ("radix_off", "radix", "radix_hot")
#: FLOP per earlier key per token and anchor layer of DSA's lightning indexer (64 heads x 128 dims x 2)
INDEXER_FLOP_PER_KEY = 2 * 64 * 128
#: the stand-in's GEMM width (DeepSeek-V3.x / GLM-5 hidden size)
HIDDEN = 7168


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PrefillStandIn:
    """Timed prefill compute: GEMMs of ``[rows, HIDDEN] x [HIDDEN, HIDDEN]`` adding up to the
    FLOPs of the computed tokens (module docstring). ``scale`` < 1 shrinks them (CPU smoke)."""

    def __init__(self, *, layers: int, anchors: int, dense_mflop: float, attn_mflop: float,
                 device: torch.device, scale: float = 1.0, rows: int = 8192) -> None:
        self.layers, self.anchors, self.scale = layers, anchors, scale
        self.per_token = layers * (dense_mflop + attn_mflop) * 1e6
        dt = torch.bfloat16 if device.type == "cuda" else torch.float32
        width = HIDDEN if device.type == "cuda" else 256
        self.x = torch.zeros(rows, width, dtype=dt, device=device)
        self.w = torch.zeros(width, width, dtype=dt, device=device)
        self.flop_per_row = 2.0 * width * width
        self.device = device

    def flops(self, tokens: int, start: int) -> float:
        """FLOPs of computing positions ``[start, start + tokens)``: per-token work plus the
        anchors' indexer over every earlier key (sum of the positions' context lengths)."""
        keys = tokens * start + tokens * (tokens + 1) // 2
        return tokens * self.per_token + self.anchors * INDEXER_FLOP_PER_KEY * keys

    def run(self, tokens: int, start: int) -> float:
        """Run the GEMMs (not synced); the FLOPs they stand for."""
        f = self.flops(tokens, start)
        left = int(f * self.scale / self.flop_per_row)
        full = self.x.shape[0]
        while left > 0:
            n = min(left, full)
            torch.mm(self.x[:n], self.w)
            left -= n
        return f


@dataclasses.dataclass
class Workload:
    name: str
    #: (request key, prompt tokens, shared-prefix tokens, decode steps); requests of one key are
    #: the turns of one conversation (same seed), run in order
    requests: list[tuple[int, int, int, int]]
    #: "together": prefill all, then decode all at once; "sequential": each decodes alone
    schedule: str

    @property
    def max_context(self) -> int:
        return max(p + out for _, p, _, out in self.requests)

    def concurrent_tokens(self, *, shared: bool) -> int:
        """Tokens alive at once (the host-pool need): with ``shared``, the prefix counted once."""
        if self.schedule == "together":
            common = max(sh for _, _, sh, _ in self.requests) if shared else 0
            return common + sum(p - (sh if shared else 0) + out for _, p, sh, out in self.requests)
        return self.max_context


def workloads(args: argparse.Namespace) -> list[Workload]:
    out = []
    if args.convs:
        reqs = [(i, args.prefix_tokens + args.suffix_tokens, args.prefix_tokens, args.shared_output)
                for i in range(args.convs)]
        out.append(Workload("shared", reqs, "together"))
    if args.turns:
        reqs, n = [], args.first_tokens
        for _ in range(args.turns):
            reqs.append((0, n, 0, args.agent_output))
            n += args.agent_output + args.new_tokens
        out.append(Workload("agent", reqs, "sequential"))
    return out


def sizes_for(args: argparse.Namespace, w: Workload, row_bytes: int, *, shared: bool) -> EngineSizes:
    """Device rows from the HBM budget (the same in every mode); the host ratio so the mode's
    requests fit (radix off: every prompt whole; radix: the shared prefix once)."""
    ps = args.page
    rows = int(args.budget_gib * 2**30) // row_bytes // ps * ps
    need = w.concurrent_tokens(shared=shared) + ps * (len(w.requests) + 2)
    ratio = max(1, -(-need // rows))
    return EngineSizes(num_reqs=len(w.requests) + 1, buffer_size=args.buffer, device_rows=rows,
                       host_to_device_ratio=ratio, max_ctx=-(-(w.max_context + ps) // ps) * ps,
                       page_size=ps)


class _Timed:
    """Wraps ``core.prepare_prefix``: synced wall time of every call (the load-back)."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.ms = 0.0
        self.device = engine.device
        inner = engine.core.prepare_prefix

        def timed(*a, **kw):
            _sync(self.device)
            t = time.perf_counter()
            ok = inner(*a, **kw)
            _sync(self.device)
            self.ms += (time.perf_counter() - t) * 1e3
            return ok

        engine.core.prepare_prefix = timed


def run_mode(args, w: Workload, mode: str, model: ToyModel, sizes: EngineSizes,
             standin: PrefillStandIn, device: torch.device) -> dict:
    residency = "always_hot" if mode == "radix_hot" else args.residency
    watermark = int(DEFAULT_RESIDENCY_WATERMARK * sizes.device_rows) if residency == "pressure" else 0
    t_build = time.perf_counter()
    engine = DecodeEngine(model, sizes, device=device, check=False, max_batch=len(w.requests) + 1,
                          skip_io=False, radix=mode != "radix_off", residency=residency,
                          watermark_rows=watermark)
    build_s = time.perf_counter() - t_build
    timer = _Timed(engine)
    rec: dict = dict(mode=mode, residency=residency, requests=[], build_s=round(build_s, 2))
    exact, checked = True, 0
    mismatch = ""

    def decode(batch: list[ToyRequest], steps: int) -> float:
        nonlocal exact, checked, mismatch
        _sync(device)
        t = time.perf_counter()
        for s in range(steps):
            engine.check = s < args.check_steps
            try:
                engine.step()
            except Mismatch as e:
                exact, mismatch = False, str(e)[:300]
                engine.check = False
            checked += engine.check
        engine.check = False
        _sync(device)
        return (time.perf_counter() - t) * 1e3

    def prefill(key: int, prompt: int, shared: int, out: int, rid: int) -> tuple[ToyRequest, dict]:
        req = ToyRequest(rid=rid, seed=1000 + key, prompt_len=prompt, max_new=out,
                         prefix_seed=7 if shared else -1, shared_len=shared)
        if not engine.can_admit(req):
            raise RuntimeError(f"{w.name}/{mode}: request {rid} (prompt {prompt}) not admitted: sizes too small")
        snap0 = engine.core.telemetry.snapshot()
        load0 = timer.ms
        _sync(device)
        t = time.perf_counter()
        engine.prefill(req)
        _sync(device)
        engine_ms = (time.perf_counter() - t) * 1e3
        computed = prompt - req.matched
        t = time.perf_counter()
        standin.run(computed, req.matched)
        _sync(device)
        standin_ms = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        while req.status is ReqStatus.STAGING:
            engine.collect()
        _sync(device)
        staging_ms = (time.perf_counter() - t) * 1e3
        snap1 = engine.core.telemetry.snapshot()
        load_ms = timer.ms - load0
        return req, dict(
            rid=rid, prompt=prompt, matched=req.matched, computed=computed,
            loaded_tokens=snap1.prefix_load_tokens - snap0.prefix_load_tokens,
            loaded_gb=round((snap1.prefix_load_bytes - snap0.prefix_load_bytes) / 1e9, 4),
            copied_rows=snap1.prefix_copy_rows - snap0.prefix_copy_rows,
            ttft_ms=round(engine_ms + standin_ms, 3), load_ms=round(load_ms, 3),
            engine_ms=round(engine_ms, 3), standin_ms=round(standin_ms, 3),
            staging_wait_ms=round(staging_ms, 3),
            full_radix_ttft_ms=round(engine_ms - load_ms + standin_ms, 3),
            resident=engine.core.residency_counts().get("resident", 0),
        )

    t0 = time.perf_counter()
    try:
        decode_ms = 0.0
        if w.schedule == "together":
            reqs = []
            for rid, (key, prompt, shared, out) in enumerate(w.requests):
                req, info = prefill(key, prompt, shared, out, rid)
                reqs.append(req)
                rec["requests"].append(info)
            decode_ms += decode(reqs, max(q.max_new for q in reqs))
            for q in reqs:
                engine.release(q, "finish")
        else:
            for rid, (key, prompt, shared, out) in enumerate(w.requests):
                req, info = prefill(key, prompt, shared, out, rid)
                d = decode([req], out)
                info["decode_ms"] = round(d, 3)
                decode_ms += d
                engine.release(req, "finish")
                rec["requests"].append(info)
        engine.check_integrity()
        engine.check_no_leaks()
        rec["leak_free"] = True
    except Exception as e:  # recorded; the next mode runs
        rec["error"] = f"{type(e).__name__}: {e}"[:500]
    rec["wall_s"] = round(time.perf_counter() - t0, 3)
    rec["decode_ms"] = round(decode_ms, 3) if "error" not in rec else None
    rec["exact"] = exact and checked > 0
    rec["checked_steps"] = checked
    if mismatch:
        rec["mismatch"] = mismatch
    rec["telemetry"] = dataclasses.asdict(engine.core.telemetry.snapshot())
    engine.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def summarize(w: Workload, modes: dict[str, dict]) -> dict:
    """Prefill tokens computed against radix off, TTFT of later requests, throughput."""
    out: dict = {}
    base = modes.get("radix_off")
    for name, rec in modes.items():
        reqs = rec.get("requests") or []
        if not reqs or "error" in rec:
            continue
        later = reqs[1:] or reqs
        s = dict(
            computed_tokens=sum(r["computed"] for r in reqs),
            loaded_tokens=sum(r["loaded_tokens"] for r in reqs),
            later_ttft_ms=round(sum(r["ttft_ms"] for r in later) / len(later), 3),
            later_load_ms=round(sum(r["load_ms"] for r in later) / len(later), 3),
            later_full_radix_ttft_ms=round(sum(r["full_radix_ttft_ms"] for r in later) / len(later), 3),
            first_ttft_ms=reqs[0]["ttft_ms"],
        )
        prefill_ms = sum(r["ttft_ms"] for r in reqs)
        out_tokens = sum(o for _, _, _, o in w.requests)
        s["prefill_ms_total"] = round(prefill_ms, 3)
        s["tokens_per_s"] = round(out_tokens / ((prefill_ms + rec["decode_ms"]) / 1e3), 2)
        if base and base.get("requests") and "error" not in base:
            b = sum(r["computed"] for r in base["requests"])
            s["computed_reduction"] = round(1 - s["computed_tokens"] / b, 4)
        out[name] = s
    if "radix_off" in out:
        off = out["radix_off"]
        for s in out.values():
            s["later_ttft_over_radix_off"] = round(s["later_ttft_ms"] / off["later_ttft_ms"], 4)
            s["throughput_over_radix_off"] = round(s["tokens_per_s"] / off["tokens_per_s"], 4)
    for s in out.values():
        s["later_ttft_over_full_radix"] = round(s["later_ttft_ms"] / s["later_full_radix_ttft_ms"], 4)
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="docs/prefix-cache.md section 10; benchmarks/E2E.md ('Prefix cache')")
    ap.add_argument("--out", required=True, type=Path, help="output directory (bench_prefix.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (the test's path)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--workloads", nargs="+", default=["shared", "agent"], choices=["shared", "agent"])
    ap.add_argument("--layers", type=int, default=61, help="sparse layers (GLM anchor rule: 16 anchors of 61)")
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--buffer", type=int, default=4096, help="hot slots B per request and layer")
    ap.add_argument("--item", type=int, default=1152, help="bytes per KV row (576 bf16 = 1152)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--budget-gib", type=float, default=12.7,
                    help="HBM for KV rows (bench_e2e's 61-layer 32K point); sets the device rows")
    ap.add_argument("--residency", choices=["pressure", "always_hot"], default="pressure")
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=25600)
    ap.add_argument("--suffix-tokens", type=int, default=512)
    ap.add_argument("--shared-output", type=int, default=64)
    ap.add_argument("--turns", type=int, default=13)
    ap.add_argument("--first-tokens", type=int, default=74000)
    ap.add_argument("--new-tokens", type=int, default=750)
    ap.add_argument("--agent-output", type=int, default=220)
    ap.add_argument("--check-steps", type=int, default=2, help="decode steps per request group checked against the oracle")
    ap.add_argument("--dense-mflop", type=float, default=88.0, help="dense MFLOP per token per layer (bench_e2e's)")
    ap.add_argument("--attn-mflop", type=float, default=71.0,
                    help="sparse attention MFLOP per token per layer (k 2048, 16 heads, 576/512 dims)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device = "cpu"
        args.layers, args.top_k, args.buffer, args.item, args.page = 5, 8, 32, 32, 4
        args.convs, args.prefix_tokens, args.suffix_tokens, args.shared_output = 4, 96, 8, 3
        args.turns, args.first_tokens, args.new_tokens, args.agent_output = 4, 120, 6, 3
        args.budget_gib = 400 * args.layers * args.item / 2**30
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_prefix: no CUDA device; use --smoke for the CPU path", file=sys.stderr)
        return 2
    shared = tuple(max(i - 1, 0) % 4 != 0 for i in range(args.layers))
    model = ToyModel(num_layers=args.layers, top_k=args.top_k, item_bytes=args.item, shared=shared)
    anchors = sum(not s for s in shared)
    standin = PrefillStandIn(layers=args.layers, anchors=anchors, dense_mflop=args.dense_mflop,
                             attn_mflop=args.attn_mflop, device=device,
                             scale=1e-6 if args.smoke else 1.0)
    standin.run(8192, 0)  # warm the GEMM
    _sync(device)
    t = time.perf_counter()
    f = standin.run(8192, 0)
    _sync(device)
    standin_tflops = f / (time.perf_counter() - t) / 1e12
    row_bytes = args.layers * args.item
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = dict(
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        environment=dict(torch=torch.__version__, python=platform.python_version(),
                         device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        host_bytes_per_cached_token=row_bytes,
        index_bytes_per_cached_token=anchors * 4 * model.index_dim,
        standin_tflops=round(standin_tflops, 1), workloads={},
    )
    rc = 0
    for w in workloads(args):
        if w.name not in args.workloads:
            continue
        entry: dict = dict(requests=len(w.requests), modes={}, sizes={}, host_gib={})
        report["workloads"][w.name] = entry
        for mode in args.modes:
            sizes = sizes_for(args, w, row_bytes, shared=mode != "radix_off")
            entry["sizes"][mode] = dataclasses.asdict(sizes)
            entry["host_gib"][mode] = round(sizes.device_rows * sizes.host_to_device_ratio * row_bytes / 2**30, 2)
            print(f"== {w.name} {mode} (device rows {sizes.device_rows}, host ratio {sizes.host_to_device_ratio})", flush=True)
            rec = run_mode(args, w, mode, model, sizes, standin, device)
            entry["modes"][mode] = rec
            if "error" in rec or not rec["exact"]:
                rc = 1
                print(f"   FAILED: {rec.get('error') or rec.get('mismatch') or 'nothing checked'}", flush=True)
            entry["summary"] = summarize(w, entry["modes"])
            (args.out / "bench_prefix.json").write_text(json.dumps(report, indent=1))
        for name, s in entry.get("summary", {}).items():
            print(f"   {name:10s} computed {s['computed_tokens']:>8d} ({s.get('computed_reduction', 0):.1%} fewer) "
                  f"loaded {s['loaded_tokens']:>8d}  later TTFT {s['later_ttft_ms']:9.2f} ms "
                  f"(load {s['later_load_ms']:.2f}; plugin off + radix {s['later_full_radix_ttft_ms']:.2f})  "
                  f"{s['tokens_per_s']:.1f} tok/s", flush=True)
    report["complete"] = True
    (args.out / "bench_prefix.json").write_text(json.dumps(report, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
