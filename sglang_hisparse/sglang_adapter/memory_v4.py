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
``translate_loc_to_hisparse_device`` (int32), the coordinator with the ``translate_loc_from_full_*``
pair. The mapping tensor is registered once and indexed inside CUDA graphs: it is never
reallocated, its trailing -1 maps SGLang's -1 to -1.

Status: the pool is built and tested against SGLang's own V4 pool on CPU; the V4 allocator and
coordinator that would serve it are not (``arg_scope`` still refuses DeepSeek-V4).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool

from sglang_hisparse.kernels.row_layout import C4_PAGED
from sglang_hisparse.sglang_adapter.memory import NoCpuSnapshots

__all__ = ["COMPRESS_RATIO", "HiSparseC4Pool"]

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
        self.full_to_hisparse_device_index_mapping: torch.Tensor | None = None

    def device_rows(self) -> list[torch.Tensor]:
        """Per C4 layer, uint8 [pages, 37440]: the ``C4_PAGED`` device layers of the core."""
        for buf in self.kv_buffer:
            C4_PAGED.check_device(buf, C4_PAGED.host_item())
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
