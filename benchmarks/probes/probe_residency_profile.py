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
from e2e_points import build_model  # noqa: E402


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
    model = build_model(args, a.layers)
    carrier, storage = ab.pinned_storage(args, min(ab.bench_e2e.host_pool_bytes(args), 48 * ab.GIB),
                                         model.toy.num_layers, dev)
    runners = ab.build_runners(args, b=a.batch, n=a.context, model=model, storage=storage,
                               device=dev, steps=2 * a.steps + 8, modes=["pressure"])["runners"]
    full, res = runners["full"], runners["pressure"]
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
