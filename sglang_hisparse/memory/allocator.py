"""Dual address space: logical ids (what SGLang schedules) over a smaller set of device rows.

::

    logical ids (req_to_token holds these; capacity = host_to_device_ratio * device rows)
      0 | 1 2 3 4 5 6 7 8 9 ... size_full              (page 0 reserved; + trailing sentinel)
            │   │       │
            ▼   ▼       ▼        mapping: int64 [logical total_ids + 1] on the pool's device
      0 | 1 2 3 4 ... size_device
    device rows (real HBM KV rows; row 0 = padding row, never handed out)

``DualSpaceAllocator`` is the facade SGLang's allocator interface and the coordinator call.
It holds the two id spaces (``logical``, ``rows``: ``memory.paged.PagedIdAllocator``) and
composes one part per job, each handed what it touches when it is built::

    DualSpaceAllocator ── SGLang-shaped allocation (alloc, alloc_extend, free, rebind, ...)
     ├─ address_map  AddressMap    logical id -> device row table (memory/address_map.py)
     ├─ prefill      PrefillRows   rows a prefill owns until the handover (memory/prefill_rows.py)
     ├─ share        PrefixShare   readers of shared prefix pages, cached pages (memory/prefix_share.py)
     ├─ handover     Handover      prefill rows -> hot / resident buffer (memory/handover.py)
     └─ hot          HotBuffers    device pages each request's buffer owns (memory/hot.py)

A used device page is owned by prefill rows or by a hot buffer, never both. The coordinator
maps the newest token into its slot's row with ``map_tokens`` / ``rebind``; such mappings
never free anything, and releasing the buffer unmaps whatever points there.

Everything is query-then-mutate: allocation returns None with nothing changed when either
space is short (after making room: cached prefix pages first, then the reclaimer's resident
rows); bad frees raise ``ValueError`` before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

import torch

from sglang_hisparse.memory.address_map import AddressMap
from sglang_hisparse.memory.handover import Handover
from sglang_hisparse.memory.hot import UNMAPPED, HotBuffers
from sglang_hisparse.memory.paged import PagedIdAllocator, _as_cpu_int64, ceil_div
from sglang_hisparse.memory.prefill_rows import PrefillRows
from sglang_hisparse.memory.prefix_share import PrefixShare

__all__ = ["UNMAPPED", "DualSpaceAllocator", "PagedIdAllocator", "Reclaimer", "ceil_div"]

P = ParamSpec("P")
R = TypeVar("R")


class Reclaimer(Protocol):
    """Who can free device rows on demand (the coordinator's residency policy)."""

    def reclaimable_rows(self) -> int: ...

    def reclaim(self, rows: int) -> int: ...


class _Part(Generic[P, R]):
    """A facade method that is the same-named method of one part: ``allocator.hold(...)`` is
    ``allocator.share.hold(...)``, bound when looked up (so it follows the part ``clear``
    builds). On the class it is the part's function, with its signature and docstring.

    NOTE: rejected, one wrapper method per forwarded call: each of the nineteen would repeat
    its part's signature and docstring, two copies to keep in step."""

    def __init__(self, part: str, method: Callable[Concatenate[Any, P], R]) -> None:
        self.part, self.method = part, method

    @overload
    def __get__(self, obj: None, owner: type) -> Callable[Concatenate[Any, P], R]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> Callable[..., R]:
        if obj is None:
            return self.method
        return getattr(getattr(obj, self.part), self.method.__name__)


class DualSpaceAllocator:
    """Logical-id allocator + device-row allocator + the parts that own the rows between them.

    device_rows:          usable device KV rows (SGLang's ``max_total_num_tokens``)
    host_to_device_ratio: logical capacity = ratio * device_rows
    page_size:            ids per page, shared by both spaces (in-page offsets agree)
    device:               where ``mapping`` and returned ids live
    logical_capacity:     logical ids if not ``ratio * device_rows`` (at most that; a caller
                          whose host pool holds fewer rows, since a logical id's host row is the id)
    """

    def __init__(
        self,
        device_rows: int,
        *,
        host_to_device_ratio: int,
        page_size: int = 1,
        device: str | torch.device = "cpu",
        logical_capacity: int | None = None,
    ):
        if host_to_device_ratio < 1:
            raise ValueError(
                f"host_to_device_ratio = {host_to_device_ratio} must be >= 1; use 1 (no oversubscription) or more."
            )
        self.page_size = page_size
        self.host_to_device_ratio = host_to_device_ratio
        self.device = torch.device(device)
        full = device_rows * host_to_device_ratio
        if logical_capacity is not None and not device_rows <= logical_capacity <= full:
            raise ValueError(
                f"logical_capacity = {logical_capacity} must lie in device_rows..ratio x device_rows "
                f"({device_rows}..{full})."
            )
        self.logical = PagedIdAllocator(
            full if logical_capacity is None else logical_capacity, page_size, device=device,
            name="logical ids",
        )
        self.rows = PagedIdAllocator(device_rows, page_size, device=device, name="device rows")
        #: the logical -> device table (``mapping``); kept across ``clear``, zeroed in place
        self.address_map = AddressMap(self.logical, self.device)
        #: the latest ``alloc()``'s ids on the CPU, and the tensor it returned (``cpu_ids_of``)
        self.last_alloc_cpu: torch.Tensor | None = None
        self._last_alloc_out: torch.Tensor | None = None
        #: frees device rows held by resident requests on demand (``set_reclaimer``), or None
        self.reclaimer: Reclaimer | None = None
        self.clear()

    @property
    def mapping(self) -> torch.Tensor:
        """int64 [logical.total_ids + 1] on ``device``: device row per logical id, UNMAPPED (0)
        if none; last = -1. Assigning a view of it rebinds the address map's."""
        return self.address_map.mapping

    @mapping.setter
    def mapping(self, view: torch.Tensor) -> None:
        self.address_map.mapping = view

    # ---- capacity ------------------------------------------------------------------------
    @property
    def size_full(self) -> int:
        """Logical capacity (what SGLang's scheduler admits against)."""
        return self.logical.size

    @property
    def size_device(self) -> int:
        return self.rows.size

    def available_size(self) -> int:
        """Ids a prefill could take now: min of free logical ids and device rows, counting the
        rows resident requests would give up (a prefill that needs them shrinks them)."""
        return min(self.logical.available_size(), self.available_rows())

    def available_rows(self) -> int:
        """Free device rows plus cached prefix rows plus those the reclaimer can free
        (resident requests' cold rows)."""
        extra = self.reclaimer.reclaimable_rows() if self.reclaimer is not None else 0
        return self.rows.available_size() + self.share.cached_rows + extra

    def set_reclaimer(self, reclaimer: Reclaimer | None) -> None:
        """Let allocations that find the device rows short call ``reclaimer.reclaim(rows)``
        (the coordinator shrinks resident requests to hot buffers) before giving up."""
        self.reclaimer = reclaimer

    def _rows_for(self, pages: int) -> bool:
        """The parts' ``room``: True when ``pages`` device pages are free, after evicting cached
        prefix pages and then asking the reclaimer for what is still missing."""
        short = pages - self.rows.available_pages()
        if short > 0:
            short -= self.share.evict_cached(short * self.page_size) // self.page_size
        if short > 0 and self.reclaimer is not None:
            self.reclaimer.reclaim(short * self.page_size)
        return pages <= self.rows.available_pages()

    # ---- SGLang-shaped allocation ----------------------------------------------------------
    def clear(self) -> None:
        """Return every id and row and forget every owner: the parts start empty."""
        self.logical.clear()
        self.rows.clear()
        self.address_map.clear()
        self.last_alloc_cpu = self._last_alloc_out = None
        #: the latest ``alloc_logical_extend`` result (device), or None
        self.last_logical_extend: torch.Tensor | None = None
        self.prefill = PrefillRows(self.logical, self.rows, self.address_map)
        #: the per-request hot buffers (device pages owned by request slots)
        self.hot = HotBuffers(self.rows, self.mapping)
        self.share = PrefixShare(self.logical, self.rows, self.prefill, self.address_map, self.hot)
        self.handover = Handover(self.rows, self.prefill, self.share, self.hot, self.address_map)

    def _handed_out(self, ids: torch.Tensor | None) -> torch.Tensor | None:
        """New prefill ids (CPU) on ``device``, remembered for :meth:`cpu_ids_of`."""
        if ids is None:
            return None
        out = ids.to(self.device, non_blocking=True)
        self.last_alloc_cpu, self._last_alloc_out = ids, out
        return out

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` (page multiple) logical ids, each with a fresh prefill row; int64 [n] or None.

        SGLang uses this for page_size 1 prefill AND decode; decode tokens get moved onto
        their hot slot with ``rebind`` (which frees the row taken here).
        """
        return self._handed_out(self.prefill.alloc(n, room=self._rows_for))

    def cpu_ids_of(self, ids: torch.Tensor) -> torch.Tensor | None:
        """``last_alloc_cpu`` when ``ids`` is the latest ``alloc()``'s result, else None.

        SGLang's page_size-1 decode hands the tensor ``alloc(bs)`` returned straight to
        ``map_last_loc_to_buffer`` as ``out_cache_loc``; with its CPU copy, ``rebind`` frees the
        rows ``alloc`` took without reading the ids back. "The result" means the same memory
        (same device, address, shape and dtype; a view SGLang took of it counts): the allocator
        holds that tensor, so its address cannot be reused by another one meanwhile. No host sync.
        """
        out = self._last_alloc_out
        if out is None or ids.device != out.device or ids.dtype != out.dtype:
            return None
        if ids.shape != out.shape or ids.data_ptr() != out.data_ptr():
            return None
        return self.last_alloc_cpu

    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """Prefill: logical ids AND device rows for positions ``prefix_lens..seq_lens-1``,
        mapped (``PrefillRows.alloc_extend``). Returns logical ids int64 [extend tokens] on
        ``device`` (also :meth:`cpu_ids_of`'s), or None (nothing changed)."""
        return self._handed_out(
            self.prefill.alloc_extend(prefix_lens, seq_lens, last_loc, room=self._rows_for)
        )

    def bind_extend(self, logical_ids: torch.Tensor, prefix_lens: torch.Tensor,
                    seq_lens: torch.Tensor) -> bool:
        """Prefill with logical ids decided elsewhere (``PrefillRows.bind_extend``). False,
        nothing changed, when the device rows are short. The ids are freed with :meth:`free`
        as any others."""
        return self.prefill.bind_extend(logical_ids, prefix_lens, seq_lens, room=self._rows_for)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """Decode: one logical id per request, no device row (the coordinator maps it to its slot)."""
        return self.logical.alloc_decode(seq_lens, last_loc)

    def alloc_logical_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """PD / speculative paths: logical ids only, unmapped. Same layout as ``alloc_extend``.
        The result is kept as ``last_logical_extend``: PD decode binds its host rows to it
        (``alloc_paged_token_slots`` runs before SGLang writes the ids into ``req_to_token``)."""
        out = self.logical.alloc_extend(prefix_lens, seq_lens, last_loc)
        self.last_logical_extend = out
        return out

    def free(self, logical_ids: torch.Tensor) -> None:
        """Free logical ids (whole pages), their prefill rows, and unmap every id of those pages.

        Hot-buffer rows a freed id was mapped into are only unmapped. Raises ValueError,
        nothing changed, on a double free or foreign id. Reads ``logical_ids`` on the CPU.
        """
        ids = _as_cpu_int64(logical_ids, "logical ids to free")
        if ids.numel() == 0:
            return
        if int(ids.min()) < 0 or int(ids.max()) >= self.logical.total_ids:
            bad = ids[(ids < 0) | (ids >= self.logical.total_ids)][:8].tolist()
            raise ValueError(
                f"free: logical id(s) {bad} outside 0..{self.logical.total_ids - 1}; they are not from this allocator."
            )
        pages = self.prefill.pages_of(ids)
        log_pages = torch.unique(ids // self.page_size)
        self.logical.check_freeable(log_pages)
        self.rows.check_freeable(pages)
        self.logical.free_pages(log_pages)
        self.rows.free_pages(pages)
        self.prefill.disown(ids)
        self.share.forget_pages(log_pages)
        # NOTE: every id of the freed pages is unmapped, not only the listed ones: a freed page
        # can hold ids the caller no longer lists that still point at hot rows (a rejected
        # draft in the page of the last accepted token), and hot.release leaves unmapping to
        # this free (memory/hot.py). Proportional to the pages freed.
        self.address_map.unmap(self.logical.page_ids_to_ids(log_pages))

    def rebind(
        self,
        logical_ids: torch.Tensor,
        rows: torch.Tensor,
        *,
        logical_ids_cpu: torch.Tensor | None = None,
    ) -> None:
        """Move decode tokens onto hot-buffer rows, freeing prefill rows ``alloc()`` gave them.

        ``logical_ids_cpu`` (``cpu_ids_of(logical_ids)``) avoids reading ``logical_ids`` back
        from the device; without it, and with page_size 1, this syncs once. With larger pages
        decode and speculative ids come from ``alloc_decode`` / ``alloc_logical_extend``, hold
        no prefill row, and nothing is read.
        """
        if logical_ids_cpu is None and self.page_size == 1:
            logical_ids_cpu = logical_ids.cpu()
        if logical_ids_cpu is not None:
            self.prefill.free_rows(_as_cpu_int64(logical_ids_cpu, "logical_ids_cpu"))
        self.address_map.map_tokens(logical_ids, rows)

    def free_request(self, req_slot: int, logical_ids: torch.Tensor) -> None:
        """Everything a finished / aborted / retracted request holds: hot buffer (if any),
        logical ids, their prefill rows and all mappings."""
        if self.hot.has(req_slot):
            self.hot.release(req_slot)
        self.free(logical_ids)

    # ---- the parts' calls, under the names SGLang's adapter and the coordinator use ---------
    translate = _Part("address_map", AddressMap.translate)
    map_tokens = _Part("address_map", AddressMap.map_tokens)
    unmap = _Part("address_map", AddressMap.unmap)
    hold = _Part("share", PrefixShare.hold)
    note_computed = _Part("share", PrefixShare.note_computed)
    mark_landed = _Part("share", PrefixShare.mark_landed)
    host_pending = _Part("share", PrefixShare.host_pending)
    computed_ids = _Part("share", PrefixShare.computed_ids)
    unhold = _Part("share", PrefixShare.unhold)
    holds = _Part("share", PrefixShare.holds)
    readers = _Part("share", PrefixShare.readers)
    drop_unread = _Part("share", PrefixShare.drop_unread)
    cache_resident = _Part("share", PrefixShare.cache_resident)
    evict_cached = _Part("share", PrefixShare.evict_cached)
    protect_cached = _Part("share", PrefixShare.protect_cached)
    release_protected = _Part("share", PrefixShare.release_protected)
    shrink_to_hot_buffer = _Part("handover", Handover.shrink_to_hot_buffer)
    keep_resident = _Part("handover", Handover.keep_resident)
    adopt_staged_hot = _Part("handover", Handover.adopt_staged_hot)

    def load_prefix(
        self, logical_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``PrefixShare.load_prefix``, making room as any allocation does."""
        return self.share.load_prefix(logical_ids, room=self._rows_for)

    def take_staged_rows(
        self, req_slot: int, logical_ids: torch.Tensor, need: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``Handover.take_staged_rows``, making room as any allocation does."""
        return self.handover.take_staged_rows(req_slot, logical_ids, need, room=self._rows_for)

    @property
    def cached_rows(self) -> int:
        return self.share.cached_rows

    @property
    def cached_evicted_rows(self) -> int:
        """Device rows of cached prefix pages taken back so far (``PrefixShare.evicted_rows``)."""
        return self.share.evicted_rows

    # the share's state under the names the harness's idle checks and the radix tests read
    # (hisparse_testing/engine.py, hisparse_testing/rig_*.py, tests/unit/test_radix_harness.py)
    @property
    def _readers(self) -> torch.Tensor:
        return self.share.reader_counts

    @property
    def _held(self) -> dict[int, torch.Tensor]:
        return self.share.held_pages

    @property
    def _cached(self) -> dict[int, None]:
        return self.share.cached_pages

    # ---- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Both spaces balance, and every used device page is owned exactly once.

        Each part proves its own invariant, in this order: the spaces' free lists, the map's
        sentinel and in-use ids, the prefill rows' agreement with the mapping, the handover's
        partition of the used pages between prefill rows and hot buffers, the prefix share's
        cached pages and reader counts, the hot buffers' page owners. Syncs.
        """
        self.logical.check_integrity()
        self.rows.check_integrity()
        self.address_map.check_integrity()
        self.prefill.check_integrity()
        self.handover.check_integrity()
        self.share.check_integrity()
        self.hot.check_integrity()
