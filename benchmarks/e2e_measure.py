"""One mode's measurement in bench_e2e: warm-up, CUDA-event timed steps, checked steps, the
telemetry window; and the point's same-run link ceiling (the plain scattered gather)."""

from __future__ import annotations

import time

import torch
from e2e_engine import CheckLog


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def link_ceiling(storage: torch.Tensor, item: int, device: torch.device, rows: int = 32768,
                 reps: int = 10) -> dict | None:
    """Same-run link ceiling: the plain scattered gather (jit_kernels/gather.cuh) of ``rows``
    random rows of this point's pinned pool into the device, median of ``reps``."""
    if device.type != "cuda":
        return None
    from sglang_hisparse.kernels import _jit

    gather = _jit.gather_module(item).gather
    host = storage[0]
    g = torch.Generator(device="cpu").manual_seed(5)
    src = torch.randint(0, host.shape[0], (rows,), generator=g).to(device)
    dst = torch.arange(rows, dtype=torch.int32, device=device)
    dev_cache = torch.empty(rows, item, dtype=torch.uint8, device=device)
    gather(src, dst, host, dev_cache)
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        gather(src, dst, host, dev_cache)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    ms = sorted(times)[len(times) // 2]
    return dict(rows=rows, item=item, ms=ms, gbps=rows * item / (ms * 1e-3) / 1e9)


def run_mode(mode: str, runner, args, device: torch.device, check: list[int]) -> dict:
    """Warm up, time ``args.steps`` steps (one CUDA event pair per step), then the checked
    steps; return the mode's record."""
    for _ in range(args.warmup):
        runner.step()
    sync(device)
    core = getattr(runner, "core", None)
    before = core.telemetry.snapshot() if core else None
    t0 = time.perf_counter()
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
        events[0].record()
        for i in range(args.steps):
            runner.step()
            events[i + 1].record()
        events[-1].synchronize()
        per_step = [events[i].elapsed_time(events[i + 1]) for i in range(args.steps)]
    else:
        per_step = []
        for _ in range(args.steps):
            t = time.perf_counter()
            runner.step()
            per_step.append((time.perf_counter() - t) * 1e3)
    step_ms = sum(per_step) / len(per_step)
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    after = core.telemetry.snapshot() if core else None
    log = CheckLog()
    for _ in range(args.check_steps):
        runner.step(check=check, log=log)
    sync(device)
    rec = dict(batch=runner.bs, step_ms=step_ms, step_ms_per_step=per_step, wall_step_ms=wall_ms,
               tokens_per_s=runner.bs * 1e3 / step_ms, tpot_ms=step_ms,
               checked_outputs=log.compared, oracle_mismatches=log.mismatches[:5],
               topk_churn=sum(log.churn) / len(log.churn) if log.churn else None)
    if before is not None and after is not None:
        sel, miss = after.selected - before.selected, after.misses - before.misses
        rec.update(miss_rate=miss / sel if sel else 0.0,
                   h2d_mb_per_step=(after.h2d_bytes - before.h2d_bytes) / args.steps / 2**20)
    if hasattr(runner, "backup_path"):
        rec["backup_path"] = runner.backup_path
    rec.update(runner.profile())
    rec["exact_vs_oracle"] = None if mode == "noio" else not log.mismatches
    rec["_log"] = log
    return rec
