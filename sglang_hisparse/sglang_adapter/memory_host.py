"""Host pool adapters: the core ``HostKVPool`` over SGLang HiCache's ``MLATokenToKVPoolHost``
buffer (:func:`build_host_pool`, DSA), and our own pinned pools as SGLang's PD decode reads them
(:func:`own_host_pool`, the families with their own device rows; which family builds which is
its ``ModelFamily.host_pool``, ``sglang_adapter/families``).

HiCache allocates and pins the layer-first buffer and knows how PD registers it for RDMA
(``get_contiguous_buf_infos``); per-request row allocation is the core's, so the coordinator
and the tests see one host-pool interface whether SGLang is present or not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sglang_hisparse.kernels.row_layout import RowLayout
from sglang_hisparse.memory.budget import available_host_bytes, check_host_budget, ranks_per_host
from sglang_hisparse.memory.host_pool import HostKVPool, host_pool_bytes

__all__ = ["C4HostPool", "HiCacheHostPool", "MHAHostPool", "build_host_pool", "own_host_pool", "server_ranks_per_host"]


def server_ranks_per_host() -> int:
    """Ranks of this server on this machine (``budget.ranks_per_host``), from the parallel
    config SGLang publishes in every scheduler process (``runtime_context.get_parallel()``:
    ``dp_size`` counts replicas, attention DP lives inside ``tp_size``). 1 when nothing is
    published, i.e. outside a server (unit tests build the coordinator directly)."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    try:
        tp, pp, nnodes, dp = int(p.tp_size), int(p.pp_size), int(p.nnodes), int(p.dp_size)
    except ValueError:  # SGLang: "config namespace 'parallel' not published"
        return 1
    return ranks_per_host(tp_size=tp, pp_size=pp, nnodes=nnodes, dp_replicas=dp)


def _agreed_budget(per_rank_bytes: int) -> tuple[int, int]:
    """(largest pool of any rank, smallest free host memory any rank measured), agreed over
    SGLang's world group before any rank allocates.

    NOTE: an all_reduce rather than each rank measuring on its own: a rank that measured
    after a neighbour pinned would find that pool missing from MemAvailable and refuse a
    machine that fits (or, comparing its own pool alone, the machine would be overcommitted).
    The all_reduce returns only once every rank has measured, and nobody allocates before it,
    so all ranks check the same figures and refuse together. It runs on the world group's
    gloo (CPU) side: no GPU work at construction.
    """
    avail = available_host_bytes()
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return per_rank_bytes, avail
    from sglang.srt.distributed.parallel_state import get_world_group

    group = get_world_group().cpu_group
    figures = torch.tensor([-per_rank_bytes, avail], dtype=torch.int64)
    dist.all_reduce(figures, op=dist.ReduceOp.MIN, group=group)
    return -int(figures[0]), int(figures[1])


class _PDHostRows:
    """PD decode's ``alloc_paged_token_slots`` over a :class:`HostKVPool` whose host row of a
    logical id is the id: the rows are the ids ``logical_source()`` names (the allocator's
    latest logical-only allocation, which ``alloc_for_decode_prealloc_hisparse`` made just
    before), bound as the request's host rows."""

    #: () -> int64 ids of the latest logical-only allocation (set by the coordinator)
    logical_source: Any = None

    def alloc_paged_token_slots(
        self,
        req_to_host_pool: torch.Tensor,
        req_to_host_pool_allocated_len: torch.Tensor | None,
        req_pool_idx: int,
        start_pos: int,
        num_tokens: int,
    ) -> torch.Tensor:
        """PD decode: host rows (int64 [num_tokens], on ``req_to_host_pool``'s device) of
        positions ``start_pos..start_pos+num_tokens-1``: the logical ids SGLang's
        ``alloc_for_decode_prealloc_hisparse`` just took for them (``alloc_logical_only``,
        decode.py:2424; they reach ``req_to_token`` only after this call, :2371), bound as
        the request's host rows. No host sync, nothing allocated."""
        end = start_pos + num_tokens
        if num_tokens > 0:
            ids = self.logical_source() if self.logical_source is not None else None
            if ids is None or ids.numel() != num_tokens:
                raise RuntimeError(
                    f"alloc_paged_token_slots: request slot {req_pool_idx} asks for {num_tokens} host "
                    f"rows, but the latest logical-only allocation holds "
                    f"{'none' if ids is None else ids.numel()} ids. The host row of a logical id is "
                    f"the id, so PD decode must allocate the request's logical ids "
                    f"(alloc_logical_only) right before this call."
                )
            self.bind(req_pool_idx, start_pos, ids)
        if req_to_host_pool is not self.host_rows:
            n = self.allocated_len(req_pool_idx)
            req_to_host_pool[req_pool_idx, :n] = self.host_rows[req_pool_idx, :n].to(
                req_to_host_pool.device
            )
        if req_to_host_pool_allocated_len is not None and req_to_host_pool_allocated_len is not self.allocated_lens:
            # a caller's own length table (ours is kept by ensure already)
            req_to_host_pool_allocated_len[req_pool_idx] = self.allocated_len(req_pool_idx)
        return req_to_host_pool[req_pool_idx, start_pos:end]


class HiCacheHostPool(_PDHostRows, HostKVPool):
    """Core host pool over the buffer of SGLang's HiCache ``MLATokenToKVPoolHost``.

    HiCache provides the storage, its pinning and the PD registration info
    (``get_contiguous_buf_infos``); rows are addressed by logical id (``HostKVPool``).
    ``logical_source``: () -> the allocator's latest logical-only ids (set by the
    coordinator), which PD decode's ``alloc_paged_token_slots`` binds.
    """

    def __init__(
        self,
        hicache: Any,
        *,
        max_requests: int,
        max_context: int,
        device: str | torch.device,
        capacity_tokens: int,
    ):
        buf = hicache.kv_buffer
        storage = buf.view(torch.uint8).reshape(buf.shape[0], buf.shape[1], -1)
        super().__init__(
            num_layers=storage.shape[0],
            item_bytes=storage.shape[2],
            capacity_tokens=capacity_tokens,
            page_size=hicache.page_size,
            max_requests=max_requests,
            max_context=max_context,
            device=device,
            storage=storage,
        )
        self.hicache = hicache
        self.logical_source = None

    @property
    def layer_num(self) -> int:
        return self.hicache.layer_num

    @property
    def kv_buffer(self) -> torch.Tensor:
        return self.kv

    def get_contiguous_buf_infos(self):
        return self.hicache.get_contiguous_buf_infos()

    def destroy(self) -> None:
        super().destroy()
        self.hicache.destroy()


class _OwnHostPool(_PDHostRows, HostKVPool):
    """Our own pinned pool as SGLang's PD decode reads a host pool (``layer_num``, ``kv_buffer``;
    each layout's ``get_contiguous_buf_infos``)."""

    @property
    def layer_num(self) -> int:
        return self.num_layers

    @property
    def kv_buffer(self) -> torch.Tensor:
        return self.kv


class C4HostPool(_OwnHostPool):
    """DeepSeek-V4's host pool: every C4 layer's entries in FlashMLA's 37,440-byte pages
    (``kernels.row_layout.C4_PAGED_HOST``), the host row of a compressed logical id the id. PD
    decode registers each layer's pages as the C4 destination (``get_contiguous_buf_infos``:
    the first ``layer_num`` transfer buffers, one item a page, decode.py:621-645) and sends the
    host page of each 64 compressed slots ``alloc_paged_token_slots`` returns (slot // 64, which
    is the request's compressed page: compressed ids are page-aligned, docs/v4-m3.md D6/D7)."""

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        layers = [self.kv[li] for li in range(self.num_layers)]
        return ([t.data_ptr() for t in layers], [t.nbytes for t in layers],
                [self.layout.page_bytes] * self.num_layers)


class MHAHostPool(_OwnHostPool):
    """MiniMax-M3's host pool: every sparse layer's K and V halves in separate arrays
    (``kernels.row_layout.KV_SPLIT_HOST``; a layer is uint8 [2H, I/2], K rows then V rows), the
    host row of a logical id the id. PD decode registers every sparse layer's K, then every
    one's V, one item per page of tokens (``get_contiguous_buf_infos``, as SGLang's M3 host pool
    and the prefill's ``get_sparse_kv_buf_infos`` pair them) and sends the page of each
    ``page_size`` slots."""

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        half = self.kv.shape[2]
        k = [(self.kv[li].data_ptr(), self.total_rows * half) for li in range(self.num_layers)]
        v = [(ptr + self.total_rows * half, n) for ptr, n in k]
        return ([p for p, _ in k + v], [n for _, n in k + v], [half * self.page_size] * (2 * self.num_layers))


def build_host_pool(
    device_pool: Any,
    *,
    ratio: int,
    page_size: int,
    max_requests: int,
    max_context: int,
    device: str | torch.device,
    pin_memory: bool | None = None,
    ranks_per_host: int | None = None,
) -> HiCacheHostPool:
    """Host pool for ``device_pool`` (a ``HiSparseDSAPool``): ``device_pool.size * ratio`` rows.

    Our budget check runs before HiCache allocates and pins: the pools of all
    ``ranks_per_host`` ranks on this machine (default: ``server_ranks_per_host()``) against its
    free host memory, with figures agreed across ranks (``_agreed_budget``); the error gives
    both in GiB and the fixes.
    """
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    capacity = device_pool.size * ratio
    item_bytes = device_pool.kv_cache_dim * device_pool.store_dtype.itemsize
    per_rank = host_pool_bytes(
        num_layers=device_pool.layer_num,
        item_bytes=item_bytes,
        capacity_tokens=capacity,
        page_size=page_size,
    )
    need, avail = _agreed_budget(per_rank)
    check_host_budget(
        need,
        what=f"The HiSparse host KV pool ({device_pool.layer_num} layers x {capacity} rows x {item_bytes} B)",
        ranks_per_host=server_ranks_per_host() if ranks_per_host is None else ranks_per_host,
        available_bytes=avail,
        ratio=ratio,
    )
    hicache = MLATokenToKVPoolHost(
        buffer_info=device_pool.get_device_pool_infos()[0].buffer_info,
        device_capacity_tokens=device_pool.size,
        start_layer=device_pool.start_layer,
        end_layer=device_pool.end_layer,
        target_layer_num=device_pool.layer_num,
        host_to_device_ratio=ratio,
        host_size=0,
        page_size=page_size,
        layout="layer_first",
        override_kv_cache_dim=device_pool.kv_cache_dim,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
    )
    return HiCacheHostPool(
        hicache,
        max_requests=max_requests,
        max_context=max_context,
        device=device,
        capacity_tokens=capacity,
    )


def own_host_pool(
    device_pool: Any, *, layout: RowLayout, capacity: int, page_size: int, max_requests: int, max_context: int,
    device: str | torch.device, pin_memory: bool | None = None, ranks_per_host: int | None = None,
) -> HostKVPool:
    """Our own pinned pool of ``capacity`` rows of ``device_pool.row_bytes`` per layer in
    ``layout``, no HiCache buffer (the families whose device rows are their own:
    ``HiSparseMHAPool``, ``HiSparseC4Pool``). As SGLang's PD decode reads it, by layout:
    ``C4_PAGED_HOST`` a :class:`C4HostPool`, ``KV_SPLIT_HOST`` an :class:`MHAHostPool`, token
    rows the plain core pool. The budget (``HostKVPool``'s check, with the free memory agreed
    across ranks) runs before anything is allocated or pinned."""
    item = device_pool.row_bytes
    _, avail = _agreed_budget(host_pool_bytes(
        num_layers=device_pool.layer_num, item_bytes=item, capacity_tokens=capacity, page_size=page_size,
        layout=layout,
    ))
    ranks = server_ranks_per_host() if ranks_per_host is None else ranks_per_host
    cls = C4HostPool if layout.host_paged else MHAHostPool if layout.host_split else HostKVPool
    return cls(
        num_layers=device_pool.layer_num, item_bytes=item, capacity_tokens=capacity,
        page_size=page_size, max_requests=max_requests, max_context=max_context, device=device,
        pin=torch.cuda.is_available() if pin_memory is None else pin_memory,
        available_bytes=avail, ranks_per_host=ranks, layout=layout,
    )
