"""Our validation runs through SGLang 0.5.23's own argument pipeline.

Real ``prepare_server_args`` + ``resolve_once`` + ``check_server_args`` with a config-only
DSA model directory, pretending to be an H200 (see conftest). In-process, the plugin is
loaded through SGLang's ``load_plugins()``; the in-tree comparison runs in a subprocess
with ``SGLANG_PLUGINS`` excluding us (marked slow; the loader's whitelist is checked in-process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.usefixtures("sglang_with_plugin")


def check(model_dir, *extra: str):
    from sglang.srt.server_args import prepare_server_args

    from hisparse_testing.rig_worker import keep_overlap_for_speculative

    keep_overlap_for_speculative()  # resolve as on CUDA, where overlap stays on with spec

    args = prepare_server_args(
        ["--model-path", str(model_dir), "--skip-tokenizer-init", "--device", "cpu", "--enable-hisparse", *extra]
    )
    args.resolve_once()
    args.check_server_args()
    return args


OK = ["--disable-radix-cache"]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--hisparse-config", '{"device_buffer_size": 8192, "host_to_device_ratio": 4, "swap_in_block_size": 256}'],
        ["--kv-cache-dtype", "fp8_e4m3", "--dsa-decode-backend", "flashmla_kv", "--dsa-prefill-backend", "flashmla_kv"],
        ["--kv-cache-dtype", "bfloat16", "--dsa-decode-backend", "flashmla_sparse"],
        ["--hisparse-config", '{"top_k": 2048, "device_buffer_size": 4096}', "--max-total-tokens", "1024"],
    ],
)
def test_accepts_good_combinations(dsa_model_dir, extra):
    check(dsa_model_dir, *OK, *extra)


def test_accepts_the_radix_cache_and_says_so(dsa_model_dir):
    from hisparse_testing.logs import captured_logs

    with captured_logs("sglang_hisparse.sglang_adapter.arg_hook") as logs:
        args = check(dsa_model_dir)  # the radix cache on, SGLang's default
    assert not args.disable_radix_cache
    assert any("radix cache on: matched prefixes are shared through the host pool" in m for m in logs), logs


@pytest.mark.parametrize(
    "extra",
    [
        ["--speculative-algorithm", "EAGLE"],  # topk resolves to 1, 4 draft tokens: B 5 * 2048
        ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4", "--hisparse-config", '{"device_buffer_size": 8192}'],
        ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "2"],
    ],
)
def test_accepts_chain_speculative_decoding(dsa_model_dir, extra):
    from hisparse_testing.logs import captured_logs

    with captured_logs("sglang_hisparse.sglang_adapter.arg_hook") as logs:
        args = check(dsa_model_dir, *OK, *extra)
    from sglang.srt.arg_groups.model_override_base import resolved_view

    view = resolved_view(args)  # what SGLang resolved (W is None on the raw args)
    assert view.speculative_eagle_topk == 1
    if "--hisparse-config" not in extra:  # the default buffer holds W + 1 selections
        W = view.speculative_num_draft_tokens
        assert W >= 2
        assert any(f'"device_buffer_size": {max(2, W + 1) * 2048}' in m for m in logs), logs


BAD = [
    (["--enable-hierarchical-cache"], r"with the radix cache does not support --enable-hierarchical-cache: HiCache .*Remove --enable-hierarchical-cache, or add --disable-radix-cache"),
    (["--enable-streaming-session"], r"does not support --enable-streaming-session: a session keeps"),
    (["--speculative-algorithm", "EAGLE"], r"with the radix cache does not support speculative decoding yet.*--disable-radix-cache"),
    (OK + ["--enable-mixed-chunk"], r"does not support --enable-mixed-chunk.*Remove --enable-mixed-chunk"),
    (OK + ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4", "--speculative-num-steps", "3",
           "--speculative-num-draft-tokens", "8", "--attention-backend", "flashinfer"], r"--speculative-eagle-topk 4: tree verify is not supported.*chain prefix.*Use --speculative-eagle-topk 1"),
    (OK + ["--speculative-algorithm", "EAGLE", "--speculative-adaptive"], r"does not support --speculative-adaptive: the verify window is sized once"),
    (OK + ["--speculative-algorithm", "EAGLE", "--hisparse-config", '{"device_buffer_size": 4096}'],
     r"'device_buffer_size' = 4096 must be >= speculative_num_draft_tokens \* top_k = 4 \* 2048 = 8192.*at least 8192"),
    (OK + ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
           "--speculative-num-draft-tokens", "6", "--hisparse-config", '{"device_buffer_size": 10240}'], r"= 6 \* 2048 = 12288.*at least 12288"),
    (OK + ["--kv-cache-dtype", "bfloat16", "--dsa-decode-backend", "flashmla_kv"], r"--dsa-decode-backend flashmla_kv cannot read.*\['flashmla_sparse'\]"),
    (OK + ["--kv-cache-dtype", "fp8_e4m3", "--dsa-prefill-backend", "flashmla_sparse"], r"--dsa-prefill-backend flashmla_sparse cannot read"),
    (OK + ["--hisparse-config", '{"device_buffer_size": 4096'], r"not valid JSON: .* column 28"),
    (OK + ["--hisparse-config", '{"buffer_size": 4096}'], r"unknown key\(s\) 'buffer_size'. Valid keys: top_k, device_buffer_size"),
    (OK + ["--hisparse-config", '{"device_buffer_size": 1024}'], r"'device_buffer_size' = 1024 must be >= top_k = 2048"),
    (OK + ["--hisparse-config", '{"device_buffer_size": 40000}'], r"exceeds 32767"),
    (OK + ["--hisparse-config", '{"host_to_device_ratio": 0}'], r"'host_to_device_ratio' = 0 must be >= 1"),
    (OK + ["--hisparse-config", '{"swap_in_block_size": 960.5}'], r"'swap_in_block_size' = 960.5 must be an integer"),
    (OK + ["--hisparse-config", '{"swap_in_block_size": 100}'], r"positive multiple of 32"),
    (OK + ["--hisparse-config", '{"top_k": 1024}'], r"disagrees with the model's index_topk = 2048"),
    (OK + ["--max-total-tokens", str(10**10)], r"pinned host KV pool \(10000000000 device rows .* needs .* GiB .* per rank; 1 rank\(s\) on this machine need .* GiB but only .* GiB is available.*Lower 'host_to_device_ratio'"),
]


@pytest.mark.parametrize("extra, match", BAD, ids=[m[:40] for _, m in BAD])
def test_rejects_bad_inputs(dsa_model_dir, extra, match):
    with pytest.raises(ValueError, match=match):
        check(dsa_model_dir, *extra)


def test_host_memory_check_counts_every_tp_rank_on_the_machine(dsa_model_dir, monkeypatch):
    """With --max-total-tokens the validation checks the pools of all ranks on this machine:
    room for 6 pools passes TP 4 and refuses TP 8 (each rank's pool alone would fit)."""
    import sglang_hisparse.sglang_adapter.arg_hook as arg_hook
    from sglang_hisparse.memory.host_pool import host_pool_bytes

    # the config-only model: 61 layers, fp8 rows of 656 B; default ratio 2, 64-token DSA pages
    per_rank = host_pool_bytes(num_layers=61, item_bytes=656, capacity_tokens=2 * 2**20, page_size=64)
    monkeypatch.setattr(arg_hook, "available_host_bytes", lambda: 6 * per_rank)
    tokens = ["--max-total-tokens", str(2**20), "--kv-cache-dtype", "fp8_e4m3"]
    check(dsa_model_dir, *OK, *tokens, "--tp-size", "4")
    with pytest.raises(ValueError, match=r"per rank; 8 rank\(s\) on this machine need .* \(at most 1 fits\)"):
        check(dsa_model_dir, *OK, *tokens, "--tp-size", "8")


def test_rejects_speculative_algorithms_off_the_eagle_chain_path(dsa_model_dir):
    with pytest.raises(ValueError, match=r"--speculative-algorithm STANDALONE is not supported by sglang-hisparse.*EAGLE, EAGLE3, NEXTN"):
        check(dsa_model_dir, *OK, "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(dsa_model_dir))


def test_non_dsa_model_named(llama_model_dir):
    with pytest.raises(ValueError, match=rf"model {llama_model_dir} \(LlamaForCausalLM\) is not a DSA model"):
        check(llama_model_dir, *OK)


IN_TREE = r"SGLANG_PLUGINS to a list without 'hisparse'"
PD_DECODE_ARGS = ["--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup", "none"]


def test_m3_is_served_with_one_kv_head_per_rank(m3_model_dir):
    check(m3_model_dir, *OK, "--tp-size", "4")
    check(m3_model_dir, *OK, "--tp-size", "4", "--kv-cache-dtype", "fp8_e4m3")
    # the most blocks a step selects: 16 top-k + 1 forced local block of 128
    check(m3_model_dir, *OK, "--tp-size", "4", "--hisparse-config", json.dumps({"top_k": 17 * 128}))
    with pytest.raises(ValueError, match=r"top_k"):
        check(m3_model_dir, *OK, "--tp-size", "4", "--hisparse-config", json.dumps({"top_k": 2048}))


@pytest.mark.parametrize(
    "extra, match",
    [
        ([], r"MiniMax-M3.*4 KV heads per attention rank at attention TP 1.*one KV head per rank.*Raise --tp-size to 4"),
        (["--tp-size", "4", *PD_DECODE_ARGS], r"MiniMax-M3.*PD decode server: sparse layers \[1, 2, 3\] keep an index value"),
        (["--tp-size", "4", "--speculative-algorithm", "EAGLE"], r"MiniMax-M3.*--speculative-algorithm EAGLE is not supported.*no target-verify form"),
    ],
)
def test_m3_refusals_name_the_rule(m3_model_dir, extra, match):
    with pytest.raises(ValueError, match=match):
        check(m3_model_dir, *OK, *extra)


def attention_dp(spelling: str, n: int) -> list[str]:
    """``n`` attention-DP groups, as 0.5.23 spells it or in the deprecated spelling."""
    if spelling == "deprecated":
        return ["--dp-size", str(n), "--enable-dp-attention"]
    return ["--attn-dp-size", str(n)]


@pytest.mark.parametrize("spelling", ["attn-dp-size", "deprecated"])
def test_m3_counts_kv_heads_per_attention_rank_under_attention_dp(m3_model_dir, spelling):
    """Attention DP splits the TP group (attention TP = tp / attn_dp): TP 8 with 8 attention-DP
    groups leaves one rank per group, which holds all 4 KV heads; SGLang's M3 pool then gets
    head_num 4 (kv_cache_configurator.py ``_build_minimax_sparse_kv_pool``), which its HiSparse
    backend asserts is 1 at the first decode (minimax_sparse_backend.py:374). After SGLang's
    resolution ``enable_dp_attention`` is False in both spellings (the deprecated one becomes
    ``attn_dp_size 8, dp_size 1``, parallel_hook.handle_deprecated_dp_attention), so that
    flag says nothing about the attention TP size."""
    from sglang.srt.arg_groups.model_override_base import resolved_view

    with pytest.raises(ValueError, match=r"MiniMax-M3.*4 KV heads per attention rank at attention TP 1 "
                                         r"\(--tp-size 8 / --attn-dp-size 8\).*one KV head per rank.*"
                                         r"Raise --tp-size to 32, or lower --attn-dp-size to 2"):
        check(m3_model_dir, *OK, "--tp-size", "8", *attention_dp(spelling, 8))
    # 8 / 2 = attention TP 4: one of the 4 KV heads per rank
    view = resolved_view(check(m3_model_dir, *OK, "--tp-size", "8", *attention_dp(spelling, 2)))
    assert (view.tp_size, view.attn_dp_size, view.dp_size, view.enable_dp_attention) == (8, 2, 1, False)


def test_m3_pd_decode_needs_k_only_index_layers_and_mooncake(tmp_path):
    """PD decode with MiniMax-M3 (docs/v4-m3.md D7): served when every sparse layer drops its
    index value (SGLang transfers no index value) and the backend is Mooncake (the dense K/V
    and index keys go as MiniMax state)."""
    from conftest import M3_CONFIG, write_model

    sc = dict(M3_CONFIG["sparse_attention_config"], sparse_disable_index_value=[0, 1, 1, 1])
    model = write_model(tmp_path / "m3_k_only", dict(M3_CONFIG, sparse_attention_config=sc))
    check(model, *OK, "--tp-size", "4", *PD_DECODE_ARGS)
    with pytest.raises(ValueError, match=r"MiniMax-M3.*--disaggregation-transfer-backend nixl.*only over Mooncake"):
        check(model, *OK, "--tp-size", "4", *PD_DECODE_ARGS, "--disaggregation-transfer-backend", "nixl")


def test_deepseek_v4_is_accepted_with_the_paths_sglang_serves_it_on(v4_model_dir):
    check(v4_model_dir, *OK, "--kv-cache-dtype", "fp8_e4m3")
    with pytest.raises(ValueError, match=r"DeepSeek-V4: --kv-cache-dtype bfloat16 is not supported.*fp8_e4m3"):
        check(v4_model_dir, *OK, "--kv-cache-dtype", "bfloat16")
    with pytest.raises(ValueError, match=r"DeepSeek-V4.*needs --disable-radix-cache"):
        check(v4_model_dir, "--kv-cache-dtype", "fp8_e4m3")
    check(v4_model_dir, *OK, "--kv-cache-dtype", "fp8_e4m3", *PD_DECODE_ARGS)  # PD decode (docs/v4-m3.md D7)
    with pytest.raises(ValueError, match=r"DeepSeek-V4.*--disaggregation-transfer-backend nixl.*only over Mooncake"):
        check(v4_model_dir, *OK, "--kv-cache-dtype", "fp8_e4m3", *PD_DECODE_ARGS, "--disaggregation-transfer-backend", "nixl")
    with pytest.raises(ValueError, match=r"DeepSeek-V4.*--speculative-algorithm EAGLE is not supported.*no C4 row layout"):
        check(v4_model_dir, *OK, "--kv-cache-dtype", "fp8_e4m3", "--speculative-algorithm", "EAGLE",
              "--speculative-eagle-topk", "1", "--speculative-num-steps", "1", "--speculative-num-draft-tokens", "2")


@pytest.mark.parametrize("fact, name", [("is_npu", "NPU"), ("is_xpu", "XPU"), ("is_hip", "ROCm")])
def test_non_cuda_platforms_are_refused(dsa_model_dir, fact, name):
    from sglang.srt.runtime_context import override_platform

    with override_platform(**{fact: True}), pytest.raises(ValueError, match=rf"--enable-hisparse on {name}: sglang-hisparse.*CUDA.*drop --enable-hisparse.*{IN_TREE}"):
        check(dsa_model_dir, *OK)


def test_pipeline_parallel_speculative_decoding_is_refused(dsa_model_dir, monkeypatch):
    # SGLang allows PP + spec co-located with SGLANG_ENABLE_PP_SPEC (validation_hook.py:139)
    monkeypatch.setenv("SGLANG_ENABLE_PP_SPEC", "1")
    with pytest.raises(ValueError, match=r"--pp-size 2 and --speculative-algorithm EAGLE.*never call commit_spec_accept_tokens.*Use --pp-size 1"):
        check(dsa_model_dir, *OK, "--pp-size", "2", "--speculative-algorithm", "EAGLE")
    check(dsa_model_dir, *OK, "--pp-size", "2")  # PP alone is fine


def test_rejects_speculative_decoding_without_the_overlap_scheduler(dsa_model_dir):
    with pytest.raises(ValueError, match=r"--speculative-algorithm EAGLE needs SGLang's overlap scheduler.*"
                                         r"_build_hisparse_decode_batch.*Remove --disable-overlap-schedule"):
        check(dsa_model_dir, *OK, "--speculative-algorithm", "EAGLE", "--disable-overlap-schedule")
    check(dsa_model_dir, *OK, "--disable-overlap-schedule")  # without speculative decoding it is fine


PD_DECODE = ["--disaggregation-mode", "decode"]


@pytest.mark.parametrize("backup", [[], ["--disaggregation-decode-retraction-backup", "cpu_tensor"]])
def test_pd_decode_needs_retraction_without_backup(dsa_model_dir, backup):
    with pytest.raises(ValueError, match=r"--disaggregation-decode-retraction-backup (unset|cpu_tensor).*retract_req before backup_kv_cache.*without admit_request_direct.*--disaggregation-decode-retraction-backup none"):
        check(dsa_model_dir, *OK, *PD_DECODE, *backup)
    check(dsa_model_dir, *OK, *PD_DECODE, "--disaggregation-decode-retraction-backup", "none")


def test_decode_kv_offload_is_refused(dsa_model_dir):
    with pytest.raises(ValueError, match=r"--disaggregation-decode-enable-offload-kvcache.*never calls request_finished.*Remove --disaggregation-decode-enable-offload-kvcache"):
        check(dsa_model_dir, *OK, *PD_DECODE, "--disaggregation-decode-retraction-backup", "none",
              "--disaggregation-decode-enable-offload-kvcache", "--hicache-storage-backend", "file")


def test_without_enable_hisparse_nothing_changes(dsa_model_dir):
    from sglang.srt.server_args import prepare_server_args

    # Radix cache on and an invalid config are fine when HiSparse is off: our hook returns.
    args = prepare_server_args(
        ["--model-path", str(dsa_model_dir), "--skip-tokenizer-init", "--device", "cpu",
         "--hisparse-config", '{"nonsense": 1}']
    )
    args.resolve_once()
    args.check_server_args()


_IN_TREE = textwrap.dedent(
    """
    import sys, torch
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    args = prepare_server_args(["--model-path", sys.argv[1], "--skip-tokenizer-init", "--device", "cpu", "--enable-hisparse"])
    args.resolve_once()
    try:
        args.check_server_args()
    except BaseException as e:
        print("RAISED", type(e).__name__, e)
    """
)


def test_sglang_plugins_excluding_us_skips_our_entry_point(monkeypatch):
    """The in-process half of the A/B: SGLang's loader leaves ``hisparse`` out of a whitelist
    that does not name it, and loads our ``register`` from one that does."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    from sglang_hisparse.plugin import ENTRY_POINT_NAME, register

    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")
    assert ENTRY_POINT_NAME not in load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    monkeypatch.setenv("SGLANG_PLUGINS", f"some_other_plugin,{ENTRY_POINT_NAME}")
    assert load_plugins_by_group(GENERAL_PLUGINS_GROUP)[ENTRY_POINT_NAME][0] is register


# NOTE: slow (a fresh interpreter importing SGLang, ~15 s): this process has our hooks applied
# and HookRegistry cannot take them back, so SGLang's own validation is only reachable in a
# subprocess; the whitelist decision itself is checked in-process above.
@pytest.mark.slow
def test_sglang_plugins_excluding_us_gives_in_tree_validation(dsa_model_dir):
    env = dict(os.environ, SGLANG_PLUGINS="some_other_plugin")
    out = subprocess.run([sys.executable, "-c", _IN_TREE, str(dsa_model_dir)], env=env, capture_output=True, text=True, timeout=300)
    # SGLang's in-tree check is an assert with its own wording; ours is a ValueError.
    assert "RAISED AssertionError Hierarchical sparse attention currently requires --disable-radix-cache" in out.stdout, out.stderr[-2000:]


def test_parse_hisparse_config_sizes_the_default_buffer_for_the_verify_window(dsa_model_dir):
    """Pool sizing and the coordinator read the config through parse_hisparse_config: with
    speculation on, its default device_buffer_size must already hold W + 1 selections. The
    'memory' and 'spec' namespaces are SGLang's own, projected from the real argument pipeline
    into a model-owned context (create_context) that is active only inside the ``with``."""
    import sglang.srt.runtime_context as rc

    from sglang_hisparse.sglang_adapter.arg_hook import parse_hisparse_config

    spec = check(dsa_model_dir, *OK, "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                 "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")
    with rc.use_context(rc.create_context(spec, role="scheduler")):
        assert rc.get_memory().hisparse_config is None and rc.get_spec().speculative_num_draft_tokens == 4
        assert parse_hisparse_config().device_buffer_size == 5 * 2048
    with rc.use_context(rc.create_context(check(dsa_model_dir, *OK), role="scheduler")):
        assert rc.get_spec().speculative_algorithm is None
        assert parse_hisparse_config().device_buffer_size == 2 * 2048
