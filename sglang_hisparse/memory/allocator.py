"""Dual address space: logical ids (what SGLang schedules) over a smaller set of device rows.

::

    logical ids (req_to_token holds these; capacity = host_to_device_ratio * device rows)
      0 | 1 2 3 4 5 6 7 8 9 ... size_full              (page 0 reserved; + trailing sentinel)
            │   │       │
            ▼   ▼       ▼        mapping: int64 [logical total_ids + 1] on the pool's device
      0 | 1 2 3 4 ... size_device
    device rows (real HBM KV rows; row 0 = padding row, never handed out)

A used device row is owned in exactly one of two ways:

* **prefill row** of a logical id: ``alloc_extend`` / ``alloc`` give every new logical id a
  device row and map it; ``free(logical_ids)`` returns those rows. The allocator keeps a CPU
  copy of this ownership (``_prefill_row``) so frees never read the device mapping.
  A prefill row can be *shared*: SGLang's radix tree keeps a finished request's ids, and a
  later request whose prompt matches them reads their KV through the same mapping. Readers
  are counted per logical page (:meth:`hold`): every request from its prefill until it is
  staged and collected holds the pages it reads (its matched prefix, loaded from host by
  :meth:`load_prefix` where no device row holds it) and the pages it computed. At collect,
  :meth:`take_staged_rows` hands the request its own rows, copying only those of pages
  another request still holds; a page nobody holds any more is freed by :meth:`drop_unread`.
  A finished resident request's pages can stay as *cached* prefill rows of their logical
  pages (:meth:`cache_resident`, a device-tier cache of what the radix tree keeps): a later
  match finds them on the device, and they are the first rows any allocation or relief takes
  back (:meth:`evict_cached`, least recently cached first).
* **hot buffer** of request slot ``r`` (``hot``, a ``memory.hot.HotBuffers``):
  ``shrink_to_hot_buffer`` turns the prompt's prefill rows into the hot buffer (keeping the
  rows the hot slots need, freeing the rest); ``hot.alloc`` (PD direct admission) and
  ``hot.grow`` add rows; ``hot.release`` returns them all. The coordinator maps the newest
  token into its slot's row with ``map_tokens`` / ``rebind``; such mappings never free
  anything, and releasing the buffer unmaps whatever points there.

NOTE: the "not on device" sentinel is 0, i.e. device row 0, the padding row, rather than -1.
The pool's KV writes translate ``out_cache_loc`` through ``mapping`` without a check (a
check would be a host sync on every layer); an unmapped id then writes harmlessly into the
padding row instead of faulting at row -1 or corrupting another request's row. The extra
last element is -1 so that SGLang's ``last_loc = -1`` ("no prefix") translates to -1.

Everything is query-then-mutate: allocation returns None with nothing changed when either
space is short; bad frees raise ``ValueError`` before anything changes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sglang_hisparse.memory.hot import UNMAPPED, HotBuffers
from sglang_hisparse.memory.paged import PagedIdAllocator, _as_cpu_int64, ceil_div

__all__ = ["UNMAPPED", "DualSpaceAllocator", "PagedIdAllocator", "Reclaimer", "ceil_div"]


class Reclaimer(Protocol):
    """Who can free device rows on demand (the coordinator's residency policy)."""

    def reclaimable_rows(self) -> int: ...

    def reclaim(self, rows: int) -> int: ...


class DualSpaceAllocator:
    """Logical-id allocator + device-row allocator + the logical → device ``mapping``.

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
        #: int64 [logical.total_ids + 1] on ``device``: device row per logical id, UNMAPPED (0) if none; last = -1
        self.mapping = torch.zeros(
            self.logical.total_ids + 1, dtype=torch.int64, device=self.device
        )
        #: the latest ``alloc()``'s ids on the CPU, and the tensor it returned (``cpu_ids_of``)
        self.last_alloc_cpu: torch.Tensor | None = None
        self._last_alloc_out: torch.Tensor | None = None
        #: frees device rows held by resident requests on demand (``set_reclaimer``), or None
        self.reclaimer: Reclaimer | None = None
        self.clear()

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
        return self.rows.available_size() + len(self._cached) * self.page_size + extra

    def set_reclaimer(self, reclaimer: Reclaimer | None) -> None:
        """Let allocations that find the device rows short call ``reclaimer.reclaim(rows)``
        (the coordinator shrinks resident requests to hot buffers) before giving up."""
        self.reclaimer = reclaimer

    def _rows_for(self, pages: int) -> bool:
        """True when ``pages`` device pages are free, after reclaiming what is missing."""
        short = pages - self.rows.available_pages()
        if short > 0:
            short -= self.evict_cached(short * self.page_size) // self.page_size
        if short > 0 and self.reclaimer is not None:
            self.reclaimer.reclaim(short * self.page_size)
        return pages <= self.rows.available_pages()

    # ---- SGLang-shaped allocation ----------------------------------------------------------
    def clear(self) -> None:
        self.logical.clear()
        self.rows.clear()
        self.mapping.zero_()
        self.mapping[-1] = -1
        self.last_alloc_cpu = self._last_alloc_out = None
        #: the latest ``alloc_logical_extend`` result (device), or None
        self.last_logical_extend: torch.Tensor | None = None
        #: int64 [logical.total_ids] (CPU): prefill row owned through each logical id, 0 if none
        self._prefill_row = torch.zeros(self.logical.total_ids, dtype=torch.int64)
        #: the per-request hot buffers (device pages owned by request slots)
        self.hot = HotBuffers(self.rows, self.mapping)
        #: int32 [logical pages + 1] (CPU): requests holding each logical page's prefill rows
        self._readers = torch.zeros(self.logical.num_pages + 1, dtype=torch.int32)
        #: request slot -> the logical pages it holds (CPU int64, unique)
        self._held: dict[int, torch.Tensor] = {}
        #: request slot -> the ids its prefill computed and still owns (CPU int64): what its
        #: staging copies; ids SGLang frees (a checkpoint's duplicates) drop out
        self._computed: dict[int, torch.Tensor] = {}
        #: bool [logical pages + 1] (CPU): computed pages whose host copy has not landed yet
        #: (their request has not been staged), which no other request may read from host
        self._pending_host = torch.zeros(self.logical.num_pages + 1, dtype=torch.bool)
        #: logical pages whose prefill rows are a cache nobody holds, oldest first
        self._cached: dict[int, None] = {}
        #: device rows of cached prefix pages taken back so far (evict_cached: pressure, allocations)
        self.cached_evicted_rows = 0
        #: cached pages evict_cached skips (protect_cached: an extend's own matched prefix)
        self._protected: set[int] = set()

    def _bind_prefill(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self._prefill_row[ids] = rows
        self.mapping[ids.to(self.device)] = rows.to(self.device, non_blocking=True)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` (page multiple) logical ids, each with a fresh prefill row; int64 [n] or None.

        SGLang uses this for page_size 1 prefill AND decode; decode tokens get moved onto
        their hot slot with ``rebind`` (which frees the row taken here).
        """
        if n < 0 or n % self.page_size:
            raise ValueError(
                f"alloc({n}): n must be a non-negative multiple of page_size = {self.page_size}."
            )
        if n // self.page_size > self.logical.available_pages() or not self._rows_for(n // self.page_size):
            return None
        ids = self.logical.page_ids_to_ids(self.logical.alloc_pages(n // self.page_size))
        rows = self.rows.page_ids_to_ids(self.rows.alloc_pages(n // self.page_size))
        self._bind_prefill(ids, rows)
        out = ids.to(self.device, non_blocking=True)
        self.last_alloc_cpu, self._last_alloc_out = ids, out
        return out

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
        """Prefill: logical ids AND device rows for positions ``prefix_lens..seq_lens-1``, mapped.

        Layout as ``PagedIdAllocator.alloc_extend`` in both spaces (a chunk that continues a
        mid-page prefix continues the prefix's device page too). prefix_lens / seq_lens: int
        [bs] (CPU); last_loc: int64 [bs], logical id of each request's last prefix token (-1
        if none; read on the CPU only for mid-page prefixes). Returns logical ids int64
        [extend tokens] on ``device``, or None (nothing changed).
        """
        need = self.logical.pages_needed_extend(prefix_lens, seq_lens)
        if need > self.logical.available_pages() or not self._rows_for(need):
            return None
        p = _as_cpu_int64(prefix_lens, "prefix_lens")
        mid = (p % self.page_size != 0) & (_as_cpu_int64(seq_lens, "seq_lens") > p)
        last = _as_cpu_int64(last_loc, "last_loc") if bool(mid.any()) else torch.full_like(p, -1)
        dev_last = self._continued_rows(mid, last, "alloc_extend")
        ids = self.logical.alloc_extend_cpu(p, seq_lens, last)
        rows = self.rows.alloc_extend_cpu(p, seq_lens, dev_last)
        self._bind_prefill(ids, rows)
        out = ids.to(self.device, non_blocking=True)
        self.last_alloc_cpu, self._last_alloc_out = ids, out  # cpu_ids_of: the extend's own ids
        return out

    def _continued_rows(self, mid: torch.Tensor, last: torch.Tensor, op: str) -> torch.Tensor:
        """int64 [bs] (CPU): the prefill device row of each mid-page chunk's last prefix id
        ``last`` (where ``mid``), -1 elsewhere: the row page the chunk's rows continue."""
        dev_last = torch.full_like(last, -1)
        if bool(mid.any()):
            dev_last[mid] = self._prefill_row[last[mid]]
            if bool((dev_last[mid] <= 0).any()):
                raise ValueError(
                    f"{op}: prefix tokens {last[mid & (dev_last <= 0)].tolist()} (logical) have no "
                    f"prefill device row, so a chunk cannot continue their page. Chunked prefill must "
                    f"run before the request is shrunk to its hot buffer."
                )
        return dev_last

    def bind_extend(self, logical_ids: torch.Tensor, prefix_lens: torch.Tensor,
                    seq_lens: torch.Tensor) -> bool:
        """Prefill with logical ids decided elsewhere (DeepSeek-V4: a C4 entry's compressed id
        is implied by SGLang's full-token page, docs/v4-m3.md D6): device rows for
        ``logical_ids`` (int64 [extend entries], CPU, request by request, each request's
        positions ``prefix_lens .. seq_lens - 1`` in ``alloc_extend``'s page layout), mapped.
        The ids' pages not yet in use are claimed; a chunk continuing a mid-page prefix
        continues its device page. False, nothing changed, when the device rows are short.
        The ids are freed with :meth:`free` as any others."""
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
        if not self._rows_for(need):
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
        self._bind_prefill(ids, rows)
        return True

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
        rows = self._prefill_row[ids]
        pages = torch.unique(rows[rows > 0] // self.page_size)
        log_pages = torch.unique(ids // self.page_size)
        self.logical.check_freeable(log_pages)
        self.rows.check_freeable(pages)
        self.logical.free_pages(log_pages)
        self.rows.free_pages(pages)
        self._prefill_row[ids] = UNMAPPED
        self._pending_host[log_pages] = False
        if self._cached:
            for pg in log_pages.tolist():
                self._cached.pop(pg, None)
        if bool((self._readers[log_pages] > 0).any()):
            self._forget_holds(log_pages)
        for r, own in list(self._computed.items()):
            gone = torch.isin(own // self.page_size, log_pages)
            if bool(gone.any()):
                self._computed[r] = own[~gone]
        # NOTE: every id of the freed pages is unmapped, not only the listed ones: a freed page
        # can hold ids the caller no longer lists that still point at hot rows (a rejected
        # draft in the page of the last accepted token), and hot.release leaves unmapping to
        # this free (memory/hot.py). Proportional to the pages freed.
        self.mapping[self.logical.page_ids_to_ids(log_pages).to(self.device)] = UNMAPPED

    # ---- shared prefill rows: readers per logical page -------------------------------------
    def hold(self, req_slot: int, logical_ids: torch.Tensor) -> torch.Tensor:
        """Request slot ``req_slot`` reads the prefill rows of ``logical_ids``' pages (int, any
        device; read on the CPU) until :meth:`unhold`; pages it already holds count once.
        Returns the pages newly held (CPU int64)."""
        pages = torch.unique(_as_cpu_int64(logical_ids, "logical ids to hold") // self.page_size)
        have = self._held.get(req_slot)
        if have is not None:
            pages = pages[~torch.isin(pages, have)]
        if pages.numel() == 0:
            return pages
        if self._cached:  # a held page is no longer a cache anyone may evict
            for pg in pages.tolist():
                self._cached.pop(pg, None)
        self._readers[pages] += 1
        self._held[req_slot] = pages if have is None else torch.cat((have, pages))
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
        pages = self._held.pop(req_slot, None)
        if pages is None:
            return torch.empty(0, dtype=torch.int64)
        self._readers[pages] -= 1
        return pages

    def holds(self, req_slot: int) -> bool:
        """Whether ``req_slot`` holds any page (a prefill not yet collected)."""
        return req_slot in self._held

    def readers(self, logical_pages: torch.Tensor) -> torch.Tensor:
        """int32 [n] (CPU): holders of each logical page."""
        return self._readers[logical_pages]

    def _forget_holds(self, log_pages: torch.Tensor) -> None:
        """Freed logical pages are held by no one any more (SGLang freed ids a request still
        held: a duplicate its checkpoint replaced by the tree's)."""
        for r, held in list(self._held.items()):
            gone = torch.isin(held, log_pages)
            if bool(gone.any()):
                self._readers[held[gone]] -= 1
                if bool(gone.all()):
                    del self._held[r]
                else:
                    self._held[r] = held[~gone]

    def drop_unread(self, log_pages: torch.Tensor) -> int:
        """Free the prefill rows of those of ``log_pages`` (CPU int64) nobody holds, and unmap
        their ids; the ids stay allocated (their KV is on host). Returns the rows freed."""
        if log_pages.numel() == 0:
            return 0
        pages = log_pages[self._readers[log_pages] == 0]
        if pages.numel() == 0:
            return 0
        ids = self.logical.page_ids_to_ids(pages)
        rows = self._prefill_row[ids]
        has = rows > 0
        if not bool(has.any()):
            return 0
        ids, rows = ids[has], rows[has]
        dev_pages = torch.unique(rows // self.page_size)
        self.rows.check_freeable(dev_pages)
        self.rows.free_pages(dev_pages)
        self._prefill_row[ids] = UNMAPPED
        self.mapping[ids.to(self.device)] = UNMAPPED
        return int(dev_pages.numel()) * self.page_size

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
            if not positional or bool((self._prefill_row[seg] > 0).any()) or int(self._readers[lp]) > 0:
                continue
            rows = dev_page * ps + seg % ps
            self._prefill_row[seg] = rows
            self.mapping[seg.to(self.device)] = rows.to(self.device, non_blocking=True)
            self._cached[lp] = None
            keep.append(dev_page)
        hot.release(req_slot, keep=keep, unmap_ids=ids[:n].to(self.device, non_blocking=True))
        return len(keep) * ps

    def evict_cached(self, rows: int) -> int:
        """Free at least ``rows`` device rows of cached prefix pages, least recently cached
        first, skipping the pages :meth:`protect_cached` named (their ids stay allocated, their
        KV on host); returns the rows freed."""
        freed = 0
        while freed < rows:
            # the oldest unprotected page (the first one whenever nothing is protected)
            lp = next((p for p in self._cached if p not in self._protected), None)
            if lp is None:
                break
            del self._cached[lp]
            freed += self.drop_unread(torch.tensor([lp], dtype=torch.int64))
        self.cached_evicted_rows += freed
        return freed

    def protect_cached(self, logical_ids: torch.Tensor) -> int:
        """Until :meth:`release_protected`, no allocation evicts the cached pages of
        ``logical_ids`` (int, any device; read on the CPU): an extend batch that matched them
        allocates its new ids first and holds its prefix after (SGLang's ``alloc_for_extend``
        order), and evicting them then would only load them back from host. Returns the
        cached pages protected."""
        pages = torch.unique(_as_cpu_int64(logical_ids, "protected logical ids") // self.page_size)
        self._protected = {p for p in pages.tolist() if p in self._cached}
        return len(self._protected)

    def release_protected(self) -> None:
        self._protected = set()

    @property
    def cached_rows(self) -> int:
        return len(self._cached) * self.page_size

    def load_prefix(
        self, logical_ids: torch.Tensor
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
        has = (self._prefill_row[all_ids] > 0).view(-1, self.page_size)
        partial = has.any(1) & ~has.all(1)
        if bool(partial.any()):
            raise ValueError(
                f"load_prefix: logical pages {pages[partial][:8].tolist()} have prefill rows for only "
                f"some of their ids; a page's rows are taken and given up together."
            )
        missing = pages[~has.any(1)]
        if missing.numel() == 0:
            return empty, empty, empty
        if not self._rows_for(int(missing.numel())):
            return None
        new_ids = self.logical.page_ids_to_ids(missing)
        # after the reclaim (a shrink unmaps what it drops), before the new rows are bound;
        # only a resident buffer's rows are sources: a hot buffer's mapping of its previous
        # newest token is left stale on purpose (coordinator/step.py) and points at slot B
        src = self.mapping[new_ids.to(self.device)].to("cpu", torch.int64).clamp_(min=0)
        mapped = src > 0
        if bool(mapped.any()):
            src[mapped] = torch.where(self.hot.in_resident_buffer(src[mapped]), src[mapped], 0)
        got = self.rows.alloc_pages(int(missing.numel()))
        new_rows = self.rows.page_ids_to_ids(got)
        self._bind_prefill(new_ids, new_rows)
        return new_ids, new_rows, src

    def take_staged_rows(
        self, req_slot: int, logical_ids: torch.Tensor, need: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A staged request's rows, for its hot or resident buffer, at collect.

        logical_ids: int64 [n] (CPU), the request's tokens in order, all with prefill rows;
        need: bool [n], the positions its buffer keeps. Drops the request's holds first. Rows
        of pages nobody else holds are handed over (their prefill ownership ends); for the
        needed positions of pages another request still holds, fresh private rows are taken
        (same in-page offset) and the caller copies ``src -> dst`` device to device.

        Returns (token_rows int64 [n], 0 where a shared position is not needed; shared bool
        [n]; src; dst), or None when the private rows are short (holds restored, nothing else
        changed)."""
        ids = _as_cpu_int64(logical_ids, "logical_ids")
        computed = self._computed.get(req_slot)
        held = self.unhold(req_slot)
        log_pages = ids // self.page_size
        shared = self._readers[log_pages] > 0
        rows = self._prefill_row[ids].clone()
        if bool((rows <= 0).any()):
            self._restore_holds(req_slot, held)
            if computed is not None:
                self._computed[req_slot] = computed
            bad = ids[rows <= 0][:8].tolist()
            raise ValueError(
                f"take_staged_rows: request slot {req_slot}: logical ids {bad} have no prefill device "
                f"row. Only a prefilled request can be collected; admit logical-only (PD) requests "
                f"with hot.alloc."
            )
        copy = shared & need
        src = dst = torch.empty(0, dtype=torch.int64)
        if bool(copy.any()):
            src_pages = torch.unique(rows[copy] // self.page_size)
            if not self._rows_for(int(src_pages.numel())):
                self._restore_holds(req_slot, held)
                if computed is not None:
                    self._computed[req_slot] = computed
                return None
            got = self.rows.alloc_pages(int(src_pages.numel()))
            # page-wise: a shared page's needed rows move to the same offsets of a private page
            remap = torch.zeros(int(src_pages.max()) + 1, dtype=torch.int64)
            remap[src_pages] = got
            src = rows[copy]
            dst = remap[src // self.page_size] * self.page_size + src % self.page_size
            rows[copy] = dst
            # private pages' rows no position needs stay with the buffer as spare / page fill
        rows[shared & ~need] = 0
        own = ~shared
        self._prefill_row[ids[own]] = UNMAPPED
        return rows, shared, src, dst

    def _restore_holds(self, req_slot: int, pages: torch.Tensor) -> None:
        if pages.numel():
            self._readers[pages] += 1
            self._held[req_slot] = pages

    # ---- hot buffers (the ownership itself is ``self.hot``) ----------------------------------
    def shrink_to_hot_buffer(
        self, req_slot: int, logical_ids: torch.Tensor, hot_size: int
    ) -> torch.Tensor:
        """Cut a prefilled request (its prompt safe on host) down to its hot buffer.

        logical_ids: int [n] (any device; read on the CPU), the request's tokens 0..n-1 in
        order, all with prefill rows. Their rows stop being prefill rows and become the hot
        buffer (``HotBuffers.adopt``: the rows of tokens ``0..min(n, B)-1`` and, when
        ``n > B``, the newest token's, with whole pages; every other prefill page is freed).
        Afterwards only the newest token stays mapped (slots get reused by the LRU, so any
        older mapping would go stale). Never allocates.

        Returns ``slot_rows`` int64 [B+1] (CPU): device row per slot, -1 where none yet.
        """
        if self.hot.has(req_slot):
            raise ValueError(
                f"shrink_to_hot_buffer: request slot {req_slot} already has a hot buffer; release it first."
            )
        ids = _as_cpu_int64(logical_ids, "logical_ids")
        n = ids.numel()
        if n < 1 or hot_size < 1:
            raise ValueError(
                f"shrink_to_hot_buffer: need >= 1 token and hot_size >= 1, got n = {n}, hot_size = {hot_size}."
            )
        rows = self._prefill_row[ids]
        if bool((rows <= 0).any()):
            bad = ids[rows <= 0][:8].tolist()
            raise ValueError(
                f"shrink_to_hot_buffer: request slot {req_slot}: logical ids {bad} have no prefill device "
                f"row. Only a prefilled request can shrink; admit logical-only (PD) requests with "
                f"hot.alloc."
            )
        self._prefill_row[ids] = UNMAPPED
        return self.adopt_staged_hot(req_slot, ids, rows, torch.zeros(n, dtype=torch.bool), hot_size)

    def keep_resident(self, req_slot: int, logical_ids: torch.Tensor) -> list[int] | None:
        """Keep every prefill row of a request (its prompt safe on host) as a resident buffer
        (``HotBuffers.adopt_resident``): all stay mapped. Returns its pages in position order,
        or None (nothing changed) when the rows are not laid out by position; the caller then
        shrinks it with :meth:`shrink_to_hot_buffer`."""
        ids = _as_cpu_int64(logical_ids, "logical_ids")
        rows = self._prefill_row[ids]
        if ids.numel() < 1 or bool((rows <= 0).any()):
            raise ValueError(
                f"keep_resident: request slot {req_slot}: every logical id needs a prefill device row."
            )
        pages = self.hot.adopt_resident(req_slot, rows)
        if pages is not None:
            self._prefill_row[ids] = UNMAPPED
        return pages

    def adopt_staged_hot(
        self, req_slot: int, logical_ids: torch.Tensor, token_rows: torch.Tensor,
        shared: torch.Tensor, hot_size: int,
    ) -> torch.Tensor:
        """:meth:`shrink_to_hot_buffer` for rows from :meth:`take_staged_rows`: the hot buffer
        adopts ``token_rows`` (freeing the own pages no slot needs); the own tokens but the
        newest are unmapped, the shared ones stay mapped to the shared rows. Returns
        ``slot_rows`` as there."""
        ids = _as_cpu_int64(logical_ids, "logical_ids")
        slot_rows = self.hot.adopt(req_slot, token_rows, hot_size)
        own = ~shared
        own[-1] = False
        if bool(own.any()):
            self.mapping[ids[own].to(self.device)] = UNMAPPED
        return slot_rows

    def free_request(self, req_slot: int, logical_ids: torch.Tensor) -> None:
        """Everything a finished / aborted / retracted request holds: hot buffer (if any),
        logical ids, their prefill rows and all mappings."""
        if self.hot.has(req_slot):
            self.hot.release(req_slot)
        self.free(logical_ids)

    # ---- mapping ---------------------------------------------------------------------------
    def translate(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """Device rows of ``logical_ids`` (any shape, on ``device``): UNMAPPED (0) if none, -1 for -1."""
        return self.mapping[logical_ids.to(torch.int64)]

    def map_tokens(self, logical_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Point logical ids (without prefill rows) at hot-buffer rows. No host sync."""
        self.mapping[logical_ids.to(self.device, torch.int64)] = rows.to(self.device, torch.int64)

    def unmap(self, logical_ids: torch.Tensor) -> None:
        """Drop hot-buffer mappings (e.g. the previous newest token once it is on host)."""
        self.mapping[logical_ids.to(self.device, torch.int64)] = UNMAPPED

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
            ids = _as_cpu_int64(logical_ids_cpu, "logical_ids_cpu")
            owned = self._prefill_row[ids]
            pages = torch.unique(owned[owned > 0] // self.page_size)
            self.rows.check_freeable(pages)
            self.rows.free_pages(pages)
            self._prefill_row[ids] = UNMAPPED
        self.map_tokens(logical_ids, rows)

    # ---- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Both spaces balance, and every used device page is owned exactly once.

        prefill pages + hot pages == used device pages (disjoint); the device mapping agrees
        with the CPU ownership copy; every other mapping points into a hot buffer; every
        mapped logical id is in use. Syncs.
        """
        self.logical.check_integrity()
        self.rows.check_integrity()
        ps = self.page_size
        if int(self.mapping[-1]) != -1:
            raise ValueError(
                f"mapping sentinel corrupted: last element is {int(self.mapping[-1])}, expected -1."
            )
        m, own = self.mapping[:-1].cpu(), self._prefill_row
        mapped = torch.nonzero(m > 0).reshape(-1)
        if mapped.numel() and not bool(self.logical._used[mapped // ps].all()):
            raise ValueError(
                f"mapping: free logical ids still mapped: {mapped[~self.logical._used[mapped // ps]][:8].tolist()}."
            )
        has_own = own > 0
        if not torch.equal(m[has_own], own[has_own]):
            raise ValueError(
                "mapping disagrees with the CPU prefill-row ownership for some logical ids."
            )
        prefill = set(torch.unique(own[has_own] // ps).tolist())
        hot = self.hot.owned_pages()
        others = set(torch.unique(m[(m > 0) & ~has_own] // ps).tolist())
        used = set(torch.nonzero(self.rows._used).reshape(-1).tolist())
        cap, free = self.rows.num_pages, self.rows.available_pages()
        if (
            prefill & hot
            or prefill | hot != used
            or free + len(prefill) + len(hot) != cap
            or not others <= hot
        ):
            raise ValueError(
                f"device rows: free {free * ps} + used {(len(prefill) + len(hot)) * ps} (prefill "
                f"{len(prefill) * ps}, hot {len(hot) * ps}) != capacity {cap * ps}, or ownership is "
                f"inconsistent (unowned used pages {sorted(used - prefill - hot)[:8]}, owned free "
                f"pages {sorted((prefill | hot) - used)[:8]}, pages both prefill and hot "
                f"{sorted(prefill & hot)[:8]}, mappings outside hot buffers {sorted(others - hot)[:8]})."
            )
        if self._cached:
            cached = torch.tensor(list(self._cached), dtype=torch.int64)
            first = self._prefill_row[cached * ps]
            if bool((self._readers[cached] != 0).any()) or bool((first <= 0).any()):
                raise ValueError(
                    f"cached prefix pages {cached[(self._readers[cached] != 0) | (first <= 0)][:8].tolist()} "
                    f"are held or have no prefill rows; a cached page is an unheld prefill page."
                )
        self.hot.check_integrity()
