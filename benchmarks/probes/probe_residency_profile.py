"""Where does a fully resident HiSparse step's time go, against plugin off (full KV)?

Builds bench_residency_ab's runners for one batch (full KV and ``"residency": "pressure"``,
every request resident), warms both, then profiles a few steps of each with torch.profiler
and prints the CUDA kernels by total device time, and the step's host (CPU) time, per runner.

    python benchmarks/probes/probe_residency_profile.py --batch 4 [--context 32768] [--steps 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_residency_ab as ab  # noqa: E402
from e2e_engine import FullKVRunner, HiSparseRunner  # noqa: E402
from e2e_model import ComputeStandIn  # noqa: E402
from e2e_points import RESIDENCY, build_model, plan_point  # noqa: E402
from e2e_selection import SelectionSpec, SelectionTable  # noqa: E402

from sglang_hisparse.memory.host_pool import HostKVPool  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    own, args = ab._args(["--out", "/tmp/probe_res", "--layers", str(a.layers), "--context",
                          str(a.context), "--batches", str(a.batch)])
    dev = torch.device("cuda")
    host_bytes = min(ab.bench_e2e.host_pool_bytes(args), 48 * ab.GIB)
    rows = host_bytes // args.item // args.page * args.page
    carrier = HostKVPool(num_layers=1, item_bytes=args.item, capacity_tokens=rows - args.page,
                         page_size=args.page, max_requests=1, max_context=1, device=dev)
    model = build_model(args, a.layers)
    L, b, n = model.toy.num_layers, a.batch, a.context
    hrows = host_bytes // (L * args.item) // args.page * args.page
    storage = carrier.kv.view(-1)[: L * hrows * args.item].view(L, hrows, args.item)
    point = dict(kind="low_pressure", label="probe", layers=L, context=n, selection="calibrated", batch=b)
    plan = plan_point(args, point, model, storage.numel())
    seeds = torch.arange(1000, 1000 + b, dtype=torch.int64, device=dev)
    sel = SelectionTable(SelectionSpec(), seeds=seeds, n0=n, k=args.top_k, anchors=model.anchors,
                         steps=2 * a.steps + 8)
    compute = ComputeStandIn(model, max_batch=b, device=dev)
    full = FullKVRunner(model, compute, bs=b, n=n, cap=plan["cap"], device=dev, selections=sel)
    full.admit()
    res = HiSparseRunner(model, compute, bs=b, n=n, cap=plan["cap"], buffer_size=args.buffer,
                         page=args.page, storage=storage, prefetch=True, skip_io=False, device=dev,
                         selections=sel, core_options=dict(RESIDENCY["pressure"]),
                         device_rows=plan["hisparse_device_rows"])
    res.admit(fill_host=True)
    for name, r in (("full", full), ("pressure", res)):
        for _ in range(3):
            r.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                r.step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / a.steps
        print(f"== {name}: {wall:.2f} ms/step wall (profiled); residency "
              f"{getattr(getattr(r, 'core', None), 'residency_counts', lambda: None)()}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.top, max_name_column_width=60))
    res.destroy()
    carrier.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
