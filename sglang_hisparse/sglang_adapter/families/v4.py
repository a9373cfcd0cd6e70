"""DeepSeek-V4: top-k compressed positions over the C4 layers' entries (docs/v4-m3.md).

SGLang builds its own ``DeepSeekV4TokenToKVPool`` whose C4 pool is ours, ``HiSparseC4Pool``
(``sglang_adapter/memory_v4.py``: one entry per 4 tokens, in FlashMLA's pages, ``C4_PAGED``);
the SWA, C128 and indexer pools stay on the device. Our ``HiSparseV4Allocator`` wraps SGLang's
SWA allocator for the token locations and binds the C4 entries by **compressed logical id**,
the core's ids here::

    req_to_token row (token locations f)  --(f + 1) % 4 == 0-->  compressed id f // 4 = core id
                                                                 = host row (C4 pages on host)

So the core steps in compressed units (lengths // 4; a decode step gains an entry only on
4-aligned lengths), the host pool holds C4 pages (``C4_PAGED_HOST``, what SGLang's PD transfer
writes) and the indexer writes its selection into ``raw_indices_buffer`` before calling
``swap_in_selected_pages`` with compressed lengths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from sglang_hisparse.kernels.row_layout import C4_PAGED_HOST
from sglang_hisparse.memory.allocator import DualSpaceAllocator
from sglang_hisparse.memory.host_pool import HostKVPool
from sglang_hisparse.sglang_adapter.families.base import ModelFamily, Selection, require_ours
from sglang_hisparse.sglang_adapter.memory_host import own_host_pool

if TYPE_CHECKING:
    from sglang_hisparse.coordinator.core import HiSparseCore


class V4Family(ModelFamily):
    name = "v4"
    label = "DeepSeek-V4"
    pools = "DeepSeekV4TokenToKVPool over HiSparseC4Pool"
    selection = Selection.C4_ENTRIES
    #: token locations are the SWA allocator's; the core's ids are the compressed ones
    rows_hold_core_ids = False

    def __init__(self, kvcache: Any, allocator: Any, dual: DualSpaceAllocator) -> None:
        super().__init__(kvcache, allocator, dual)
        self.compress_ratio = int(self.pool.compress_ratio)

    @classmethod
    def detects(cls, kvcache: Any) -> bool:
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

        return isinstance(kvcache, DeepSeekV4TokenToKVPool)

    def hisparse_pool(self, kvcache: Any) -> Any:
        """``DeepSeekV4TokenToKVPool.c4_kv_pool`` (the one our V4 allocator holds as
        ``hisparse_kvcache``), which must be ours."""
        from sglang_hisparse.sglang_adapter.memory_v4 import HiSparseC4Pool

        return require_ours(kvcache.c4_kv_pool, HiSparseC4Pool, "DeepSeek-V4 C4 pool")

    def device_layers(self) -> tuple[list[torch.Tensor], int]:
        """The C4 layers' pages, uint8 [pages, 37440] each (``C4_PAGED``), indexed from 0 as
        the indexer numbers them."""
        return self.pool.device_rows(), 0

    def host_pool(self, *, ratio: int, page_size: int, max_requests: int, max_context: int,
                  device: str | torch.device, pd_decode: bool = False, pin_memory: bool | None = None,
                  ranks_per_host: int | None = None) -> HostKVPool:
        """Our own pinned pool in the device's C4 pages (``C4_PAGED_HOST``, a ``C4HostPool``),
        co-located and PD alike, one row per compressed logical id (the allocator core's
        logical capacity, which its SWA token pages decide, not ``ratio``).

        NOTE: paged on the host too, co-located as well, so one layout serves both: it costs at
        most +1.6 % resolve per miss on the H200 (benchmarks/RESOLVE.md)."""
        return own_host_pool(
            self.pool, layout=C4_PAGED_HOST, capacity=self.dual.size_full, page_size=page_size,
            max_requests=max_requests, max_context=max_context, device=device, pin_memory=pin_memory,
            ranks_per_host=ranks_per_host,
        )

    def index_buffer(self, num_reqs: int, top_k: int, device: str | torch.device) -> torch.Tensor:
        """``raw_indices_buffer``: int32 [R, top_k], -1 padded, each request's selected
        compressed positions, written by the indexer before ``swap_in`` (a captured address,
        never reallocated)."""
        return torch.full((num_reqs, top_k), -1, dtype=torch.int32, device=device)

    def core_ids(self, row: torch.Tensor) -> torch.Tensor:
        """The compressed ids of the 4-token groups the locations ``row`` complete."""
        return self.pool.translate_loc_from_full_to_compressed(row)

    def latest_prealloc_ids(self) -> torch.Tensor | None:
        """The compressed ids of the prealloc's token locations (the V4 allocator records them
        in ``alloc_logical_only`` / ``alloc_extend_swa_tail``)."""
        return self.core_ids(self.allocator.last_logical_only)

    def map_last_loc(self, core: HiSparseCore, *, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     req_pool_indices_cpu: torch.Tensor) -> None:
        """Every request generates a token, but only those whose length reaches a multiple of 4
        gain a C4 entry (the compressor writes entry ``seq_len // 4 - 1``); the core steps in
        compressed lengths with ``grows`` (docs/v4-m3.md D1), the new entries' ids (the
        allocator's ``get_last_loc_compressed`` of the growing rows' locations, picked with a
        host-built index)."""
        c = self.compress_ratio
        lens = [int(x) for x in seq_lens_cpu.tolist()]
        grows = [n % c == 0 for n in lens]
        at = torch.tensor([i for i, g in enumerate(grows) if g], dtype=torch.int64)
        new = self.allocator.get_last_loc_compressed(
            out_cache_loc.to(torch.int64).index_select(0, at.to(out_cache_loc.device)))
        core.map_last_loc(
            req_index=req_pool_indices, seq_lens=seq_lens // c, new_logical=new,
            req_index_cpu=[int(x) for x in req_pool_indices_cpu.tolist()],
            seq_lens_cpu=[n // c for n in lens], grows=grows,
        )
