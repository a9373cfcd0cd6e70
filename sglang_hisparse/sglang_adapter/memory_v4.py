"""DeepSeek-V4's C4 compressed KV under HiSparse: ``HiSparseC4Pool`` (docs/v4-m3.md).

SGLang 0.5.23's ``DeepSeekV4TokenToKVPool._init_compressed_pools`` builds the C4 layers' pool
from the module global ``deepseek_v4_memory_pool.HiSparseC4DevicePool`` (looked up at call
time) when HiSparse is on; the plugin rebinds that name to this class. It is SGLang's
``DeepSeekV4SingleKVPool`` (the buffers FlashMLA and the compressor read: per C4 layer uint8
[pages, 37440], 64 entries a page, ``kernels.row_layout.C4_PAGED``) at ``size`` device rows,
addressed by **compressed logical id** through the allocator's mapping::

    full-token location f  --(f + 1) % 4 == 0-->  compressed id f // 4  --mapping-->  device row
    (SGLang's SWA allocator)                      (our DualSpaceAllocator's         (this pool's
                                                   logical space, bind_extend)       entries)

Readers: the compressor translates its write locations with the private
``_translate_loc_to_hisparse_device`` (int64, ``compressor_v2.py``), the indexer's prefill with
``translate_loc_to_hisparse_device`` (int32), the coordinator's V4 family (``families/v4.py``)
with ``translate_loc_from_full_to_compressed``. The mapping tensor is registered once and indexed inside CUDA graphs: it is never
reallocated, its trailing -1 maps SGLang's -1 to -1.

``HiSparseV4Allocator`` wraps SGLang's SWA allocator for the token spaces and binds the C4
entries' device rows by compressed id (docs/v4-m3.md D6).

Both are plugin targets, built when ``arg_scope`` accepts DeepSeek-V4; with the coordinator's
V4 family (``families.v4.V4Family``) SGLang's real scheduler drives them in the rig
(``hisparse_testing/rig_v4.py``). No real V4 model has run on a GPU with them (the device
machine cannot hold SGLang); the kernels' C4 layout is checked there bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool

from sglang_hisparse.kernels.row_layout import C4_PAGED
from sglang_hisparse.memory.allocator import DualSpaceAllocator
from sglang_hisparse.sglang_adapter.memory import NoCpuSnapshots

__all__ = ["COMPRESS_RATIO", "HiSparseC4Pool", "HiSparseV4Allocator"]

#: tokens per C4 entry
COMPRESS_RATIO = 4


class HiSparseC4Pool(NoCpuSnapshots, DeepSeekV4SingleKVPool):
    """The C4 layers' compressed KV at device rows. Constructor: the arguments
    ``DeepSeekV4TokenToKVPool._make_kv_pool`` passes to ``HiSparseC4DevicePool``."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, layer_num: int, device: str, enable_memory_saver: bool,
                 start_layer: int | None = None, end_layer: int | None = None, **kwargs: Any):
        super().__init__(size, page_size, dtype, qk_nope_head_dim, qk_rope_head_dim, layer_num, device,
                         enable_memory_saver, start_layer, end_layer, **kwargs)
        if self.page_size != C4_PAGED.entries or self.bytes_per_page_padded != C4_PAGED.page_bytes:
            raise ValueError(
                f"HiSparseC4Pool: pages of {self.page_size} entries / {self.bytes_per_page_padded} B; "
                f"sglang-hisparse's kernels read DeepSeek-V4's layout ({C4_PAGED.entries} entries in "
                f"{C4_PAGED.page_bytes} B). Use the V4 KV layout (on SM100: SGLANG_DSV4_KV_LAYOUT=v4)."
            )
        self.compress_ratio = COMPRESS_RATIO
        #: bytes of an entry's host row (its 584 bytes in a whole number of 16-byte pieces)
        self.row_bytes = C4_PAGED.host_item()
        self.full_to_hisparse_device_index_mapping: torch.Tensor | None = None

    def device_rows(self) -> list[torch.Tensor]:
        """Per C4 layer, uint8 [pages, 37440]: the ``C4_PAGED`` device layers of the core (which
        checks their shape)."""
        return list(self.kv_buffer)

    # -- the compressed logical id -> device row translation --------------------------------
    def register_mapping(self, mapping: torch.Tensor) -> None:
        """int64 [compressed logical ids + 1], last element -1 (the allocator's, registered once)."""
        self.full_to_hisparse_device_index_mapping = mapping

    def _mapping(self) -> torch.Tensor:
        mapping = self.full_to_hisparse_device_index_mapping
        if mapping is None:
            raise ValueError("HiSparseC4Pool: no mapping registered; build the V4 allocator over this pool.")
        return mapping

    def translate_loc_from_full_to_compressed(self, full_loc: torch.Tensor) -> torch.Tensor:
        """Compressed ids of the full-token locations that end a 4-token group, in order."""
        full_loc = full_loc.to(torch.int64)
        return full_loc[(full_loc + 1) % COMPRESS_RATIO == 0] // COMPRESS_RATIO

    def _translate_loc_to_hisparse_device(self, compressed: torch.Tensor) -> torch.Tensor:
        """int64 device rows of compressed ids (the compressor's store kernel checks int64)."""
        return self._mapping()[compressed.to(torch.int64)]

    def translate_loc_to_hisparse_device(self, compressed: torch.Tensor) -> torch.Tensor:
        """int32 device rows of compressed ids (what FlashMLA's page indices take)."""
        return self._translate_loc_to_hisparse_device(compressed).to(torch.int32)

    def translate_loc_from_full_to_hisparse_device(self, full_loc: torch.Tensor) -> torch.Tensor:
        return self._translate_loc_to_hisparse_device(self.translate_loc_from_full_to_compressed(full_loc))

    # -- writes (compressed logical ids -> device rows) -------------------------------------
    def set_key_buffer(self, layer_id: int, loc: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        super().set_key_buffer(layer_id, self.translate_loc_to_hisparse_device(loc), *args, **kwargs)

    def set_key_buffer_fused(self, layer_id: int, loc: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return super().set_key_buffer_fused(layer_id, self.translate_loc_to_hisparse_device(loc), *args, **kwargs)


def _from_swa(name: str) -> property:
    """A read-only attribute of the wrapped SWA allocator (``logical_attn_allocator``)."""
    return property(lambda self: getattr(self.logical_attn_allocator, name))


class HiSparseV4Allocator(BaseTokenToKVPoolAllocator):
    """DeepSeek-V4's allocator under HiSparse: SGLang's SWA allocator for the token spaces (full
    and sliding-window locations, 256-token pages; every pass-through of docs/v4-m3.md section
    2a forwarded to it), and a ``DualSpaceAllocator`` (``.core``) over the compressed space,
    whose logical pages follow the full pages (one 64-entry page per 256-token page, D6):
    prefill binds device rows for the extend's new C4 entries (``bind_extend``), a free of full
    pages frees the compressed pages the core holds for them. Constructor: SGLang's wrap
    (``kv_cache_configurator``: ``Alloc(swa_allocator)``).

    NOTE: ``alloc_extend`` reads the new full locations on the CPU to bind their compressed
    ids (one device-to-host copy per prefill allocation, outside the decode loop); SGLang's
    SWA allocator computes them on the device and the core's ownership tables are CPU-side.
    """

    def __init__(self, logical_attn_allocator: Any):
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

        kvcache = getattr(logical_attn_allocator, "_kvcache", None)
        c4 = getattr(kvcache, "c4_kv_pool", None)
        if not isinstance(kvcache, DeepSeekV4TokenToKVPool) or not isinstance(c4, HiSparseC4Pool):
            raise ValueError(
                f"HiSparseV4Allocator: the SWA allocator's pool ({type(kvcache).__name__}) must be "
                f"DeepSeekV4TokenToKVPool with sglang-hisparse's HiSparseC4Pool as its C4 pool "
                f"({type(c4).__name__}); launch with the sglang-hisparse plugin installed."
            )
        self.logical_attn_allocator = logical_attn_allocator
        self._kvcache, self.hisparse_kvcache = kvcache, c4
        self.page_size = logical_attn_allocator.page_size
        self.dtype, self.device = c4.dtype, c4.device
        self.need_sort = getattr(logical_attn_allocator, "need_sort", False)
        self.compress_ratio = COMPRESS_RATIO
        self.hisparse_page_size = c4.page_size
        if self.page_size != self.hisparse_page_size * COMPRESS_RATIO:
            raise ValueError(
                f"HiSparseV4Allocator: token pages of {self.page_size} and C4 pages of "
                f"{self.hisparse_page_size} entries; DeepSeek-V4 pairs 256-token pages with 64-entry ones."
            )
        compressed = logical_attn_allocator.size_full // COMPRESS_RATIO
        self.core = DualSpaceAllocator(
            c4.size, host_to_device_ratio=max(1, -(-compressed // c4.size)), page_size=c4.page_size,
            device=c4.device, logical_capacity=max(compressed, c4.size),
        )
        self.free_pages = self.release_pages = self.free_group = None
        #: the full-token locations of the latest logical-only allocation (PD decode's
        #: prealloc; the coordinator's host pool binds their C4 entries' compressed ids)
        self.last_logical_only: torch.Tensor | None = None
        self.full_free_group: list[torch.Tensor] = []
        c4.register_mapping(self.core.mapping)

    # -- what the coordinator and PD read ----------------------------------------------------
    @property
    def full_to_hisparse_device_index_mapping(self) -> torch.Tensor:
        return self.core.mapping

    @property
    def hisparse_attn_allocator(self) -> Any:
        """The C4 device rows (PD decode admits against their ``available_size()`` in hot
        buffers, decode.py:1414-1431)."""
        return self.core.rows

    #: the token spaces' sizes and SWA map are the SWA allocator's
    size = _from_swa("size")
    size_full = _from_swa("size_full")
    size_swa = _from_swa("size_swa")
    full_to_swa_index_mapping = _from_swa("full_to_swa_index_mapping")

    def get_kvcache(self) -> Any:
        return self._kvcache

    def debug_print(self) -> str:
        return (f"#full/swa: {self.logical_attn_allocator.debug_print()}, #C4 device rows free: "
                f"{self.core.rows.available_size()} of {self.core.size_device}")

    # -- capacity: a prefill needs its C4 entries' device rows too ----------------------------
    def _c4_tokens(self) -> int:
        return self.core.available_rows() * COMPRESS_RATIO

    def available_size(self) -> int:
        return min(self.logical_attn_allocator.available_size(), self._c4_tokens())

    def full_available_size(self) -> int:
        return min(self.logical_attn_allocator.full_available_size(), self._c4_tokens())

    def swa_available_size(self) -> int:
        return self.logical_attn_allocator.swa_available_size()

    def swa_capacity_and_available(self, *, full_capacity: int, swa_capacity: int) -> Any:
        return ((full_capacity, self.full_available_size()), (swa_capacity, self.swa_available_size()))

    def create_prefill_budget(self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0) -> Any:
        from sglang.srt.mem_cache.prefill_budget import SWAPrefillBudget

        return SWAPrefillBudget(self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)

    def reclaim_for_prealloc(self, tree_cache: Any, full_tokens: int, swa_tokens: int) -> str | None:
        return self.logical_attn_allocator.reclaim_for_prealloc(tree_cache, full_tokens, swa_tokens)

    # -- token-space pass-throughs -------------------------------------------------------------
    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self.logical_attn_allocator.translate_loc_from_full_to_swa(kv_indices)

    def translate_swa_indices_for_transfer(self, *args: Any, **kwargs: Any) -> Any:
        return self.logical_attn_allocator.translate_swa_indices_for_transfer(*args, **kwargs)

    def free_swa(self, free_indices: torch.Tensor) -> None:
        self.logical_attn_allocator.free_swa(free_indices)

    def free_swa_segment(self, free_indices: torch.Tensor, *, start_pos: int) -> None:
        self.logical_attn_allocator.free_swa_segment(free_indices, start_pos=start_pos)

    def free_full(self, free_indices: torch.Tensor) -> None:
        """Full-token locations only (SGLang's segment frees); the C4 entries go with
        :meth:`free` or the coordinator's finish."""
        if free_indices.numel() == 0:
            return
        if self.free_group is None:
            self.logical_attn_allocator.free_full(free_indices)
        else:
            self.full_free_group.append(free_indices.clone())

    # -- allocation ------------------------------------------------------------------------------
    def alloc(self, need_size: int) -> Any:
        raise NotImplementedError("DeepSeek-V4 under HiSparse allocates through alloc_extend / alloc_decode.")

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int) -> Any:
        """Token locations from SGLang's SWA allocator, and device rows for the new C4 entries
        (positions ``p`` of the extend with ``(p + 1) % 4 == 0``) bound to their compressed ids.
        None, nothing changed, when either side is short."""
        p_c = prefix_lens_cpu.to(torch.int64) // COMPRESS_RATIO
        s_c = seq_lens_cpu.to(torch.int64) // COMPRESS_RATIO
        c4_pages = self.core.logical.pages_needed_extend(p_c, s_c)
        if c4_pages * self.hisparse_page_size > self.core.available_rows():
            return None
        locs = self.logical_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                                        last_loc, extend_num_tokens)
        if locs is None:
            return None
        compressed = self.hisparse_kvcache.translate_loc_from_full_to_compressed(locs).to("cpu")
        if not self.core.bind_extend(compressed, p_c, s_c):
            self.logical_attn_allocator.free(locs)
            return None
        return locs

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor) -> Any:
        """Token locations only: a decode step's C4 entry lands in the request's hot buffer."""
        return self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def alloc_logical_only(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                           seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int) -> Any:
        """PD decode's prealloc: token locations only (the C4 entries arrive in the host pool,
        their device rows come with the hot buffer at admission)."""
        locs = self.logical_attn_allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                                        last_loc, extend_num_tokens)
        self.last_logical_only = locs
        return locs

    def alloc_extend_swa_tail(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                              seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int,
                              swa_tail_len: int) -> Any:
        """PD decode's prealloc as SGLang makes it for SWA models (decode.py:2411): full-token
        locations for the prompt, SWA locations for its window tail only; as
        :meth:`alloc_logical_only`, no C4 device row."""
        locs = self.logical_attn_allocator.alloc_extend_swa_tail(
            prefix_lens=prefix_lens, prefix_lens_cpu=prefix_lens_cpu, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu,
            last_loc=last_loc, extend_num_tokens=extend_num_tokens, swa_tail_len=swa_tail_len)
        self.last_logical_only = locs
        return locs

    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        """The compressed id of the last complete 4-token group ending at or before each
        location (-1 stays -1)."""
        return (last_locs - (COMPRESS_RATIO - 1)) // COMPRESS_RATIO

    # -- frees -----------------------------------------------------------------------------------
    def _compressed_of_pages(self, free_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Compressed ids of the C4 pages of the full pages of ``free_index``: (those the core
        claimed at prefill, the others: pages opened by decode, whose entries were only mapped
        into hot rows)."""
        pages = torch.unique(free_index.to("cpu", torch.int64) // self.page_size)
        pages = pages[(pages > 0) & (pages <= self.core.logical.num_pages)]
        held = self.core.logical._used[pages]
        ids = self.core.logical.page_ids_to_ids
        return ids(pages[held]), ids(pages[~held])

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(free_index.clone())
            return
        self.logical_attn_allocator.free(free_index)
        claimed, mapped_only = self._compressed_of_pages(free_index)
        if claimed.numel():
            self.core.free(claimed)
        if mapped_only.numel():  # a decode-opened page: nothing to free, but nothing may stay mapped
            self.core.unmap(mapped_only)

    def free_group_begin(self) -> None:
        self.free_group = []
        self.full_free_group = []

    def free_group_end(self) -> None:
        group, full = self.free_group, self.full_free_group
        self.free_group, self.full_free_group = None, []
        if group:
            self.free(torch.cat(group))
        if full:
            self.free_full(torch.cat(full))

    def clear(self) -> None:
        self.logical_attn_allocator.clear()
        self.core.clear()
        self.free_group, self.full_free_group = None, []

    def check_integrity(self) -> None:
        self.core.check_integrity()
