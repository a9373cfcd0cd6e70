"""PD decode over a real transfer engine (issue 52): SGLang's prefill instance sends over
Mooncake TCP into our decode instance's host pool (``hisparse_testing.rig_mooncake``).

Two scheduler processes a scenario (SGLang's parallel runtime and Mooncake engine are
process-global); skipped when the Mooncake engine is not importable here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.managers.scheduler")

from hisparse_testing.rig_mooncake import engine_missing  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_MISSING = engine_missing()


def _run(scenarios: str, workdir: Path) -> dict[str, dict]:
    """Run ``scenarios`` (comma-separated) over one pair of instances: scenario -> record."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, "-m", "hisparse_testing.rig_mooncake", scenarios, str(workdir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    recs = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("RIG ")]
    if not recs:
        prefill_log = workdir / "prefill.log"
        tail = prefill_log.read_text()[-3000:] if prefill_log.exists() else ""
        pytest.fail(f"{scenarios}: no record (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-5000:]}\n"
                    f"prefill:\n{tail}")
    for rec in recs:
        assert rec["ok"], f"{rec['scenario']}: {rec.get('error')}\n{rec.get('traceback', '')}"
    return {rec["scenario"]: rec for rec in recs}


_needs_engine = pytest.mark.skipif(_MISSING is not None, reason=f"Mooncake transfer engine: {_MISSING}")


@pytest.fixture(scope="module")
def dsa(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The CI pair: short then long prompts over one prefill and one decode instance (the
    second scenario costs ~1 s over the instances' ~25 s of imports and startup)."""
    return _run("dsa_short,dsa_long", tmp_path_factory.mktemp("mc"))


def _page(rec: dict) -> int:
    return rec["kv_bytes_per_page"] + rec["state_bytes_per_page"]


@_needs_engine
def test_mooncake_dsa_short(dsa: dict[str, dict]) -> None:
    """DSA short prompts: every token equals full KV, both instances idle clean, and the
    prefill wrote exactly one KV page, one indexer-key page and the metadata per request."""
    rec = dsa["dsa_short"]
    # prompts of 5-60 tokens: one 64-token page each
    assert rec["bytes_per_request"] == _page(rec) + rec["metadata_bytes_per_request"], rec
    assert rec["bytes"] % rec["requests"] == 0, rec


@_needs_engine
def test_mooncake_dsa_long(dsa: dict[str, dict]) -> None:
    """DSA long prompts (300-900 tokens, 5-15 pages each, in flight together): every token
    equals full KV, both idle checks, and the wire carried exactly every prompt page (KV and
    indexer keys) plus one request's metadata each."""
    rec = dsa["dsa_long"]
    (ph,) = rec["phases"]
    assert ph["pages"] == sum(-(-n // 64) for n in ph["prompt_tokens"]) == 40, ph
    assert rec["bytes"] == ph["pages"] * _page(rec) + rec["requests"] * dsa["dsa_short"]["metadata_bytes_per_request"], rec


@pytest.mark.slow
@_needs_engine
def test_mooncake_decode_radix_suffix_only(tmp_path: Path) -> None:
    """The decode radix cache: a request sharing 9 pages with a finished one receives only its
    2 unmatched pages (with the cache) instead of all 11 (without); tokens equal full KV and
    both instances idle clean (the tree evicted through SGLang's path) either way."""
    full = _run("prefix", tmp_path / "full")["prefix"]
    radix = _run("prefix_radix", tmp_path / "radix")["prefix_radix"]
    meta = full["metadata_bytes_per_request"]
    without, with_tree = full["phases"][1], radix["phases"][1]
    assert without["bytes"] == 11 * _page(full) + meta, without
    assert with_tree["bytes"] == 2 * _page(radix) + meta, with_tree
    assert radix["phases"][0]["bytes"] == full["phases"][0]["bytes"], (radix, full)


@pytest.mark.slow
@_needs_engine
def test_mooncake_abort_mid_transfer(tmp_path: Path) -> None:
    """A decode-side abort while the prefill's write is held: the decode keeps the host rows
    bound until the write drains (checked in the rig), both instances idle clean, and the
    decode serves the next requests exactly, their pages and nothing else on the wire."""
    rec = _run("abort_transfer", tmp_path)["abort_transfer"]
    aborted, after = rec["phases"]
    assert aborted["prefill_finish"] == {"ab0": "abort"}, aborted
    assert after["bytes"] == after["pages"] * _page(rec) + 2 * rec["metadata_bytes_per_request"], after


@pytest.mark.slow
@_needs_engine
def test_mooncake_prefill_killed_mid_transfer(tmp_path: Path) -> None:
    """The prefill instance SIGKILLed while its write is held: SGLang's heartbeat (2 s, one
    miss) finds it dead and fails the request ("Lost connection with prefill instance"), the
    decode keeps its rows bound until the deferred-release deadline (2 s: no drain ack can
    come), finishes it aborted with no tokens and idles clean. No prefill is left to serve more."""
    rec = _run("kill_prefill", tmp_path)["kill_prefill"]
    (ph,) = rec["phases"]
    fail = ph["failure"]
    assert ph["prefill_exitcode"] == -9, ph
    assert "Lost connection with prefill instance" in fail["messages"]["kill0"], fail
    assert fail["bound_while_held"] == 300 and fail["released_after_s"] >= 1.5, fail


@pytest.mark.slow
@_needs_engine
def test_mooncake_transfer_timeout(tmp_path: Path) -> None:
    """SGLang's decode-side KV wait (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` = 2 s) runs out
    while the prefill's write is held: the decode fails the request, keeps its rows bound while
    the write is held, both instances finish it aborted and idle clean, and the decode serves
    the next requests exactly, their pages and nothing else on the wire."""
    rec = _run("timeout_transfer", tmp_path)["timeout_transfer"]
    timed_out, after = rec["phases"]
    fail = timed_out["failure"]
    assert "timed out after" in fail["messages"]["to0"] and fail["bound_while_held"] == 300, fail
    assert timed_out["prefill_finish"] == {"to0": "abort"}, timed_out
    assert after["bytes"] == after["pages"] * _page(rec) + 2 * rec["metadata_bytes_per_request"], after
