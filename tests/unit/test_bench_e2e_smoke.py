"""benchmarks/bench_e2e.py --smoke: the GPU benchmark's code path at tiny sizes on CPU.

Checks the JSON's shape (every point x mode, the IO-hiding and low-pressure tables, the
calibration table, config, environment, notes) and the exactness flags (HiSparse sync /
prefetch / every IO-hiding change == oracle == full KV on the sampled outputs), plus that the
batched content helpers equal the toy model's bytes (the oracle depends on it) and that the
calibrated selections are distinct, in range and batch-independent. No timing is asserted.
The tests that read the whole smoke's JSON are marked slow (~30 s); the others run by default.
"""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def bench(import_benchmark):
    return import_benchmark("bench_e2e")


@pytest.fixture(scope="module")
def report(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    rc = bench.main(["--smoke", "--out", str(out)])
    assert rc == 0
    return json.loads((out / "bench_e2e.json").read_text())


@pytest.mark.slow
def test_json_has_every_point_and_mode(report):
    assert report["complete"] is True
    kinds = [(p["kind"], p["context"]) for p in report["points"]]
    assert kinds == [("main", 256), ("main", 512), ("low_pressure", 256), ("ramp", 256), ("toy", 256)]
    for key in ("config", "environment", "notes", "calibration", "tables"):
        assert report[key]
    assert report["environment"]["torch"] == torch.__version__
    assert {r["source"].split(" ")[0] for r in report["calibration"]["rows"]} >= {"trace", "calibrated"}
    for p in report["points"]:
        assert "error" not in p, p.get("trace")
        if p["kind"] == "ramp":
            continue
        for mode, rec in p["modes"].items():
            assert "error" not in rec, (mode, rec.get("trace"))
            assert rec["batch"] >= 1 and rec["step_ms"] > 0 and rec["tokens_per_s"] > 0
            # 2 interleaved rounds of 3 timed steps each (the smoke's --repeats / --steps)
            assert rec["checked_outputs"] > 0 and len(rec["step_ms_per_step"]) == 6
            assert len(rec["round_ms"]) == 2 and rec["spread"] is not None
            assert "h2d_gbps" in rec
        assert c_has(p, ("exposed_io_us_per_token",), "prefetch")
        assert 0.0 < p["modes"]["prefetch"]["miss_rate"] < 1.0
    main = [p for p in report["points"] if p["kind"] == "main"]
    for p in main:
        assert set(p["modes"]) == {"full", "sync", "prefetch", "noio", "full_nodense", "prefetch_nodense",
                                   "prefetch+slru", "pressure"}
        assert p["modes"]["prefetch"]["batch"] > p["modes"]["full"]["batch"]
        assert {"prefetch_over_full", "prefetch_over_noio", "batch_ratio"} <= set(p["ratios"])
        # the headline group, then every change against prefetch in one A/B group
        assert [g["modes"][0] for g in p["groups"]] == ["full", "prefetch"]
        assert set(p["groups"][1]["modes"]) == {"prefetch", "prefetch+slru", "pressure"}
    # one A/B row per change and main point (pressure included), read over the same rounds
    assert len(report["tables"]["io_hiding"]) == 2 * len(main)
    assert all(len(r["before_round_ms"]) == len(r["after_round_ms"]) == 2 for r in report["tables"]["io_hiding"])
    (low,) = report["tables"]["low_pressure"]
    assert low["batch"] == 2 and "prefetch_over_full" in low and "pressure_over_full" in low
    assert [r["point"] for r in report["tables"]["high_pressure"]] == [p["label"] for p in main]


@pytest.mark.slow
def test_cpu_points_are_invalid_by_the_sanity_lines(report):
    """The CPU smoke runs eagerly (no CUDA graphs, no profiler trace): every sanity line that
    needs the GPU fails, so no CPU figure can pass as a result."""
    for p in report["points"]:
        if p["kind"] == "ramp":
            continue
        assert set(p["sanity"]) == {"graph_replayed", "host_gap_under_3pct", "attention_scales",
                                    "noio_le_prefetch_le_sync", "spread_under_3pct"}
        assert p["sanity"]["graph_replayed"] is False and p["valid"] is False
        assert all(r["graphs"]["eager_steps"] > 0 for r in p["modes"].values())


@pytest.mark.slow
def test_ramp_rises_past_the_full_kv_limit_and_back(report):
    (p,) = [p for p in report["points"] if p["kind"] == "ramp"]
    modes = p["ramp"]["modes"]
    assert p["exact"] is True
    levels = modes["prefetch"]["levels"]
    assert levels[0] == levels[-1] == 1 and max(levels) == p["plan"]["hisparse_batch"]
    assert max(levels) > p["plan"]["full_batch"]
    # full KV runs only the levels its budget holds; HiSparse every level, one step each
    assert {s["c"] for s in modes["full"]["steps"]} == {c for c in levels if c <= p["plan"]["full_batch"]}
    assert [s["c"] for s in modes["prefetch"]["steps"]] == levels
    assert all(m["exact_vs_oracle"] and m["checked_outputs"] > 0 for m in modes.values())
    # residency counts per pressure step; the first request is resident, later ones shrink it
    steps = modes["pressure"]["steps"]
    assert {"resident", "hot", "free_rows"} <= set(steps[0]) and steps[0]["resident"] == 1
    assert steps[-1]["resident"] + steps[-1]["hot"] == 1
    assert len(p["ramp"]["summary"]["per_level"]) == len(levels)


def c_has(point: dict, keys: tuple[str, ...], mode: str) -> bool:
    return all(k in point["modes"][mode] for k in keys)


@pytest.mark.slow
def test_exactness_flags(report):
    assert report["exact"] is True
    for p in report["points"]:
        assert p["exact"] is True
        if p["kind"] == "ramp":
            continue
        assert p["modes"]["full"]["exact_vs_oracle"] is True
        assert p["modes"]["noio"]["exact_vs_oracle"] is None  # timing oracle: not checked
        for mode, rec in p["modes"].items():
            if mode in ("full", "noio", "full_nodense"):
                continue
            assert rec["exact_vs_oracle"] is True and rec["exact_vs_full"] is True, mode
            assert rec["compared_with_full"] > 0 and not rec["full_mismatches"]
    assert all(r["exact"] for r in report["tables"]["io_hiding"])


def test_batched_content_equals_toy_model(bench):
    from e2e_model import BenchModel

    from hisparse_testing.toy_model import ToyModel

    toy = ToyModel(num_layers=3, top_k=4, item_bytes=1152, shared=(False, True, False))
    model = BenchModel(toy)
    seeds, pos = torch.tensor([0, 7, 2**30 - 1]), torch.tensor([0, 40_000, 131_071])
    for layer in range(3):
        want = torch.cat([toy.kv(int(s), p.view(1), layer) for s, p in zip(seeds, pos, strict=True)])
        assert torch.equal(model.kv_rows(seeds, pos, layer), want)
        keys = torch.cat([toy.index_keys(int(s), p.view(1), layer) for s, p in zip(seeds, pos, strict=True)])
        assert torch.equal(model.index_key_rows(seeds, pos, layer), keys)
    # the per-step forward writes every layer's rows (and the anchors' keys) from one call each
    all_kv = model.kv_rows_layers(seeds, pos, 3)
    assert all(torch.equal(all_kv[layer], model.kv_rows(seeds, pos, layer)) for layer in range(3))
    all_keys = model.index_key_rows_layers(seeds, pos, [0, 2])
    assert torch.equal(all_keys[1], model.index_key_rows(seeds, pos, 2))
    n = torch.tensor([40_001])
    assert torch.equal(model.queries_layers(seeds, n, [0, 2])[1], model.queries(seeds, 40_001, 2))


def test_calibrated_selections_are_distinct_and_batch_independent(bench):
    from e2e_selection import CalibratedIndexer, SelectionSpec

    k, n0 = 16, 400
    seeds = torch.arange(1000, 1006, dtype=torch.int64)
    wide = CalibratedIndexer(SelectionSpec(), seeds, n0, k)
    alone = CalibratedIndexer(SelectionSpec(), seeds[3:4], n0, k)
    for n in (n0 + 1, n0 + 5):
        sel = wide.select(2, n)
        assert sel.shape == (6, k) and sel.dtype == torch.int32
        assert int(sel.min()) >= 0 and int(sel.max()) < n
        assert all(row.unique().numel() == k for row in sel)
        assert torch.equal(alone.select(2, n)[0], sel[3])


def test_forced_selection_wins_in_order(bench):
    from e2e_model import BenchModel

    from hisparse_testing.toy_model import ToyModel

    toy = ToyModel(num_layers=1, top_k=4, item_bytes=128, shared=(False,))
    model = BenchModel(toy)
    keys = torch.rand(2, 50, toy.index_dim)
    forced = torch.tensor([[7, 3, 49, 0], [1, 2, 3, 4]], dtype=torch.int32)
    got = model.select(keys, model.queries(torch.tensor([1, 2]), 50, 0), 50, forced=forced)
    assert torch.equal(got, forced)


def test_glm_anchor_pattern(bench):
    from e2e_points import shared_pattern

    for layers, anchors in ((78, 21), (61, 16)):
        pat = shared_pattern(layers, "glm", 4)
        assert sum(not s for s in pat) == anchors
        assert [i for i, s in enumerate(pat) if not s][:4] == [0, 1, 5, 9]


def test_refuses_when_a_mode_admits_nothing(bench, tmp_path):
    from e2e_points import build_model, build_points, check_point, plan_point

    args = bench.parse_args(["--smoke", "--out", str(tmp_path)])
    args.budget_gib = "1e-7"  # far below one request's KV
    point = build_points(args)[0]
    model = build_model(args, point["layers"])
    plan = plan_point(args, point, model, bench.host_pool_bytes(args))
    with pytest.raises(ValueError, match="admits no request"):
        check_point(args, model, plan, torch.device("cpu"), 0)


def test_v4_stack_smoke_is_exact_and_compresses(bench, tmp_path):
    """``--stack v4``: DeepSeek-V4's C4 layers (4 tokens per entry, entries in C4 pages, windows
    and C128 entries resident in both modes) run every mode exact against the oracle and full KV,
    and HiSparse admits more requests than full KV under the same budget."""
    rc = bench.main(["--smoke", "--stack", "v4", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench_e2e.json").read_text())
    assert rc == 0 and report["exact"] is True and report["complete"] is True
    main = [p for p in report["points"] if p["kind"] == "main"]
    assert [p["context"] for p in main] == [1024, 2048]
    for p in main:
        assert p["plan"]["compress_ratio"] == 4 and p["plan"]["cap"] * 4 >= p["plan"]["cap_tokens"]
        assert p["modes"]["prefetch"]["batch"] > p["modes"]["full"]["batch"]
        assert p["modes"]["prefetch"]["miss_rate"] > 0.05
        assert p["modes"]["prefetch"]["exact_vs_full"] is True


def test_v4_stack_refuses_a_token_page(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--stack", "v4", "--page", "16", "--out", str(tmp_path), "--device", "cpu"])


def test_node_point_takes_the_preset_shape_and_its_kv_room(bench, tmp_path):
    """--node-preset glm-5.1 (the default): 78 layers, every one its own indexer, and the KV
    room one H200 of an 8-GPU node has after GLM-5.1's weights (SGLang's 0.85 static fraction
    less 700 / 8 GiB of weights)."""
    from e2e_points import build_points, plan_point, point_model

    args = bench.parse_args(["--plan-only", "--out", str(tmp_path), "--device", "cpu", "--host-gib", "84"])
    (node,) = [p for p in build_points(args) if p["kind"] == "node"]
    assert node["layers"] == 78 and node["anchors"] == list(range(78)) and node["context"] == 32768
    assert node["budget_bytes"] / 2**30 == pytest.approx(0.85 * 139.8 - 700 / 8, abs=0.01)
    model = point_model(args, node, {})
    assert model.anchors == list(range(78))
    plan = plan_point(args, node, model, int(84 * 2**30))
    assert plan["budget_bytes"] == node["budget_bytes"] and plan["full_batch"] == 11
    assert plan["hisparse_limited_by"] == "host_dram" and plan["hisparse_batch_admitted_hbm"] > plan["hisparse_batch"]
    none = bench.parse_args(["--plan-only", "--out", str(tmp_path), "--device", "cpu", "--node-preset", "none"])
    assert not [p for p in build_points(none) if p["kind"] == "node"]
