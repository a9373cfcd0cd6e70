"""A request's life as SGLang drives it through its HiSparse coordinator: staging after prefill,
the radix cache's prefix holds and PD prefixes, direct admission (PD decode), finish / retract /
abort. ``RequestCalls`` is a part of ``SGLangHiSparseCoordinator`` (``coordinator.py`` builds the
state it reads); each method translates SGLang's ``Req`` into ``HiSparseCore`` calls.

```
prefill done ─ admit_request_into_staging ─► core.admit_staging (the prompt's KV → host, side stream)
             ─ collect_ready_reqs ─────────► core.collect_ready  (TP-agreed) ─► decode
PD decode    ─ admit_request_direct ───────► core.admit_direct   (KV already in the host pool)
radix cache  ─ prepare_extend / protect_matched / adopt_pd_prefix / rebind_tree_rows (radix_hooks.py)
finish, retract, abort, release_unstaged ──► core.finish         (frees rows, host rows, map entries)
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang_hisparse.coordinator.core import HiSparseCore
    from sglang_hisparse.memory.allocator import DualSpaceAllocator
    from sglang_hisparse.memory.host_pool import HostKVPool
    from sglang_hisparse.sglang_adapter.families import ModelFamily


def _seq_len_of(req: Any) -> int:
    """Tokens with KV when a request joins decode: prompt + outputs - 1 (the last output's
    KV is computed by the next step), as SGLang's ``_build_hisparse_decode_batch`` counts."""
    return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)


class RequestCalls:
    """The per-request calls of ``SGLangHiSparseCoordinator``."""

    core: HiSparseCore
    dual: DualSpaceAllocator
    family: ModelFamily
    host_pool: HostKVPool
    req_to_token_pool: Any

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
