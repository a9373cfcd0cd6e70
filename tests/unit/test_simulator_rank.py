"""The rank-aware policy (issue 49, simulator model): victims skip the step's next-best ranks;
exact hand-built misses, equality with slru without ranks, and clear refusals of traces
without ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sglang_hisparse.cli import simulate as cli
from sglang_hisparse.traces.format import Stream
from sglang_hisparse.traces.policies import POLICIES, RANK_POLICIES, make_policy
from sglang_hisparse.traces.simulator import prepare, prepare_stream, simulate, simulate_stream
from sglang_hisparse.traces.synthetic import ScoreSpec, SyntheticSpec, generate, generate_scored


def _csr(rows):
    offs = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(r) for r in rows], out=offs[1:])
    return offs, np.concatenate([np.array(r, np.int32) for r in rows]) if rows else np.zeros(0, np.int32)


def _stream(seq_lens, sels, ranks):
    offs, pos = _csr(sels)
    rank_offs, rank_pos = _csr(ranks)
    return Stream(0, 0, np.array(seq_lens, np.int32), offs, pos, rank_offs, rank_pos)


def test_next_best_outlives_the_oldest_evictable():
    # B=3: slots s0 s1 s2 hold tokens 0 1 2, slru order [s0 s1 s2], all level 0.
    # step 0 (n=10) sel [5], next-best [0]: one miss. slru evicts the oldest, token 0;
    #   rank skips token 0 (next-best) and evicts token 1.
    # step 1 (n=11) sel [0]: slru misses token 0 again, rank hits it.
    st = _stream([10, 11], [[5, 9], [0, 10]], [[0], []])  # 9, 10: the newest tokens (always hit)
    assert simulate_stream(st, "slru", 3).misses_per_step.tolist() == [1, 1]
    assert simulate_stream(st, "rank", 3).misses_per_step.tolist() == [1, 0]
    assert simulate_stream(st, "rank:0", 3).misses_per_step.tolist() == [1, 1]  # no ranks read: slru


def test_when_every_evictable_is_next_best_the_oldest_of_them_goes():
    # step 0 (n=10) sel [5], next-best [2 1 0] (all three residents): the victims fall back to the
    # next-best in slru's order, oldest first: token 0, as slru. step 1 (n=11) sel [0]: a miss
    # under both, then step 2 (n=12) sel [1]: slru evicted 1 at step 1; rank protected it.
    st = _stream([10, 11, 12], [[5], [0], [1]], [[2, 1, 0], [1], []])
    assert simulate_stream(st, "slru", 3).misses_per_step.tolist() == [1, 1, 1]
    assert simulate_stream(st, "rank", 3).misses_per_step.tolist() == [1, 1, 0]


def test_prepared_next_best_drops_the_newest_and_the_selected():
    # After --top-k 1 on a sorted trace, position 4 is a dropped selection: rank 2, before 7.
    st = _stream([10], [[3, 4]], [[9, 7]])
    ps = prepare_stream(st)
    assert ps.next_best[0].tolist() == [7]  # 9 is the newest token (n - 1)
    assert prepare_stream(_stream([10], [[3]], [[4, 9, 7]])).next_best[0].tolist() == [4, 7]
    assert prepare_stream(Stream(0, 0, st.seq_lens, st.offsets, st.positions)).next_best is None


@pytest.mark.parametrize("initial", ["prefix", "empty"])
def test_without_ranks_read_rank_is_slru_miss_for_miss(initial):
    trace = generate_scored(ScoreSpec(streams=2, layers=2, prompt_len=300, steps=60, top_k=32, next_best=16,
                                      rho=0.9, jitter=0.5, seed=5))
    for st in prepare(trace):
        for B in (40, 64, 96):
            a = simulate_stream(st, "slru", B, initial=initial).misses_per_step
            b = simulate_stream(st, "rank:0", B, initial=initial).misses_per_step
            assert a.tolist() == b.tolist()


def test_ranks_help_on_a_persistent_score_process():
    # Near-misses are the likeliest next picks when scores persist (rho 0.95): fewer misses than
    # slru and lru at every B, more of them the more ranks are read.
    trace = generate_scored(ScoreSpec(streams=1, layers=2, prompt_len=1500, steps=80, top_k=64, next_best=64,
                                      rho=0.95, seed=2))
    streams = prepare(trace)
    for B in (96, 128):
        m = {p: simulate(streams, p, [B])[str(B)]["overall"]["misses"] for p in ("lru", "slru", "rank:16", "rank")}
        assert m["rank"] < min(m["lru"], m["slru"]) and m["rank"] <= m["rank:16"], (B, m)


def test_traces_without_ranks_are_refused_clearly(tmp_path, capsys):
    plain = generate(SyntheticSpec(streams=1, layers=1, prompt_len=200, steps=10, top_k=32, seed=1))
    with pytest.raises(ValueError, match="reads the indexer's next-best ranks, and this trace has none"):
        simulate(plain, "rank", [40])
    path = str(tmp_path / "plain.npz")
    generate(SyntheticSpec(streams=1, layers=1, prompt_len=200, steps=10, top_k=32, seed=1), path)
    assert cli.main(["--trace", path, "--policy", "rank", "--buffer", "40"]) == 2
    err = capsys.readouterr().err
    assert "--policy rank reads the indexer's next-best ranks" in err and "rank-blind" in err
    out = tmp_path / "all.json"
    assert cli.main(["--trace", path, "--policy", "all", "--buffer", "40", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())["results"]) == set(POLICIES)  # "all": the rank-blind ones


def test_cli_all_includes_rank_on_a_ranked_trace(tmp_path, capsys):
    path = str(tmp_path / "r.npz")
    generate_scored(ScoreSpec(streams=1, layers=1, prompt_len=200, steps=10, top_k=32, next_best=8, seed=1), path)
    out = tmp_path / "r.json"
    assert cli.main(["--trace", path, "--policy", "all", "--policy", "rank:4", "--buffer", "40",
                     "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert set(res) == set(POLICIES) | set(RANK_POLICIES) | {"rank:4"}
    assert "vs_lru" in res["rank"]["40"]


def test_policy_names():
    assert make_policy("rank:5").m == 5 and make_policy("rank").m is None and make_policy("rank").needs_ranks
    assert not make_policy("slru").needs_ranks
    with pytest.raises(ValueError, match="use rank:M"):
        make_policy("rank:x")
    with pytest.raises(ValueError, match=r"rank:M\)"):
        make_policy("nope")


def test_policy_eval_evaluates_rank_on_ranked_traces(tmp_path, import_benchmark):
    ev = import_benchmark("policy_eval")
    path = str(tmp_path / "s.npz")
    generate_scored(ScoreSpec(streams=1, layers=2, prompt_len=400, steps=30, top_k=32, next_best=32, seed=4), path)
    r = ev.evaluate(path, (2.0,))
    row = r["B"]["64"]
    assert {"rank", "rank:64", "rank:128", "slru"} <= set(row) and "vs_lru" in row["rank"]
    r["role"] = "synthetic"
    assert "rank closes" in ev.table([r]) and "| rank |" in ev.guard_table([r])
    plain = str(tmp_path / "p.npz")
    generate(SyntheticSpec(streams=1, layers=1, prompt_len=200, steps=10, top_k=32, seed=1), plain)
    assert "rank" not in ev.evaluate(plain, (2.0,))["B"]["64"]
