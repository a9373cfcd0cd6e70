"""The capacity planner: byte formulas, published figures, index sharing, batches, CLI contract.

Pure arithmetic: no torch, no sglang, no GPU. Every expected number is written out by hand
from the formulas in sglang_hisparse/planner.py so a change in the arithmetic shows here.
"""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest

from sglang_hisparse import planner
from sglang_hisparse.cli import plan as plan_cli
from sglang_hisparse.presets import (
    anchor_layers,
    index_row_bytes,
    kv_row_bytes,
    load_preset,
    load_preset_raw,
    model_from_config,
    preset_names,
)

K128 = 128 * 1024


def _parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="test")
    plan_cli.add_parser(root.add_subparsers(dest="command"))
    return root


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    args = _parser().parse_args(["plan", *argv])
    code = plan_cli.run(args)
    out, err = capsys.readouterr()
    return code, out, err


def _plan(model: str = "GLM-5.1", **kw) -> planner.Plan:
    return planner.plan(planner.PlanInputs(model=load_preset(model), **kw))


# ------------------------------------------------------------------------ row bytes
def test_row_bytes_match_the_dsa_layouts():
    assert kv_row_bytes(512, 64, "bf16") == 1152  # 576 bf16 values
    assert kv_row_bytes(512, 64, "fp8") == 512 + 4 * 4 + 64 * 2 == 656  # e4m3 latent, fp32 scales, bf16 rope
    assert index_row_bytes(128) == 128 + 4  # fp8 key + one fp32 scale
    with pytest.raises(ValueError, match="kv_lora_rank = 500.*--kv-dtype bf16"):
        kv_row_bytes(500, 64, "fp8")


def test_presets_load_and_name_their_shapes():
    assert preset_names() == ["DeepSeek-V3.2", "DeepSeek-V4-Flash", "GLM-5.1", "GLM-5.2"]
    glm = load_preset("glm-5.1")  # case-insensitive
    assert (glm.layers, glm.index_topk, len(glm.anchors)) == (78, 2048, 78)
    assert load_preset("DeepSeek-V3.2").layers == 61


# ------------------------------------------------------------------------ published figures
def test_published_glm51_figures():
    """13.09 GB per request at 128K, ~0.4 GB with B = 4096 (docs/planner.md derives both).

    The published arithmetic is 78 layers x (1152 B bf16 KV row + 128 B fp8 index key) x n;
    it leaves out the index key's 4-byte fp32 scale, which the planner counts (132 B), so the
    planner's figure is 0.3 % higher.
    """
    published = planner.published_kv_bytes(78, 1152 + 128, K128)
    assert published == 13_086_228_480
    assert round(published / 1e9, 2) == 13.09
    assert round(planner.published_kv_bytes(78, 1152 + 128, 4096) / 1e9, 1) == 0.4

    row = _plan(kv_budget_gib=40).contexts[0]
    assert row.full_bytes_per_request == 78 * (1152 + 132) * K128
    assert row.full_bytes_per_request / published == pytest.approx(1.0031, abs=1e-4)
    # The hot buffers alone (B + 1 slots: the newest token has its own) are the ~0.4 GB...
    assert row.hisparse_kv_bytes_per_request == 78 * 1152 * 4097
    assert round(row.hisparse_kv_bytes_per_request / 1e9, 1) == 0.4
    # ...and the index-K cache, which the indexer scans every step, stays on the GPU in full.
    assert row.hisparse_index_bytes_per_request == 78 * 132 * K128


def test_per_request_hbm_counts_the_coordinators_slot_state():
    """GLM-5.1 at 128K, B = 4096: per layer slot_tokens (B+1)*4, lru B*2 and the resident hint
    (128K/32 int32 words); once per request slot_rows (B+1)*4 and host_rows 128K int64; and its
    batch row's resolver buffers: out_rows k int32, the miss plan k int64 + k int32 + a count,
    the batch id and the kernel's arrival counter; per layer the default slru policy's word."""
    row = _plan(kv_budget_gib=40).contexts[0]
    hint = 78 * (K128 // 32) * 4
    assert hint == 1_277_952  # ~1 MB a request: 256 MB for 256 requests
    resolver = 2048 * 4 + 2048 * 12 + 4 + 4 + 4
    assert resolver == 32_780  # under 1 % of the rest
    table = (K128 // 64) * 4 + 4  # the resident page table ("residency": "pressure", 64-token pages)
    state = 78 * (4097 * 4 + 4096 * 2 + 4) + hint + 4097 * 4 + K128 * 8 + resolver + table
    assert row.hisparse_state_bytes_per_request == state == 4_301_444
    assert row.hisparse_bytes_per_request == 78 * 1152 * 4097 + 78 * 132 * K128 + state
    # The slot state is sized by the context, not the batch: a short context holds less.
    short = _plan(contexts=(8192,), kv_budget_gib=40).contexts[0]
    short_state = 78 * (4097 * 4 + 4096 * 2 + 256 * 4 + 4) + 4097 * 4 + 8192 * 8 + resolver + 128 * 4 + 4
    assert short.hisparse_state_bytes_per_request == short_state
    # 0.25 % of the request, yet here it costs one: 25 requests per GPU without it, 24 with it.
    assert 40 * 2**30 // (row.hisparse_bytes_per_request - state) == 25
    assert row.batch_hisparse_hbm == 24


# ------------------------------------------------------------------------ index sharing
def test_glm52_index_sharing_has_21_anchors():
    # default rule: a layer runs its indexer iff max(layer - 1, 0) % freq == 0
    expected = (0, 1, *range(5, 78, 4))
    assert anchor_layers({"index_topk_freq": 4}, 78) == expected
    assert len(expected) == 21
    assert load_preset("GLM-5.2").anchors == expected


@pytest.mark.parametrize(
    ("config", "layers", "anchors"),
    [
        ({}, 4, (0, 1, 2, 3)),
        ({"index_topk_freq": 2, "index_skip_topk_offset": 1}, 6, (0, 2, 4)),
        ({"index_topk_pattern": "FSSF"}, 5, (0, 3, 4)),  # past the pattern: own indexer
        ({"indexer_types": ["full", "shared", "full"], "index_topk_freq": 4}, 3, (0, 2)),  # types win
        ({"cli_factor": 3, "index_topk_pattern": "FFFFFF"}, 6, (0, 3)),  # cli_factor beats pattern
    ],
)
def test_anchor_precedence(config, layers, anchors):
    assert anchor_layers(config, layers) == anchors


def test_shared_layers_keep_kv_but_index_depends_on_the_engine():
    n = 32 * 1024
    glm52 = _plan("GLM-5.2", contexts=(n,), kv_budget_gib=40)
    row = glm52.contexts[0]
    # Full KV (SGLang elides shared layers' index-K without HiSparse): 78 KV + 21 index layers.
    assert row.full_bytes_per_request == 78 * 1152 * n + 21 * 132 * n
    # HiSparse on SGLang 0.5.23 keeps index-K on all 78 layers; every layer has its own hot buffer.
    assert row.hisparse_index_bytes_per_request == 78 * 132 * n
    assert row.hisparse_kv_bytes_per_request == 78 * 1152 * 4097
    elided = _plan("GLM-5.2", contexts=(n,), kv_budget_gib=40, hisparse_index_layers="anchors").contexts[0]
    assert elided.hisparse_index_bytes_per_request == 21 * 132 * n
    # Shared layers still move their own misses: the link bytes count all 78 layers,
    # but only the 21 anchors sit on the critical path when prefetch replays the rest.
    assert row.h2d_bytes_per_token == pytest.approx(78 * 2048 * 0.134 * 1152)
    assert row.io_exposed_ms_per_step == pytest.approx(row.io_ms_per_step * 21 / 78)


# ------------------------------------------------------------------------ batches and IO
def test_batches_host_and_link_by_hand():
    # 40 GiB per GPU, GLM-5.1 bf16 at 128K, B = 4096, DP attention over 8 ranks.
    row = _plan(kv_budget_gib=40).contexts[0]
    budget = 40 * 2**30
    full = 78 * 1284 * K128
    hs = 78 * 1152 * 4097 + 78 * 132 * K128 + 4_260_156  # hot KV + index-K + slot state
    host = 78 * 1152 * K128
    assert row.batch_full == budget // full == 3
    assert row.batch_hisparse_hbm == budget // hs == 24
    assert row.batch_hisparse_host == (2048 * 2**30 // 8) // host == 23
    assert (row.batch_hisparse, row.limited_by) == (23, "host")
    assert (row.node_batch_full, row.node_batch_hisparse) == (24, 184)
    assert row.host_dram_node_bytes == 8 * 23 * host
    per_token = 78 * 2048 * 0.134 * 1152
    assert row.io_ms_per_step == pytest.approx(23 * per_token / 50e9 * 1e3)
    assert row.batch_io_fits == int(0.050 * 50e9 // per_token)
    assert row.turn_on and row.gain == pytest.approx(184 / 24)


def test_a_shared_prefix_is_held_once_per_gpu_in_hbm_for_full_kv_and_in_host_dram_for_hisparse():
    s = 65536  # half of 128K shared (a radix-cache system prompt)
    row = _plan(kv_budget_gib=40, shared_prefix=s).contexts[0]
    budget = 40 * 2**30
    full = 78 * 1284 * (K128 - s)
    assert row.batch_full == (budget - 78 * 1284 * s) // full == 5  # 3 unshared
    hs = 78 * 1152 * 4097 + 78 * 132 * (K128 - s) + 4_260_156  # hot buffers stay private
    assert row.batch_hisparse_hbm == (budget - 78 * 132 * s) // hs
    host = 78 * 1152 * (K128 - s)
    assert row.batch_hisparse_host == (2048 * 2**30 // 8 - 78 * 1152 * s) // host == 45  # 23 unshared
    assert row.host_dram_node_bytes == 8 * (row.batch_hisparse * host + 78 * 1152 * s)
    assert row.batch_hisparse == min(row.batch_hisparse_hbm, row.batch_hisparse_host)


def test_fp8_rows_shrink_kv_but_not_the_index_cache():
    row = _plan(kv_dtype="fp8", kv_budget_gib=40).contexts[0]
    assert row.full_bytes_per_request == 78 * (656 + 132) * K128
    assert row.hisparse_kv_bytes_per_request == 78 * 656 * 4097
    assert row.hisparse_index_bytes_per_request == 78 * 132 * K128
    assert row.h2d_bytes_per_token == pytest.approx(78 * 2048 * 0.134 * 656)


def test_without_dp_attention_every_rank_holds_every_request():
    row = _plan(kv_budget_gib=40, dp_attention=False).contexts[0]
    assert (row.node_batch_full, row.node_batch_hisparse) == (3, 23)
    # each of the 8 ranks pins its own copy of the 23 requests
    assert row.host_dram_node_bytes == 8 * 23 * 78 * 1152 * K128


def test_short_context_needs_no_io_and_is_not_recommended():
    row = _plan(contexts=(4096,), kv_budget_gib=40).contexts[0]
    assert row.h2d_bytes_per_token == 0 and row.io_ms_per_step == 0 and row.batch_io_fits is None
    assert not row.turn_on and "<= B = 4096" in row.reason


def test_context_beyond_the_resolve_kernels_shared_memory_is_not_recommended():
    # top-k 2048, B 4096: the position bitmap fits up to ~840K tokens, not 1M (slru, the
    # default policy, adds its 128 B of level counts to lru's 271264 B).
    ok, over = _plan(contexts=(128 * 1024, 1 << 20), kv_budget_gib=40).contexts
    assert "shared memory" not in ok.reason
    assert not over.turn_on and "needs 271392 B of shared memory per CTA at 1048576 tokens" in over.reason
    assert "use --buffer <=" not in over.reason  # no B >= top-k fits at 1M


def test_io_over_the_step_target_is_reported():
    row = _plan(contexts=(32 * 1024,), kv_budget_gib=40, link_gbps=5).contexts[0]
    assert not row.io_fits
    assert "link-bound" in row.reason and f"<= {row.batch_io_fits * 8}" in row.reason


def test_break_even_context_is_where_the_footprint_ratio_crosses_min_gain():
    inputs = planner.PlanInputs(model=load_preset("GLM-5.1"), kv_budget_gib=40)
    n = planner.break_even_context(inputs)
    a, c, d = 78 * 1284, 78 * 1152 * 4097, 78 * 132

    def ratio(x: int) -> float:
        state = 78 * (4097 * 4 + 4096 * 2 + -(-x // 32) * 4) + 4097 * 4 + 8 * x
        return a * x / (c + d * x + state)

    assert n == 6556  # 6519 without the slot state
    assert ratio(n) >= 1.5 > ratio(n - 1)
    # a model whose index cache alone is over 1/min_gain of the full footprint never pays off
    assert planner.break_even_context(
        planner.PlanInputs(model=load_preset("GLM-5.1"), kv_budget_gib=40, min_gain=20)) is None


def test_default_kv_share_comes_from_the_weights():
    p = _plan()
    assert p.kv_share == pytest.approx(0.85 - 700 / 8 / 140)
    assert p.kv_budget_bytes == int(p.kv_share * 140 * 2**30)
    with pytest.raises(ValueError, match="--tp 1: .*leave no KV room.*Raise --tp or --gpu-hbm-gib, or pass --kv-share"):
        _plan(tp=1)


# ------------------------------------------------------------------------ model config
def test_model_config_matches_the_preset(tmp_path):
    config = {"num_hidden_layers": 78, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
              "index_head_dim": 128, "index_topk": 2048, "index_topk_freq": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = _parser().parse_args(["plan", "--model-config", str(tmp_path), "--kv-budget-gib", "40"])
    inputs = plan_cli.inputs_from_args(args)
    preset = load_preset("GLM-5.2")
    assert inputs.model.anchors == preset.anchors and inputs.model.layers == 78
    assert planner.plan(inputs).contexts == _plan("GLM-5.2", kv_budget_gib=40).contexts


def test_model_config_without_dsa_keys_is_rejected():
    with pytest.raises(ValueError, match="missing index_head_dim, index_topk.*DSA model"):
        model_from_config({"num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, name="llama")


# ------------------------------------------------------------------------ CLI contract
def test_no_arguments_plans_glm51_on_8xh200_at_128k(capsys):
    code, out, _ = _run(capsys)
    assert code == 0
    assert "GLM-5.1, bf16 KV, 8 x 140 GiB GPUs" in out
    assert "128K" in out and "13.13 GB" in out
    assert "Recommendation: turn it on" in out
    assert '"device_buffer_size": 4096' in out and '"host_to_device_ratio": 32' in out
    table = out.split("\n\n")[1].splitlines()
    assert len({len(line) for line in table}) == 1  # aligned: every table line equally wide


def test_json_output(capsys):
    code, out, _ = _run(capsys, "--model", "DeepSeek-V3.2", "--context", "32K,64K", "--context", "131072", "--json")
    assert code == 0
    data = json.loads(out)
    assert [r["context"] for r in data["contexts"]] == [32768, 65536, 131072]
    assert data["derived"]["kv_row_bytes"] == 1152 and data["inputs"]["model"]["layers"] == 61
    assert all(r["gain"] is None or math.isfinite(r["gain"]) for r in data["contexts"])


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--buffer", "1024"], r"--buffer 1024 must be >= the model's top-k 2048.*--buffer 4096"),
        (["--model", "llama-3"], r"--model 'llama-3' is not a preset\. Valid presets: DeepSeek-V3\.2, DeepSeek-V4-Flash, GLM-5\.1, GLM-5\.2"),
        (["--context", "0"], r"--context 0 must be in \[1, 2147483647\] tokens"),
        (["--kv-share", "1.5"], r"--kv-share 1\.5 must be in \(0, 1\]"),
        (["--miss-rate", "13.4"], r"--miss-rate 13\.4 must be in \[0, 1\]"),
        (["--tp", "0"], r"--tp 0 must be in \[1, 65536\]"),
        (["--link-gbps", "0"], r"--link-gbps 0\.0 must be a number in \(0, 1000000\]"),
        (["--model-config", "/nonexistent/config.json"], r"--model-config /nonexistent/config.json: cannot read"),
        (["--context", "32K", "--shared-prefix", "32K"], r"--shared-prefix 32768 must be in \[0, the shortest --context 32768\)"),
    ],
)
def test_bad_inputs_exit_2_naming_the_flag(capsys, argv, pattern):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ")
    assert re.search(pattern, err), err


def test_argparse_level_errors_exit_2(capsys):
    for argv in (["--context", "lots"], ["--kv-share", "0.3", "--kv-budget-gib", "30"]):
        with pytest.raises(SystemExit) as e:
            _parser().parse_args(["plan", *argv])
        assert e.value.code == 2
    assert "is not a token count" in capsys.readouterr().err


def test_parse_tokens():
    assert plan_cli.parse_tokens("128K") == [131072]
    assert plan_cli.parse_tokens("32k, 64k,1M") == [32768, 65536, 1048576]
    assert plan_cli.parse_tokens("4096") == [4096]


def test_help_explains_units_and_defaults():
    text = " ".join(_parser()._subparsers._group_actions[0].choices["plan"].format_help().split())
    for needle in ("GiB", "GB/s", "default 2*top-k = 4096", "0.134", "K = 1024", "(default 50.0)"):
        assert needle in text, needle


def test_trace_sets_the_miss_rate_from_the_lru_simulator(capsys, tmp_path):
    np = pytest.importorskip("numpy")
    from sglang_hisparse.traces import simulator, synthetic

    path = str(tmp_path / "t.npz")
    trace = synthetic.generate(synthetic.SyntheticSpec(streams=2, layers=2, prompt_len=512, steps=32,
                                                       top_k=64, drift=0.2), path)
    # model top-k 2048 with B = 4096 -> the 64-wide trace is replayed at the same ratio: B = 128
    expected = simulator.simulate(trace, "lru", [128])["128"]["overall"]["long_miss_rate"]
    assert 0 < expected < 1 and np.isfinite(expected)
    code, out, _ = _run(capsys, "--trace", path, "--json", "--kv-budget-gib", "40", "--policy", "lru")
    assert code == 0
    data = json.loads(out)
    assert data["inputs"]["miss_rate"] == pytest.approx(expected)
    assert "B=128, B scaled by trace top-k 64/2048" in data["inputs"]["miss_rate_source"]
    # a trace that never passes B says nothing about misses
    code, _, err = _run(capsys, "--trace", path, "--buffer", "20480")  # replayed at B = 640 > 544
    assert code == 2 and "no step is longer than B" in err
    code, _, err = _run(capsys, "--trace", str(tmp_path / "missing.npz"))
    assert code == 2 and "--trace" in err and "cannot load" in err


def test_plot_without_matplotlib_is_explained(capsys, tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        code, _, err = _run(capsys, "--plot", str(tmp_path / "p.png"))
        assert code == 2 and "pip install" in err and "matplotlib" in err
    else:
        code, _, _ = _run(capsys, "--plot", str(tmp_path / "p.png"))
        assert code == 0 and (tmp_path / "p.png").stat().st_size > 0


# ------------------------------------------------------------------------ verdict -> flags (issue 33)
def _glm51_config(tmp_path):
    raw = json.loads((plan_cli.Path(planner.__file__).parent / "presets" / "glm-5.1.json").read_text())
    raw["num_hidden_layers"] = raw.pop("layers")
    del raw["weights_gib"]  # a config.json has the shape, not the weight size
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def test_off_verdict_prints_plugin_off_flags_and_the_ab(capsys):
    code, out, _ = _run(capsys, "--context", "4K")
    assert code == 0 and "leave it off" in out
    flags = [line for line in out.splitlines() if line.startswith("Decode server flags")]
    assert flags == ["Decode server flags (HiSparse off, plain SGLang): --max-running-requests 656"]
    assert "--enable-hisparse" not in flags[0]
    assert "SGLANG_PLUGINS" in out and "without 'hisparse'" in out and "sglang-hisparse's HiSparse" in out


def test_flags_follow_the_binding_constraint(capsys):
    p = _plan(link_gbps=5)
    (r,) = p.contexts
    assert (r.node_batch_hisparse, r.node_batch_link) == (152, 80)
    assert (r.node_batch_recommended, r.bound_by) == (80, "link")
    code, out, _ = _run(capsys, "--link-gbps", "5")
    assert code == 0 and "--max-running-requests 80 " in out and "--max-running-requests 152" not in out
    assert "at most 80 requests per node (link-bound)" in out
    (r,) = _plan().contexts  # 50 GB/s: HBM binds, the link would allow more
    assert (r.node_batch_recommended, r.bound_by) == (152, "hbm") and r.node_batch_link > 152


def test_index_line_in_words_and_reason_printed_once(capsys):
    _, out, _ = _run(capsys)
    assert "anchor layers (x" not in out
    assert "132 B per token per layer (fp8 key of 128 values + fp32 scale)" in out
    assert "in all 78 layers (each runs its own indexer); the same under HiSparse" in out
    assert out.count("batch 16 -> 152 per node") == 1
    _, out, _ = _run(capsys, "--model", "GLM-5.2")
    assert "in the 21 of 78 layers that run their own indexer" in out and "in all 78 under HiSparse" in out


def test_model_config_names_the_assumption_that_differs_from_the_preset(capsys, tmp_path):
    code, out, _ = _run(capsys, "--model-config", _glm51_config(tmp_path))
    assert code == 0 and "--max-running-requests 168" in out
    notes = [line for line in out.splitlines() if line.startswith("  note")]
    assert len(notes) == 1
    assert "KV share differs from the GLM-5.1 preset" in notes[0] and "0.250 here" in notes[0]
    assert "0.225 there" in notes[0]
    # with the preset's share the config plans exactly what the preset plans
    _, out, _ = _run(capsys, "--model-config", str(tmp_path), "--kv-share", f"{0.85 - 700 / 8 / 140}")
    assert "--max-running-requests 152" in out and "  note" not in out


def test_emit_config_prints_only_the_config_and_flags(capsys):
    code, out, err = _run(capsys, "--emit-config")
    assert code == 0 and err == ""
    config, flags = out.splitlines()
    assert json.loads(config) == {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 32}
    assert flags == "--enable-hisparse --max-running-requests 152"
    _, out, _ = _run(capsys, "--emit-config", "--link-gbps", "5")
    assert out.splitlines()[1].endswith("--max-running-requests 80")
    _, out, _ = _run(capsys, "--emit-config", "--context", "4K")
    assert out == "\n--max-running-requests 656\n"  # off: no config, plain SGLang flags
    code, out, err = _run(capsys, "--emit-config", "--json")
    assert code == 2 and out == "" and "--emit-config" in err
    help_text = " ".join(_parser()._subparsers._group_actions[0].choices["plan"].format_help().split())
    assert "--emit-config print only two lines for launch scripts" in help_text


def test_config_is_sized_for_the_context_the_flags_are_for():
    # 1M is off (resolve kernel shared memory): the config is for 128K, ratio 32, not 256
    p = _plan("GLM-5.2", contexts=(32 * 1024, K128, 1024 * 1024))
    assert [r.turn_on for r in p.contexts] == [True, True, False]
    assert p.suggested_config["host_to_device_ratio"] == 32
    assert _plan(contexts=(4096,)).suggested_config["host_to_device_ratio"] == 1  # all off: the longest


M3_SHAPE = {  # MiniMax-M3.1's attention (tests/conftest.py M3_CONFIG), 8 layers, the first dense
    "architectures": ["MiniMaxM3SparseForCausalLM"], "num_hidden_layers": 8, "head_dim": 128,
    "num_key_value_heads": 4,
    "sparse_attention_config": {"sparse_attention_freq": [0] + [1] * 7, "sparse_block_size": 128,
                                "sparse_topk_blocks": 16, "sparse_init_block": 0, "sparse_local_block": 1,
                                "sparse_index_dim": 128, "sparse_disable_index_value": [0, 1, 0, 1, 0, 1, 0, 1]},
}


def test_minimax_m3_is_planned_with_its_byte_formulas():
    """M3: the sparse layers' K then V of one head per rank go through HiSparse (2 x 128 x 2 B =
    512 B bf16, 256 B fp8); the index cache (128-wide keys in 7 sparse layers, values in the 3
    that keep them: 10 x 256 B bf16) and the dense layer's K/V (512 B) stay on the device for
    the whole context in both modes; top-k = (16 + 1 local) blocks x 128."""
    m = model_from_config(M3_SHAPE, name="m3")
    assert (m.family, m.layers, m.dense_layers, m.index_value_layers, m.index_topk) == ("minimax-m3", 7, 1, 3, 2176)
    assert (m.kv_bytes("bf16"), m.kv_bytes("fp8"), m.index_bytes) == (512, 256, 0)
    assert (m.device_bytes_per_token("bf16"), m.device_bytes_per_token("fp8")) == (10 * 256 + 512, 10 * 128 + 256)
    n = 131072
    p = planner.plan(planner.PlanInputs(model=m, contexts=(n,), tp=4, dp_attention=False, kv_budget_gib=60))
    r = p.contexts[0]
    assert r.full_bytes_per_request == (7 * 512 + 10 * 256 + 512) * n
    assert r.hisparse_kv_bytes_per_request == 7 * 512 * (4352 + 1)
    assert r.hisparse_index_bytes_per_request == (10 * 256 + 512) * n
    assert r.host_bytes_per_request == 7 * 512 * n
    assert p.suggested_config["top_k"] == 2176 and p.suggested_config["device_buffer_size"] == 4352
    with pytest.raises(ValueError, match="--dp-attention with MiniMax-M3.*one KV head per attention rank"):
        planner.plan(planner.PlanInputs(model=m, contexts=(n,), tp=4, dp_attention=True))
    with pytest.raises(ValueError, match="sparse_block_size = 0 must be an integer"):
        model_from_config({**M3_SHAPE, "sparse_attention_config": {**M3_SHAPE["sparse_attention_config"],
                                                                   "sparse_block_size": 0}}, name="bad")


def test_minimax_m3_config_through_the_cli(tmp_path, capsys):
    import json as _json

    from sglang_hisparse.cli.main import main as cli_main

    path = tmp_path / "config.json"
    path.write_text(_json.dumps(M3_SHAPE))
    assert cli_main(["plan", "--model-config", str(path), "--tp", "4", "--no-dp-attention",
                     "--context", "128K", "--kv-budget-gib", "60"]) == 0
    out = capsys.readouterr().out
    assert "512 B/token/layer x 7 layers (MiniMax-M3's sparse layers" in out and "2560 B per token of index cache" in out


def test_deepseek_v4_flash_is_planned_per_c4_entry():
    """DeepSeek-V4-Flash: the 21 C4 layers' entries (one per 4 tokens, 585 B a FlashMLA page's
    share on the device, 592 B flat in host DRAM) go through HiSparse at top-512 / B 1024; the
    C4 indexer keys (132 B per entry), the 20 C128 layers' entries (one per 128 tokens) and the
    43 layers' 128-token windows stay on the device in both modes; fp8 only, no shared prefix."""
    m = load_preset("DeepSeek-V4-Flash")
    assert (m.family, m.layers, m.c128_layers, m.window_layers, m.window, m.index_topk) == (
        "deepseek-v4", 21, 20, 43, 128, 512)
    assert (m.kv_bytes("fp8"), m.host_row_bytes("fp8"), m.index_bytes, m.default_kv_dtype) == (585, 592, 132, "fp8")
    n = 32768
    p = planner.plan(planner.PlanInputs(model=m, contexts=(n,), kv_dtype="fp8", kv_budget_gib=60))
    r = p.contexts[0]
    e = n // 4
    resident = 585 * (20 * (n // 128) + 43 * 128)
    assert r.full_bytes_per_request == (21 * 585 + 21 * 132) * e + resident
    assert r.hisparse_kv_bytes_per_request == 21 * 585 * (1024 + 1)
    assert r.hisparse_index_bytes_per_request == 21 * 132 * e + resident
    assert r.host_bytes_per_request == 21 * 592 * e
    assert r.h2d_bytes_per_token == pytest.approx(21 * 512 * 0.134 * 592)
    assert p.suggested_config == {"top_k": 512, "device_buffer_size": 1024, "host_to_device_ratio": 8}
    # a context whose entries fit the hot buffer needs no HiSparse
    short = planner.plan(planner.PlanInputs(model=m, contexts=(4096,), kv_dtype="fp8")).contexts[0]
    assert not short.turn_on and "1024 C4 entries (4096 tokens) <= B = 1024" in short.reason
    even = p.break_even_context
    assert even is not None and 4 * 1025 <= even
    assert planner._full_bytes(p.inputs, even) >= 1.5 * sum(planner._hisparse_bytes(p.inputs, even))
    assert planner._full_bytes(p.inputs, even - 1) < 1.5 * sum(planner._hisparse_bytes(p.inputs, even - 1))
    with pytest.raises(ValueError, match="--kv-dtype bf16: DeepSeek-V4's C4 pool stores fp8_e4m3 entries only"):
        planner.plan(planner.PlanInputs(model=m, contexts=(n,), kv_dtype="bf16"))
    with pytest.raises(ValueError, match="--shared-prefix 1024 with DeepSeek-V4-Flash.*radix cache off"):
        planner.plan(planner.PlanInputs(model=m, contexts=(n,), kv_dtype="fp8", shared_prefix=1024))


def test_deepseek_v4_config_through_the_cli(tmp_path, capsys):
    """A V4 config.json plans as the preset does (fp8 by default); bad compress_ratios are named."""
    import json as _json

    from sglang_hisparse.cli.main import main as cli_main

    raw = load_preset_raw("DeepSeek-V4-Flash")
    cfg = {"num_hidden_layers": 43, "compress_ratios": raw["compress_ratios"], "sliding_window": 128,
           "index_topk": 512, "index_head_dim": 128, "architectures": ["DeepseekV4ForCausalLM"]}
    path = tmp_path / "config.json"
    path.write_text(_json.dumps(cfg))
    assert cli_main(["plan", "--model-config", str(path), "--context", "32K", "--kv-budget-gib", "60"]) == 0
    out = capsys.readouterr().out
    assert "585 B per C4 entry (one per 4 tokens) x 21 C4 layers" in out and "fp8 KV" in out
    assert cli_main(["plan", "--model", "DeepSeek-V4-Flash", "--context", "32K", "--kv-budget-gib", "60"]) == 0
    assert capsys.readouterr().out.split("\n", 1)[1] == out.split("\n", 1)[1]  # the same plan, named apart
    with pytest.raises(ValueError, match=r"compress_ratios = .* must list 0, 4 or 128 for each of the 43 layers"):
        model_from_config({**cfg, "compress_ratios": [4, 64]}, name="bad")
