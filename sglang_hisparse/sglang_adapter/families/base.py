"""``ModelFamily``: what one model family contributes to the SGLang coordinator.

A family is found once, from the pool SGLang built (``families.detect_family``), and then
answers every question on which the families differ, so the coordinator asks the family and
never its type:

| question | base answer (a token-granular family) | who differs |
|---|---|---|
| :meth:`detects`: is ``kvcache`` this family's pool? | (each family's own) | |
| :attr:`pool`: the pool whose rows go through HiSparse | ``kvcache`` itself | M3: its main pool; V4: its C4 pool |
| :meth:`device_layers`: per-layer device rows, first layer id | (each family's own) | |
| :meth:`core_top_k`: positions the core resolves per layer and step | SGLang's ``top_k`` | M3: its merged blocks x block size |
| :meth:`host_pool`: the pinned host pool and its row layout | HiCache's buffer, token rows | M3: our pool (PD: K/V apart); V4: C4 pages |
| :attr:`compress_ratio`: tokens per core logical id | 1 | V4: 4 |
| :attr:`rows_hold_core_ids`: ``req_to_token`` rows are the core's ids | True | V4: token locations, the core's ids are compressed |
| :meth:`core_ids`: the core's ids of a row's token locations | the row | V4: the compressed ids of completed groups |
| :meth:`latest_prealloc_ids`: the ids PD decode's host rows bind | the latest logical-only allocation | V4: its compressed ids |
| :meth:`index_buffer`: where the indexer writes its selection | none (passed to the call) | V4: ``raw_indices_buffer`` |
| :meth:`map_last_loc`: a decode step's new token into the core | every request gains a token | V4: a C4 entry every 4 tokens |
| :meth:`swap_in_blocks`: SGLang's block-selection call | refused | M3: served |

Validation-time rules (which models and serving paths a family is served with) run before any
pool exists, keyed by the model config, and stay in ``arg_scope``; the pool classes SGLang
constructs stay the plugin's REPLACE targets in ``sglang_adapter/memory*.py``.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from sglang_hisparse.memory.allocator import DualSpaceAllocator

if TYPE_CHECKING:
    from sglang_hisparse.coordinator.core import HiSparseCore
    from sglang_hisparse.memory.host_pool import HostKVPool


class Selection(Enum):
    """What a family's indexer selects per layer and decode step (the value names it in messages)."""

    TOKENS = "token positions"
    C4_ENTRIES = "compressed positions (C4 entries, one per 4 tokens)"
    BLOCKS = "blocks of tokens"


def dual_allocator(allocator: Any) -> DualSpaceAllocator:
    """The ``DualSpaceAllocator`` behind SGLang's ``token_to_kv_pool_allocator``.

    Under the plugin, SGLang builds our ``HiSparseTokenAllocator`` (DSA, M3) or
    ``HiSparseV4Allocator``, whose core is ``.core``; anything else means SGLang built its own
    allocator (the plugin's hooks did not run).
    """
    core = getattr(allocator, "core", None)
    if not isinstance(core, DualSpaceAllocator):
        raise ValueError(
            f"SGLangHiSparseCoordinator: token_to_kv_pool_allocator ({type(allocator).__name__}) "
            f"is not sglang-hisparse's HiSparseTokenAllocator. Launch with the sglang-hisparse "
            f"plugin installed so SGLang builds our allocator and pools."
        )
    return core


def require_ours(pool: Any, cls: type, what: str) -> Any:
    """``pool`` when it is our ``cls`` (the plugin's REPLACE target SGLang built); raises
    otherwise, naming ``what`` the pool is."""
    if not isinstance(pool, cls):
        raise ValueError(
            f"SGLangHiSparseCoordinator: the {what} ({type(pool).__name__}) is not "
            f"sglang-hisparse's {cls.__name__}; launch with the sglang-hisparse plugin installed."
        )
    return pool


class ModelFamily:
    """One model family as served: SGLang's allocator (:attr:`allocator`, its core
    :attr:`dual`) and the pool whose rows go through HiSparse (:attr:`pool`). Built by
    ``families.detect_family`` for the family whose :meth:`detects` holds."""

    #: short name (logs, tests)
    name: ClassVar[str]
    #: the model family in messages
    label: ClassVar[str]
    #: the pool classes a served pool is made of, in messages
    pools: ClassVar[str]
    selection: ClassVar[Selection] = Selection.TOKENS
    #: tokens per core logical id (a core logical id's host row is the id)
    compress_ratio: int = 1
    #: ``req_to_token`` rows hold the core's logical ids themselves (so the radix tree's ids
    #: are host rows, and a finished request's row is what the tree may keep)
    rows_hold_core_ids: ClassVar[bool] = True

    def __init__(self, kvcache: Any, allocator: Any, dual: DualSpaceAllocator) -> None:
        self.allocator, self.dual = allocator, dual
        self.pool = self.hisparse_pool(kvcache)

    @classmethod
    def detects(cls, kvcache: Any) -> bool:
        """``kvcache`` (``allocator.get_kvcache()``) is the pool SGLang builds for this family."""
        raise NotImplementedError

    def hisparse_pool(self, kvcache: Any) -> Any:
        """The pool whose rows go through HiSparse; the rest of ``kvcache`` stays on the device."""
        return kvcache

    def device_layers(self) -> tuple[list[torch.Tensor], int]:
        """Per-layer device KV as uint8 views (the core's ``device_kv``), and the model layer id
        of the first (SGLang passes model layer ids to ``swap_in_*``)."""
        raise NotImplementedError

    def core_top_k(self, top_k: int) -> int:
        """The positions the core resolves per layer and step, from the ``top_k`` SGLang passes."""
        return top_k

    def host_pool(self, *, ratio: int, page_size: int, max_requests: int, max_context: int,
                  device: str | torch.device, pd_decode: bool = False, pin_memory: bool | None = None,
                  ranks_per_host: int | None = None) -> HostKVPool:
        """The pinned host pool, one row per core logical id (``max_context``: host rows per
        request slot; ``pd_decode``: this server is a PD decode instance, whose host pool is
        SGLang's transfer destination). Its ``layout`` is the core's row layout."""
        raise NotImplementedError

    def index_buffer(self, num_reqs: int, top_k: int, device: str | torch.device) -> torch.Tensor | None:
        """A buffer SGLang's indexer writes its selection into before ``swap_in``, or None
        where the selection is passed to the call."""
        return None

    def core_ids(self, row: torch.Tensor) -> torch.Tensor:
        """The core's logical ids for a request's token locations ``row``."""
        return row

    def latest_prealloc_ids(self) -> torch.Tensor | None:
        """The core ids of the allocator's latest logical-only allocation (PD decode's prealloc),
        which the host pool's ``alloc_paged_token_slots`` binds as the request's host rows."""
        return self.dual.last_logical_extend

    def map_last_loc(self, core: HiSparseCore, *, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     req_pool_indices_cpu: torch.Tensor) -> None:
        """A decode step's new token of every request, after ``seq_lens += 1``: its logical id
        ``out_cache_loc`` into the newest slot. With page_size 1 ``out_cache_loc`` is what
        ``allocator.alloc(bs)`` just returned, whose CPU copy the allocator kept: the rows
        ``alloc`` mapped go back without reading the ids from the GPU. No host sync."""
        core.map_last_loc(
            req_index=req_pool_indices, seq_lens=seq_lens, new_logical=out_cache_loc,
            req_index_cpu=[int(x) for x in req_pool_indices_cpu.tolist()],
            seq_lens_cpu=[int(x) for x in seq_lens_cpu.tolist()],
            new_logical_cpu=self.dual.cpu_ids_of(out_cache_loc),
        )

    def swap_in_blocks(self, core: HiSparseCore, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       top_k_blocks: torch.Tensor, layer_id: int, block_size: int) -> torch.Tensor:
        """SGLang's ``swap_in_selected_blocks``, served by the families that select blocks."""
        raise ValueError(
            f"swap_in_selected_blocks is MiniMax-M3's call, but this coordinator serves a {self.label} "
            f"pool ({type(self.pool).__name__}), which selects {self.selection.value}; DSA backends call "
            f"swap_in_selected_pages."
        )
