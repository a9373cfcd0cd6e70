"""Host-read rate against the host reads each SM keeps in flight (GPU, JSON out).

The same random rows per step (batch x 5 % of k = 2048, uniform over the 4 GiB pinned pool) are
copied by the plain gather (one warp per row, full grid: ~12 rows in flight per SM at batch 16)
and by the replay kernel on G CTAs of T threads, each thread keeping ``kUnroll`` (4) 16-byte
loads in flight: about G * T * 4 / (SMs * item / 16) rows per SM. If the rate falls when an SM
holds many rows at once, a kernel that issues every miss early (v9, v12) should lose to one
that feeds the link a few rows per SM at a time (benchmarks/RESOLVE.md).

    python benchmarks/probes/probe_inflight.py --out inflight.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_resolve
from bench_resolve import (  # noqa: E402
    DEV,
    Pool,
    plan_rows,
    printed,
    probe_args,
    random_plans,
    time_graph,
    write_probe,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_hisparse.kernels import _jit, ops  # noqa: E402


def probe_config(host, item, bs, sms, steps, reps):
    """The gather and the replay grids on one config's plans: one record each."""
    per_req = round(0.05 * 2048)
    rows = bs * per_req
    dev_cache = torch.empty(2 * rows, item, dtype=torch.uint8, device=DEV)
    plans = random_plans(bs, per_req, host.shape[0], 2 * rows, steps, seed=bs)
    flat = [plan_rows(p) for p in plans]
    nr = torch.tensor([bs], dtype=torch.int32, device=DEV)
    gather = _jit.gather_module(item).gather
    us = time_graph(lambda t: gather(flat[t][0], flat[t][1], host, dev_cache), lambda: None,
                    steps, reps)
    recs = [dict(kernel="gather", item=item, bs=bs, rows=rows, us=round(us, 2),
                 rows_per_sm_in_flight=round(rows / sms, 1))]
    for ctas in (8, 33, 66, 132, 264):
        for block in (128, 512):
            us = time_graph(
                lambda t, c=ctas, b=block: ops.replay(
                    plan=plans[t], num_real_reqs=nr, host_cache=host, device_cache=dev_cache,
                    ctas=c, block_size=b),
                lambda: None, steps, reps)
            in_flight = min(rows, ctas * block * 4 * 16 / item) / min(ctas, sms)
            recs.append(dict(kernel="replay", item=item, bs=bs, rows=rows, ctas=ctas, block=block,
                             us=round(us, 2), rows_per_sm_in_flight=round(in_flight, 1)))
    return recs


def main(argv=None) -> int:
    args = probe_args(__doc__, "probe_inflight.json", 5, argv)
    pool, sms = Pool(4.0), torch.cuda.get_device_properties(0).multi_processor_count
    recs = printed(rec for item in (656, 1152) for bs in (16, 64)
                   for rec in probe_config(pool.rows(item), item, bs, sms, args.steps, args.reps))
    write_probe(args.out, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
