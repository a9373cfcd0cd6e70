"""Prometheus metrics for HiSparse, served by SGLang's own ``/metrics`` endpoint.

With ``--enable-metrics`` SGLang runs prometheus_client in multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR`` is set before the schedulers spawn), so metrics created in a
scheduler process appear on the HTTP server's ``/metrics`` next to SGLang's ``sglang:*``
series. :class:`PrometheusSink` turns each periodic :class:`~sglang_hisparse.telemetry.TelemetrySnapshot`
into counter increments; it runs on the telemetry report cadence
(``SGLANG_HISPARSE_LOG_INTERVAL``), so it adds no host sync to the decode step.

| series (label ``tp_rank``) | type | meaning |
|---|---|---|
| ``sglang:hisparse_selected_total`` | counter | top-k entries resolved (real requests, resolving layers) |
| ``sglang:hisparse_misses_total`` | counter | of those, rows copied host→device |
| ``sglang:hisparse_h2d_bytes_total`` | counter | KV bytes copied host→device (resolve, replay, preloads) |
| ``sglang:hisparse_backup_tokens_total`` | counter | tokens written through to host after their step |
| ``sglang:hisparse_staged_requests_total`` | counter | prompts staged device→host after prefill |
| ``sglang:hisparse_direct_admissions_total`` | counter | PD requests admitted from the host pool |
| ``sglang:hisparse_decode_steps_total`` | counter | decode steps mapped |
| ``sglang:hisparse_prefix_hit_tokens_total`` | counter | prompt tokens a prefill did not compute (radix-cache matches) |
| ``sglang:hisparse_prefix_load_tokens_total`` | counter | of those, loaded host→device (no device row held them) |
| ``sglang:hisparse_prefix_copy_rows_total`` | counter | rows copied device to device: out of pages another request reads (collect), out of a running resident request's buffer (prefix hit) |
| ``sglang:hisparse_hit_rate`` | gauge | hit rate over the last report interval |
| ``sglang:hisparse_residency_shrinks_total`` | counter | resident requests shrunk to hot buffers (``"residency": "pressure"``) |
| ``sglang:hisparse_resident_requests`` | gauge | requests holding all their device rows, at the last report |
| ``sglang:hisparse_hot_requests`` | gauge | decoding requests in their B-slot hot buffer, at the last report |
| ``sglang:hisparse_free_device_rows`` | gauge | free device KV rows, at the last report |
| ``sglang:hisparse_prefix_cached_rows`` | gauge | device rows finished requests left as cached prefix rows (radix cache), taken back first under pressure |
| ``sglang:hisparse_tree_host_rows`` | gauge | host rows (logical ids) the radix tree holds as cached prefixes, at the latest request release (radix cache on) |
| ``sglang:hisparse_evicted_rows_total{tier=...}`` | counter | device rows taken back, by tier: ``device_cache`` (cached prefix rows, first), ``resident_shrink`` (rows a shrinking resident request gave up); the radix tree's own evictions (logical ids, host rows) are SGLang's ``sglang:*`` eviction series |

The residency series exist with ``"residency": "pressure"`` only. Resident requests make no
host->device copies; a rising ``hot_requests`` with ``free_device_rows`` near the watermark
means HBM is the bound and HiSparse is trading IO for capacity.

Hit rate over any window: ``1 - rate(misses_total) / rate(selected_total)``.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_hisparse.telemetry import TelemetrySnapshot

PREFIX = "sglang:hisparse_"
#: snapshot field -> (counter name without prefix/suffix, help)
COUNTERS = {
    "selected": ("selected", "Top-k entries resolved (real requests, resolving layers)."),
    "misses": ("misses", "Top-k entries copied host to device (misses)."),
    "h2d_bytes": ("h2d_bytes", "KV bytes copied host to device by resolve, replay and preloads."),
    "backup_tokens": ("backup_tokens", "Tokens written through to host after their decode step."),
    "staged_requests": ("staged_requests", "Prompts staged device to host after prefill."),
    "direct_admissions": ("direct_admissions", "PD requests admitted straight from the host pool."),
    "steps": ("decode_steps", "Decode steps mapped by the coordinator."),
    "prefix_hit_tokens": ("prefix_hit_tokens", "Prompt tokens a prefill did not compute (radix-cache matches)."),
    "prefix_load_tokens": ("prefix_load_tokens", "Matched prefix tokens loaded host to device."),
    "prefix_copy_rows": ("prefix_copy_rows", "Rows copied device to device: out of pages another request reads, or out of a running resident request's buffer for a prefix hit."),
}
#: residency count -> (gauge name without prefix, help); ``shrinks`` is a counter
GAUGES = {
    "resident": ("resident_requests", "Requests holding all their device rows (residency pressure)."),
    "hot": ("hot_requests", "Decoding requests in their B-slot hot buffer."),
    "free_rows": ("free_device_rows", "Free device KV rows."),
    "cached_rows": ("prefix_cached_rows", "Device rows finished requests left as a radix-cache prefix cache."),
}

#: eviction tier label -> residency count of the rows it took back
EVICTION_TIERS = {"device_cache": "cached_evicted_rows", "resident_shrink": "shrunk_rows"}


class PrometheusSink:
    """Publishes telemetry snapshots as Prometheus series labelled with ``labels``.

    Call it with ``(snapshot, previous_snapshot_or_None, elapsed_s)``; counters advance by the
    difference. ``registry`` defaults to prometheus_client's global one (what SGLang exports).
    """

    def __init__(self, labels: dict[str, str], registry: Any = None) -> None:
        counters, hit_rate, gauges, shrinks, evicted, tree_rows = _families(registry, tuple(sorted(labels)))
        self._counters = {field: family.labels(**labels) for field, family in counters.items()}
        self._hit_rate = hit_rate.labels(**labels)
        self._gauges = {key: family.labels(**labels) for key, family in gauges.items()}
        self._shrinks = shrinks.labels(**labels)
        self._evicted = {tier: evicted.labels(**labels, tier=tier) for tier in EVICTION_TIERS}
        self._tree_rows = tree_rows.labels(**labels)

    def __call__(self, snap: TelemetrySnapshot, prev: TelemetrySnapshot | None, elapsed_s: float) -> None:
        for field, counter in self._counters.items():
            delta = getattr(snap, field) - (getattr(prev, field) if prev is not None else 0)
            if delta > 0:
                counter.inc(delta)
        selected = snap.selected - (prev.selected if prev is not None else 0)
        misses = snap.misses - (prev.misses if prev is not None else 0)
        if selected > 0:
            self._hit_rate.set(1.0 - misses / selected)
        if snap.tree_tokens >= 0:
            self._tree_rows.set(snap.tree_tokens)
        if snap.residency is not None:
            for key, gauge in self._gauges.items():
                gauge.set(snap.residency[key])
            before = prev.residency if prev is not None and prev.residency else {}
            # cumulative residency counts -> counter increments
            for counter, key in ((self._shrinks, "shrinks"),
                                 *((self._evicted[t], k) for t, k in EVICTION_TIERS.items())):
                delta = snap.residency.get(key, 0) - before.get(key, 0)
                if delta > 0:
                    counter.inc(delta)


# Keyed by the registry itself, held weakly. NOTE: keyed by id(), a registry created after
# another was freed could get its id and be handed the dead registry's families, so its series
# were never registered (190 of 200 fresh registries in a loop; a CI failure of
# test_two_sinks_share_one_registry that depended on test order).
_FAMILIES: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()


def _families(registry: Any, label_names: tuple[str, ...]) -> tuple[dict[str, Any], Any, dict[str, Any], Any, Any, Any]:
    """The metric families, created once per registry (a second coordinator in one process,
    or a test, would otherwise register the same series twice and fail)."""
    from prometheus_client import REGISTRY, Counter, Gauge

    reg = REGISTRY if registry is None else registry
    if reg not in _FAMILIES:
        counters = {
            field: Counter(PREFIX + name, help_, label_names, registry=reg)
            for field, (name, help_) in COUNTERS.items()
        }
        # NOTE: "mostrecent" keeps one value per label set across processes; the default
        # multiprocess mode ("all") would add a pid label to every series.
        hit_rate = Gauge(
            PREFIX + "hit_rate", "Hit rate over the last report interval.", label_names,
            registry=reg, multiprocess_mode="mostrecent",
        )
        gauges = {
            key: Gauge(PREFIX + name, help_, label_names, registry=reg, multiprocess_mode="mostrecent")
            for key, (name, help_) in GAUGES.items()
        }
        shrinks = Counter(PREFIX + "residency_shrinks", "Resident requests shrunk to hot buffers.",
                          label_names, registry=reg)
        evicted = Counter(PREFIX + "evicted_rows", "Device rows taken back, by tier (device_cache first, then resident_shrink).",
                          (*label_names, "tier"), registry=reg)
        tree_rows = Gauge(PREFIX + "tree_host_rows", "Host rows (logical ids) the radix tree holds as cached prefixes.",
                          label_names, registry=reg, multiprocess_mode="mostrecent")
        _FAMILIES[reg] = (counters, hit_rate, gauges, shrinks, evicted, tree_rows)
    return _FAMILIES[reg]


def prometheus_sink_if_enabled(labels: dict[str, str]) -> PrometheusSink | None:
    """A sink when SGLang runs with ``--enable-metrics`` (prometheus multiprocess mode is set
    up) and prometheus_client is importable; otherwise None, at no cost."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    try:
        return PrometheusSink(labels)
    except ImportError:
        return None
