"""DSA models (DeepSeek-V3.2, GLM-5.x): top-k token positions over MLA rows.

SGLang builds our ``HiSparseDSAPool`` (``sglang_adapter/memory.py``; ``kv_buffer[l]`` [rows, 1,
kv_cache_dim] of its store dtype, one token a row: ``TOKEN``) and our
``HiSparseTokenAllocator``; the host pool is HiCache's ``MLATokenToKVPoolHost`` buffer
(``memory_host.build_host_pool``), which also serves PD's RDMA registration. Everything else is
the base family's: SGLang's ``top_k``, one logical id per token, ``swap_in_selected_pages``.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_hisparse.memory.host_pool import HostKVPool
from sglang_hisparse.sglang_adapter.families.base import ModelFamily
from sglang_hisparse.sglang_adapter.memory_host import build_host_pool


class DSAFamily(ModelFamily):
    name = "dsa"
    label = "DSA"
    pools = "HiSparseDSAPool"

    @classmethod
    def detects(cls, kvcache: Any) -> bool:
        from sglang_hisparse.sglang_adapter.memory import HiSparseDSAPool

        return isinstance(kvcache, HiSparseDSAPool)

    def device_layers(self) -> tuple[list[torch.Tensor], int]:
        """``kv_buffer[l]`` as uint8 [rows, I] (I = kv_cache_dim x itemsize: 656 fp8, 1152 bf16)."""
        layers = [buf.view(torch.uint8).reshape(buf.shape[0], -1) for buf in self.pool.kv_buffer]
        return layers, int(self.pool.start_layer or 0)

    def host_pool(self, *, ratio: int, page_size: int, max_requests: int, max_context: int,
                  device: str | torch.device, pd_decode: bool = False, pin_memory: bool | None = None,
                  ranks_per_host: int | None = None) -> HostKVPool:
        """HiCache's buffer of ``pool.size x ratio`` token rows, co-located and PD alike."""
        return build_host_pool(self.pool, ratio=ratio, page_size=page_size, max_requests=max_requests,
                               max_context=max_context, device=device, pin_memory=pin_memory,
                               ranks_per_host=ranks_per_host)
