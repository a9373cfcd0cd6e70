"""Hot buffers: which device pages each request's hot slots own (part of ``DualSpaceAllocator``).

Once a request's prompt is safe on host it keeps only the device rows its hot slots need
(docs/architecture.md, hot-buffer rules)::

    prompt of n tokens, hot size B          slot:  0   1  ..  B-1 |  B
    n <= B : rows of tokens 0..n-1                 t0  t1 .. (empty)| (empty)
    n >  B : rows of tokens 0..B-1 + newest        t0  t1 .. tB-1   | t(n-1)

Whole pages holding those rows are kept (page_size > 1: the other rows of a kept page become
*spare* rows, handed out first when the buffer grows); every other prefill page is freed.

**Resident buffers** (``"residency": "pressure"``): a request that keeps *every* position's
row. Its pages are in position order, so position p's row is
``pages[p // page_size] * page_size + p % page_size`` (prefill and short buffers already lay
rows out that way; :meth:`adopt_resident` checks it). It grows by one page when a new token
opens one, and :meth:`shrink_resident` turns it into an ordinary hot buffer of the pages
holding positions ``0..B-1`` and the newest token (the coordinator first moves the KV of the B
positions it keeps into those rows), freeing every other page::

    resident, n tokens:   pages  P0 P1 .. P(B/ps-1) | P(B/ps) ... P((n-1)/ps)
    after the shrink:     pages  P0 P1 .. P(B/ps-1) |              P((n-1)/ps)   (rest freed)

``HotBuffers`` is composed into the allocator and handed what it touches when it is built:
the device-row allocator it takes pages from and the logical -> device ``mapping``. Prefill
ownership (which logical id owns which device row) is ``memory.prefill_rows.PrefillRows``;
``memory.handover.Handover`` turns prefill rows into a hot buffer with :meth:`adopt`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang_hisparse.memory.paged import ceil_div

if TYPE_CHECKING:
    from sglang_hisparse.memory.paged import PagedIdAllocator

UNMAPPED = 0


@dataclass
class HotBuffer:
    """Device pages owned by one request's hot buffer, and the rows not yet given to a slot."""

    pages: list[int] = field(default_factory=list)
    spare: list[int] = field(default_factory=list)  # ascending
    #: resident buffers only: positions 0..length-1 have rows (pages in position order)
    resident: bool = False
    length: int = 0
    #: short buffers: the rows of history slots 0.. in slot order (what make_resident checks)
    history: list[int] = field(default_factory=list)


class HotBuffers:
    """Per-request hot buffers over ``rows`` (see the module docstring).

    rows: the device-row allocator (pages come from and go back to it); mapping: int64
    [logical ids + 1] on the device, the allocator's logical -> device table (mutated in
    place, never reassigned).
    """

    def __init__(self, rows: PagedIdAllocator, mapping: torch.Tensor) -> None:
        self.rows = rows
        self.mapping = mapping
        self.page_size = rows.page_size
        self._bufs: dict[int, HotBuffer] = {}
        self._page_owner: dict[int, int] = {}  # device page -> request slot
        #: bool [device rows] on the mapping's device, all False between releases
        self._released: torch.Tensor | None = None

    # ---- queries ---------------------------------------------------------------------------
    def max_pages(self, hot_size: int) -> int:
        """Worst-case device pages of one hot buffer of ``hot_size`` (B) slots + the newest slot."""
        return ceil_div(hot_size, self.page_size) + 1

    def request_slots(self) -> list[int]:
        return sorted(self._bufs)

    def has(self, req_slot: int) -> bool:
        return req_slot in self._bufs

    def pages(self, req_slot: int) -> list[int]:
        return list(self._bufs[req_slot].pages) if req_slot in self._bufs else []

    def spare_rows(self, req_slot: int) -> list[int]:
        return list(self._bufs[req_slot].spare) if req_slot in self._bufs else []

    def owned_pages(self) -> set[int]:
        """Every device page some hot buffer owns."""
        return set(self._page_owner)

    def is_resident(self, req_slot: int) -> bool:
        buf = self._bufs.get(req_slot)
        return buf is not None and buf.resident

    def in_resident_buffer(self, rows: torch.Tensor) -> torch.Tensor:
        """bool [n] (CPU): whether each device row (CPU int64) lies in a page of a resident
        buffer, whose rows hold their positions' KV for as long as it stays resident (a hot
        buffer's mapped rows may be stale: a previous newest token's entry points at slot B)."""
        if rows.numel() == 0:
            return torch.zeros(0, dtype=torch.bool)
        pages, inverse = torch.unique(rows // self.page_size, return_inverse=True)
        ok = torch.tensor([self.is_resident(self._page_owner.get(pg, -1)) for pg in pages.tolist()],
                          dtype=torch.bool)
        return ok[inverse]

    def resident_slots(self) -> list[int]:
        return sorted(r for r, buf in self._bufs.items() if buf.resident)

    def resident_length(self, req_slot: int) -> int:
        """Positions a resident buffer has rows for (0 for any other buffer)."""
        buf = self._bufs.get(req_slot)
        return buf.length if buf is not None and buf.resident else 0

    def resident_row(self, req_slot: int, pos: int) -> int:
        """Device row of position ``pos`` of a resident buffer."""
        buf = self._bufs[req_slot]
        return buf.pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def resident_rows(self, req_slot: int) -> torch.Tensor:
        """int64 [length] (CPU): the device row of every position of a resident buffer."""
        buf = self._bufs[req_slot]
        ps, n = self.page_size, buf.length
        pages = torch.tensor(buf.pages, dtype=torch.int64)
        return pages.repeat_interleave(ps)[:n] * ps + torch.arange(n, dtype=torch.int64) % ps

    def resident_pages_after_shrink(self, length: int, hot_size: int) -> int:
        """Pages a resident buffer of ``length`` positions keeps when it shrinks."""
        first = ceil_div(hot_size, self.page_size)
        return first + int((length - 1) // self.page_size >= first)

    def reclaimable_rows(self, hot_size: int) -> int:
        """Rows shrinking every resident buffer would free (a query)."""
        return sum(self.reclaimable_rows_of(r, hot_size) for r in self.resident_slots())

    def reclaimable_rows_of(self, req_slot: int, hot_size: int) -> int:
        buf = self._bufs[req_slot]
        if not buf.resident:
            return 0
        keep = self.resident_pages_after_shrink(buf.length, hot_size)
        return max(0, len(buf.pages) - keep) * self.page_size

    # ---- mutation --------------------------------------------------------------------------
    def adopt(self, req_slot: int, token_rows: torch.Tensor, hot_size: int) -> torch.Tensor:
        """Make the prefill rows of a request's tokens its hot buffer, freeing the pages no
        hot slot needs.

        token_rows: int64 [n] (CPU), the device row of each token 0..n-1 (the caller has
        dropped their prefill ownership); 0 for a token whose row the request does not own (a
        shared prefix page, ``DualSpaceAllocator.take_staged_rows``), allowed only where no
        slot needs it. Keeps the rows of tokens ``0..min(n, B)-1`` and, when ``n > B``, the
        newest token's row, with the whole pages holding them. Returns ``slot_rows`` int64
        [B+1] (CPU): device row per slot, -1 where none yet.
        """
        self._require_new(req_slot, "shrink_to_hot_buffer")
        n, ps = token_rows.numel(), self.page_size
        k = min(n, hot_size)
        slot_rows = torch.full((hot_size + 1,), -1, dtype=torch.int64)
        slot_rows[:k] = token_rows[:k]
        if n > hot_size:
            slot_rows[hot_size] = token_rows[n - 1]
        assigned = slot_rows[slot_rows >= 0]
        if bool((assigned <= 0).any()):
            raise ValueError(
                f"shrink_to_hot_buffer: request slot {req_slot}: a hot slot's token has no row of its own."
            )
        pages = torch.unique(token_rows[token_rows > 0] // ps)
        keep = torch.unique(assigned // ps)
        drop = pages[~torch.isin(pages, keep)]
        self.rows.check_freeable(drop)
        self.rows.free_pages(drop)
        spare = self.rows.page_ids_to_ids(keep)
        self._add(req_slot, keep.tolist(), spare[~torch.isin(spare, assigned)].tolist())
        self._bufs[req_slot].history = token_rows[:k].tolist()
        return slot_rows

    def alloc(self, req_slot: int, length: int, hot_size: int) -> torch.Tensor | None:
        """Hot buffer for a request with no device rows (PD direct admission).

        Allocates rows for slots ``0..min(length, B)-1`` and, when ``length > B``, slot B, in
        ascending row order. Maps nothing. Returns ``slot_rows`` int64 [B+1] (CPU, -1 where
        none) or None when the device is short (nothing changed).
        """
        self._require_new(req_slot, "hot.alloc")
        if length < 0 or hot_size < 1:
            raise ValueError(
                f"hot.alloc: length = {length} must be >= 0 and hot_size = {hot_size} >= 1."
            )
        k = min(length, hot_size)
        need = k + (1 if length > hot_size else 0)
        pages = self.rows.alloc_pages(ceil_div(need, self.page_size))
        if pages is None:
            return None
        rows = self.rows.page_ids_to_ids(pages)
        slot_rows = torch.full((hot_size + 1,), -1, dtype=torch.int64)
        slot_rows[:k] = rows[:k]
        if length > hot_size:
            slot_rows[hot_size] = rows[k]
        self._add(req_slot, pages.tolist(), rows[need:].tolist())
        self._bufs[req_slot].history = rows[:k].tolist()
        return slot_rows

    def adopt_resident(self, req_slot: int, token_rows: torch.Tensor) -> list[int] | None:
        """Make the prefill rows of tokens ``0..n-1`` a resident buffer, keeping every page.

        token_rows: int64 [n] (CPU). Returns the pages in position order, or None (nothing
        changed) when the rows are not laid out by position (row of p = page(p) * ps + p % ps),
        which the resident page table needs."""
        self._require_new(req_slot, "adopt_resident")
        pages = self._positional_pages(token_rows)
        if pages is None:
            return None
        self._add(req_slot, pages, [])
        buf = self._bufs[req_slot]
        buf.resident, buf.length = True, token_rows.numel()
        return list(pages)

    def alloc_resident(self, req_slot: int, length: int) -> list[int] | None:
        """A resident buffer for a request with no device rows (PD direct admission): pages
        for positions ``0..length-1``; None when the device is short (nothing changed)."""
        self._require_new(req_slot, "alloc_resident")
        pages = self.rows.alloc_pages(ceil_div(length, self.page_size))
        if pages is None:
            return None
        self._add(req_slot, pages.tolist(), [])
        buf = self._bufs[req_slot]
        buf.resident, buf.length = True, length
        return pages.tolist()

    def make_resident(self, req_slot: int, length: int) -> list[int] | None:
        """Turn a short hot buffer holding positions ``0..length-1`` (slot p = token p) into a
        resident one; None (nothing changed) if its rows are not laid out by position."""
        buf = self._buffer(req_slot, "make_resident")
        rows = torch.tensor(buf.history, dtype=torch.int64)
        pages = self._positional_pages(rows) if rows.numel() == length else None
        if pages is None or sorted(pages) != sorted(buf.pages):
            return None
        buf.pages, buf.spare, buf.history = pages, [], []
        buf.resident, buf.length = True, length
        return list(pages)

    def grow_resident(self, req_slot: int) -> tuple[int, int | None] | None:
        """The row of a resident buffer's next position (``length``), taking a fresh page when
        that position opens one. Returns (row, (page index, page) of a page it took, or None), or
        None when no page is free (nothing changed)."""
        buf = self._buffer(req_slot, "grow_resident")
        p, ps = buf.length, self.page_size
        taken = None
        if p // ps == len(buf.pages):
            got = self.rows.alloc_pages(1)
            if got is None:
                return None
            taken = (p // ps, int(got[0]))
            buf.pages.append(taken[1])
            self._page_owner[taken[1]] = req_slot
        buf.length = p + 1
        return buf.pages[p // ps] * ps + p % ps, taken

    def resident_growth_rows(self, req_slots: list[int]) -> int:
        """Rows the next decode step's resident growth takes (one page per request whose next
        position opens a page)."""
        need = 0
        for r in req_slots:
            buf = self._bufs.get(r)
            if buf is not None and buf.resident and buf.length // self.page_size == len(buf.pages):
                need += self.page_size
        return need

    def shrink_resident(self, req_slot: int, hot_size: int) -> torch.Tensor:
        """Turn a resident buffer into an ordinary hot buffer (the module diagram): keep the
        pages of positions ``0..B-1`` and of the newest position, free the rest. The caller has
        moved the KV it keeps into those rows. Returns the freed rows, int64 (CPU)."""
        buf = self._buffer(req_slot, "shrink_resident")
        if not buf.resident or buf.length <= hot_size:
            raise ValueError(
                f"shrink_resident: request slot {req_slot} is not a resident buffer longer than "
                f"B = {hot_size} (resident {buf.resident}, length {buf.length})."
            )
        ps, n = self.page_size, buf.length
        first = ceil_div(hot_size, ps)
        keep = buf.pages[:first]
        newest_page = buf.pages[(n - 1) // ps]
        if newest_page not in keep:
            keep = keep + [newest_page]
        drop = [pg for pg in buf.pages if pg not in set(keep)]
        drop_t = torch.tensor(drop, dtype=torch.int64)
        self.rows.check_freeable(drop_t)
        self.rows.free_pages(drop_t)
        for pg in drop:
            del self._page_owner[pg]
        used = {self.resident_row(req_slot, p) for p in range(hot_size)}
        used.add(self.resident_row(req_slot, n - 1))
        own = self.rows.page_ids_to_ids(torch.tensor(keep, dtype=torch.int64)).tolist()
        buf.pages, buf.spare = keep, sorted(set(own) - used)
        buf.resident, buf.length = False, 0
        return self.rows.page_ids_to_ids(drop_t)

    def unmap_rows(self, rows: torch.Tensor) -> None:
        """Clear every mapping entry pointing into ``rows`` (int64, CPU; freed rows): a gather
        and a masked fill over the whole mapping on its device, no host sync. A shrink needs it
        (its request lives on, so no free of its ids follows); :meth:`release` does not."""
        if rows.numel() == 0:
            return
        released = self._released_scratch()
        dev_rows = rows.to(released.device, non_blocking=True)
        released.index_fill_(0, dev_rows, True)
        # mapping values are >= 0 here (the -1 sentinel is excluded); row 0 is never released
        self.mapping[:-1].masked_fill_(released[self.mapping[:-1]], UNMAPPED)
        released.index_fill_(0, dev_rows, False)

    def _unmap_into(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Unmap those of ``ids`` whose mapping points into ``rows`` (int64, CPU): proportional
        to the ids, no host sync."""
        released = self._released_scratch()
        dev_rows = rows.to(released.device, non_blocking=True)
        released.index_fill_(0, dev_rows, True)
        ids = ids.to(self.mapping.device, torch.int64).reshape(-1)
        cur = self.mapping[ids]
        self.mapping[ids] = torch.where(released[cur.clamp(min=0)], torch.zeros_like(cur), cur)
        released.index_fill_(0, dev_rows, False)

    def _positional_pages(self, rows: torch.Tensor) -> list[int] | None:
        ps, n = self.page_size, rows.numel()
        if n == 0:
            return None
        pages = rows[::ps] // ps
        pos = torch.arange(n, dtype=torch.int64)
        if not torch.equal(rows, pages.repeat_interleave(ps)[:n] * ps + pos % ps):
            return None
        return pages.tolist()

    def rows_to_grow(self, req_slots: list[int], hot_size: int) -> int:
        """Device rows the next decode step's hot-buffer growth takes (a query; nothing changes).

        A request whose buffer holds fewer than ``hot_size + 1`` slot rows and has no spare row
        left takes one fresh page (``page_size`` rows) when its next token needs a slot; slots
        are filled one per step, so one page per request is the most one step can take.
        Request slots without a hot buffer (still staging) take none.
        """
        need = self.resident_growth_rows(req_slots)
        for r in req_slots:
            buf = self._bufs.get(r)
            if buf is None or buf.spare or buf.resident:
                continue
            if len(buf.pages) * self.page_size < hot_size + 1:
                need += self.page_size
        return need

    def grow(self, req_slot: int, count: int = 1) -> torch.Tensor | None:
        """``count`` more rows for a request's hot buffer (a short request filling its next slot,
        or slot B when it first grows past B).

        Spare rows of its pages come first (lowest first), then fresh pages. Returns int64
        [count] (CPU) or None when the device is short (nothing changed).
        """
        buf = self._buffer(req_slot, "hot.grow")
        missing = count - len(buf.spare)
        if missing > 0:
            pages = self.rows.alloc_pages(ceil_div(missing, self.page_size))
            if pages is None:
                return None
            for pg in pages.tolist():
                self._page_owner[pg] = req_slot
            buf.pages.extend(pages.tolist())
            buf.spare.extend(self.rows.page_ids_to_ids(pages).tolist())
        out, buf.spare = buf.spare[:count], buf.spare[count:]
        buf.history.extend(out)
        return torch.tensor(out, dtype=torch.int64)

    def release(self, req_slot: int, *, unmap_ids: torch.Tensor | None = None,
                keep: list[int] | None = None) -> None:
        """Return all pages of a request's hot buffer, in time proportional to its pages.

        ``keep``: pages that leave the buffer without being freed (their rows become cached
        prefill rows, ``DualSpaceAllocator.cache_resident``).

        ``unmap_ids`` (int, on the mapping's device; the request's logical ids): unmap those of
        them that point into the released rows, on the device, no host sync. Needed when the
        caller's free does not follow for every id: SGLang's radix tree keeps a finished
        request's ids, and a kept id mapped to a released row would translate into whoever
        takes the row next.

        The mapping is left to the caller's ``free(logical_ids)``, which follows at once
        (``DualSpaceAllocator.free_request``; in a server SGLang's ``release_kv_cache`` right
        after ``request_finished``) and unmaps every id it frees. NOTE: that is enough because
        only the request's own logical ids ever point into its hot rows: prefill maps a token's
        own id, a decode step maps the new token's id onto its slot (``map_last_loc``: the
        previous newest stays mapped, harmlessly, until now), a verify round maps the window's
        ids (``prepare_spec``); and the caller frees all of them (an id freed earlier, a
        rejected draft, was unmapped then). The rejected alternative, clearing entries here by
        scanning the whole mapping (:meth:`unmap_rows`), costs O(logical ids) per finished
        request: a 10^7-entry gather + fill on the GPU for one request of a few thousand rows
        (at 16 M ids 162 us of GPU time per release against 9-10 us,
        ``benchmarks/results/step_overhead_h200.json``).
        Between this call and the free the stale entries point at free rows; nothing
        translates a finished request's ids then, and ``check_integrity`` runs after the free.
        """
        buf = self._buffer(req_slot, "hot.release")
        kept = set(keep or ())
        pages = torch.tensor([pg for pg in buf.pages if pg not in kept], dtype=torch.int64)
        self.rows.check_freeable(pages)
        if unmap_ids is not None and unmap_ids.numel():
            self._unmap_into(unmap_ids, self.rows.page_ids_to_ids(pages))
        self.rows.free_pages(pages)
        for pg in buf.pages:
            del self._page_owner[pg]
        del self._bufs[req_slot]

    # ---- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every page has one owner, and every buffer's spare rows lie in its own pages."""
        owned = [pg for buf in self._bufs.values() for pg in buf.pages]
        if len(owned) != len(set(owned)) or set(owned) != set(self._page_owner):
            raise ValueError(
                f"hot buffers: {len(owned)} pages listed by buffers ({len(set(owned))} distinct), "
                f"{len(self._page_owner)} in the owner table; each page must belong to one buffer."
            )
        for r, buf in self._bufs.items():
            own_rows = set(
                self.rows.page_ids_to_ids(torch.tensor(buf.pages, dtype=torch.int64)).tolist()
            )
            if not set(buf.spare) <= own_rows:
                raise ValueError(
                    f"hot buffer of request slot {r}: spare rows outside its pages {buf.pages}."
                )

    # ---- helpers ---------------------------------------------------------------------------
    def _released_scratch(self) -> torch.Tensor:
        if self._released is None:
            self._released = torch.zeros(
                self.rows.total_ids, dtype=torch.bool, device=self.mapping.device
            )
        return self._released

    def _require_new(self, req_slot: int, op: str) -> None:
        if req_slot in self._bufs:
            raise ValueError(
                f"{op}: request slot {req_slot} already has a hot buffer; release it first."
            )

    def _buffer(self, req_slot: int, op: str) -> HotBuffer:
        if req_slot not in self._bufs:
            raise ValueError(
                f"{op}: request slot {req_slot} has no hot buffer (slots with one: {self.request_slots()[:16]})."
            )
        return self._bufs[req_slot]

    def _add(self, req_slot: int, pages: list[int], spare: list[int]) -> None:
        for pg in pages:
            self._page_owner[pg] = req_slot
        self._bufs[req_slot] = HotBuffer(pages=list(pages), spare=sorted(spare))
