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


def _seq_len_of(req: Any) -> int:
    """Tokens with KV when a request joins decode: prompt + outputs - 1 (the last output's
    KV is computed by the next step), as SGLang's ``_build_hisparse_decode_batch`` counts."""
    return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)


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


class SGLangHiSparseCoordinator:
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
        from sglang_hisparse.sglang_adapter.arg_hook import model_buffer_size, published_config

        # parse_hisparse_config could not size a default buffer for the model's top_k
        device_buffer_size = model_buffer_size(
            top_k=top_k, device_buffer_size=device_buffer_size, num_draft_tokens=num_draft_tokens
        )
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
        # SGLang passes only its own keys; ours come from the validated server config
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

    def host_token_len(self, kv_allocated_len: int) -> int:
        """Host positions of ``kv_allocated_len`` tokens (PD decode sizes the transfer by it)."""
        return int(kv_allocated_len) // self.family.compress_ratio

    # -- staging, collection, direct admission --------------------------------------------------
    def set_decode_producer_stream(self, stream: Any) -> None:
        self.core.set_producer_stream(stream)

    def admit_request_into_staging(self, req: Any) -> None:
        r = req.kv.req_pool_idx
        n = int(req.extend_end)
        req.hisparse_staging = True
        row = self.req_to_token_pool.req_to_token[r, :n]
        cpl = int(getattr(req.kv, "cache_protected_len", 0) or 0)
        if cpl and self.dual.computed_ids(r) is not None:
            # the checkpoint just before (checkpoint_kv_cache) may have repointed pages of the
            # row to ids another request inserted: hold them, loading what is only on host
            self._prepare(r, self._cpu_rows([(r, cpl)])[0])
        # NOTE: SGLang's result processor synchronizes the prefill batch's copy_done event
        # (recorded on the forward stream after the forward) before it admits, so the KV is
        # written; under the overlap scheduler the forward stream already holds the next batch.
        self.core.admit_staging(r, self.family.core_ids(row), req, prompt_written=True)

    def collect_ready_reqs(self) -> list[Any]:
        ready = [entry.req for entry in self.core.collect_ready()]
        for req in ready:
            req.hisparse_staging = False
        return ready

    def has_ongoing_staging(self) -> bool:
        return self.core.has_ongoing_staging()

    def admit_request_direct(self, req: Any) -> None:
        r, n = req.kv.req_pool_idx, self.host_token_len(_seq_len_of(req))
        have = self.host_pool.allocated_len(r)
        if have < n:
            raise ValueError(
                f"admit_request_direct: request {getattr(req, 'rid', '?')} (slot {r}) needs {n} host "
                f"positions but the PD transfer allocated {have}; the KV must be in the host pool first."
            )
        self.core.admit_direct(r, n)
        req.hisparse_staging = False

    # -- finish ---------------------------------------------------------------------------------
    def request_finished(self, req: Any) -> None:
        r = req.kv.req_pool_idx
        if r is not None:
            # its ids, for those the radix tree keeps (mapped into hot rows released here)
            n = self.host_pool.allocated_len(r)
            keep = n and self.family.rows_hold_core_ids
            self.core.finish(r, self.req_to_token_pool.req_to_token[r, :n] if keep else None)
        req.hisparse_staging = False

    def retract_req(self, req: Any) -> None:
        self.request_finished(req)

    def abort_staging_request(self, req: Any) -> None:
        self.request_finished(req)

    def release_unstaged(self, req: Any) -> None:
        """Before ``release_kv_cache``: a request released with prefill state but without
        ``request_finished`` (SGLang aborts between chunks, process_pending_chunked_abort) is
        finished here, so the ids it computed reach host before the tree keeps them."""
        r = getattr(req.kv, "req_pool_idx", None)
        if r is not None and self.dual.holds(r) and self.core.state.phase[r].value == "free":
            self.core.finish(r)

    # -- radix cache (radix_hooks.py) -----------------------------------------------------------
    def prepare_extend(self, reqs: list[Any], req_slots: list[int], extend_lens: list[int],
                       out_cache_loc: torch.Tensor) -> None:
        """After ``alloc_for_extend``: each request holds the tree part of its row
        (``req.kv.cache_protected_len`` ids: the match, then what its checkpoints published)
        and the ids this extend computed (``out_cache_loc``, split by ``extend_lens``).

        NOTE: the tree part is read back from ``req_to_token`` (one small copy per extend batch
        with a match; the tree keeps its values on the GPU only). The computed ids come from the
        allocator's CPU copy of the latest allocation when ``out_cache_loc`` is it (always, in
        SGLang 0.5.23's extend path), else they are read back too."""
        computed = self.dual.cpu_ids_of(out_cache_loc)
        if computed is None:
            computed = out_cache_loc.cpu()
        prefixes = self._cpu_rows([(r, int(getattr(q.kv, "cache_protected_len", 0) or 0))
                                   for q, r in zip(reqs, req_slots, strict=True)])
        off = 0
        for r, ext, prefix in zip(req_slots, extend_lens, prefixes, strict=True):
            self._prepare(r, prefix, computed[off : off + int(ext)])
            off += int(ext)

    def protect_matched(self, reqs: list[Any], tree_cache: Any) -> None:
        """Before ``alloc_for_extend``: the cached device pages new requests of the batch
        matched stay while the batch allocates (``DualSpaceAllocator.protect_cached``). One
        read-back of the matched ids, only while the device-tier cache holds pages."""
        if not self.dual.cached_rows:
            return
        parts = [tree_cache.prefix_device_indices(q) for q in reqs
                 if q.kv.req_pool_idx is None and int(q.prefix_len or 0) > 0]
        if parts:
            self.dual.protect_cached(torch.cat([p.reshape(-1).to(torch.int64) for p in parts]))

    def _cpu_rows(self, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """``req_to_token[r, :n]`` on the CPU for each (r, n), in one read-back."""
        r2t = self.req_to_token_pool.req_to_token
        parts = [r2t[r, :n] for r, n in spans if n]
        flat = torch.cat(parts).to(torch.int64).cpu() if parts else torch.empty(0, dtype=torch.int64)
        out, off = [], 0
        for _, n in spans:
            out.append(flat[off : off + n])
            off += n
        return out

    def _prepare(self, r: int, prefix: torch.Tensor, computed: torch.Tensor | None = None) -> None:
        if not self.core.prepare_prefix(r, prefix, computed_ids=computed):
            raise RuntimeError(
                f"HiSparse: no device rows to load request slot {r}'s matched prefix ({prefix.numel()} "
                f"tokens; {self.dual.rows.available_size()} rows free, {self.dual.available_rows()} with "
                f"what resident requests give up). The prefill budget reserves them "
                f"(radix_hooks.reserve_prefix_rows); lower --max-running-requests or raise the KV budget."
            )

    def adopt_pd_prefix(self, req: Any, prefix_ids: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """PD decode with its radix cache (``radix_hooks.pd_prealloc_with_prefix``): SGLang's
        HiSparse prealloc took logical ids and bound host rows for every position; the matched
        ``m`` positions go back to the tree's ids (``prefix_ids``, whose host rows hold their KV:
        a finished request's prompt and output), the fresh ids of them are freed, and only the
        suffix's host rows, ``dst[m:]``, are the transfer destination (SGLang slices it to the
        prompt's ``n - m``). One read-back, of the freed ids, outside the decode step."""
        r, m = req.kv.req_pool_idx, prefix_ids.numel()
        if m % self.dual.page_size:
            raise ValueError(f"adopt_pd_prefix: a prefix of {m} tokens is not whole pages of {self.dual.page_size}.")
        fresh = self.req_to_token_pool.req_to_token[r, :m].clone()
        self.req_to_token_pool.req_to_token[r, :m] = prefix_ids.to(self.req_to_token_pool.req_to_token.dtype)
        self.host_pool.bind(r, 0, prefix_ids)
        self.dual.free(fresh)
        req.prefix_len = m
        self.core.telemetry.add_prefix(m, 0, 0)
        return dst[m:]

    def rebind_tree_rows(self, reqs: list[Any]) -> None:
        """PD decode with its radix cache, after ``process_prebuilt``'s checkpoints: each
        request's first ``cache_protected_len`` positions read the ids its ``req_to_token`` row
        holds now. The checkpoint freed the ids of pages the tree already had (a concurrent
        identical or overlapping prompt inserted first) and repointed the row to the tree's,
        whose host rows hold the same KV; the freed ids go to later transfers. Device to
        device, no host sync; the core's other state is by position."""
        r2t = self.req_to_token_pool.req_to_token
        for req in reqs:
            r, m = req.kv.req_pool_idx, int(req.kv.cache_protected_len or 0)
            if r is None or not m or not self.family.rows_hold_core_ids:
                continue
            self.host_pool.bind(r, 0, r2t[r, :m])

    # -- decode ---------------------------------------------------------------------------------
    def map_last_loc_to_buffer(
        self,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        req_pool_indices_cpu: torch.Tensor,
    ) -> None:
        """``ScheduleBatch.prepare_for_decode`` (schedule_batch.py), after ``alloc_for_decode``
        and ``seq_lens += 1``: the new token of every request, in the family's units
        (``ModelFamily.map_last_loc``). No host sync."""
        self.family.map_last_loc(
            self.core, seq_lens=seq_lens, out_cache_loc=out_cache_loc, req_pool_indices=req_pool_indices,
            seq_lens_cpu=seq_lens_cpu, req_pool_indices_cpu=req_pool_indices_cpu,
        )

    def wait_for_pending_backup(self) -> None:
        self.core.wait_for_pending_backup()

    def swap_in_selected_pages(
        self,
        req_pool_indices: torch.Tensor,
        compressed_seq_lens: torch.Tensor,
        top_k_result: torch.Tensor,
        layer_id: int,
    ) -> torch.Tensor:
        return self.core.swap_in(req_pool_indices, compressed_seq_lens, top_k_result, layer_id)

    def swap_in_selected_blocks(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        top_k_blocks: torch.Tensor,
        layer_id: int,
        sparse_block_size: int,
    ) -> torch.Tensor:
        """MiniMax-M3's decode (``minimax_sparse_backend._hisparse_swap_in_blocks``, per sparse
        layer): block ids -> device rows of their positions (``ModelFamily.swap_in_blocks``;
        refused by the families that select tokens or C4 entries)."""
        return self.family.swap_in_blocks(
            self.core, req_pool_indices, seq_lens, top_k_blocks, layer_id, sparse_block_size
        )

    # -- speculative decoding (EAGLE / MTP chains; num_draft_tokens = W > 0) -------------------
    def allocate_spec_scratch(self, req_pool_indices: list[int]) -> None:
        """New requests' slots (``alloc_for_extend``): a capacity check for their W window rows,
        which the core takes when the request joins decode. No-op without spec."""
        self.core.reserve_spec([int(r) for r in req_pool_indices])

    def prepare_spec_verify(self, batch: Any) -> None:
        """``eagle_prepare_for_verify``, after ``batch.out_cache_loc`` holds the W logical ids
        of positions ``seq_lens .. seq_lens+W-1`` per request (request-major)."""
        if not self.core.num_draft_tokens:
            raise ValueError(
                "prepare_spec_verify: the coordinator was built with num_draft_tokens = 0; "
                "SGLang passes speculative_num_draft_tokens when --speculative-algorithm is set."
            )
        # NOTE: one device read-back when seq_lens_cpu is None, kept because no host copy of
        # these lengths exists yet. Under spec v2 the DSA backend declares
        # needs_cpu_seq_lens = False (dsa_backend.py:505), so resolve_seq_lens_cpu drops the
        # mirror (overlap_utils.py:615) and batch.seq_lens is gathered on the device from the
        # previous round's accept lengths, which the scheduler has not seen ("accept_lens not
        # known to schedule", overlap_utils.py:590): each Req's kv_committed_len lags by that
        # round until process_batch_result runs, after this batch is launched. The host needs
        # s now (host rows through s+W-1, short/long slots, the window's positions).
        seq_cpu = getattr(batch, "seq_lens_cpu", None)
        if seq_cpu is None:
            seq_cpu = batch.seq_lens.cpu()
        req_cpu = getattr(batch, "req_pool_indices_cpu", None)
        if req_cpu is None or len(req_cpu) != len(seq_cpu):
            req_cpu = [req.kv.req_pool_idx for req in batch.reqs]
        # NOTE: the verify ids' CPU copy is passed when they are the latest alloc() result.
        # SGLang's verify gathers them from req_to_token (assign_extend_cache_locs, eagle_utils.py)
        # after an earlier alloc reserved them, so with page_size 1 rebind reads them back once
        # a round. On CUDA SGLang gives DSA models 64-token pages (model_overrides/deepseek_v2.py)
        # and the spec reserve takes logical-only ids (alloc_logical_only, allocation.py): there
        # rebind frees nothing and reads nothing.
        self.core.prepare_spec(
            req_index=batch.req_pool_indices,
            req_index_cpu=[int(x) for x in (req_cpu.tolist() if torch.is_tensor(req_cpu) else req_cpu)],
            seq_lens_cpu=[int(x) for x in seq_cpu.tolist()],
            out_cache_loc=batch.out_cache_loc,
            out_cache_loc_cpu=self.dual.cpu_ids_of(batch.out_cache_loc),
        )

    def commit_spec_accept_tokens(self, batch: Any, accept_indices: torch.Tensor) -> None:
        """After verification: ``accept_indices`` int [bs, D] flat verify rows ``b*W + j`` of
        the accepted chain prefix, -1 padded (empty for an idle batch). No host sync."""
        self.core.commit_spec(accept_indices)

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
