"""``SGLangHiSparseCoordinator``: what SGLang 0.5.23 constructs as its HiSparse coordinator.

The plugin registers this class as a REPLACE of
``sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator``; ``ModelRunner.maybe_init_hisparse_coordinator`` (``sglang/srt/model_executor/model_runner.py``)
builds it with the keyword arguments of the native constructor, and the scheduler, batch, DSA
backend and PD paths call the methods below (the SGLang call site is named at each). Every
call is translated into :class:`HiSparseCore` terms:

```
SGLang                                      HiSparseCore
admit_request_into_staging(req)         ->  admit_staging(req.kv.req_pool_idx, req_to_token[r, :extend_end], req)
collect_ready_reqs() -> [Req]           ->  collect_ready()  (entries carry the Req)
admit_request_direct(req)               ->  admit_direct(r, seq_len)
map_last_loc_to_buffer(...)             ->  map_last_loc(...)
swap_in_selected_pages(ri, sl, tk, l)   ->  swap_in(ri, sl, tk, l)
swap_in_selected_blocks(ri, sl, tb, l, b) -> swap_in_blocks(ri, sl, tb, l, b)  (MiniMax-M3)
request_finished / retract_req /
abort_staging_request(req)              ->  finish(r)
get_token_stats()                       ->  HiSparseTokenStats from the allocator / host pool
allocate_spec_scratch(req_pool_indices) ->  reserve_spec(slots)       (speculative decoding:
prepare_spec_verify(batch)              ->  prepare_spec(...)          num_draft_tokens = W > 0;
commit_spec_accept_tokens(batch, ai)    ->  commit_spec(ai)            see coordinator.spec)
```

The calls live in two parts of the class, ``request_calls.RequestCalls`` (a request's life,
the radix cache) and ``step_calls.StepCalls`` (decode steps, speculative verify); this module
builds what they read and answers SGLang's attribute reads and reports.

Memory comes from the allocator SGLang passes (ours: its ``DualSpaceAllocator`` is ``.core``)
and the pool behind it (``get_kvcache()``), whose model family (``families``: DSA, MiniMax-M3,
DeepSeek-V4) is detected once, here, from the pool's type. The family names the pool whose
rows go through HiSparse, its per-layer device rows, the selection the core resolves, and the
pinned host pool, built here (one row per logical id, so every admitted token fits; for DSA
over SGLang's HiCache host buffer, which also serves PD's RDMA registration).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

from sglang_hisparse.coordinator.core import HiSparseCore
from sglang_hisparse.kernel_policy import SERVING_POLICY
from sglang_hisparse.memory.state_bytes import coordinator_state_bytes
from sglang_hisparse.metrics import prometheus_sink_if_enabled
from sglang_hisparse.sglang_adapter.budget import log_coordinator_state
from sglang_hisparse.sglang_adapter.families import detect_family
from sglang_hisparse.sglang_adapter.request_calls import RequestCalls
from sglang_hisparse.sglang_adapter.step_calls import StepCalls

logger = logging.getLogger("sglang_hisparse")


def _radix_cache_on() -> bool:
    """SGLang's radix cache is on in this server (a finished request's ids may stay in its
    tree, so its rows are worth keeping as a device-tier cache)."""
    try:
        from sglang.srt.runtime_context import get_memory

        return not bool(get_memory().disable_radix_cache)
    except Exception:  # no published server config (unit tests build the coordinator directly)
        return False


def _pd_decode_server() -> bool:
    """This server is a PD decode instance (``--disaggregation-mode decode``); False when no
    server config is published (unit tests build the coordinator directly)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return getattr(get_server_args(), "disaggregation_mode", "null") == "decode"
    except Exception:
        return False


def _rank_in(group: Any) -> int:
    """This process's rank in ``group`` (0 without torch.distributed or a group)."""
    try:
        import torch.distributed as dist

        return dist.get_rank(group) if group is not None and dist.is_initialized() else 0
    except Exception:
        return 0


def _policy_note(policy: str) -> str:
    """The policy for the startup line, saying when it is the default."""
    if policy != SERVING_POLICY:
        return policy
    return f"{policy} (the default; \"policy\": \"lru\" in --hisparse-config for plain LRU)"


class SGLangHiSparseCoordinator(RequestCalls, StepCalls):
    """Drop-in for SGLang's ``HiSparseCoordinator``: the constructor takes the keyword
    arguments ``ModelRunner.maybe_init_hisparse_coordinator`` passes."""

    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        top_k: int,
        device_buffer_size: int,
        device: str | torch.device,
        tp_group: Any,
        host_to_device_ratio: int = 2,
        swap_in_block_size: int | None = None,
        shared_index_layers: list[bool] | None = None,
        num_draft_tokens: int = 0,
        residency: str | None = None,
        residency_watermark: float | None = None,
    ) -> None:
        from sglang_hisparse.sglang_adapter.arg_hook import published_config

        # SGLang passes its own keys (top_k, device_buffer_size, ...) from parse_hisparse_config,
        # i.e. from the server's resolved config (arg_hook.server_config, already sized for the
        # model's top_k); ours (residency, policy) are read from that same object below
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.top_k = top_k
        self.device_buffer_size = device_buffer_size
        self.device = device
        self.tp_group = tp_group
        self.swap_in_block_size = swap_in_block_size
        self.host_to_device_ratio = host_to_device_ratio

        #: the model family SGLang built the pool for (families.detect_family, once)
        self.family = family = detect_family(token_to_kv_pool_allocator)
        self.dual = family.dual
        self.mem_pool_device = family.pool
        top_k = family.core_top_k(top_k)
        device_kv, start_layer = family.device_layers()
        req_to_token = req_to_token_pool.req_to_token
        num_reqs, max_ctx = int(req_to_token.shape[0]), int(req_to_token.shape[1])
        # host rows per request slot: one per core logical id, whose host row is the id
        max_ctx = -(-max_ctx // family.compress_ratio)
        self.host_pool = family.host_pool(
            ratio=host_to_device_ratio, page_size=self.dual.page_size, max_requests=num_reqs,
            max_context=max_ctx, device=device, pd_decode=_pd_decode_server(),
        )
        #: where the indexer writes its selection before swap_in, for the families that do
        #: (DeepSeek-V4: int32 [R, top_k]); None otherwise
        self.raw_indices_buffer = family.index_buffer(num_reqs, top_k, device)
        cfg = published_config()
        cfg = replace(cfg, **{k: v for k, v in (("residency", residency),
                                                ("residency_watermark", residency_watermark)) if v is not None})
        mode, watermark = cfg.residency, cfg.watermark_rows(self.dual.size_device)
        policy = cfg.policy  # the replacement policy (slru by default)
        self.core = HiSparseCore(
            top_k=top_k, buffer_size=device_buffer_size, num_reqs=num_reqs,
            allocator=self.dual, host=self.host_pool, device_kv=device_kv,
            host_kv=self.host_pool.kv, device=device, shared_index_layers=shared_index_layers,
            start_layer=start_layer, tp_group=tp_group, block_size=swap_in_block_size,
            # no decode batch (CUDA-graph padded ones included) exceeds the request slots, so
            # the per-step buffers never grow, in particular not during graph capture
            max_batch=num_reqs, num_draft_tokens=int(num_draft_tokens or 0),
            residency=mode, watermark_rows=watermark, policy=policy,
            cache_finished=_radix_cache_on(),
            row_layout=self.host_pool.layout,
        )
        sink = prometheus_sink_if_enabled({"tp_rank": str(_rank_in(tp_group))})
        if sink is not None:  # --enable-metrics: our counters join SGLang's /metrics
            self.core.telemetry.sinks.append(sink)
        # PD decode reads these (disaggregation/decode.py): it admits a request against
        # padded_buffer_size + spec_swap.scratch_capacity device rows. A verify window adds W
        # rows to the hot buffer (one of them may be slot B's), so W pages-rounded covers it.
        self.mem_pool_host = self.host_pool
        self.req_to_host_pool = self.host_pool.host_rows
        # the radix hooks (radix_hooks.py) reach the coordinator through the allocator
        token_to_kv_pool_allocator.hisparse_coordinator = self
        self.host_pool.logical_source = family.latest_prealloc_ids
        self.padded_buffer_size = self.dual.hot.max_pages(device_buffer_size) * self.dual.page_size
        if hasattr(token_to_kv_pool_allocator, "configure_hot_buffer"):
            # check_decode_mem then counts hot-buffer growth, so SGLang retracts before a step
            # would find no device row (docs/memory.md, "Decode memory pressure")
            token_to_kv_pool_allocator.configure_hot_buffer(device_buffer_size)
        W, page = self.core.num_draft_tokens, self.dual.page_size
        self.spec_swap = SimpleNamespace(scratch_capacity=-(-W // page) * page)
        if W:
            # the scheduler's admission then charges every new request its window rows
            token_to_kv_pool_allocator.configure_spec_scratch(
                self.spec_swap.scratch_capacity, device_buffer_size=self.padded_buffer_size
            )
        log_coordinator_state(
            state_bytes=coordinator_state_bytes(
                request_slots=num_reqs, num_layers=len(device_kv), buffer_size=device_buffer_size,
                max_context=max_ctx, top_k=top_k, num_draft_tokens=W,
                cuda=torch.device(device).type == "cuda", policy=policy,
                residency_page_size=self.dual.page_size if self.core.residency.enabled else 0,
            ),
            request_slots=num_reqs,
        )
        logger.info(
            "HiSparse (sglang-hisparse): top_k=%d, B=%d, policy %s, %d layers, %d request slots, "
            "host pool %.2f GiB, shared-index prefetch %s, speculative verify window %d, residency %s",
            top_k, device_buffer_size, _policy_note(policy), len(device_kv), num_reqs,
            self.host_pool.nbytes / 2**30, "on" if self.core.prefetch_enabled else "off",
            self.core.num_draft_tokens,
            f"pressure (watermark {watermark} rows)" if self.core.residency.enabled else "always_hot",
        )

    # -- attributes SGLang reads ------------------------------------------------------------
    @property
    def num_real_reqs(self) -> torch.Tensor:
        """int32 [1] device tensor; the model runner fills it with the real batch size."""
        return self.core.num_real_reqs

    @property
    def ack_staging_queue(self) -> list[Any]:
        """Requests still staging (items carry ``.req``)."""
        return self.core.staging_queue

    @property
    def req_to_host_pool_allocated_len(self) -> torch.Tensor:
        """int64 [R] (CPU): host positions allocated per request slot, the host pool's own
        ``allocated_lens`` (kept in step as rows are taken and freed; PD decode passes it to
        ``alloc_paged_token_slots``)."""
        return self.host_pool.allocated_lens

    # -- reporting / teardown -------------------------------------------------------------------
    def get_token_stats(self) -> Any:
        from sglang.srt.managers.hisparse_coordinator import HiSparseTokenStats

        dev_cap = self.dual.size_device
        dev_used = self.dual.rows.used_size()
        host_cap = self.host_pool.size
        host_used = self.dual.logical.used_size()  # a logical id's host row is the id
        return HiSparseTokenStats(
            device_tokens=dev_used,
            device_token_usage=dev_used / dev_cap if dev_cap else 0.0,
            host_tokens=host_used,
            host_token_usage=host_used / host_cap if host_cap else 0.0,
        )

    def telemetry(self) -> dict[str, float | int]:
        """Cumulative counters (hit rate, misses/step, bytes moved, staging/backups); syncs."""
        return self.core.telemetry.snapshot().as_dict()

    def destroy(self) -> None:
        self.core.destroy()
        self.host_pool.destroy()
