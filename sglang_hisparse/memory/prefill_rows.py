"""Prefill rows: the device rows a prefill owns through its logical ids (part of ``DualSpaceAllocator``).

A prefill runs on full device rows: every new logical id gets a device row of its own, in
the same page layout in both spaces (a chunk that continues a mid-page prefix continues the
prefix's device page too)::

    logical ids   [ 4  5  6  7 | 8  9 ]          row: int64 [logical total ids] (CPU)
                    │  │  │  │   │  │            row[id] = the device row id owns, 0 if none
    device rows   [12 13 14 15 |20 21 ]          mapping[id] = row[id] (the address map)

The ownership lasts until the request's rows are handed over to its hot or resident buffer
(``memory.handover``), dropped as a prefix nobody reads (``memory.prefix_share``) or freed
with their ids. ``row`` is the CPU copy of that ownership, so frees never read the device
mapping.

Allocation is query-then-mutate: it returns None (nothing changed) when either space is
short. The caller's ``room(pages)`` runs first when the device rows look short: it may free
some (evict cached prefix pages, shrink resident requests) and answers whether ``pages`` are
free now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sglang_hisparse.memory.hot import UNMAPPED
from sglang_hisparse.memory.paged import _as_cpu_int64

if TYPE_CHECKING:
    from sglang_hisparse.memory.address_map import AddressMap
    from sglang_hisparse.memory.paged import PagedIdAllocator

__all__ = ["PrefillRows", "Room"]

#: make room for ``pages`` device pages; True when that many are free afterwards
Room = Callable[[int], bool]


class PrefillRows:
    """Prefill ownership of device rows by logical id (see the module docstring).

    logical / rows: the two id spaces (same page size); address_map: where bound rows are
    mapped. Holds ``row`` and nothing else.
    """

    def __init__(self, logical: PagedIdAllocator, rows: PagedIdAllocator, address_map: AddressMap) -> None:
        self.logical, self.rows, self.address_map = logical, rows, address_map
        self.page_size = logical.page_size
        #: int64 [logical.total_ids] (CPU): prefill row owned through each logical id, 0 if none
        self.row = torch.zeros(logical.total_ids, dtype=torch.int64)

    # ---- ownership -------------------------------------------------------------------------
    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 [n] (CPU, a copy): the prefill row of each CPU id, 0 where it has none."""
        return self.row[ids]

    def bind(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """``ids`` (CPU int64) own ``rows`` (CPU int64), mapped."""
        self.row[ids] = rows
        self.address_map.bind(ids, rows)

    def disown(self, ids: torch.Tensor) -> None:
        """``ids`` own no row any more (their rows were handed over or freed); mappings stay."""
        self.row[ids] = UNMAPPED

    def pages_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The distinct device pages (CPU int64) of the prefill rows of CPU ``ids``."""
        rows = self.row[ids]
        return torch.unique(rows[rows > 0] // self.page_size)

    def free_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Free the device pages of ``ids``' prefill rows (whole pages) and disown the ids;
        their mappings stay. Returns the pages freed. Raises the row allocator's errors,
        nothing changed, for a page that is not in use."""
        pages = self.pages_of(ids)
        self.rows.free_pages(pages)
        self.disown(ids)
        return pages

    def owned_pages(self) -> set[int]:
        """Every device page holding some prefill row."""
        return set(torch.unique(self.row[self.row > 0] // self.page_size).tolist())

    # ---- allocation ------------------------------------------------------------------------
    def alloc(self, n: int, *, room: Room) -> torch.Tensor | None:
        """``n`` (page multiple) fresh logical ids, each with a fresh prefill row; CPU int64
        [n] or None."""
        if n < 0 or n % self.page_size:
            raise ValueError(
                f"alloc({n}): n must be a non-negative multiple of page_size = {self.page_size}."
            )
        if n // self.page_size > self.logical.available_pages() or not room(n // self.page_size):
            return None
        ids = self.logical.page_ids_to_ids(self.logical.alloc_pages(n // self.page_size))
        rows = self.rows.page_ids_to_ids(self.rows.alloc_pages(n // self.page_size))
        self.bind(ids, rows)
        return ids

    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor, *, room: Room
    ) -> torch.Tensor | None:
        """Logical ids AND prefill rows for positions ``prefix_lens..seq_lens-1``, mapped.

        Layout as ``PagedIdAllocator.alloc_extend`` in both spaces. prefix_lens / seq_lens: int
        [bs] (CPU); last_loc: int64 [bs], logical id of each request's last prefix token (-1
        if none; read on the CPU only for mid-page prefixes). Returns CPU int64 [extend
        tokens], or None (nothing changed).
        """
        need = self.logical.pages_needed_extend(prefix_lens, seq_lens)
        if need > self.logical.available_pages() or not room(need):
            return None
        p = _as_cpu_int64(prefix_lens, "prefix_lens")
        mid = (p % self.page_size != 0) & (_as_cpu_int64(seq_lens, "seq_lens") > p)
        last = _as_cpu_int64(last_loc, "last_loc") if bool(mid.any()) else torch.full_like(p, -1)
        dev_last = self._continued_rows(mid, last, "alloc_extend")
        ids = self.logical.alloc_extend_cpu(p, seq_lens, last)
        rows = self.rows.alloc_extend_cpu(p, seq_lens, dev_last)
        self.bind(ids, rows)
        return ids

    def bind_extend(self, logical_ids: torch.Tensor, prefix_lens: torch.Tensor,
                    seq_lens: torch.Tensor, *, room: Room) -> bool:
        """Prefill rows for logical ids decided elsewhere (DeepSeek-V4: a C4 entry's compressed
        id is implied by SGLang's full-token page, docs/v4-m3.md D6), mapped.

        logical_ids: int64 [extend entries], CPU, request by request, each request's positions
        ``prefix_lens .. seq_lens - 1`` in ``alloc_extend``'s page layout. The ids' pages not
        yet in use are claimed; a chunk continuing a mid-page prefix continues its device page.
        False, nothing changed, when the device rows are short.
        """
        ids = _as_cpu_int64(logical_ids, "logical ids to bind")
        p = _as_cpu_int64(prefix_lens, "prefix_lens")
        s = _as_cpu_int64(seq_lens, "seq_lens")
        if ids.numel() != int((s - p).clamp(min=0).sum()):
            raise ValueError(f"bind_extend: {ids.numel()} ids for {int((s - p).clamp(min=0).sum())} extend positions.")
        ps = self.page_size
        pages = torch.unique(ids // ps)
        new = pages[~self.logical._used[pages]] if pages.numel() else pages
        need = self.logical.pages_needed_extend(p, s)
        if new.numel() != need:
            raise ValueError(
                f"bind_extend: the ids start {new.numel()} new pages but the extend needs {need}; each "
                f"request's ids must continue its prefix's page and fill whole pages in order.")
        if not room(need):
            return False
        # the device side follows alloc_extend: a mid-page chunk continues its prefix's row page;
        # the prefix's last id precedes the chunk's first on the same page
        mid = (p % ps != 0) & (s > p)
        last = torch.full_like(p, -1)
        if bool(mid.any()):
            first = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), (s - p).clamp(min=0)[:-1]]), 0)
            last[mid] = ids[first[mid]] - 1
        dev_last = self._continued_rows(mid, last, "bind_extend")
        if not self.logical.claim_pages(new):
            raise ValueError(f"bind_extend: logical pages {new.tolist()[:8]} are already in use.")
        rows = self.rows.alloc_extend_cpu(p, s, dev_last)
        self.bind(ids, rows)
        return True

    def _continued_rows(self, mid: torch.Tensor, last: torch.Tensor, op: str) -> torch.Tensor:
        """int64 [bs] (CPU): the prefill device row of each mid-page chunk's last prefix id
        ``last`` (where ``mid``), -1 elsewhere: the row page the chunk's rows continue."""
        dev_last = torch.full_like(last, -1)
        if bool(mid.any()):
            dev_last[mid] = self.row[last[mid]]
            if bool((dev_last[mid] <= 0).any()):
                raise ValueError(
                    f"{op}: prefix tokens {last[mid & (dev_last <= 0)].tolist()} (logical) have no "
                    f"prefill device row, so a chunk cannot continue their page. Chunked prefill must "
                    f"run before the request is shrunk to its hot buffer."
                )
        return dev_last

    # ---- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The device mapping agrees with ``row`` wherever an id owns a row. Syncs."""
        m, has = self.address_map.mapping[:-1].cpu(), self.row > 0
        if not torch.equal(m[has], self.row[has]):
            raise ValueError(
                "mapping disagrees with the CPU prefill-row ownership for some logical ids."
            )
