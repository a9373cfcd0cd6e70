"""bench_e2e's sanity lines and A/B verdicts (benchmarks/e2e_report.py) on hand-made figures:
a point failing a line is invalid, and a change becomes a default only past the noise."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def report(import_benchmark):
    return import_benchmark("e2e_report")


def _mode(step: float, spread: float, busy: float, eager: int = 0) -> dict:
    return dict(step_ms=step, spread=spread, graphs=dict(replays=10, eager_steps=eager, captures=2),
                gpu_profile=dict(busy_ms_per_step=busy, span_ms_per_step=busy * 1.05, host_gap_share=0.05))


ATTENTION = dict(k=2048, dim=576, hbm_gbps=4200.0, per_batch=[
    dict(batch=5, us=14.3), dict(batch=9, us=16.3), dict(batch=18, us=23.2), dict(batch=37, us=43.6)])


def _point(report, **modes) -> dict:
    from e2e_measure import with_step_time

    for rec in modes.values():
        with_step_time(rec["gpu_profile"], rec["step_ms"])
    p = dict(modes=modes)
    p["sanity"] = report.sanity(p, p, ATTENTION)
    return p


def test_the_measured_graph_point_is_valid(report):
    p = _point(report, full=_mode(31.68, 0.0003, 31.08), sync=_mode(62.61, 0.0012, 61.70),
               noio=_mode(45.41, 0.0011, 44.59), prefetch=_mode(51.26, 0.0003, 50.76))
    assert all(p["sanity"].values()), p["sanity"]
    # the host gap is read against the timed step, not the (longer) profiled span
    assert p["modes"]["prefetch"]["gpu_profile"]["span_gap_share"] == 0.05
    assert p["modes"]["prefetch"]["gpu_profile"]["host_gap_share"] == pytest.approx(1 - 50.76 / 51.26)


@pytest.mark.parametrize("line, modes", [
    ("graph_replayed", dict(full=_mode(30, 0.001, 29.9, eager=3))),
    ("host_gap_under_3pct", dict(full=_mode(30, 0.001, 28.0))),
    ("spread_under_3pct", dict(full=_mode(30, 0.05, 29.9))),
    # an oracle slower than the mode that copies contradicts physics
    ("noio_le_prefetch_le_sync", dict(noio=_mode(60, 0.001, 59.9), prefetch=_mode(50, 0.001, 49.9))),
    ("noio_le_prefetch_le_sync", dict(prefetch=_mode(60, 0.001, 59.9), sync=_mode(50, 0.001, 49.9))),
])
def test_each_line_fails_alone(report, line, modes):
    p = _point(report, **modes)
    assert p["sanity"][line] is False
    assert all(v for k, v in p["sanity"].items() if k != line), p["sanity"]


def test_attention_that_beats_hbm_or_shrinks_with_batch_is_not_real(report):
    assert report._attention_scales(ATTENTION)
    fast = dict(ATTENTION, per_batch=[dict(batch=1, us=12.0), dict(batch=37, us=13.0)])
    assert not report._attention_scales(fast)  # 36 more requests' rows in 1 us: > 1.2x HBM
    shrinks = dict(ATTENTION, per_batch=[dict(batch=4, us=20.0), dict(batch=8, us=19.0)])
    assert not report._attention_scales(shrinks)
    assert not report._attention_scales(None)


def test_attention_on_its_latency_floor_is_not_judged_on_growth(report):
    # measured on the H200 (low pressure, batch 4): every batch's rows read well below HBM,
    # the time flat on the kernel's latency floor; growth is judged only where bytes dominate
    floor = dict(ATTENTION, per_batch=[dict(batch=1, us=12.07), dict(batch=2, us=12.19), dict(batch=4, us=12.95)])
    assert report._attention_scales(floor)
    # ... but a flat time where the largest batch's rows alone need longer is a stand-in's
    flat = dict(ATTENTION, per_batch=[dict(batch=4, us=12.0), dict(batch=64, us=12.5)])
    assert not report._attention_scales(flat)


def test_host_gap_reads_the_replay_span_and_keeps_the_busy_figure(report):
    from e2e_measure import with_step_time

    # 1,700 graph nodes a step: the device idles ~1 ms inside the graph, the host adds 0.1 ms
    gp = dict(busy_ms_per_step=29.0, span_ms_per_step=31.0, host_gap_share=0.06)
    with_step_time(gp, 30.1, dict(replay_ms=30.0, step_ms=30.1))
    assert gp["busy_gap_share"] == pytest.approx(1 - 29.0 / 30.1)
    assert gp["host_gap_share"] == pytest.approx(1 - 30.0 / 30.1)
    assert gp["graph_idle_share"] == pytest.approx(1 - 29.0 / 30.0)
    # without spans (an eager mode, an older JSON) the busy figure is the line's
    gp2 = dict(busy_ms_per_step=29.0, span_ms_per_step=31.0, host_gap_share=0.06)
    with_step_time(gp2, 30.1)
    assert gp2["host_gap_share"] == gp2["busy_gap_share"]


def test_ab_verdicts_need_every_round_and_more_than_noise_and_min_gain(report):
    def group(base, change):
        return dict(modes=["prefetch", "prefetch+x"], rounds={
            "prefetch": dict(step_ms=sum(base) / 3, round_ms=base, spread=(max(base) - min(base)) / (sum(base) / 3)),
            "prefetch+x": dict(step_ms=sum(change) / 3, round_ms=change,
                               spread=(max(change) - min(change)) / (sum(change) / 3))})

    def row(base, change):
        (r,) = report.ab_rows(dict(label="p", groups=[group(base, change)], modes={}, valid=True))
        return r

    assert row([50.0, 50.1, 50.0], [48.0, 48.1, 48.0])["beats_noise"]          # 4 %, noise 0.2 %
    assert not row([50.0, 50.1, 50.0], [49.9, 50.0, 49.9])["beats_noise"]      # 0.2 % < MIN_GAIN
    assert not row([50.0, 55.0, 50.0], [48.0, 48.0, 48.0])["beats_noise"]      # inside the spread
    assert row([50.0, 50.1, 50.0], [60.0, 60.1, 60.0])["worse_beyond_noise"]
