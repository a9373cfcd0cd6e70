"""benchmarks/bench_e2e.py --smoke: the GPU benchmark's code path at tiny sizes on CPU.

Checks the JSON's shape (every mode x context, config, environment, notes) and the
exactness flags (HiSparse sync/prefetch == oracle == full KV on the sampled outputs), plus
that the batched content helpers equal the toy model's bytes (the oracle depends on it).
No timing is asserted. The two tests that read the whole smoke's JSON are marked slow (the
smoke runs every mode at two contexts, ~15 s); the content and refusal checks run by default.
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
def test_json_has_every_mode_and_context(report):
    assert report["complete"] is True
    assert [c["context"] for c in report["contexts"]] == [256, 512]
    for key in ("config", "environment", "notes", "sizes"):
        assert report[key]
    assert report["environment"]["torch"] == torch.__version__
    for c in report["contexts"]:
        assert set(c["modes"]) == {"full", "sync", "prefetch", "noio", "full_nodense", "prefetch_nodense"}
        for rec in c["modes"].values():
            assert rec["batch"] >= 1 and rec["step_ms"] > 0 and rec["tokens_per_s"] > 0
            assert rec["checked_outputs"] > 0
        for mode in ("sync", "prefetch"):
            assert "exposed_io_us_per_token" in c["modes"][mode]
            assert 0.0 < c["modes"][mode]["miss_rate"] < 1.0
        assert set(c["ratios"]) >= {"prefetch_over_full", "prefetch_over_noio", "batch_ratio",
                                    "prefetch_over_full_no_dense"}
        # The smoke sizes are chosen so HiSparse admits more requests than full KV.
        assert c["modes"]["prefetch"]["batch"] > c["modes"]["full"]["batch"]


@pytest.mark.slow
def test_exactness_flags(report):
    assert report["exact"] is True
    for c in report["contexts"]:
        assert c["exact"] is True
        assert c["modes"]["full"]["exact_vs_oracle"] is True
        assert c["modes"]["noio"]["exact_vs_oracle"] is None  # timing oracle: not checked
        for mode in ("sync", "prefetch", "prefetch_nodense"):
            rec = c["modes"][mode]
            assert rec["exact_vs_oracle"] is True and rec["exact_vs_full"] is True
            assert rec["compared_with_full"] > 0 and not rec["full_mismatches"]


def test_batched_content_equals_toy_model(bench):
    from e2e_model import BenchModel

    from sglang_hisparse.testing.toy_model import ToyModel

    toy = ToyModel(num_layers=3, top_k=4, item_bytes=1152, shared=(False, True, False))
    model = BenchModel(toy)
    seeds, pos = torch.tensor([0, 7, 2**30 - 1]), torch.tensor([0, 40_000, 131_071])
    for layer in range(3):
        want = torch.cat([toy.kv(int(s), p.view(1), layer) for s, p in zip(seeds, pos, strict=True)])
        assert torch.equal(model.kv_rows(seeds, pos, layer), want)
        keys = torch.cat([toy.index_keys(int(s), p.view(1), layer) for s, p in zip(seeds, pos, strict=True)])
        assert torch.equal(model.index_key_rows(seeds, pos, layer), keys)


def test_refuses_when_a_mode_admits_nothing(bench, tmp_path):
    args = bench.parse_args(["--smoke", "--out", str(tmp_path)])
    args.budget_gib = 1e-7  # far below one request's KV
    model = bench.build_model(args)
    with pytest.raises(SystemExit, match="admits no request"):
        bench.check_machine(args, model, bench.plan_sizes(args, model), torch.device("cpu"))
