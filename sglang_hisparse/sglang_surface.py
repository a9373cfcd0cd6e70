"""Where sglang-hisparse reaches into SGLang 0.5.23's objects: every attribute path we read (or
write for SGLang to read), by owner, with who reads it.

A read through ``getattr(obj, "name", default)`` or ``hasattr`` of a name that moved or was
never there gives the default without a word: ``getattr(req, "req_pool_idx", None)`` was None
for every request, because 0.5.23 keeps the slot in ``Req.kv`` (``ReqKvInfo``), so the decode
check counted no hot-buffer growth. ``tests/unit/test_sglang_surface.py`` checks every entry
here against the installed SGLang (a real ``Req``, the real argument pipeline, the classes'
sources) and that every literal name our adapter reads with ``getattr``/``hasattr`` is listed
here (or in :data:`OURS`), so a new read cannot skip the check.

No import of ``sglang``: the table is data. Each entry's last field says who reads it.
"""

from __future__ import annotations

#: dotted paths on a ``sglang.srt.managers.schedule_batch.Req`` instance (``kv`` is its
#: ``ReqKvInfo``, schedule_batch.py:951)
REQ: tuple[tuple[str, str], ...] = (
    ("kv.req_pool_idx", "the request slot: request_calls, step_calls, memory.check_decode_capacity, radix_hooks, rig"),
    ("kv.cache_protected_len", "the tree-owned prefix: request_calls.prepare_extend / admit_request_into_staging, rig"),
    ("origin_input_ids", "the prompt: request_calls._seq_len_of, rig"),
    ("output_ids", "the outputs: request_calls._seq_len_of, rig"),
    ("extend_end", "the prefilled length: request_calls.admit_request_into_staging"),
    ("prefix_len", "the matched prefix: radix_hooks.reserve_prefix_rows; written by request_calls.adopt_pd_prefix"),
    ("rid", "messages, scheduler_hooks.abort_staging_requests, rig"),
    ("hisparse_staging", "written by request_calls, read by SGLang's scheduler"),
    ("to_finish", "scheduler_hooks.abort_staging_requests"),
    ("finished", "scheduler_hooks.abort_staging_requests"),
    ("bootstrap_room", "rig FakePrefill"),
    ("skip_radix_cache_insert", "written by rig FakePrefill"),
)

#: names that are NOT attributes of a ``Req`` in 0.5.23, and where the value lives instead
NOT_ON_REQ: tuple[tuple[str, str], ...] = (
    ("req_pool_idx", "kv.req_pool_idx"),
    ("cache_protected_len", "kv.cache_protected_len"),
)

#: fields of ``sglang.srt.managers.schedule_batch.ScheduleBatch`` (a dataclass)
SCHEDULE_BATCH: tuple[tuple[str, str], ...] = (
    ("reqs", "step_calls.prepare_spec_verify, radix_hooks.prepare_extend_prefixes, rig"),
    ("tree_cache", "radix_hooks.prepare_extend_prefixes"),
    ("token_to_kv_pool_allocator", "radix_hooks (PD decode checkpoint)"),
    ("extend_lens", "radix_hooks.prepare_extend_prefixes, rig"),
    ("prefix_lens", "rig"),
    ("seq_lens", "step_calls.prepare_spec_verify, rig"),
    ("seq_lens_cpu", "step_calls.prepare_spec_verify"),
    ("req_pool_indices", "step_calls.prepare_spec_verify, rig"),
    ("req_pool_indices_cpu", "step_calls.prepare_spec_verify"),
    ("out_cache_loc", "step_calls.prepare_spec_verify, rig"),
    ("input_ids", "rig"),
    ("forward_mode", "rig"),
    ("spec_info", "rig_spec"),
)

#: fields of the resolved server arguments (``resolving_view`` / ``resolved_view``)
SERVER_ARGS: tuple[tuple[str, str], ...] = tuple((name, "arg_hook / arg_scope") for name in (
    "enable_hisparse", "hisparse_config", "model_path", "kv_cache_dtype", "enable_mixed_chunk",
    "dsa_prefill_backend", "dsa_decode_backend", "disable_radix_cache", "radix_cache_backend",
    "enable_hierarchical_cache", "enable_lmcache", "enable_flexkv", "enable_unified_cache_external_linker",
    "enable_streaming_session", "enable_session_radix_cache", "speculative_algorithm",
    "speculative_eagle_topk", "speculative_adaptive", "speculative_num_draft_tokens", "max_total_tokens",
    "page_size", "pp_size", "tp_size", "dp_size", "attn_dp_size", "attn_cp_size", "dcp_size", "ep_size",
    "moe_dp_size", "nnodes", "disable_overlap_schedule", "disaggregation_mode",
    "disaggregation_transfer_backend", "disaggregation_decode_enable_offload_kvcache",
    "disaggregation_decode_retraction_backup", "disaggregation_decode_enable_radix_cache",
    "disaggregation_decode_host_receive_threshold", "disaggregation_decode_allocation_policy",
    "_resolved_overrides",
)) + (
    # NOTE: it exists, but after 0.5.23's resolution it is False whenever attention DP runs
    # (parallel_hook.handle_deprecated_dp_attention): read attn_dp_size, never this
    ("enable_dp_attention", "nobody (kept to document the trap)"),
)

#: (namespace of ``sglang.srt.runtime_context.get_<namespace>()``, leaf)
PUBLISHED: tuple[tuple[str, str, str], ...] = (
    ("memory", "enable_hisparse", "budget.reserve_coordinator_state, rig"),
    ("memory", "hisparse_config", "arg_hook.server_config (parse_hisparse_config, published_config)"),
    ("memory", "disable_radix_cache", "coordinator._radix_cache_on"),
    ("spec", "speculative_algorithm", "arg_hook.parse_hisparse_config, rig"),
    ("spec", "speculative_num_draft_tokens", "arg_hook.parse_hisparse_config, budget.state_shape, rig_spec"),
    ("spec", "speculative_eagle_topk", "rig_spec"),
    ("spec", "speculative_num_steps", "rig_spec"),
    ("schedule", "page_size", "budget, rig"),
    ("schedule", "max_total_tokens", "budget._probe"),
    ("schedule", "max_running_requests", "budget.reserve_coordinator_state, rig"),
    ("schedule", "max_prefill_tokens", "rig"),
    ("schedule", "max_queued_requests", "rig"),
    ("parallel", "tp_size", "memory_host.server_ranks_per_host"),
    ("parallel", "pp_size", "memory_host.server_ranks_per_host"),
    ("parallel", "nnodes", "memory_host.server_ranks_per_host"),
    ("parallel", "dp_size", "memory_host.server_ranks_per_host"),
    ("disagg", "disaggregation_mode", "budget.state_shape, rig"),
    ("disagg", "enable_pd_role_switch", "budget.state_shape"),
    ("disagg", "disaggregation_decode_extra_slots", "budget.state_shape, rig"),
)

#: attributes of ``sglang.srt.configs.model_config.ModelConfig`` (checked on a real one)
MODEL_CONFIG: tuple[tuple[str, str], ...] = (
    ("hf_config", "arg_scope, budget, families.m3.M3Family.core_top_k"),
    ("hf_text_config", "budget.state_shape"),
    ("quantization", "arg_scope._check_m3 (NVFP4 refusal)"),
    ("is_hybrid_swa", "arg_scope._check_pool_kind"),
    ("context_len", "budget.state_shape, rig"),
    ("head_dim", "arg_hook._check_host_memory (M3)"),
    ("get_num_kv_heads", "arg_scope._check_m3_heads"),
)

_POOL = "sglang.srt.mem_cache.memory_pool."
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_DECODE = "sglang.srt.disaggregation.decode.DecodePreallocQueue"
_TREE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
_SWA = "sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator"
_V4 = "sglang.srt.mem_cache.deepseek_v4_memory_pool."
_HOST = "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost"
_KVC = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_LAYERS = "sglang.srt.model_executor.model_runner_components.layer_setup.ModelLayerInfo"
_ABORT = "sglang.srt.managers.io_struct.AbortReq"

#: (class, attribute, reader): defined on the class or assigned to ``self`` in its (or a base's) source
CLASS_ATTRS: tuple[tuple[str, str, str], ...] = (
    (_SCHEDULER, "hisparse_coordinator", "radix_hooks, scheduler_hooks, rig"),
    (_SCHEDULER, "enable_hisparse", "radix_hooks.pd_prealloc_with_prefix"),
    (_SCHEDULER, "chunked_req", "rig_scenarios"),
    (_SCHEDULER, "draft_worker", "rig_scenarios"),
    (_SCHEDULER, "running_batch", "rig"),
    (_SCHEDULER, "last_batch", "rig"),
    (_SCHEDULER, "tree_cache", "rig"),
    (_SCHEDULER, "tp_worker", "rig"),
    (_SCHEDULER, "token_to_kv_pool_allocator", "rig"),
    (_SCHEDULER, "req_to_token_pool", "rig"),
    (_SCHEDULER, "enable_skip_finishing_decode", "written by rig (overlap loop)"),
    (_SCHEDULER, "_war_barrier_enabled", "written by rig (overlap loop)"),
    (_SCHEDULER, "sliding_window_size", "written by rig (V4)"),
    (_SCHEDULER, "cur_batch_for_debug", "written by rig"),
    (_SCHEDULER, "_sched_idled", "written by rig"),
    (_SCHEDULER, "waiting_queue", "rig_traffic"),
    (_SCHEDULER, "model_config", "rig_traffic"),
    (_SCHEDULER, "disagg_decode_prealloc_queue", "rig, rig_traffic"),
    (_SCHEDULER, "disagg_decode_transfer_queue", "rig_traffic"),
    ("sglang.srt.mem_cache.base_prefix_cache.EvictResult", "num_tokens_evicted", "rig_traffic"),
    ("sglang.srt.configs.model_config.ModelConfig", "hf_eos_token_id", "rig_traffic"),
    ("sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2", "draft_worker", "rig_scenarios"),
    ("sglang.srt.managers.schedule_policy.PrefillAdder", "token_to_kv_pool_allocator", "radix_hooks.reserve_prefix_rows"),
    ("sglang.srt.mem_cache.prefill_budget.PrefillBudget", "allocator", "radix_hooks.available_rows_bound"),
    ("sglang.srt.managers.schedule_policy.PrefillAdder", "memory_budget",
     "radix_hooks.admit_ignore_eos_on_both_spaces"),
    (_DECODE, "scheduler", "radix_hooks.pd_prealloc_with_prefix"),
    (_DECODE, "_send_kv_metadata", "wrapped by rig FakePrefill"),
    (_DECODE, "retracted_queue", "rig_traffic"),
    (_DECODE, "tree_cache", "radix_hooks (PD decode radix)"),
    (_DECODE, "token_to_kv_pool_allocator", "radix_hooks (PD decode radix)"),
    ("sglang.srt.disaggregation.fake.conn.FakeKVReceiver", "has_sent_metadata", "written by rig FakePrefill"),
    (_ABORT, "rid", "scheduler_hooks.abort_staging_requests"),
    (_ABORT, "abort_all", "scheduler_hooks.abort_staging_requests"),
    (_ABORT, "abort_message", "scheduler_hooks.abort_staging_requests"),
    (_TREE, "token_to_kv_pool_allocator", "radix_hooks"),
    (_TREE, "supports_prefix_sharing", "radix_hooks._sharing"),
    (_TREE, "disable", "radix_hooks._sharing"),
    (_TREE, "evictable_size", "radix_hooks.release_unstaged"),
    (_TREE, "protected_size", "radix_hooks.release_unstaged"),
    (_TREE, "evict", "rig"),
    (_POOL + "MiniMaxSparseKVPool", "main_pool", "families.m3.M3Family.hisparse_pool"),
    (_POOL + "DSATokenToKVPool", "kv_buffer", "families.dsa.DSAFamily.device_layers"),
    (_POOL + "DSATokenToKVPool", "start_layer", "families.dsa.DSAFamily.device_layers, memory_host"),
    (_POOL + "MHATokenToKVPool", "start_layer", "families.m3.M3Family.device_layers"),
    (_POOL + "DSATokenToKVPool", "end_layer", "memory_host.build_host_pool"),
    (_POOL + "DSATokenToKVPool", "layer_num", "memory_host.build_host_pool"),
    (_POOL + "DSATokenToKVPool", "kv_cache_dim", "memory, memory_host"),
    (_POOL + "DSATokenToKVPool", "store_dtype", "memory, memory_host"),
    (_POOL + "DSATokenToKVPool", "index_key_cache", "memory.HiSparseDSAPool.move_kv_cache"),
    (_POOL + "DSATokenToKVPool", "get_device_pool_infos", "memory_host.build_host_pool"),
    (_POOL + "MHATokenToKVPool", "kv_cache_layout", "memory_m3"),
    (_POOL + "MHATokenToKVPool", "memory_saver_adapter", "memory_m3"),
    (_POOL + "MHATokenToKVPool", "head_num", "memory_m3"),
    (_POOL + "MHATokenToKVPool", "head_dim", "memory_m3"),
    (_POOL + "MHATokenToKVPool", "store_dtype", "memory_m3"),
    (_POOL + "MHATokenToKVPool", "_create_buffers_normal", "overridden by memory_m3"),
    (_POOL + "MHATokenToKVPool", "_create_quantized_buffers", "overridden by memory_m3"),
    (_POOL + "MHATokenToKVPool", "_alloc_post_capture_buffers", "overridden by memory_m3"),
    (_POOL + "MHATokenToKVPool", "_store_kv_layer", "overridden by memory_m3"),
    (_SWA, "_kvcache", "memory_v4.HiSparseV4Allocator"),
    (_SWA, "need_sort", "memory_v4.HiSparseV4Allocator"),
    (_SWA, "page_size", "memory_v4.HiSparseV4Allocator"),
    (_SWA, "size", "memory_v4 (_from_swa)"),
    (_SWA, "size_full", "memory_v4 (_from_swa)"),
    (_SWA, "size_swa", "memory_v4 (_from_swa)"),
    (_SWA, "full_to_swa_index_mapping", "memory_v4 (_from_swa)"),
    (_V4 + "DeepSeekV4TokenToKVPool", "c4_kv_pool", "memory_v4.HiSparseV4Allocator, families.v4.V4Family.hisparse_pool"),
    (_V4 + "DeepSeekV4SingleKVPool", "bytes_per_page_padded", "memory_v4.HiSparseC4Pool"),
    (_V4 + "DeepSeekV4SingleKVPool", "kv_buffer", "memory_v4.HiSparseC4Pool"),
    (_V4 + "DeepSeekV4SingleKVPool", "set_key_buffer", "memory_v4.HiSparseC4Pool"),
    (_V4 + "DeepSeekV4SingleKVPool", "set_key_buffer_fused", "memory_v4.HiSparseC4Pool"),
    (_HOST, "kv_buffer", "memory_host.HiCacheHostPool"),
    (_HOST, "page_size", "memory_host.HiCacheHostPool"),
    (_HOST, "layer_num", "memory_host.HiCacheHostPool"),
    (_HOST, "get_contiguous_buf_infos", "memory_host.HiCacheHostPool"),
    (_KVC, "spec_algorithm", "budget.state_shape"),
    (_KVC, "layer_info", "budget.state_shape"),
    (_KVC, "model_config", "budget.state_shape"),
    (_KVC, "device", "budget.state_shape"),
    (_KVC, "is_draft_worker", "budget.reserve_coordinator_state"),
    (_KVC, "resolve_max_num_reqs", "budget._probe"),
    (_LAYERS, "num_effective_layers", "budget.state_shape"),
    (_LAYERS, "start_layer", "budget.state_shape"),
    (_LAYERS, "end_layer", "budget.state_shape"),
)

#: names the adapter reads with ``getattr``/``hasattr`` that are not SGLang's: attributes of our
#: own classes, optional Hugging Face config keys, Python internals (name, why)
OURS: tuple[tuple[str, str], ...] = (
    ("core", "our allocators' DualSpaceAllocator (families.base.dual_allocator)"),
    ("configure_hot_buffer", "our HiSparseTokenAllocator"),
    ("_hisparse_logical_only", "our flag on SGLang's PrefillBudget (radix_hooks.admit_ignore_eos_on_both_spaces)"),
    ("hisparse_coordinator", "set on SGLang's allocator by our coordinator (also Scheduler's, in CLASS_ATTRS)"),
    ("accept_lengths", "the rig's stand-in draft worker"),
    ("index_topk", "Hugging Face config key, absent on MiniMax-M3 by design"),
    ("text_config", "Hugging Face config key of multimodal wrappers, optional"),
    ("cell_contents", "Python closure cells (plugin.is_ours)"),
    ("__closure__", "Python functions (plugin.is_ours)"),
)

#: files whose literal ``getattr``/``hasattr`` names must all be in the tables above, as globs
#: from a checkout's root: the rig (``hisparse_testing/``) reads SGLang's objects too, but it is
#: test support outside the wheel
SCANNED = (
    "sglang_hisparse/sglang_adapter/*.py", "sglang_hisparse/sglang_adapter/families/*.py",
    "sglang_hisparse/arg_scope.py", "sglang_hisparse/plugin.py", "sglang_hisparse/metrics.py",
    "hisparse_testing/sglang_rig.py", "hisparse_testing/rig_*.py",
)


def listed_names() -> set[str]:
    """Every attribute name the tables above vouch for (the last part of each path)."""
    names = {path.rsplit(".", 1)[-1] for path, _ in REQ + SCHEDULE_BATCH + SERVER_ARGS + MODEL_CONFIG}
    names |= {leaf for _, leaf, _ in PUBLISHED} | {attr for _, attr, _ in CLASS_ATTRS}
    return names | {name for name, _ in OURS}
