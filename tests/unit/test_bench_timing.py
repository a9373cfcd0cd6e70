"""The kernel benchmarks' replay order (benchmarks/bench_resolve.py:time_graphs): sequential by
default, or every graph once per round with the order rotated each round, and the per-round
ratios. Plain callables stand in for the CUDA graphs; no timing is asserted.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(import_benchmark):
    return import_benchmark("bench_resolve")


def _graphs(log):
    """Stand-ins for GraphTimer factories: capturing and each replay are logged."""
    values = iter(range(100))

    def factory(name):
        def make():
            log.append(f"capture {name}")

            def replay():
                log.append(name)
                return float(next(values))
            return replay
        return make

    return {n: factory(n) for n in "abc"}


def test_sequential_captures_and_replays_one_graph_at_a_time(bench, monkeypatch):
    monkeypatch.setattr(bench, "INTERLEAVE", False)
    log: list[str] = []
    samples = bench.time_graphs(_graphs(log), reps=2)
    assert log == ["capture a", "a", "a", "capture b", "b", "b", "capture c", "c", "c"]
    assert samples == {"a": [0.0, 1.0], "b": [2.0, 3.0], "c": [4.0, 5.0]}


def test_interleaved_rounds_rotate_the_order(bench, monkeypatch):
    monkeypatch.setattr(bench, "INTERLEAVE", True)
    log: list[str] = []
    samples = bench.time_graphs(_graphs(log), reps=3)
    assert log[:3] == ["capture a", "capture b", "capture c"]
    assert log[3:] == list("abc" "bca" "cab")  # no graph is always first (or last) in its round
    assert samples == {"a": [0.0, 5.0, 7.0], "b": [1.0, 3.0, 8.0], "c": [2.0, 4.0, 6.0]}


def test_interleaved_rounds_report_each_round(bench, monkeypatch):
    monkeypatch.setattr(bench, "INTERLEAVE", True)
    log: list[str] = []
    bench.time_graphs(_graphs(log), reps=2, on_round=lambda: log.append("round"))
    assert log[3:] == ["a", "b", "c", "round", "b", "c", "a", "round"]


def test_clock_reasons_are_named(bench):
    assert bench.decode_clock_reasons(0) == []
    assert bench.decode_clock_reasons(0x1 | 0x4) == ["gpu_idle", "sw_power_cap"]
    assert bench.decode_clock_reasons(0x40 | 0x1000) == ["hw_thermal_slowdown", "0x1000"]


def test_paired_ratios_are_per_round(bench):
    # Drift that moves both alike leaves the paired ratio exact, whatever the medians say.
    resolve = [10.0, 20.0, 30.0, 40.0, 50.0]
    ceiling = [9.0, 18.0, 27.0, 36.0, 45.0]
    assert bench.paired(ceiling, resolve) == {"median": 0.9, "q": [0.9, 0.9]}
    assert bench.paired([1.0, 3.0], [2.0, 2.0]) == {"median": 1.0, "q": [0.5, 1.5]}
    with pytest.raises(ValueError):
        bench.paired([1.0], [1.0, 2.0])  # rounds must pair up


class _FakeNvml:
    """pynvml stand-in: fixed clocks and power; `broken` names calls that raise."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

    def __init__(self, broken=()):
        self.broken = set(broken)

    def _check(self, name):
        if name in self.broken:
            raise RuntimeError(f"{name} not supported")

    def nvmlDeviceGetClockInfo(self, handle, which):  # noqa: N802 - NVML's name
        self._check("mem" if which == self.NVML_CLOCK_MEM else "sm")
        return {self.NVML_CLOCK_SM: 1980, self.NVML_CLOCK_MEM: 3201}[which]

    def nvmlDeviceGetPowerUsage(self, handle):  # noqa: N802 - NVML's name
        self._check("power")
        return 612345  # mW

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):  # noqa: N802 - NVML's name
        self._check("reasons")
        return 0x4


def test_gpu_state_reads_clocks_and_power(bench, monkeypatch):
    monkeypatch.setattr(bench, "_nvml", lambda: (_FakeNvml(), "handle"))
    assert bench.gpu_state() == dict(sm_mhz=1980, mem_mhz=3201, power_w=612.3)
    assert bench.clock_reasons() == ["sw_power_cap"]


def test_gpu_state_leaves_out_only_what_nvml_refuses(bench, monkeypatch):
    monkeypatch.setattr(bench, "_nvml", lambda: (_FakeNvml(broken={"mem", "reasons"}), "h"))
    assert bench.gpu_state() == dict(sm_mhz=1980, mem_mhz=None, power_w=612.3)
    assert bench.clock_reasons() is None

    def no_nvml():
        raise ImportError("No module named 'pynvml'")
    monkeypatch.setattr(bench, "_nvml", no_nvml)
    assert bench.gpu_state() == dict(sm_mhz=None, mem_mhz=None, power_w=None)
