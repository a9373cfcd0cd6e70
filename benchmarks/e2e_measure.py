"""How bench_e2e measures: interleaved repeats of timed steps, the telemetry window, the GPU's
busy time from a profiler trace, checked steps, and the point's same-run ceilings (the plain
scattered gather for the link, a device copy for HBM).

A **group** is a set of modes whose runners are alive together; ``run_group`` times them in
``--repeats`` rounds, each mode ``--steps`` steps a round after ``--block-warmup`` untimed ones,
the order reversed every other round (A B C, C B A, A B C), so slow drift of the machine lands on
every mode alike and the rounds' spread is the run-to-run noise a difference has to beat.
"""

from __future__ import annotations

import statistics
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


def hbm_ceiling(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> dict | None:
    """Same-run HBM ceiling: a device-to-device copy of ``nbytes`` (read + write), median."""
    if device.type != "cuda":
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    ms = sorted(times)[len(times) // 2]
    del a, b
    return dict(bytes=2 * nbytes, ms=ms, gbps=2 * nbytes / (ms * 1e-3) / 1e9)


def timed_steps(runner, steps: int, device: torch.device) -> list[float]:
    """``steps`` steps, one CUDA event pair per step (CPU: wall clock); ms per step."""
    if device.type != "cuda":
        out = []
        for _ in range(steps):
            t = time.perf_counter()
            runner.step()
            out.append((time.perf_counter() - t) * 1e3)
        return out
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        runner.step()
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(steps)]


class Samples:
    """One mode's timed steps in one group: per round, its step times and telemetry deltas."""

    def __init__(self) -> None:
        self.rounds: list[list[float]] = []
        self.selected = self.misses = self.h2d_bytes = 0
        self.steps = 0

    def add(self, runner, steps: int, device: torch.device) -> None:
        core = getattr(runner, "core", None)
        before = core.telemetry.snapshot() if core else None
        self.rounds.append(timed_steps(runner, steps, device))
        self.steps += steps
        if before is not None:
            after = core.telemetry.snapshot()
            self.selected += after.selected - before.selected
            self.misses += after.misses - before.misses
            self.h2d_bytes += after.h2d_bytes - before.h2d_bytes

    def figures(self) -> dict:
        flat = [ms for r in self.rounds for ms in r]
        means = [sum(r) / len(r) for r in self.rounds]
        step = sum(flat) / len(flat)
        out = dict(step_ms=step, step_ms_median=statistics.median(flat), step_ms_per_step=flat,
                   round_ms=means, spread=(max(means) - min(means)) / step if len(means) > 1 else None)
        if self.selected:
            out.update(miss_rate=self.misses / self.selected,
                       h2d_mb_per_step=self.h2d_bytes / self.steps / 2**20)
        return out


def run_group(modes: list[str], runners: dict, args, device: torch.device) -> dict[str, Samples]:
    """Interleaved rounds over the alive runners of ``modes`` (see the module docstring)."""
    samples = {m: Samples() for m in modes}
    for r in range(args.repeats):
        order = modes if r % 2 == 0 else modes[::-1]
        for m in order:
            for _ in range(args.block_warmup):
                runners[m].step()
            samples[m].add(runners[m], args.steps, device)
    return samples


#: kernel-name fragments -> component of the step (the first that matches; the rest is "other")
CATEGORIES = (
    ("attention", ("_sparse_mla_", "embedding_bag", "EmbeddingBag")),
    ("resolve", ("resolve", "replay", "hisparse", "gather_rows", "layer_copy")),
    ("dense", ("gemm", "gemv", "cutlass", "xmma", "cublas", "sm90_")),
    ("indexer", ("topk", "sort", "radix", "index", "gather", "scatter", "reduce", "elementwise",
                 "vectorized", "unrolled", "where", "mul", "add")),
)


def _category(name: str) -> str:
    for cat, frags in CATEGORIES:
        if any(f in name for f in frags):
            return cat
    return "other"


def _kernel_intervals(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every device activity (kernels, copies, memsets) in a trace."""
    out = []
    try:
        for ev in prof.profiler.kineto_results.events():
            if ev.device_type() == torch.autograd.DeviceType.CUDA:
                s = ev.start_ns() / 1e3
                out.append((ev.name(), s, s + ev.duration_ns() / 1e3))
    except AttributeError:
        for ev in prof.events():
            if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
                out.append((ev.name, ev.time_range.start, ev.time_range.end))
    return out


def gpu_profile(runner, steps: int, device: torch.device) -> dict | None:
    """``steps`` steps under torch.profiler: the GPU's busy time (the union of every device
    activity's interval, all streams) and the span from the first activity's start to the last
    one's end (``host_gap_share`` here is 1 - busy / span; ``with_step_time`` replaces it by the
    figure against the unprofiled step). Also busy time per component (``CATEGORIES``, by
    kernel name) and the device activities per step."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    runner.step()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.step()
        sync(device)
    iv = sorted(_kernel_intervals(prof), key=lambda t: t[1])
    if not iv:
        return dict(error="the profiler saw no device activity", host_gap_share=None)
    busy, cur_s, cur_e = 0.0, iv[0][1], iv[0][2]
    by_cat: dict[str, float] = {}
    for name, s, e in iv:
        by_cat[_category(name)] = by_cat.get(_category(name), 0.0) + (e - s)
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, _, e in iv) - iv[0][1]
    return dict(steps=steps, span_ms_per_step=span / steps / 1e3, busy_ms_per_step=busy / steps / 1e3,
                host_gap_share=1.0 - busy / span if span > 0 else None,
                activities_per_step=len(iv) / steps,
                component_ms_per_step={k: v / steps / 1e3 for k, v in sorted(by_cat.items())})


def replay_spans(runner, steps: int, device: torch.device) -> dict | None:
    """``steps`` steps with CUDA events around each graph replay as well as at each step's
    boundary: the replay's span (the GPU from its first node's start to its last node's end,
    intra-graph dependency gaps included) against the whole step (bookkeeping outside the
    graph, and any wait of the GPU for the host, included). None unless every step replayed."""
    if device.type != "cuda" or not getattr(runner, "graphs", False):
        return None
    runner.replay_events = []
    try:
        step_ms = timed_steps(runner, steps, device)
        pairs = runner.replay_events
    finally:
        runner.replay_events = None
    if len(pairs) != steps:
        return None
    replay = [a.elapsed_time(b) for a, b in pairs]
    return dict(steps=steps, step_ms=sum(step_ms) / steps, replay_ms=sum(replay) / steps)


def with_step_time(gp: dict | None, step_ms: float, spans: dict | None = None) -> None:
    """The gap figures of a profiled mode, each over the timed (unprofiled) step:

    - ``busy_gap_share``: 1 - the GPU's busy time in the trace / the step (issue 47's literal
      definition). Under graphs it also counts the device's own idle between a graph's nodes
      (~0.5 us per dependency edge, ~1,700 nodes a step), which no host change removes.
    - ``host_gap_share``: 1 - the replay's span / the step (``replay_spans``, the same mode's
      steps): the time the GPU waits for the host between graphs, the share that eager launches
      made 15-35 % of a step. The sanity line reads this one; without spans (an eager mode) it
      falls back to ``busy_gap_share``.
    - ``graph_idle_share``: 1 - busy / the replay's span (the intra-graph idle, for the record).

    The trace's own span is longer than an unprofiled step (tracing ~1,700 kernels a step costs
    ~1 ms), so ``span_gap_share`` (1 - busy / span) counts the profiler's idle too; it is kept,
    labelled, not used."""
    if not gp or gp.get("busy_ms_per_step") is None:
        return
    if "span_gap_share" not in gp:
        gp["span_gap_share"] = gp.get("host_gap_share")
    gp["step_ms"] = step_ms
    gp["busy_gap_share"] = max(0.0, 1.0 - gp["busy_ms_per_step"] / step_ms)
    gp["host_gap_share"] = gp["busy_gap_share"]
    if spans:
        gp["replay_ms_per_step"] = spans["replay_ms"]
        gp["spans_step_ms"] = spans["step_ms"]
        gp["host_gap_share"] = max(0.0, 1.0 - spans["replay_ms"] / spans["step_ms"])
        gp["graph_idle_share"] = max(0.0, 1.0 - gp["busy_ms_per_step"] / spans["replay_ms"])


def finish_mode(mode: str, runner, samples: Samples, args, device: torch.device, check: list[int]) -> dict:
    """A mode's record after its groups: the headline group's figures, the profile, the checked
    steps (those at build, which every mode of the point took at the same lengths, and
    ``--check-steps`` more after all its timed steps) and the graph counters."""
    rec = dict(batch=runner.bs, **samples.figures())
    rec.update(tokens_per_s=runner.bs * 1e3 / rec["step_ms"], tpot_ms=rec["step_ms"])
    if getattr(args, "profile_steps", 0):
        rec["gpu_profile"] = gp = gpu_profile(runner, args.profile_steps, device)
        with_step_time(gp, rec["step_ms"], replay_spans(runner, args.profile_steps, device))
    log = getattr(runner, "check_log", None) or CheckLog()  # (the steps checked at build, if any)
    for _ in range(args.check_steps):
        runner.step(check=check, log=log)
    sync(device)
    rec.update(checked_outputs=log.compared, oracle_mismatches=log.mismatches[:5],
               topk_churn=sum(log.churn) / len(log.churn) if log.churn else None,
               graphs=dict(replays=runner.replays, eager_steps=runner.eager_steps, captures=runner.captures))
    if hasattr(runner, "backup_path"):
        rec["backup_path"] = runner.backup_path
    rec["exact_vs_oracle"] = None if mode == "noio" else not log.mismatches
    rec["_log"] = log
    return rec
