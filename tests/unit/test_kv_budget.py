"""The coordinator's GPU state is reserved out of the KV budget SGLang sizes its pool from (CPU).

SGLang 0.5.23's own ``KVCacheConfigurator._resolve_memory_pool_config`` runs as
``ModelRunner.alloc_memory_pool`` calls it, for the config-only DeepSeek-V3.2-shaped model of
conftest at a 128K context, with the free-GPU-memory figure faked (100 GB free, 120 GB before
weights, --mem-fraction-static resolved to 0.716: a 65.92 GiB budget) and our hooks applied.

Per request slot (L = 61 layers, B = 4096, P = 131072 + 4 req_to_token columns, k = 2048):

    slot state  61 * (4097*4 + 4096*2 + 4097*4) + 4097*4 + 131076*8   = 3,564,044 B
                 (slot_tokens, lru, resident hint of ceil(131076/32) = 4097 words; slot_rows, host_rows)
    resolver    2048 * 16 + 4 + 4 + 4                                =    32,780 B  (cuda: arrival counter)

A device row costs 61 * (1152 + 132 * 2) = 86,376 B: bf16 KV row + index-K at host_to_device_ratio 2.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hisparse_testing.logs import captured_logs

pytestmark = pytest.mark.usefixtures("sglang_with_plugin")

# slot state + resolver row + the resident page table of "residency": "pressure" (the
# default): ceil(131076 / 64) int32 columns and the flag; + the default slru policy's word
# per layer (61)
PER_SLOT = 3_564_044 + 32_780 + 2049 * 4 + 4 + 61 * 4
ROW_BYTES = 86_376
PAGE = 64
CONTEXT = 131072


@pytest.fixture(autouse=True)
def _no_reservation_leaks():
    from sglang_hisparse.sglang_adapter import budget

    budget.clear_reservation()
    yield
    budget.clear_reservation()


@pytest.fixture
def configurator(dsa_model_dir, monkeypatch):
    """Build (server flags) -> a KVCacheConfigurator as ModelRunner.init_kv_cache_configurator
    does, inside its own runtime context (the process-wide one is left alone)."""
    import torch
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache import kv_cache_configurator as kcc
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    monkeypatch.setattr(kcc, "get_available_gpu_memory", lambda *a, **k: 100.0)  # GB free
    contexts = []

    def build(*flags: str, model_dir=dsa_model_dir, layers: int = 61):
        args = prepare_server_args([
            "--model-path", str(model_dir), "--skip-tokenizer-init", "--device", "cpu",
            "--disable-radix-cache", "--context-length", str(CONTEXT), *flags,
        ])
        args.resolve_once()
        ctx = rc.create_context(args, role="scheduler")
        # NOTE: a stand-in for SGLang's GroupCoordinator (the world group): a real one needs
        # torch.distributed.init_process_group and gloo groups, which are process-global; only its
        # cpu_group is read, by get_available_gpu_memory, which is faked above
        ctx.parallel.override_permanently(world_group=SimpleNamespace(cpu_group=None))
        use = rc.use_context(ctx)
        use.__enter__()
        contexts.append(use)
        model_config = ModelConfig.from_server_args(args)
        spec_algorithm = SpeculativeAlgorithm.from_string(None)
        kvc = kcc.KVCacheConfigurator(
            device="cuda", gpu_id=0, attn_dp_size=1, pp_size=1, pp_group=None, model=None,
            model_config=model_config, server_args=args,
            kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="bfloat16", model_dtype=torch.bfloat16,
            page_size=PAGE, sliding_window_size=None, spec_algorithm=spec_algorithm,
            is_draft_worker=False, post_capture_kv_active=False,
            spec_aux_config=resolve_spec_aux_hidden_state_config(
                server_args=args, model_config=model_config, spec_algorithm=spec_algorithm, is_draft_worker=False),
            is_hybrid_swa=False, is_hybrid_swa_compress=False, use_mla_backend=True,
            layer_info=ModelLayerInfo(start_layer=0, end_layer=layers, num_effective_layers=layers),
            forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None,
            memory_pool_config=None,
        )
        return kvc

    yield build
    for use in reversed(contexts):
        use.__exit__(None, None, None)


def _unreserved_budget(kvc) -> int:
    """What SGLang's own _profile_available_bytes returns (the function our hook wraps)."""
    profile = type(kvc)._profile_available_bytes
    return getattr(profile, "__wrapped__", profile)(kvc, 120.0)


def test_the_pool_loses_exactly_the_state_of_every_request_slot(configurator):
    from sglang_hisparse.sglang_adapter.budget import last_reservation

    kvc = configurator("--enable-hisparse", "--max-running-requests", "64")
    config = kvc._resolve_memory_pool_config(120.0)
    budget = _unreserved_budget(kvc)
    assert budget == 70_781_061_038  # (100 - 120 * (1 - 0.716)) GiB
    assert config.max_running_requests == 64
    # 64 requests + req_to_token's padding row, each with its slot state and resolver row
    reserved = 65 * PER_SLOT
    assert config.max_total_num_tokens == (budget - reserved) // ROW_BYTES // PAGE * PAGE == 816_704
    assert last_reservation().reserved_bytes == reserved == 234_342_420
    # without the reservation SGLang would have built 819,392 rows: 2688 = 42 pages fewer
    assert budget // ROW_BYTES // PAGE * PAGE - config.max_total_num_tokens == 2688


def test_the_reservation_covers_the_request_count_sglang_derives_from_the_pool(configurator):
    from sglang_hisparse.sglang_adapter.budget import last_reservation

    kvc = configurator("--enable-hisparse")  # no --max-running-requests: SGLang derives it
    with captured_logs() as logs:
        config = kvc._resolve_memory_pool_config(120.0)
    res = last_reservation()
    budget = _unreserved_budget(kvc)
    # unreserved, SGLang would size 819,392 rows and 3200 requests (rows / context * 512): 11.5 GB
    # of state. The reservation is for the fixed point: 2752 requests, whose pool derives 2752.
    assert config.max_running_requests == res.max_running_requests == 2752
    assert res.request_slots == 2753 and res.reserved_bytes == 2753 * PER_SLOT
    assert config.max_total_num_tokens == (budget - res.reserved_bytes) // ROW_BYTES // PAGE * PAGE
    assert config.max_total_num_tokens == 704_512
    (line,) = [m for m in logs if "reserved" in m]
    assert "reserved 9.24 GiB of the 65.92 GiB KV budget" in line, line
    assert "2753 request slots x 3.44 MiB" in line and "--max-running-requests" in line


def test_without_hisparse_the_budget_is_sglangs(configurator):
    from sglang_hisparse.sglang_adapter.budget import last_reservation

    kvc = configurator()
    assert kvc._profile_available_bytes(120.0) == _unreserved_budget(kvc)
    assert last_reservation() is None


def test_state_that_leaves_no_kv_page_names_the_figures_and_the_fixes(configurator, monkeypatch):
    from sglang.srt.mem_cache import kv_cache_configurator as kcc

    # 34.0865 - 34.08 GiB of slack: a 6.7 MiB budget. SGLang alone would build one 64-row page
    # (5.3 MiB); the state of one request slot (3.4 MiB) leaves no room for it.
    monkeypatch.setattr(kcc, "get_available_gpu_memory", lambda *a, **k: 34.0865)
    kvc = configurator("--enable-hisparse", "--max-running-requests", "8")
    assert _unreserved_budget(kvc) // ROW_BYTES // PAGE == 1
    with pytest.raises(ValueError, match=r"(?s)coordinator's GPU state needs 3\.4 MiB \(1 request slot x.*"
                                         r"budget of 6\.7 MiB.*--max-running-requests.*--mem-fraction-static"):
        kvc._resolve_memory_pool_config(120.0)


def test_the_planner_charges_the_same_state_per_request(configurator):
    from sglang_hisparse.planner import PlanInputs, plan
    from sglang_hisparse.presets import load_preset
    from sglang_hisparse.sglang_adapter.budget import last_reservation

    kvc = configurator("--enable-hisparse", "--max-running-requests", "64")
    kvc._resolve_memory_pool_config(120.0)
    res = last_reservation()
    # the server's rows are context + 4 columns wide: plan for that many tokens
    row = plan(PlanInputs(model=load_preset("deepseek-v3.2"), contexts=(res.shape.max_context,))).contexts[0]
    assert row.hisparse_state_bytes_per_request == res.per_slot_bytes == PER_SLOT


def test_minimax_m3_state_counts_its_sparse_layers_and_merged_selection(configurator, m3_model_dir):
    """M3: only the sparse layers (3 of 4) have hot buffers, and the core resolves the merged
    selection, 16 top-k blocks + 1 local block of 128 = 2176 positions, B = 2 x 2176 by default."""
    from sglang_hisparse.sglang_adapter.budget import state_shape

    kvc = configurator("--enable-hisparse", "--tp-size", "4", model_dir=m3_model_dir, layers=4)
    shape = state_shape(kvc)
    assert (shape.num_layers, shape.top_k, shape.buffer_size) == (3, 2176, 4352)
