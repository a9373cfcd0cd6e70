"""Prometheus series from telemetry snapshots (what SGLang's /metrics serves with --enable-metrics)."""

import pytest

from sglang_hisparse.metrics import PrometheusSink, prometheus_sink_if_enabled
from sglang_hisparse.telemetry import Telemetry, TelemetrySnapshot

prometheus_client = pytest.importorskip("prometheus_client")


def snap(**kw) -> TelemetrySnapshot:
    base = dict(steps=0, selected=0, misses=0, h2d_bytes=0, backup_tokens=0, backup_bytes=0,
                staged_requests=0, staged_tokens=0, direct_admissions=0, preload_tokens=0)
    base.update(kw)
    return TelemetrySnapshot(**base)


def value(reg, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, {"tp_rank": "0", **labels})


def test_counters_advance_by_deltas_and_gauge_is_interval_hit_rate():
    reg = prometheus_client.CollectorRegistry()
    sink = PrometheusSink({"tp_rank": "0"}, registry=reg)
    first = snap(steps=10, selected=1000, misses=100, h2d_bytes=115200, staged_requests=2)
    sink(first, None, 30.0)
    second = snap(steps=25, selected=3000, misses=150, h2d_bytes=172800, staged_requests=2, direct_admissions=1)
    sink(second, first, 30.0)
    assert value(reg, "sglang:hisparse_decode_steps_total") == 25
    assert value(reg, "sglang:hisparse_selected_total") == 3000
    assert value(reg, "sglang:hisparse_misses_total") == 150
    assert value(reg, "sglang:hisparse_h2d_bytes_total") == 172800
    assert value(reg, "sglang:hisparse_staged_requests_total") == 2
    assert value(reg, "sglang:hisparse_direct_admissions_total") == 1
    assert value(reg, "sglang:hisparse_hit_rate") == pytest.approx(1 - 50 / 2000)


def test_telemetry_feeds_sinks_on_its_report_cadence():
    import torch

    t = Telemetry(torch.device("cpu"), log_interval_s=1e-9)
    seen = []
    t.sinks.append(lambda s, p, e: seen.append((s.steps, p)))
    t.add_step()
    t.maybe_log()
    t.add_step()
    t.maybe_log()
    assert [steps for steps, _ in seen] == [1, 2] and seen[0][1] is None and seen[1][1].steps == 1


def test_off_without_sglang_metrics(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert prometheus_sink_if_enabled({"tp_rank": "0"}) is None


def test_two_sinks_share_one_registry():
    reg = prometheus_client.CollectorRegistry()
    a = PrometheusSink({"tp_rank": "0"}, registry=reg)
    b = PrometheusSink({"tp_rank": "1"}, registry=reg)
    a(snap(misses=3, selected=10), None, 1.0)
    b(snap(misses=4, selected=10), None, 1.0)
    assert value(reg, "sglang:hisparse_misses_total") == 3
    assert reg.get_sample_value("sglang:hisparse_misses_total", {"tp_rank": "1"}) == 4


def test_a_new_registry_never_gets_a_freed_ones_series():
    """Registries created and freed one after another (CPython reuses their ids) each get their
    own series."""
    import weakref

    # NOTE: a registry holds no reference cycle, so `del` frees it at once and the next one may
    # take its id; a gc.collect() per round (a full pass over SGLang's heap in the suite's
    # process, which made this the slowest unit test) added nothing. The weakref proves each
    # one was freed.
    seen, reused = set(), 0
    for _ in range(20):
        reg = prometheus_client.CollectorRegistry()
        PrometheusSink({"tp_rank": "0"}, registry=reg)(snap(misses=3, selected=10), None, 1.0)
        assert value(reg, "sglang:hisparse_misses_total") == 3
        reused += id(reg) in seen
        seen.add(id(reg))
        freed = weakref.ref(reg)
        del reg
        assert freed() is None
    assert reused > 0  # the hazard the families' weak keys guard against did occur


def test_residency_gauges_and_shrink_counter():
    reg = prometheus_client.CollectorRegistry()
    sink = PrometheusSink({"tp_rank": "0"}, registry=reg)
    res = dict(resident=3, hot=5, free_rows=640, watermark_rows=100, shrinks=2, shrunk_rows=0,
               resident_admissions=8, cached_rows=64, cached_evicted_rows=128)
    first = snap(residency=res)
    sink(first, None, 30.0)
    second = snap(residency={**res, "resident": 1, "hot": 7, "free_rows": 120, "shrinks": 4,
                             "shrunk_rows": 4096, "cached_evicted_rows": 192})
    sink(second, first, 30.0)
    assert value(reg, "sglang:hisparse_resident_requests") == 1
    assert value(reg, "sglang:hisparse_hot_requests") == 7
    assert value(reg, "sglang:hisparse_free_device_rows") == 120
    assert value(reg, "sglang:hisparse_residency_shrinks_total") == 4
    assert value(reg, "sglang:hisparse_prefix_cached_rows") == 64
    assert value(reg, "sglang:hisparse_evicted_rows_total", tier="device_cache") == 192
    assert value(reg, "sglang:hisparse_tree_host_rows") == 0  # radix cache off: never set
    sink(snap(residency=res, tree_tokens=4096), second, 30.0)
    assert value(reg, "sglang:hisparse_tree_host_rows") == 4096
    assert value(reg, "sglang:hisparse_evicted_rows_total", tier="resident_shrink") == 4096
    # always_hot: no residency in the snapshot, the gauges stay at their initial 0
    reg2 = prometheus_client.CollectorRegistry()
    PrometheusSink({"tp_rank": "0"}, registry=reg2)(snap(), None, 1.0)
    assert value(reg2, "sglang:hisparse_resident_requests") == 0
