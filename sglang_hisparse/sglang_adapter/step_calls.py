"""The per-step calls of SGLang's HiSparse coordinator: a decode step's new token, the
per-layer resolve of the indexer's selection, and the speculative verify window
(``num_draft_tokens`` = W > 0). ``StepCalls`` is a part of ``SGLangHiSparseCoordinator``
(``coordinator.py`` builds the state it reads); the family (``families``) gives the forms that
differ: how a step's token enters the core, and which selection call it serves.

```
prepare_for_decode ─ map_last_loc_to_buffer ─► family.map_last_loc ─► core.map_last_loc
model runner ─────── wait_for_pending_backup ─► core.wait_for_pending_backup
per sparse layer ─── swap_in_selected_pages ──► core.swap_in          (tokens, C4 entries)
                     swap_in_selected_blocks ─► family.swap_in_blocks (blocks)
speculative ──────── allocate_spec_scratch / prepare_spec_verify / commit_spec_accept_tokens
                                             ─► core.reserve_spec / prepare_spec / commit_spec
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang_hisparse.coordinator.core import HiSparseCore
    from sglang_hisparse.memory.allocator import DualSpaceAllocator
    from sglang_hisparse.sglang_adapter.families import ModelFamily


class StepCalls:
    """The per-step calls of ``SGLangHiSparseCoordinator``."""

    core: HiSparseCore
    dual: DualSpaceAllocator
    family: ModelFamily

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
