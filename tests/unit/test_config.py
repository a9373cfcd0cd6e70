"""HiSparseConfig: defaults, the model's top-k, and every rejection's message."""

import pytest

from sglang_hisparse.config import MAX_DEVICE_BUFFER_SIZE, HiSparseConfig


def test_defaults_follow_top_k():
    cfg = HiSparseConfig.from_json(None, model_top_k=1024)
    assert cfg == HiSparseConfig(top_k=1024, device_buffer_size=2048, host_to_device_ratio=2, swap_in_block_size=None)
    assert cfg.policy == "slru"


def test_existing_launch_command_keys_accepted():
    text = '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 4, "swap_in_block_size": 960}'
    cfg = HiSparseConfig.from_json(text, model_top_k=2048)
    assert (cfg.device_buffer_size, cfg.host_to_device_ratio, cfg.swap_in_block_size) == (4096, 4, 960)


def test_round_trip():
    cfg = HiSparseConfig.from_json('{"device_buffer_size": 8192}')
    assert HiSparseConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"device_buffer_size": 4096', r"not valid JSON: .* line 1 column 28 \(char 27\)"),
        ("[1, 2]", r"expected a JSON object, got list"),
        ('{"buffer": 4096}', r"unknown key\(s\) 'buffer'. Valid keys: top_k, device_buffer_size, host_to_device_ratio, swap_in_block_size"),
        ('{"device_buffer_size": 1024}', r"'device_buffer_size' = 1024 must be >= top_k = 2048.*at least 2048"),
        (f'{{"device_buffer_size": {MAX_DEVICE_BUFFER_SIZE + 1}}}', r"exceeds 32767: the kernels store slot ids as int16"),
        ('{"host_to_device_ratio": 0}', r"'host_to_device_ratio' = 0 must be >= 1"),
        ('{"swap_in_block_size": 100}', r"'swap_in_block_size' = 100 must be a positive multiple of 32.*Try 96"),
        ('{"swap_in_block_size": 2048}', r"no larger than 1024.*Try 1024"),
        ('{"swap_in_block_size": 0}', r"positive multiple of 32.*Try 32"),
        ('{"device_buffer_size": 4096.0}', r"'device_buffer_size' = 4096.0 must be an integer. Use 4096."),
        ('{"host_to_device_ratio": "2"}', r"'host_to_device_ratio' = \"2\" must be an integer"),
        ('{"top_k": true}', r"'top_k' = true must be an integer"),
        ('{"top_k": 0}', r"'top_k' = 0 must be >= 1"),
    ],
)
def test_rejections_name_key_value_rule_fix(text, match):
    with pytest.raises(ValueError, match=match):
        HiSparseConfig.from_json(text)


def test_top_k_must_match_model():
    with pytest.raises(ValueError, match=r"'top_k' = 1024 disagrees with the model's index_topk = 2048.*set it to 2048"):
        HiSparseConfig.from_json('{"top_k": 1024}', model_top_k=2048)


def test_frozen():
    cfg = HiSparseConfig()
    with pytest.raises(AttributeError):
        cfg.top_k = 1  # type: ignore[misc]


def test_speculative_default_buffer_holds_w_plus_one_selections():
    assert HiSparseConfig.from_json(None, num_draft_tokens=4).device_buffer_size == 5 * 2048
    assert HiSparseConfig.from_json(None, model_top_k=512, num_draft_tokens=2).device_buffer_size == 3 * 512
    # W = 1 and W = 0 keep the non-speculative default and checks
    assert HiSparseConfig.from_json(None, num_draft_tokens=1).device_buffer_size == 2 * 2048
    assert HiSparseConfig.from_json('{"device_buffer_size": 2048}', num_draft_tokens=1).device_buffer_size == 2048
    assert HiSparseConfig.from_json('{"device_buffer_size": 8192}', num_draft_tokens=4).device_buffer_size == 8192


@pytest.mark.parametrize(
    "text, W, match",
    [
        ('{"device_buffer_size": 4096}', 4, r"'device_buffer_size' = 4096 must be >= speculative_num_draft_tokens \* top_k = 4 \* 2048 = 8192.*at least 8192 \(10240"),
        ('{"device_buffer_size": 8191}', 4, r"at least 8192"),
        (None, 16, r"16 \* 2048 = 32768 exceeds 32767.*--speculative-num-draft-tokens 15 or fewer"),
        (None, -1, r"--speculative-num-draft-tokens -1 must be an integer in \[0, 2\*\*31\)"),
    ],
)
def test_speculative_buffer_rejections_give_the_number(text, W, match):
    with pytest.raises(ValueError, match=match):
        HiSparseConfig.from_json(text, num_draft_tokens=W)


def test_kernel_shared_memory_figures_match_the_kernels():
    from sglang_hisparse.kernel_limits import resolve_smem_bytes, verify_smem_bytes

    # The layouts' own figures: resolve 73 KiB + 3 B per 16 tokens of context (79 KiB at 32K,
    # 97 KiB at 128K: two CTAs per SM); verify 206 KiB (docs/speculative.md).
    assert resolve_smem_bytes(2048, 4096) == 74656
    assert resolve_smem_bytes(2048, 4096, 32768) == 80800
    assert resolve_smem_bytes(2048, 4096, 131072) == 99232
    assert verify_smem_bytes(2048, 5 * 2048, 4) == 211104


def test_buffer_too_large_for_the_resolve_kernel():
    # the default policy (slru) keeps 128 B more per CTA than lru: 32 slots less at top_k 4096
    with pytest.raises(ValueError, match=r"'device_buffer_size' = 32767 with top_k = 4096 needs 250656 B of shared memory.*Use 'device_buffer_size' <= 28352"):
        HiSparseConfig.from_json('{"device_buffer_size": 32767}', model_top_k=4096)
    assert HiSparseConfig.from_json('{"device_buffer_size": 28352}', model_top_k=4096).device_buffer_size == 28352
    with pytest.raises(ValueError, match=r"needs 250528 B of shared memory.*Use 'device_buffer_size' <= 28384"):
        HiSparseConfig.from_json('{"device_buffer_size": 32767, "policy": "lru"}', model_top_k=4096)
    assert HiSparseConfig.from_json('{"device_buffer_size": 28384, "policy": "lru"}', model_top_k=4096).device_buffer_size == 28384
    assert HiSparseConfig.from_json('{"device_buffer_size": 32767}', model_top_k=2048).device_buffer_size == 32767


def test_context_too_long_for_the_resolve_kernel_names_both_fixes():
    from sglang_hisparse.kernel_limits import check_resolve_fits

    check_resolve_fits(2048, 4096, 163840)  # DeepSeek-V3.2's context: fits with room
    with pytest.raises(ValueError, match=r"up to 163840 tokens needs 239472 B.*--context-length <= 126336 or 'device_buffer_size' <= 28852"):
        check_resolve_fits(2048, 30000, 163840)
    with pytest.raises(ValueError, match=r"Use --context-length <= 126336\.$"):
        check_resolve_fits(2048, 30000, 1 << 20)


def test_verify_window_too_wide_for_the_verify_kernel():
    with pytest.raises(ValueError, match=r"speculative_num_draft_tokens = 5 .* use --speculative-num-draft-tokens 4 or fewer"):
        HiSparseConfig.from_json(None, model_top_k=2048, num_draft_tokens=5)
    with pytest.raises(ValueError, match=r"use 'device_buffer_size' between 8192 and 17354"):
        HiSparseConfig.from_json('{"device_buffer_size": 20000}', model_top_k=2048, num_draft_tokens=4)
    assert HiSparseConfig.from_json(None, model_top_k=2048, num_draft_tokens=4).device_buffer_size == 10240


@pytest.mark.parametrize(
    "text, match",
    [
        # SGLang's own parser (sparsity/factory.py _parse_sparse_config) takes these keys
        ('{"algorithm": "deepseek_dsa", "page_size": 64}',
         r"unknown key\(s\) 'algorithm', 'page_size'.*sglang-hisparse's rule.*SGLang's in-tree parser accepts.*SGLANG_PLUGINS to a list without 'hisparse'"),
        # ... and any swap_in_block_size in [1, 1024]
        ('{"swap_in_block_size": 100}',
         r"positive multiple of 32.*sglang-hisparse's rule: the resolve kernel's block-wide scans work in whole warps.*SGLang's in-tree parser accepts 1..1024.*SGLANG_PLUGINS to a list without 'hisparse'.*Try 96"),
    ],
)
def test_stricter_than_sglang_rules_say_they_are_ours(text, match):
    with pytest.raises(ValueError, match=match):
        HiSparseConfig.from_json(text)
