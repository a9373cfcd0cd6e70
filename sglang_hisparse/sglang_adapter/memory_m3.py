"""MiniMax-M3's sparse-layer KV pool under HiSparse: ``HiSparseMHAPool``.

SGLang 0.5.23's ``MiniMaxSparseKVPool.__init__`` (``mem_cache/memory_pool.py``, under
``--enable-hisparse``) builds its main pool from ``hisparse_memory_pool.HiSparseMHAMainPool``,
imported at call time; the plugin rebinds that name to this class. The main pool holds the
K and V of the sparse layers only, at device rows (``size`` = device rows); the dense layers'
pool and the index K/V pools stay at logical size on the device (SGLang sizes them
``size * host_to_device_ratio``) and never go through HiSparse. ``MiniMaxSparseKVPool``
forwards ``register_mapping`` and the ``translate_loc_*`` calls here; the M3 attention backend
reads ``full_to_hisparse_device_index_mapping`` once at init (``minimax_sparse_backend.py``),
so the allocator's mapping tensor is registered once and never reallocated.

Row layout::

    rows[l]  uint8 [size + page_size, 2 * H * D * itemsize]   one allocation per sparse layer
             ├ K of the token ─┤├ V of the token ─┤            (H = 1 KV head per rank)
    k_buffer[l] = rows[l] viewed [size + page_size, H, D] at byte 0       (row stride 2HD)
    v_buffer[l] = rows[l] viewed [size + page_size, H, D] at byte HD*its  (row stride 2HD)

NOTE: K and V of a token are stored side by side so that one HiSparse row is one contiguous
piece: the resolve, replay, backup and prefix-load kernels move ``I = 2 * H * D * itemsize``
bytes per miss exactly as they move a DSA row, with no second copy per miss. SGLang's M3
readers take K and V with their strides (the Triton decode and prefill kernels pass
``k_cache.stride(0)`` / ``v_cache.stride(0)``); writes go through :meth:`_store_kv_layer`
here, one indexed row write, never through SGLang's JIT ``store_cache`` (whose row layout
is its own). The rejected alternative, SGLang's K-half / V-half allocation with a two-piece
copy in every kernel, costs a second address computation and store per miss in the resolve's
hot loop and a second pass in every host transfer.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from sglang_hisparse.memory.translation import ForwardTranslation, translate_locations
from sglang_hisparse.sglang_adapter.memory import NoCpuSnapshots

__all__ = ["HiSparseMHAPool"]


class HiSparseMHAPool(NoCpuSnapshots, MHATokenToKVPool):
    """M3's sparse-layer K/V at device rows, addressed by logical location through the
    allocator's mapping. Constructor: the arguments ``MiniMaxSparseKVPool`` passes to
    ``HiSparseMHAMainPool``."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str, enable_memory_saver: bool, start_layer: int | None = None,
                 end_layer: int | None = None, **kwargs: Any):
        unknown = sorted(set(kwargs) - {"v_head_dim"})
        if unknown or kwargs.get("v_head_dim", head_dim) != head_dim:
            raise ValueError(
                f"HiSparseMHAPool: MiniMax-M3's HiSparse pool takes K and V of one head_dim "
                f"({head_dim}); got {kwargs}. This SGLang build passes arguments sglang-hisparse "
                f"0.1 does not know; run the in-tree HiSparse (SGLANG_PLUGINS without hisparse)."
            )
        super().__init__(
            size=size, page_size=page_size, dtype=dtype, head_num=head_num, head_dim=head_dim,
            layer_num=layer_num, device=device, enable_memory_saver=enable_memory_saver,
            start_layer=start_layer, end_layer=end_layer,
        )
        self.full_to_hisparse_device_index_mapping: torch.Tensor | None = None
        self.bytes_per_token_k = head_num * head_dim * self.store_dtype.itemsize
        self.bytes_per_token_v = self.bytes_per_token_k
        #: bytes of one HiSparse row (K then V)
        self.row_bytes = self.bytes_per_token_k + self.bytes_per_token_v
        self.host_capacity_tokens: int | None = None
        self._per_forward = ForwardTranslation()

    # -- buffers ----------------------------------------------------------------------------
    def _create_buffers_normal(self) -> None:
        """One allocation per layer holding each token's K then V (module docstring)."""
        if self.kv_cache_layout != "nhd":
            raise ValueError(
                f"HiSparseMHAPool: KV layout {self.kv_cache_layout!r} is not supported; HiSparse "
                f"rows need the token-major (NHD) layout. Unset SGLANG_USE_HND_KVCACHE / "
                f"SGLANG_AITER_KV_CACHE_LAYOUT."
            )
        rows, H, D = self.size + self.page_size, self.head_num, self.head_dim
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.hisparse_rows = [
                torch.zeros((rows, 2, H, D), dtype=self.store_dtype, device=self.device)
                for _ in range(self.layer_num)
            ]
        self.k_buffer = [buf[:, 0] for buf in self.hisparse_rows]
        self.v_buffer = [buf[:, 1] for buf in self.hisparse_rows]

    def _create_quantized_buffers(self) -> None:
        raise ValueError(
            "HiSparseMHAPool: a quantized KV cache method (packed data + scales) cannot be held "
            "as HiSparse rows. Use --kv-cache-dtype auto, bfloat16, fp8_e4m3 or fp8_e5m2."
        )

    def _alloc_post_capture_buffers(self) -> None:
        raise ValueError(
            "HiSparseMHAPool: post-capture KV backing is not supported with HiSparse; the hot "
            "buffers are addressed at fixed device rows. Turn post-capture backing off."
        )

    def device_rows(self) -> list[torch.Tensor]:
        """Per sparse layer, uint8 [size + page_size, row_bytes]: the rows the resolve fills."""
        return [buf.view(torch.uint8).reshape(buf.shape[0], -1) for buf in self.hisparse_rows]

    # -- the logical -> device translation --------------------------------------------------
    def register_mapping(self, mapping: torch.Tensor) -> None:
        """Called by ``HiSparseTokenAllocator`` (through ``MiniMaxSparseKVPool``): int64
        [logical ids + 1], last element -1."""
        self.full_to_hisparse_device_index_mapping = mapping

    def _mapping(self) -> torch.Tensor:
        mapping = self.full_to_hisparse_device_index_mapping
        if mapping is None:
            raise ValueError(
                "HiSparseMHAPool: no mapping registered; construct HiSparseTokenAllocator with the "
                "MiniMaxSparseKVPool that holds this pool as kvcache."
            )
        return mapping

    def translate_loc_to_hisparse_device(self, loc: torch.Tensor) -> torch.Tensor:
        """Device rows of logical ``loc`` (any shape); negative entries pass through."""
        return translate_locations(self._mapping(), loc)

    _translate_loc_to_hisparse_device = translate_loc_to_hisparse_device
    translate_loc_from_full_to_hisparse_device = translate_loc_to_hisparse_device

    def translate_loc_from_full_to_compressed(self, loc: torch.Tensor) -> torch.Tensor:
        return loc  # M3 is token-granular: compression ratio 1

    # -- writes -----------------------------------------------------------------------------
    def set_kv_buffer(self, layer: Any, loc_info: Any, cache_k: torch.Tensor, cache_v: torch.Tensor,
                      *args: Any, **kwargs: Any) -> None:
        """K/V of logical ``loc`` written at their device rows (translated once per forward,
        ``memory.translation``)."""
        if kwargs.get("dcp_kv_mask") is not None:
            raise ValueError("HiSparseMHAPool: decode context parallelism is not supported with HiSparse.")
        loc, _, _ = unwrap_write_loc(loc_info)
        rows = self._per_forward(self._mapping(), loc, int(layer.layer_id))
        super().set_kv_buffer(layer, rows, cache_k, cache_v, *args, **kwargs)

    def _store_kv_layer(self, layer_idx: int, loc: torch.Tensor, cache_k: torch.Tensor,
                        cache_v: torch.Tensor) -> None:
        """One indexed write of each token's K and V into its row (already cast and viewed as
        the store dtype by ``set_kv_buffer``); -1 rows (padding) are skipped."""
        loc = loc.to(torch.int64)
        n, H, D = loc.shape[0], self.head_num, self.head_dim
        kv = torch.stack((cache_k.reshape(n, H, D), cache_v.reshape(n, H, D)), dim=1)
        keep = loc >= 0
        if not bool(keep.all()):
            loc, kv = loc[keep], kv[keep]
        self.hisparse_rows[layer_idx][loc] = kv

    def transfer_values_on_device(self, dst_indices: torch.Tensor, src_indices: torch.Tensor) -> None:
        """Copy device rows ``src`` -> ``dst`` in every layer (physical rows, no translation)."""
        if src_indices.numel() == 0:
            return
        for buf in self.hisparse_rows:
            buf[dst_indices] = buf[src_indices]

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        raise NotImplementedError(
            "HiSparseMHAPool: speculative decoding is not supported for MiniMax-M3 under "
            "sglang-hisparse (refused at argument validation)."
        )
