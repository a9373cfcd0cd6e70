"""MiniMax-M3: block top-k over the sparse layers' MHA K/V (docs/v4-m3.md).

SGLang builds its own ``MiniMaxSparseKVPool`` whose main pool is ours, ``HiSparseMHAPool``
(``sglang_adapter/memory_m3.py``: the sparse layers' K then V of a token in one device row);
the dense layers' and the index pools stay on the device and never go through HiSparse. The
allocator is our ``HiSparseTokenAllocator``, one logical id per token. Decode calls
``swap_in_selected_blocks`` with block ids, which the core expands to their tokens.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from sglang_hisparse.kernels.row_layout import KV_SPLIT_HOST, TOKEN
from sglang_hisparse.memory.host_pool import HostKVPool
from sglang_hisparse.sglang_adapter.families.base import ModelFamily, Selection, require_ours
from sglang_hisparse.sglang_adapter.memory_host import own_host_pool

if TYPE_CHECKING:
    from sglang_hisparse.coordinator.core import HiSparseCore

logger = logging.getLogger("sglang_hisparse")


class M3Family(ModelFamily):
    name = "m3"
    label = "MiniMax-M3"
    pools = "MiniMaxSparseKVPool over HiSparseMHAPool"
    selection = Selection.BLOCKS

    @classmethod
    def detects(cls, kvcache: Any) -> bool:
        from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

        return isinstance(kvcache, MiniMaxSparseKVPool)

    def hisparse_pool(self, kvcache: Any) -> Any:
        """``MiniMaxSparseKVPool.main_pool``: the sparse layers' K/V, which must be ours."""
        from sglang_hisparse.sglang_adapter.memory_m3 import HiSparseMHAPool

        return require_ours(kvcache.main_pool, HiSparseMHAPool, "MiniMax-M3 main pool")

    def device_layers(self) -> tuple[list[torch.Tensor], int]:
        """``device_rows()``: per sparse layer uint8 [rows, 2 x head_dim x itemsize], K then V;
        the first sparse layer's model id (SGLang addresses them as layer_id - first)."""
        return self.pool.device_rows(), int(self.pool.start_layer)

    def core_top_k(self, top_k: int) -> int:
        """The served model's selection width, as the server's resolved config holds it
        (``arg_scope.selection_width``: its top-k blocks plus the forced init/local ones, times
        the block size; SGLang passes that config's ``top_k``, as M3 has no ``index_topk``);
        ``top_k`` unchanged when no server config is published (unit tests build the
        coordinator directly)."""
        from sglang_hisparse.sglang_adapter.arg_hook import server_config

        cfg = server_config()
        if cfg is None:
            return top_k
        logger.info("HiSparse (sglang-hisparse): MiniMax-M3 selects up to %d tokens a step (its "
                    "top-k blocks with the forced init and local ones)", cfg.top_k)
        return cfg.top_k

    def host_pool(self, *, ratio: int, page_size: int, max_requests: int, max_context: int,
                  device: str | torch.device, pd_decode: bool = False, pin_memory: bool | None = None,
                  ranks_per_host: int | None = None) -> HostKVPool:
        """Our own pinned pool of ``pool.size x ratio`` rows per sparse layer: whole K-then-V
        rows co-located; as a PD decode server K and V apart (``KV_SPLIT_HOST``, an
        ``MHAHostPool``: the arrays SGLang's transfer writes, docs/v4-m3.md D7).

        NOTE: split only where PD needs it: its reads cost up to 1.8x the resolve at batch 64
        (benchmarks/RESOLVE.md "Host rows split"), so co-located M3 keeps whole rows."""
        return own_host_pool(
            self.pool, layout=KV_SPLIT_HOST if pd_decode else TOKEN, capacity=self.pool.size * ratio,
            page_size=page_size, max_requests=max_requests, max_context=max_context, device=device,
            pin_memory=pin_memory, ranks_per_host=ranks_per_host,
        )

    def swap_in_blocks(self, core: HiSparseCore, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       top_k_blocks: torch.Tensor, layer_id: int, block_size: int) -> torch.Tensor:
        """int32 block ids [bs, n_blocks] (-1 = none; the indexer's top-k blocks with the forced
        init/local ones) and token ``seq_lens`` -> int32 device rows [bs, n_blocks x block],
        each block expanded to its positions, -1 past ``seq_len``."""
        return core.swap_in_blocks(req_pool_indices, seq_lens, top_k_blocks, layer_id, int(block_size))
