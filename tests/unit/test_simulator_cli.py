"""`python -m sglang_hisparse simulate`: JSON contents, plot fallback, errors exit 2."""

from __future__ import annotations

import importlib.util
import json

from sglang_hisparse.cli import simulate as cli
from sglang_hisparse.traces.synthetic import SyntheticSpec, generate


def _trace(tmp_path):
    path = str(tmp_path / "t.npz")
    generate(SyntheticSpec(streams=2, layers=2, prompt_len=200, steps=20, top_k=32, seed=1), path)
    return path


def test_json_and_table(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["--trace", _trace(tmp_path), "--policy", "lru", "--policy", "belady",
                   "--buffer", "32", "--buffer", "64", "--top-k", "24", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"lru", "belady"} and set(doc["results"]["lru"]) == {"32", "64"}
    o = doc["results"]["lru"]["32"]["overall"]
    assert set(o["bytes_per_token"]) == {"656", "1152"} and 0 <= o["miss_rate"] <= 1
    assert set(doc["results"]["lru"]["32"]["layers"]) == {"0", "1"}
    assert "lru" in capsys.readouterr().out


def test_plot_or_clear_message(tmp_path, capsys):
    png = tmp_path / "p.png"
    rc = cli.main(["--trace", _trace(tmp_path), "--policy", "all", "--buffer", "32", "--plot", str(png)])
    assert rc == 0
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in capsys.readouterr().err
    else:
        assert png.exists()


def test_errors_exit_2(tmp_path, capsys):
    assert cli.main(["--trace", str(tmp_path / "none.npz"), "--policy", "lru", "--buffer", "8"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["--trace", _trace(tmp_path), "--policy", "bogus", "--buffer", "64"]) == 2
    assert "unknown" in capsys.readouterr().err
    assert cli.main(["--trace", _trace(tmp_path), "--policy", "lru", "--buffer", "8"]) == 2
    assert "--buffer >= top-k" in capsys.readouterr().err
