"""The kernel benchmark's target verdicts (benchmarks/bench_resolve.py:target_verdicts and
``--verdicts``): which records each of the issue's targets judges, against which limit, and the
exit status, on hand-written records (no GPU).
"""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(import_benchmark):
    return import_benchmark("bench_resolve")


def _trace(bs, churn, item=656, **fields):
    rec = dict(kind="trace", bs=bs, k=2048, B=4096, item=item, ctx=32768, churn=churn,
               resolve_us=20.0, noio_us=10.0)
    rec.update(fields)
    return rec


def _uneven(ctas, layout, gbps, item=656):
    return dict(kind="uneven", bs=24, k=2048, B=4096, item=item, ctx=32768, ctas=ctas,
                host_layout=layout, io_gbps=gbps)


RECORDS = [
    _trace(1, 0.15, resolve_us=12.0),
    _trace(1, 0.05, resolve_us=40.0),             # no batch-1 target at 5 %
    _trace(16, 0.05, io_ratio=0.921),             # missed
    _trace(64, 0.05, noio_us=11.6, io_ratio=0.957),
    _trace(64, 0.0, noio_us=12.4),                # missed; no misses, so no ratio
    _trace(64, 0.05, B=2048, noio_us=30.0, io_ratio=0.5),     # another B: not a target config
    _trace(64, 0.05, ctx=131072, noio_us=30.0, io_ratio=0.5),  # another context: likewise
    _uneven(5, "paged", 41.6),
    _uneven(1, "paged", 39.3),                    # one CTA per request: a comparison only
    _uneven(5, "uniform", 24.2),                  # random rows of the whole pool: ceiling-bound
    dict(kind="replay", bs=100, per_req=2, item=656, ctas8_us=8.4, ctas8_ratio=0.739),
    dict(kind="replay", bs=16, per_req=307, item=656, ctas8_us=84.6, ctas8_ratio=0.882),
    dict(kind="ctas_sweep", bs=1, k=2048, B=4096, item=1152, ctx=32768, churn=0.15,
         resolve_us=99.0, noio_us=99.0),
]


def test_each_target_judges_the_configs_it_names_against_its_limit(bench):
    got = {(v["target"], v["config"]): (v["value"], v["limit"], v["met"])
           for v in bench.target_verdicts(RECORDS)}
    assert got == {
        ("batch1", "656 B, batch 1, 15 % churn"): (12.0, 25.0, True),
        ("io", "656 B, batch 16, 5 % churn"): (0.921, 0.95, False),
        ("noio", "656 B, batch 64, 5 % churn"): (11.6, 12.0, True),
        ("io", "656 B, batch 64, 5 % churn"): (0.957, 0.95, True),
        ("noio", "656 B, batch 64, 0 % churn"): (12.4, 12.0, False),
        ("uneven", "656 B, batch 24, 5 CTAs per request"): (41.6, 40.0, True),
        ("replay8", "656 B, batch 100 x 2 misses"): (0.739, 0.70, True),
        ("replay_us", "656 B, batch 100 x 2 misses"): (8.4, 25.0, True),
        ("replay8", "656 B, batch 16 x 307 misses"): (0.882, 0.70, True),
    }


def test_the_summary_counts_each_target_and_lists_every_miss(bench):
    lines = bench.verdict_lines(bench.target_verdicts(RECORDS))
    assert lines[0] == "met    batch 1 @15 % churn: resolve <= 25 us: 1/1 configs"
    assert "MISSED batch 64: bookkeeping alone (NO_IO) <= 12 us: 1/2 configs" in lines
    assert "         656 B, batch 64, 0 % churn: 12.4 (limit 12.0)" in lines
    assert "MISSED batch >= 16: IO >= 0.95 of the same-run ceiling: 1/2 configs" in lines
    assert "         656 B, batch 16, 5 % churn: 0.921 (limit 0.95)" in lines


@pytest.mark.parametrize("records, status", [
    (RECORDS, 1),
    ([r for r in RECORDS if r.get("io_ratio") != 0.921 and r.get("noio_us") != 12.4], 0),
])
def test_verdicts_flag_judges_a_saved_run_without_a_gpu(bench, tmp_path, capsys, records, status):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(dict(meta={}, records=records)))
    assert bench.main(["--verdicts", str(path)]) == status
    out = capsys.readouterr().out
    assert ("MISSED" in out) == (status == 1)
    assert "met    replay on 8 CTAs: >= 0.70 of the ceiling: 2/2 configs" in out


def test_verdicts_flag_says_when_a_run_has_no_target_config(bench, tmp_path, capsys):
    path = tmp_path / "probe.json"
    path.write_text(json.dumps([dict(kind="ceiling_probe", item=656, us=1.0)]))
    assert bench.main(["--verdicts", str(path)]) == 0
    assert "no record of a target config" in capsys.readouterr().out
