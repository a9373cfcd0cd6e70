"""The env registry: typed values, legacy in-tree names, and which name was used."""

import pytest

from sglang_hisparse import envs


def test_defaults(monkeypatch):
    for name, var in envs.registry().items():
        for n in (name, *var.legacy):
            monkeypatch.delenv(n, raising=False)
        assert envs.get(name) == var.default
        assert envs.source(name) is None


def test_legacy_name_honoured_and_reported(monkeypatch):
    monkeypatch.delenv("SGLANG_HISPARSE_DISABLE_PREFETCH", raising=False)
    monkeypatch.setenv("SGLANG_DISABLE_HISPARSE_PREFETCH", "1")
    assert envs.get("SGLANG_HISPARSE_DISABLE_PREFETCH") is True
    assert envs.source("SGLANG_HISPARSE_DISABLE_PREFETCH") == "SGLANG_DISABLE_HISPARSE_PREFETCH"
    monkeypatch.setenv("SGLANG_HISPARSE_DISABLE_PREFETCH", "0")  # our name wins
    assert envs.get("SGLANG_HISPARSE_DISABLE_PREFETCH") is False
    assert envs.source("SGLANG_HISPARSE_DISABLE_PREFETCH") == "SGLANG_HISPARSE_DISABLE_PREFETCH"


def test_bad_values_are_errors(monkeypatch):
    monkeypatch.setenv("SGLANG_HISPARSE_SKIP_IO", "maybe")
    with pytest.raises(ValueError, match=r"SGLANG_HISPARSE_SKIP_IO='maybe' is not a boolean"):
        envs.get("SGLANG_HISPARSE_SKIP_IO")
    monkeypatch.setenv("SGLANG_HISPARSE_LOG_INTERVAL", "soon")
    with pytest.raises(ValueError, match=r"is not a number"):
        envs.get("SGLANG_HISPARSE_LOG_INTERVAL")


def test_unknown_name():
    with pytest.raises(KeyError, match="unknown sglang_hisparse environment variable"):
        envs.get("SGLANG_HISPARSE_NOPE")


def test_table_lists_every_variable():
    table = envs.markdown_table()
    for name in envs.registry():
        assert f"`{name}`" in table


def test_docs_table_is_current():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert envs.markdown_table() in doc, "regenerate the table in docs/configuration.md from envs.markdown_table()"


def test_integer_values(monkeypatch):
    name = "SGLANG_HISPARSE_RECORD_NEXT_BEST"
    monkeypatch.setenv(name, " 128 ")
    assert envs.get(name) == 128 and type(envs.get(name)) is int
    for bad, rule in (("-1", "must be an integer >= 0"), ("1.5", "is not an integer"), ("1_000", "is not an integer"),
                      ("true", "is not an integer"), ("9" * 5000, "has too many digits")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=rf"{name}=.* {rule}"):
            envs.get(name)
