"""The ramp point of bench_e2e: concurrency rising from 1 past the full-KV limit and back.

Per mode, one runner over R request slots (full KV: its budget's batch; HiSparse: the
point's HiSparse batch); slots ``0..c-1`` decode at level c. A joining request is admitted
(PD) at the current length, so every active request keeps one length and the batched engine
stays one ``[c, n]`` block; on the way down the newest requests finish and free their rows.
Each level runs one untimed step (on CUDA its graph is captured there: one per concurrency),
``--ramp-steps`` timed steps replayed from that graph (a CUDA event pair and a sync around each,
so per-step counters can be read) and one checked step, eager (sampled request 0 vs the oracle
bytes).

Issue 29's reading: per level, pressure-mode's step over the slower of the pure modes at that
concurrency (full KV where it fits, always-hot HiSparse), target <= 1.10.
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback

import torch
from e2e_engine import CheckLog, FullKVRunner, HiSparseRunner

RAMP_TARGET = 1.10


def ramp_levels(top: int) -> list[int]:
    """1, 2, 4, ... below ``top``, ``top``, then back down the same levels."""
    up = []
    c = 1
    while c < top:
        up.append(c)
        c *= 2
    up.append(top)
    return up + up[-2::-1]


def ramp_total_steps(args, top: int) -> int:
    """Warm-up, then per level one untimed step (a new level's graph is captured there), the
    timed steps and one checked step."""
    return args.warmup + len(ramp_levels(top)) * (args.ramp_steps + 2)


def _counts(runner) -> dict:
    core = getattr(runner, "core", None)
    fn = getattr(core, "residency_counts", None)
    return dict(fn()) if fn is not None else {}


def _timed_step(runner, device: torch.device) -> float:
    if device.type == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        runner.step()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1)
    t = time.perf_counter()
    runner.step()
    return (time.perf_counter() - t) * 1e3


def run_ramp_mode(runner, levels: list[int], args, device: torch.device) -> dict:
    """Levels above the runner's slots (full KV past its limit) are skipped, keeping the
    level indices of the whole schedule."""
    log, steps = CheckLog(), []
    slots = runner.slots
    # one graph per level (captured at its untimed first step); its checked step runs eagerly
    runner.graphs = getattr(args, "graphs", False) and device.type == "cuda"
    runner.check_in_graph = False
    runner.set_concurrency(levels[0])
    for _ in range(args.warmup):
        runner.step()
    for i, c in enumerate(levels):
        if c > slots:
            continue
        runner.set_concurrency(c)
        runner.step()
        for _ in range(args.ramp_steps):
            ms = _timed_step(runner, device)
            steps.append(dict(level=i, c=c, step_ms=ms, **_counts(runner)))
        runner.step(check=[0], log=log)
    return dict(levels=levels, steps=steps, checked_outputs=log.compared,
                oracle_mismatches=log.mismatches[:5], exact_vs_oracle=not log.mismatches)


def make_ramp_runner(mode: str, plan: dict, model, compute, storage, selections, args, device, options):
    n, cap = plan["context"], plan["cap"]
    if mode == "full":
        runner = FullKVRunner(model, compute, bs=plan["full_batch"], n=n, cap=cap, device=device,
                              selections=selections)
        runner.admit()
        return runner
    runner = HiSparseRunner(model, compute, bs=plan["hisparse_batch"], n=n, cap=cap,
                            buffer_size=args.buffer, page=args.page, storage=storage, prefetch=True,
                            skip_io=False, device=device, selections=selections, core_options=options,
                            device_rows=plan["hisparse_device_rows"])
    runner.start_empty()
    return runner


def summarize_ramp(modes: dict) -> dict:
    """Per level: median step per mode; pressure over the slower pure mode; the worst."""
    levels = next((m["levels"] for m in modes.values() if "levels" in m), [])
    rows, worst = [], None
    for i, c in enumerate(levels):
        row = dict(level=i, c=c)
        for mode, rec in modes.items():
            ms = [s["step_ms"] for s in rec.get("steps", []) if s["level"] == i and s["c"] == c]
            if ms:
                row[f"{mode}_ms"] = statistics.median(ms)
        pure = [row[k] for k in ("full_ms", "prefetch_ms") if k in row]
        if "pressure_ms" in row and pure:
            row["pressure_over_slower_pure"] = row["pressure_ms"] / max(pure)
            worst = max(worst or 0.0, row["pressure_over_slower_pure"])
        rows.append(row)
    return dict(per_level=rows, worst_pressure_over_slower_pure=worst,
                target=f"<= {RAMP_TARGET}", met=None if worst is None else worst <= RAMP_TARGET)


def run_ramp_point(args, point, plan, model, compute, storage, selections, device, *, options) -> dict:
    """Every mode of the ramp point; ``options(mode)``: its HiSparseCore options."""
    levels = ramp_levels(plan["hisparse_batch"])
    modes: dict[str, dict] = {}
    for mode in point["modes"]:
        gc.collect()
        runner = None
        try:
            runner = make_ramp_runner(mode, plan, model, compute, storage, selections, args, device,
                                      options(mode))
            modes[mode] = run_ramp_mode(runner, levels, args, device)
            print(f"  {point['label']:<22} {mode:<18} levels {levels}: median step "
                  f"{sorted(s['step_ms'] for s in modes[mode]['steps'])[len(modes[mode]['steps']) // 2]:.2f} ms  "
                  f"exact {modes[mode]['exact_vs_oracle']}", flush=True)
        except Exception as exc:
            print(f"  {point['label']} ramp {mode}: FAILED {exc!r}", flush=True)
            modes[mode] = dict(error=repr(exc), trace=traceback.format_exc()[-2000:])
        finally:
            if runner is not None and hasattr(runner, "destroy"):
                runner.destroy()
            del runner
    exact = all(m.get("exact_vs_oracle", False) for m in modes.values())
    return dict(point, plan=plan, ramp=dict(modes=modes, summary=summarize_ramp(modes)), exact=exact)
