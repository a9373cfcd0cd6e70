"""Prefix share: who reads which prefill rows, and which rows stay as a device cache (part of
``DualSpaceAllocator``).

With SGLang's radix cache a finished request's logical ids stay in the tree, and a later
request whose prompt matches them reads their KV through the same ids. Readers are counted
per logical page::

    logical page:      1    2    3    4           held_pages: slot -> pages it reads
    reader_counts:     2    1    0    0           (its matched prefix + what it computed)
    cached_pages:                {3,  4}          unheld prefill pages kept on the device,
                                                  least recently cached first

* **holds**: every request holds the pages it reads from its prefill until it is collected
  (:meth:`hold` / :meth:`unhold`); :meth:`note_computed` records the ids its prefill computed,
  which its staging copies and which no other request may read from host until they land
  (:meth:`mark_landed`, :meth:`host_pending`).
* **loading**: :meth:`load_prefix` gives a matched prefix's pages without prefill rows fresh
  rows; the caller fills them from a resident buffer's rows or from host.
* **dropping**: :meth:`drop_unread` frees the prefill rows of pages nobody holds any more (the
  ids stay with the tree, their KV on host).
* **cached pages**: a finished resident request's pages can stay as prefill rows of their
  logical pages (:meth:`cache_resident`); a later match finds them on the device. Any
  allocation short of rows, and the watermark relief, take them back first
  (:meth:`evict_cached`, least recently cached first, skipping what :meth:`protect_cached`
  named); a hold or a free of their ids ends the caching.

NOTE: the reader count lives per logical page, not per device row: a page's rows are taken
and given up together, and a request reads whole pages of the tree's ids. The rejected
alternative, a count per device row, would be ``page_size`` times the bookkeeping for the
same answer and would have to follow rows through :meth:`load_prefix`'s fresh pages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_hisparse.memory.paged import _as_cpu_int64

if TYPE_CHECKING:
    from sglang_hisparse.memory.address_map import AddressMap
    from sglang_hisparse.memory.hot import HotBuffers
    from sglang_hisparse.memory.paged import PagedIdAllocator
    from sglang_hisparse.memory.prefill_rows import PrefillRows, Room

__all__ = ["Holds", "PrefixShare"]

#: what :meth:`PrefixShare.drop_holds` took from a request slot: (held pages, computed ids or None)
Holds = tuple[torch.Tensor, torch.Tensor | None]


class PrefixShare:
    """Readers and cached pages over the prefill rows of ``prefill`` (see the module docstring).

    logical / rows: the two id spaces; prefill: the prefill-row ownership the shared rows are
    part of; address_map: where dropped ids are unmapped; hot: the hot buffers (resident
    buffers' rows are load sources; a cached page leaves one).
    """

    def __init__(self, logical: PagedIdAllocator, rows: PagedIdAllocator, prefill: PrefillRows,
                 address_map: AddressMap, hot: HotBuffers) -> None:
        self.logical, self.rows, self.prefill = logical, rows, prefill
        self.address_map, self.hot = address_map, hot
        self.page_size = logical.page_size
        #: int32 [logical pages + 1] (CPU): requests holding each logical page's prefill rows
        self.reader_counts = torch.zeros(logical.num_pages + 1, dtype=torch.int32)
        #: request slot -> the logical pages it holds (CPU int64, unique)
        self.held_pages: dict[int, torch.Tensor] = {}
        #: request slot -> the ids its prefill computed and still owns (CPU int64): what its
        #: staging copies; ids SGLang frees (a checkpoint's duplicates) drop out
        self._computed: dict[int, torch.Tensor] = {}
        #: bool [logical pages + 1] (CPU): computed pages whose host copy has not landed yet
        #: (their request has not been staged), which no other request may read from host
        self._pending_host = torch.zeros(logical.num_pages + 1, dtype=torch.bool)
        #: logical pages whose prefill rows are a cache nobody holds, oldest first
        self.cached_pages: dict[int, None] = {}
        #: device rows of cached prefix pages taken back so far (evict_cached: pressure, allocations)
        self.evicted_rows = 0
        #: cached pages evict_cached skips (protect_cached: an extend's own matched prefix)
        self._protected: set[int] = set()

    # ---- holds -----------------------------------------------------------------------------
    def hold(self, req_slot: int, logical_ids: torch.Tensor) -> torch.Tensor:
        """Request slot ``req_slot`` reads the prefill rows of ``logical_ids``' pages (int, any
        device; read on the CPU) until :meth:`unhold`; pages it already holds count once.
        Returns the pages newly held (CPU int64)."""
        pages = torch.unique(_as_cpu_int64(logical_ids, "logical ids to hold") // self.page_size)
        have = self.held_pages.get(req_slot)
        if have is not None:
            pages = pages[~torch.isin(pages, have)]
        if pages.numel() == 0:
            return pages
        if self.cached_pages:  # a held page is no longer a cache anyone may evict
            for pg in pages.tolist():
                self.cached_pages.pop(pg, None)
        self.reader_counts[pages] += 1
        self.held_pages[req_slot] = pages if have is None else torch.cat((have, pages))
        return pages

    def note_computed(self, req_slot: int, logical_ids: torch.Tensor) -> None:
        """The prefill of ``req_slot`` computed ``logical_ids`` (held too): its staging copies
        those of them still allocated to it (:meth:`computed_ids`)."""
        ids = _as_cpu_int64(logical_ids, "computed logical ids").reshape(-1)
        self.hold(req_slot, ids)
        self._pending_host[ids // self.page_size] = True
        have = self._computed.get(req_slot)
        self._computed[req_slot] = ids if have is None else torch.cat((have, ids))

    def mark_landed(self, req_slot: int) -> None:
        """The host copy of what ``req_slot`` computed has landed (its staging event is done,
        or the caller's stream is ordered after the copy)."""
        own = self._computed.get(req_slot)
        if own is not None and own.numel():
            self._pending_host[own // self.page_size] = False

    def host_pending(self, logical_ids: torch.Tensor) -> bool:
        """Whether any page of ``logical_ids`` (CPU) waits for its host copy: a request whose
        buffer would read such a page from host must not start decoding yet."""
        return bool(self._pending_host[_as_cpu_int64(logical_ids, "logical ids") // self.page_size].any())

    def computed_ids(self, req_slot: int) -> torch.Tensor | None:
        """The ids :meth:`note_computed` recorded for ``req_slot`` that are still its (CPU),
        or None when nothing was recorded (no radix cache: every id of the prompt is its own)."""
        return self._computed.get(req_slot)

    def unhold(self, req_slot: int) -> torch.Tensor:
        """Drop every hold of ``req_slot`` (and its computed-ids record); returns the logical
        pages it held (CPU int64)."""
        self._computed.pop(req_slot, None)
        pages = self.held_pages.pop(req_slot, None)
        if pages is None:
            return torch.empty(0, dtype=torch.int64)
        self.reader_counts[pages] -= 1
        return pages

    def drop_holds(self, req_slot: int) -> Holds:
        """:meth:`unhold`, returning what :meth:`restore_holds` needs to undo it (a collect
        that turns out short of rows)."""
        computed = self._computed.get(req_slot)
        return self.unhold(req_slot), computed

    def restore_holds(self, req_slot: int, holds: Holds) -> None:
        pages, computed = holds
        if pages.numel():
            self.reader_counts[pages] += 1
            self.held_pages[req_slot] = pages
        if computed is not None:
            self._computed[req_slot] = computed

    def holds(self, req_slot: int) -> bool:
        """Whether ``req_slot`` holds any page (a prefill not yet collected)."""
        return req_slot in self.held_pages

    def readers(self, logical_pages: torch.Tensor) -> torch.Tensor:
        """int32 [n] (CPU): holders of each logical page."""
        return self.reader_counts[logical_pages]

    def forget_pages(self, log_pages: torch.Tensor) -> None:
        """Freed logical pages (CPU int64, distinct) leave every record: no longer pending,
        cached, held (SGLang freed ids a request still held: a duplicate its checkpoint
        replaced by the tree's) or computed."""
        self._pending_host[log_pages] = False
        if self.cached_pages:
            for pg in log_pages.tolist():
                self.cached_pages.pop(pg, None)
        if bool((self.reader_counts[log_pages] > 0).any()):
            for r, held in list(self.held_pages.items()):
                gone = torch.isin(held, log_pages)
                if bool(gone.any()):
                    self.reader_counts[held[gone]] -= 1
                    if bool(gone.all()):
                        del self.held_pages[r]
                    else:
                        self.held_pages[r] = held[~gone]
        for r, own in list(self._computed.items()):
            gone = torch.isin(own // self.page_size, log_pages)
            if bool(gone.any()):
                self._computed[r] = own[~gone]

    # ---- loading and dropping shared rows --------------------------------------------------
    def load_prefix(
        self, logical_ids: torch.Tensor, *, room: Room
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Give the ids of ``logical_ids``' pages that have no prefill row one (fresh device
        pages, same in-page offset), mapped: a matched prefix about to be read by a prefill.

        logical_ids: int, any device (read on the CPU), whole pages of ids in use. Returns
        (ids, rows, src) CPU int64, or None when the device rows are short (nothing changed):
        the caller copies ``rows`` from the device rows ``src`` where ``src > 0`` (the id is
        still mapped into a running resident request's buffer, whose row holds its KV) and
        from the host rows ``ids`` elsewhere. Reading the mapping syncs the current
        stream once, when some page is missing."""
        ids = _as_cpu_int64(logical_ids, "prefix logical ids")
        empty = torch.empty(0, dtype=torch.int64)
        if ids.numel() == 0:
            return empty, empty, empty
        pages = torch.unique(ids // self.page_size)
        all_ids = self.logical.page_ids_to_ids(pages)
        if not bool(self.logical.is_used(all_ids).all()):
            raise ValueError(
                f"load_prefix: prefix ids {all_ids[~self.logical.is_used(all_ids)][:8].tolist()} are "
                f"not allocated; a matched prefix must be ids the radix tree holds."
            )
        has = (self.prefill.rows_of(all_ids) > 0).view(-1, self.page_size)
        partial = has.any(1) & ~has.all(1)
        if bool(partial.any()):
            raise ValueError(
                f"load_prefix: logical pages {pages[partial][:8].tolist()} have prefill rows for only "
                f"some of their ids; a page's rows are taken and given up together."
            )
        missing = pages[~has.any(1)]
        if missing.numel() == 0:
            return empty, empty, empty
        if not room(int(missing.numel())):
            return None
        new_ids = self.logical.page_ids_to_ids(missing)
        # after the reclaim (a shrink unmaps what it drops), before the new rows are bound;
        # only a resident buffer's rows are sources: a hot buffer's mapping of its previous
        # newest token is left stale on purpose (coordinator/step.py) and points at slot B
        dev_ids = new_ids.to(self.address_map.device)
        src = self.address_map.translate(dev_ids).to("cpu", torch.int64).clamp_(min=0)
        mapped = src > 0
        if bool(mapped.any()):
            src[mapped] = torch.where(self.hot.in_resident_buffer(src[mapped]), src[mapped], 0)
        got = self.rows.alloc_pages(int(missing.numel()))
        new_rows = self.rows.page_ids_to_ids(got)
        self.prefill.bind(new_ids, new_rows)
        return new_ids, new_rows, src

    def drop_unread(self, log_pages: torch.Tensor) -> int:
        """Free the prefill rows of those of ``log_pages`` (CPU int64) nobody holds, and unmap
        their ids; the ids stay allocated (their KV is on host). Returns the rows freed."""
        if log_pages.numel() == 0:
            return 0
        pages = log_pages[self.reader_counts[log_pages] == 0]
        if pages.numel() == 0:
            return 0
        ids = self.logical.page_ids_to_ids(pages)
        ids = ids[self.prefill.rows_of(ids) > 0]
        if ids.numel() == 0:
            return 0
        freed = self.prefill.free_rows(ids)
        self.address_map.unmap(ids)
        return int(freed.numel()) * self.page_size

    # ---- cached pages ----------------------------------------------------------------------
    def cache_resident(self, req_slot: int, logical_ids: torch.Tensor) -> int:
        """Release a finished resident request, keeping its pages as cached prefill rows of
        their logical pages (radix cache: the tree may keep the ids, and a later match then
        loads nothing). logical_ids: int [n] (CPU), the request's ids in position order. A page
        whose ids another row already holds, or whose ids are not laid out by position, is
        released instead. The caller's free of ids the tree does not keep frees their rows as
        for any prefill row. Returns the rows kept."""
        ids = _as_cpu_int64(logical_ids, "logical_ids")
        hot, ps = self.hot, self.page_size
        n = min(ids.numel(), hot.resident_length(req_slot))
        keep: list[int] = []
        for k, dev_page in enumerate(hot.pages(req_slot)):
            seg = ids[k * ps : min((k + 1) * ps, n)]
            if seg.numel() == 0:
                break
            lp = int(seg[0]) // ps
            positional = bool((seg // ps == lp).all()) and torch.equal(seg % ps, torch.arange(seg.numel()))
            if not positional or bool((self.prefill.rows_of(seg) > 0).any()) or int(self.reader_counts[lp]) > 0:
                continue
            self.prefill.bind(seg, dev_page * ps + seg % ps)
            self.cached_pages[lp] = None
            keep.append(dev_page)
        hot.release(req_slot, keep=keep, unmap_ids=ids[:n].to(self.address_map.device, non_blocking=True))
        return len(keep) * ps

    def evict_cached(self, rows: int) -> int:
        """Free at least ``rows`` device rows of cached prefix pages, least recently cached
        first, skipping the pages :meth:`protect_cached` named (their ids stay allocated, their
        KV on host); returns the rows freed."""
        freed = 0
        while freed < rows:
            # the oldest unprotected page (the first one whenever nothing is protected)
            lp = next((p for p in self.cached_pages if p not in self._protected), None)
            if lp is None:
                break
            del self.cached_pages[lp]
            freed += self.drop_unread(torch.tensor([lp], dtype=torch.int64))
        self.evicted_rows += freed
        return freed

    def protect_cached(self, logical_ids: torch.Tensor) -> int:
        """Until :meth:`release_protected`, no allocation evicts the cached pages of
        ``logical_ids`` (int, any device; read on the CPU): an extend batch that matched them
        allocates its new ids first and holds its prefix after (SGLang's ``alloc_for_extend``
        order), and evicting them then would only load them back from host. Returns the
        cached pages protected."""
        pages = torch.unique(_as_cpu_int64(logical_ids, "protected logical ids") // self.page_size)
        self._protected = {p for p in pages.tolist() if p in self.cached_pages}
        return len(self._protected)

    def release_protected(self) -> None:
        self._protected = set()

    @property
    def cached_rows(self) -> int:
        return len(self.cached_pages) * self.page_size

    # ---- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every cached page is an unheld prefill page, and each page's reader count is the
        number of request slots holding it."""
        ps = self.page_size
        if self.cached_pages:
            cached = torch.tensor(list(self.cached_pages), dtype=torch.int64)
            first = self.prefill.rows_of(cached * ps)
            if bool((self.reader_counts[cached] != 0).any()) or bool((first <= 0).any()):
                raise ValueError(
                    f"cached prefix pages {cached[(self.reader_counts[cached] != 0) | (first <= 0)][:8].tolist()} "
                    f"are held or have no prefill rows; a cached page is an unheld prefill page."
                )
        counted = torch.zeros_like(self.reader_counts)
        for pages in self.held_pages.values():
            counted[pages] += 1
        if not torch.equal(counted, self.reader_counts):
            bad = torch.nonzero(counted != self.reader_counts).reshape(-1)[:8]
            raise ValueError(
                f"prefix share: reader counts {self.reader_counts[bad].tolist()} of logical pages "
                f"{bad.tolist()} disagree with the request slots holding them "
                f"({counted[bad].tolist()}); every hold counts once per page."
            )
