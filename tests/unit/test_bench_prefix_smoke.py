"""benchmarks/bench_prefix.py --smoke: the prefix-cache benchmark's code path at tiny sizes on CPU.

Checks the JSON (both workloads x every mode, exact and leak-free), that the radix cache
computes fewer prompt tokens than radix off by what the tree must save (every later request's
whole pages of shared prefix), that a running resident conversation's prefix reaches the next
one device to device, and that a finished turn's pages stay a device-tier cache under
"pressure" while "always_hot" loads the prefix back. No timing is asserted.
"""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def report(import_benchmark, tmp_path_factory):
    bench = import_benchmark("bench_prefix")
    out = tmp_path_factory.mktemp("prefix")
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    return json.loads((out / "bench_prefix.json").read_text())


def test_every_workload_and_mode_ran_exact_and_leak_free(report):
    assert report["complete"] is True
    assert set(report["workloads"]) == {"shared", "agent"}
    for w in report["workloads"].values():
        assert set(w["modes"]) == {"radix_off", "radix", "radix_hot"}
        for mode, rec in w["modes"].items():
            assert "error" not in rec, (mode, rec["error"])
            assert rec["exact"] and rec["leak_free"] and rec["checked_steps"] > 0, mode
    assert report["host_bytes_per_cached_token"] == 5 * 32


def test_the_tree_saves_every_later_requests_shared_pages(report):
    cfg = report["config"]
    page = cfg["page"]
    shared = report["workloads"]["shared"]["summary"]
    prompt = cfg["prefix_tokens"] + cfg["suffix_tokens"]
    assert shared["radix_off"]["computed_tokens"] == cfg["convs"] * prompt
    later = prompt - cfg["prefix_tokens"] // page * page
    assert shared["radix"]["computed_tokens"] == prompt + (cfg["convs"] - 1) * later
    agent = report["workloads"]["agent"]["summary"]
    assert agent["radix"]["computed_reduction"] > 0.6 and shared["radix"]["computed_reduction"] > 0.6


def test_device_rows_serve_a_hit_when_they_can(report):
    shared = report["workloads"]["shared"]["modes"]
    # the first conversation is running resident when the others match: copied, not loaded
    assert shared["radix"]["telemetry"]["prefix_load_tokens"] == 0
    assert shared["radix"]["telemetry"]["prefix_copy_rows"] > 0
    agent = report["workloads"]["agent"]["summary"]
    assert agent["radix"]["loaded_tokens"] == 0  # each finished turn stays cached on the device
    assert agent["radix_hot"]["loaded_tokens"] > 0
