"""The GPU probe scripts under benchmarks/ import and explain themselves on a CPU-only machine
(their kernels only build and run with CUDA; the figures are in benchmarks/results/)."""

import pytest


@pytest.mark.parametrize("name", ["probe_bulk_reads", "probe_gather_shape", "probe_inflight", "probe_resolve"])
def test_probe_help(import_benchmark, name, capsys):
    mod = import_benchmark(name)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    assert "--out" in capsys.readouterr().out
