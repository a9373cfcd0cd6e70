"""The GPU probe scripts under benchmarks/probes/ import and explain themselves on a CPU-only
machine (their kernels only build and run with CUDA; what they found is in docs/kernels.md and
benchmarks/RESOLVE.md, the figures in benchmarks/results/)."""

import importlib
import sys
from pathlib import Path

import pytest

PROBES = Path(__file__).resolve().parents[2] / "benchmarks" / "probes"


@pytest.fixture
def import_probe():
    sys.path.insert(0, str(PROBES))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(PROBES))


@pytest.mark.parametrize("name", ["ab_resolve", "probe_bulk_reads", "probe_gather_shape",
                                  "probe_inflight", "probe_resolve"])
def test_probe_help(import_probe, name, capsys):
    mod = import_probe(name)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    assert "--out" in capsys.readouterr().out


def test_every_probe_has_its_question_in_the_readme():
    readme = (PROBES / "README.md").read_text()
    for f in sorted(PROBES.glob("*")):
        if f.suffix in (".py", ".cu"):
            assert f"`{f.name}`" in readme, f.name
