"""SGLang-facing memory classes: thin adapters over the SGLang-free memory core.

Under ``--enable-hisparse`` SGLang 0.5.23's ``kv_cache_configurator`` constructs (names bound
at import time in ``sglang.srt.mem_cache.kv_cache_configurator``; the plugin replaces them):

* ``HiSparseDSATokenToKVPool`` (``_build_dsa_kv_pool``)            → ``HiSparseDSAPool``
* ``HiSparseTokenToKVPoolAllocator`` (``_build_token_to_kv_pool_allocator``) → ``HiSparseTokenAllocator``

and the coordinator's DSA family builds the host pool with ``build_host_pool`` (``memory_host``, re-exported here). All allocation logic is
in ``sglang_hisparse.memory.allocator`` / ``host_pool``; these classes translate SGLang's call
shapes (``prefix_lens_cpu``, ``loc_info``, PD host-slot requests) into core calls.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import (
    DSATokenToKVPool,
    MLATokenToKVPool,
    unwrap_write_loc,
)

from sglang_hisparse.memory.allocator import DualSpaceAllocator
from sglang_hisparse.memory.translation import ForwardTranslation, translate_locations
from sglang_hisparse.sglang_adapter.memory_host import HiCacheHostPool, build_host_pool

__all__ = ["HiCacheHostPool", "HiSparseDSAPool", "HiSparseTokenAllocator", "build_host_pool"]


class NoCpuSnapshots:
    """SGLang's CPU snapshot calls of a device pool (PD retraction backup), which HiSparse's
    pools refuse: the full KV already lives in the coordinator's host pool."""

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        raise NotImplementedError(
            "HiSparse keeps full KV in its own host pool; CPU snapshots of the device pool are unsupported."
        )

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        raise NotImplementedError(
            "HiSparse keeps full KV in its own host pool; CPU snapshots of the device pool are unsupported."
        )


class HiSparseDSAPool(NoCpuSnapshots, DSATokenToKVPool):
    """DSA KV pool whose KV rows are device rows and whose indexer keys are logical.

    ``size`` = device rows. The indexer key cache is sized ``size * host_to_device_ratio``
    (every logical id; it never leaves the GPU). KV writes and reads take logical locations
    and translate them through the allocator's mapping (registered by the allocator); the
    per-layer calls translate a forward's locations once (``memory.translation``: the first
    layer's translation serves the later layers of the same forward).
    """

    def __init__(self, size: int, *args: Any, host_to_device_ratio: int = 2, **kwargs: Any):
        if host_to_device_ratio < 1:
            raise ValueError(
                f"host_to_device_ratio = {host_to_device_ratio} must be >= 1 (--hisparse-config)."
            )
        kwargs["index_buf_size"] = size * host_to_device_ratio
        super().__init__(size, *args, **kwargs)
        self.host_to_device_ratio = host_to_device_ratio
        self.bytes_per_token = self.kv_cache_dim * self.store_dtype.itemsize
        self.full_to_hisparse_device_index_mapping: torch.Tensor | None = None
        #: the per-forward translation of the per-layer KV writes and reads
        self._per_forward = ForwardTranslation()

    def register_mapping(self, mapping: torch.Tensor) -> None:
        """Called by ``HiSparseTokenAllocator``: int64 [logical ids + 1], last element -1."""
        self.full_to_hisparse_device_index_mapping = mapping

    def _mapping(self) -> torch.Tensor:
        mapping = self.full_to_hisparse_device_index_mapping
        if mapping is None:
            raise ValueError(
                "HiSparseDSAPool: no mapping registered; construct HiSparseTokenAllocator with this pool as kvcache."
            )
        return mapping

    def translate_loc_to_hisparse_device(self, loc: torch.Tensor) -> torch.Tensor:
        """Device rows of logical ``loc`` (any shape); negative entries (padding) pass through."""
        return translate_locations(self._mapping(), loc)

    def _layer_rows(self, loc: torch.Tensor, layer: Any, layer_id_override: int | None = None) -> torch.Tensor:
        """``translate_loc_to_hisparse_device(loc)`` for one layer's KV access, computed once
        per forward (``memory.translation.ForwardTranslation``, its NOTE has the rules)."""
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        return self._per_forward(self._mapping(), loc, layer_id)

    # SGLang's other spellings of the same translation
    _translate_loc_to_hisparse_device = translate_loc_to_hisparse_device
    translate_loc_from_full_to_hisparse_device = translate_loc_to_hisparse_device

    def translate_loc_from_full_to_compressed(self, loc: torch.Tensor) -> torch.Tensor:
        return loc  # DSA has no compressed layers: compression ratio 1

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, layer_id_override=None):
        loc, _, _ = unwrap_write_loc(loc_info)
        super().set_kv_buffer(
            layer, self._layer_rows(loc, layer, layer_id_override), cache_k, cache_v,
            layer_id_override,
        )

    def set_mla_kv_buffer(
        self, layer, loc_info, cache_k_nope, cache_k_rope, layer_id_override=None
    ):
        loc, _, _ = unwrap_write_loc(loc_info)
        super().set_mla_kv_buffer(
            layer,
            self._layer_rows(loc, layer, layer_id_override),
            cache_k_nope,
            cache_k_rope,
            layer_id_override,
        )

    def get_mla_kv_buffer(self, layer, loc, dst_dtype=None):
        return super().get_mla_kv_buffer(layer, self._layer_rows(loc, layer), dst_dtype)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Speculative accept: KV moves between the translated device rows, indexer keys
        between the logical locations."""
        MLATokenToKVPool.move_kv_cache(
            self,
            self.translate_loc_to_hisparse_device(tgt_loc),
            self.translate_loc_to_hisparse_device(src_loc),
        )
        self.index_key_cache.move(tgt_loc, src_loc)

    def transfer_values_on_device(
        self, dst_indices: torch.Tensor, src_indices: torch.Tensor
    ) -> None:
        """Copy device rows ``src`` → ``dst`` in every layer (physical rows, no translation)."""
        if src_indices.numel() == 0:
            return
        for buf in self.kv_buffer:
            buf[dst_indices] = buf[src_indices]



class HiSparseTokenAllocator(BaseTokenToKVPoolAllocator):
    """SGLang's token allocator interface over ``DualSpaceAllocator`` (``self.core``).

    Constructor: exactly the arguments of ``kv_cache_configurator._build_token_to_kv_pool_allocator``
    (``size`` = device rows). ``size`` / ``size_full`` report logical capacity, which is what
    the scheduler admits against; ``available_size`` is the smaller of the two spaces.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
        kvcache: Any,
        need_sort: bool,
        host_to_device_ratio: int = 2,
    ):
        # NOTE: BaseTokenToKVPoolAllocator.__init__ assigns ``self.size``, which is a
        # read-only property here (logical capacity), so the base attributes are set by hand.
        self.page_size, self.dtype, self.device = page_size, dtype, device
        self._kvcache, self.need_sort = kvcache, need_sort
        self.free_pages = None
        self.release_pages = None
        self.free_group = None
        self.compress_ratio = 1
        self.core = DualSpaceAllocator(
            size, host_to_device_ratio=host_to_device_ratio, page_size=page_size, device=device
        )
        self._spec_scratch = 0
        self._spec_buffer = 0
        self._hot_size = 0  # B, set by the coordinator (configure_hot_buffer); 0 = not yet built
        kvcache.register_mapping(self.core.mapping)

    # ---- what SGLang's scheduler / PD decode read ----------------------------------------
    @property
    def size(self) -> int:
        return self.core.size_full

    @property
    def size_full(self) -> int:
        return self.core.size_full

    @property
    def logical_attn_allocator(self):
        return self.core.logical

    @property
    def hisparse_attn_allocator(self):
        return self.core.rows

    @property
    def hisparse_page_size(self) -> int:
        return self.page_size

    @property
    def hisparse_kvcache(self):
        return self._kvcache

    @property
    def full_to_hisparse_device_index_mapping(self) -> torch.Tensor:
        return self.core.mapping

    def available_size(self) -> int:
        return self.core.available_size()

    def debug_print(self) -> str:
        c = self.core
        return (
            f"#logical available: {c.logical.available_size()}/{c.size_full}, "
            f"#device available: {c.rows.available_size()}/{c.size_device}, hot buffers: {len(c.hot.request_slots())}"
        )

    def check_integrity(self) -> None:
        self.core.check_integrity()

    # ---- allocation ----------------------------------------------------------------------
    def alloc(self, need_size: int):
        return self.core.alloc(need_size)

    def alloc_extend(
        self,
        prefix_lens,
        prefix_lens_cpu,
        seq_lens,
        seq_lens_cpu,
        last_loc,
        extend_num_tokens,
        *args,
        **kwargs,
    ):
        return self.core.alloc_extend(prefix_lens_cpu, seq_lens_cpu, last_loc)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc, *args, **kwargs):
        return self.core.alloc_decode(seq_lens_cpu, last_loc)

    def alloc_logical_only(
        self,
        prefix_lens,
        prefix_lens_cpu,
        seq_lens,
        seq_lens_cpu,
        last_loc,
        extend_num_tokens,
        *args,
        **kwargs,
    ):
        return self.core.alloc_logical_extend(prefix_lens_cpu, seq_lens_cpu, last_loc)

    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        return last_locs

    def get_last_loc_hisparse_device(self, last_locs: torch.Tensor) -> torch.Tensor:
        return self._kvcache.translate_loc_to_hisparse_device(last_locs)

    # ---- frees: immediate, because a freed id must stop translating at once ---------------
    def free(self, free_index: torch.Tensor) -> None:
        self.core.free(free_index)

    def free_group_begin(self) -> None:
        return None

    def free_group_end(self) -> None:
        return None

    def clear(self) -> None:
        self.core.clear()

    def resize(self, config) -> None:
        raise NotImplementedError(
            "HiSparse: resizing the KV pool at runtime is unsupported (the mapping and host pool are sized once)."
        )

    def evict_to_free_tokens(self, tree_cache, num_tokens: int) -> bool | None:
        """Evict the radix tree only for a shortfall of logical ids: evicting frees ids (and
        their host rows), never device rows, which the coordinator's reclaimer provides; the
        base class would evict for ``available_size()``, the smaller of the two spaces, and
        drop cached prefixes for nothing."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return None
        shortfall = num_tokens - self.core.logical.available_size()
        if shortfall > 0:
            tree_cache.evict_for_alloc(EvictParams(num_tokens=shortfall))
        return None

    # ---- decode memory check: SGLang's retraction converges on it -----------------------
    def configure_hot_buffer(self, hot_size: int) -> None:
        """B, so that :meth:`check_decode_capacity` can count the hot-buffer growth of a step."""
        self._hot_size = int(hot_size)

    def check_decode_capacity(self, *, num_tokens: int, tree_cache, requests=None, spec_algorithm=None) -> bool:
        """Whether the next decode step fits: ``num_tokens`` logical ids, and device rows for the
        rows page-size-1 ``alloc()`` maps to the new ids (rebound the same step) plus the fresh
        pages short requests' hot buffers take as they fill their next slot.

        NOTE: SGLang's base check compares ``available_size()`` (here the smaller of the two
        spaces) with ``num_tokens`` only, so a batch of short requests could pass it and then
        find no device row to grow into (``map_last_loc`` raises); counting the growth here
        makes SGLang's ``retract_decode`` loop retract a request instead.
        """
        self.evict_to_free_tokens(tree_cache, num_tokens)
        rows = num_tokens if self.page_size == 1 else 0
        if requests and self._hot_size:
            # SGLang 0.5.23 keeps the request slot in ``Req.kv`` (``ReqKvInfo.req_pool_idx``)
            slots = [int(r.kv.req_pool_idx) for r in requests if r.kv.req_pool_idx is not None]
            rows += self.core.hot.rows_to_grow(slots, self._hot_size)
        # resident requests' cold rows count: the coordinator shrinks them before the step grows
        return self.core.logical.available_size() >= num_tokens and self.core.available_rows() >= rows

    # ---- speculative decoding reserve ----------------------------------------------------
    def configure_spec_scratch(self, capacity: int, *, device_buffer_size: int = 0) -> None:
        """Per-request device rows speculative decoding needs beyond the prompt's rows."""
        for name, v in (("capacity", capacity), ("device_buffer_size", device_buffer_size)):
            if v < 0 or v % self.page_size:
                raise ValueError(
                    f"configure_spec_scratch: {name} = {v} must be a non-negative multiple of page_size = {self.page_size}."
                )
        self._spec_scratch = capacity
        self._spec_buffer = device_buffer_size if capacity else 0

    def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int = 0) -> int:
        # The hot buffer reuses the prompt's device rows, so only rows the prompt does not
        # cover are extra; scratch is charged once, when the request gets its slot.
        prompt_rows = -(-prefill_tokens // self.page_size) * self.page_size
        return max(self._spec_buffer - prompt_rows, 0) + (
            0 if has_req_pool_slot else self._spec_scratch
        )
