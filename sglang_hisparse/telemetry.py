"""HiSparse counters, cheap enough to leave on in production.

Counters the device computes (top-k selections and misses per resolve) accumulate into
device tensors with in-place adds queued on the resolving stream: no host sync, no
allocation once warmed up, and the adds are captured into CUDA graphs like any other kernel.
Counters the host already knows (staged requests, backed-up tokens, decode steps) are plain
Python ints. The device values are read (one sync) only by :meth:`Telemetry.snapshot`,
which the periodic log line and ``get_token_stats``-style reporting call.

How to read them (docs/coordinator.md has the long form):

- ``hit_rate = 1 - misses / selected``: share of valid top-k entries (real requests, all
  resolving layers) already on the device. Short requests (``n <= B``) are all hits.
- ``misses_per_step``: host→device row copies per decode step, summed over resolving layers
  (shared-index layers replaying their anchor's misses are counted in ``h2d_bytes`` only).
- ``h2d_bytes``: KV bytes copied host→device by resolve and replay (plus direct-admission
  preloads); divide by wall time for the PCIe/C2C bandwidth HiSparse uses.
- ``staged_requests`` / ``staged_tokens``: prompts copied device→host after prefill.
- ``backup_tokens``: previous-newest tokens written through to host (one per request-step,
  minus the first step after admission); ``backup_bytes`` counts all layers.
- ``prefix_hit_tokens``: prompt tokens a prefill did not compute (radix-cache matches held by
  ``prepare_prefix``); ``prefix_load_tokens`` / ``prefix_load_bytes``: those of them loaded
  host→device because no device row held them (the rest were on the device already);
  ``prefix_copy_rows``: rows copied device to device instead: by a collect, out of pages
  another request still reads, and by ``prepare_prefix``, out of a running resident request's buffer
  that still maps a matched id.
- ``tree_tokens``: logical ids the radix tree holds (their host rows are the cached prefixes),
  from SGLang's own counts at each request release.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("sglang_hisparse")


@dataclass(frozen=True)
class TelemetrySnapshot:
    """Counter values at one instant (cumulative since construction)."""

    steps: int
    selected: int
    misses: int
    h2d_bytes: int
    backup_tokens: int
    backup_bytes: int
    staged_requests: int
    staged_tokens: int
    direct_admissions: int
    preload_tokens: int
    #: residency ("pressure"): requests resident / hot now, free device rows, shrinks so far;
    #: None when residency is off (always_hot)
    residency: dict[str, int] | None = None
    prefix_hit_tokens: int = 0
    prefix_load_tokens: int = 0
    prefix_load_bytes: int = 0
    prefix_copy_rows: int = 0
    #: tokens (logical ids, so host rows) the radix tree holds, SGLang's evictable + protected
    #: sizes at the latest request release; -1 until one was seen (radix cache off: stays -1)
    tree_tokens: int = -1

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.selected if self.selected else 1.0

    @property
    def misses_per_step(self) -> float:
        return self.misses / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {k: v for k, v in self.__dict__.items() if k != "residency"}
        for k, v in (self.residency or {}).items():
            out[f"residency_{k}"] = v
        out["hit_rate"] = self.hit_rate
        out["misses_per_step"] = self.misses_per_step
        return out


class Telemetry:
    """Accumulates counters; see the module docstring for their meaning.

    ``device`` counters: ``_dev[0]`` selected, ``_dev[1]`` misses, ``_dev[2]`` h2d bytes
    (int64 [3] on the coordinator's device).
    """

    def __init__(self, device: torch.device, *, log_interval_s: float = 0.0) -> None:
        self._dev = torch.zeros(3, dtype=torch.int64, device=device)
        self.steps = 0
        self.backup_tokens = 0
        self.backup_bytes = 0
        self.staged_requests = 0
        self.staged_tokens = 0
        self.direct_admissions = 0
        self.preload_tokens = 0
        self.preload_bytes = 0
        self.prefix_hit_tokens = 0
        self.prefix_load_tokens = 0
        self.prefix_load_bytes = 0
        self.prefix_copy_rows = 0
        self.tree_tokens = -1
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        #: () -> residency counts (``Residency.counts``), set by the core when residency is on
        self.residency_counts: Callable[[], dict[str, int]] | None = None
        self._last_snapshot: TelemetrySnapshot | None = None
        #: called with (snapshot, previous snapshot or None, seconds) at every report, e.g.
        #: ``metrics.PrometheusSink``; they share the one sync the report costs
        self.sinks: list[Callable[[TelemetrySnapshot, TelemetrySnapshot | None, float], None]] = []

    # -- device-side accumulation (no host sync) ---------------------------------------
    def add_resolve(
        self,
        *,
        top_k: torch.Tensor,
        miss_count: torch.Tensor,
        real_mask: torch.Tensor,
        item_bytes: int,
        copies: int,
    ) -> None:
        """Count one resolve: ``top_k`` int32 [bs, k]; ``miss_count`` int32 [bs];
        ``real_mask`` bool [bs] (rows below ``num_real_reqs``); ``copies`` = layers that
        copy these misses (the anchor plus its replayed shared layers)."""
        self.add_selected(top_k=top_k, real_mask=real_mask)
        misses = (miss_count.to(torch.int64) * real_mask).sum()
        self._dev[1].add_(misses)
        self._dev[2].add_(misses * (item_bytes * copies))

    def add_selected(self, *, top_k: torch.Tensor, real_mask: torch.Tensor) -> None:
        """:meth:`add_resolve` for a resolve that copied nothing (an all-resident batch)."""
        self._dev[0].add_(((top_k >= 0) & real_mask[:, None]).sum())

    # -- host-side accumulation ---------------------------------------------------------
    def add_step(self) -> None:
        self.steps += 1

    def add_backup(self, tokens: int, bytes_all_layers: int) -> None:
        self.backup_tokens += tokens
        self.backup_bytes += bytes_all_layers

    def add_staging(self, tokens: int) -> None:
        self.staged_requests += 1
        self.staged_tokens += tokens

    def add_direct(self, preload_tokens: int, preload_bytes: int) -> None:
        self.direct_admissions += 1
        self.preload_tokens += preload_tokens
        self.preload_bytes += preload_bytes

    def add_prefix(self, hit_tokens: int, load_tokens: int, load_bytes: int) -> None:
        self.prefix_hit_tokens += hit_tokens
        self.prefix_load_tokens += load_tokens
        self.prefix_load_bytes += load_bytes

    def add_prefix_copy(self, rows: int) -> None:
        self.prefix_copy_rows += rows

    # -- reporting (syncs) ------------------------------------------------------------------
    def snapshot(self) -> TelemetrySnapshot:
        selected, misses, h2d = (int(v) for v in self._dev.tolist())
        return TelemetrySnapshot(
            steps=self.steps,
            selected=selected,
            misses=misses,
            h2d_bytes=h2d + self.preload_bytes,
            backup_tokens=self.backup_tokens,
            backup_bytes=self.backup_bytes,
            staged_requests=self.staged_requests,
            staged_tokens=self.staged_tokens,
            direct_admissions=self.direct_admissions,
            preload_tokens=self.preload_tokens,
            residency=self.residency_counts() if self.residency_counts is not None else None,
            prefix_hit_tokens=self.prefix_hit_tokens,
            prefix_load_tokens=self.prefix_load_tokens,
            prefix_load_bytes=self.prefix_load_bytes,
            prefix_copy_rows=self.prefix_copy_rows,
            tree_tokens=self.tree_tokens,
        )

    def maybe_log(self) -> None:
        """Every ``log_interval_s``: the summary line, then the sinks (one sync per report)."""
        if self.log_interval_s <= 0:
            return
        now = time.monotonic()
        if now - self._last_log < self.log_interval_s:
            return
        elapsed = now - self._last_log
        self._last_log = now
        snap = self.snapshot()
        logger.info(format_line(snap, self._last_snapshot, elapsed))
        for sink in self.sinks:
            sink(snap, self._last_snapshot, elapsed)
        self._last_snapshot = snap


def format_line(
    snap: TelemetrySnapshot, prev: TelemetrySnapshot | None, elapsed_s: float
) -> str:
    """One log line: interval figures first (since ``prev``), cumulative totals after."""
    base = prev or TelemetrySnapshot(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    steps = snap.steps - base.steps
    selected = snap.selected - base.selected
    misses = snap.misses - base.misses
    moved = snap.h2d_bytes - base.h2d_bytes
    hit = 1.0 - misses / selected if selected else 1.0
    return (
        f"HiSparse: hit rate {hit:.2%}, {misses / steps if steps else 0.0:.1f} misses/step, "
        f"{moved / 1e9:.3f} GB host->device ({moved / 1e9 / max(elapsed_s, 1e-9):.2f} GB/s) "
        f"over {steps} steps; staged {snap.staged_requests - base.staged_requests} reqs, "
        f"backed up {snap.backup_tokens - base.backup_tokens} tokens | totals: "
        f"hit rate {snap.hit_rate:.2%}, {snap.h2d_bytes / 1e9:.3f} GB moved, "
        f"{snap.staged_requests} staged, {snap.direct_admissions} direct"
        + _residency_part(snap.residency)
        + _prefix_part(snap)
    )


def _prefix_part(snap: TelemetrySnapshot) -> str:
    if not snap.prefix_hit_tokens:
        return ""
    return (f" | prefix: {snap.prefix_hit_tokens} hit tokens ({snap.prefix_load_tokens} loaded, "
            f"{snap.prefix_load_bytes / 1e9:.3f} GB), {snap.prefix_copy_rows} rows copied")


def _residency_part(c: dict[str, int] | None) -> str:
    if c is None:
        return ""
    return (f" | residency: {c['resident']} resident, {c['hot']} hot, {c['free_rows']} device rows "
            f"free (watermark {c['watermark_rows']}), {c.get('cached_rows', 0)} cached, {c['shrinks']} shrinks")
