"""``record-trace`` argument path, no model weights: the recorder call is monkeypatched, so
these check only what the command hands to ``hf_record.record_text_files`` (issue 49)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from sglang_hisparse.cli import record_trace
from sglang_hisparse.traces import hf_record


@pytest.fixture
def calls(monkeypatch):
    """The keyword arguments of each ``record_text_files`` call the command makes."""
    if importlib.util.find_spec("transformers") is None:  # the command's optional-extra check
        monkeypatch.setitem(sys.modules, "transformers", types.ModuleType("transformers"))
    seen: list[dict] = []
    monkeypatch.setattr(hf_record, "record_text_files", lambda **kw: seen.append(kw))
    monkeypatch.setattr(hf_record, "locate_smollm2_gguf", lambda: "default.gguf")
    return seen


def test_default_records_version_1(calls):
    assert record_trace.main(["--text", "a.txt", "--out", "t.npz"]) == 0
    (kw,) = calls
    assert kw["next_best"] == 0  # no ranks: make_header(next_best=None), a version-1 trace as before
    assert (kw["gguf"], kw["texts"], kw["out"], kw["top_k"]) == ("default.gguf", ["a.txt"], "t.npz", 256)


def test_next_best_is_passed_through(calls):
    argv = ["--gguf", "m.gguf", "--text", "a.txt", "--text", "b.txt", "--out", "r.npz",
            "--top-k", "64", "--next-best", "32"]
    assert record_trace.main(argv) == 0
    (kw,) = calls
    assert (kw["gguf"], kw["texts"], kw["top_k"], kw["next_best"]) == ("m.gguf", ["a.txt", "b.txt"], 64, 32)


@pytest.mark.parametrize("bad", ["-1", "many", "1.5"])
def test_bad_next_best_is_a_usage_error(calls, bad, capsys):
    with pytest.raises(SystemExit) as e:
        record_trace.main(["--text", "a.txt", "--out", "t.npz", "--next-best", bad])
    assert e.value.code == 2 and not calls
    assert f"--next-best {bad!r}: give an integer >= 0" in capsys.readouterr().err


def test_help_says_what_ranks_are_for(capsys):
    with pytest.raises(SystemExit):
        record_trace.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--next-best M" in out and "ranks k+1..k+M" in out
    assert "version-2 trace" in out and "simulate --policy rank" in out
