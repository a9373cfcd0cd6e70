"""Hot buffers: which device pages each request's hot slots own (part of ``DualSpaceAllocator``).

Once a request's prompt is safe on host it keeps only the device rows its hot slots need
(docs/architecture.md, hot-buffer rules)::

    prompt of n tokens, hot size B          slot:  0   1  ..  B-1 |  B
    n <= B : rows of tokens 0..n-1                 t0  t1 .. (empty)| (empty)
    n >  B : rows of tokens 0..B-1 + newest        t0  t1 .. tB-1   | t(n-1)

Whole pages holding those rows are kept (page_size > 1: the other rows of a kept page become
*spare* rows, handed out first when the buffer grows); every other prefill page is freed.

``HotBuffers`` is composed into the allocator and handed what it touches when it is built:
the device-row allocator it takes pages from and the logical -> device ``mapping``. Prefill
ownership (which logical id owns which device row) stays with
``DualSpaceAllocator``, which turns prefill rows into a hot buffer with :meth:`adopt`.
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


class HotBuffers:
    """Per-request hot buffers over ``rows`` (see the module docstring).

    rows: the device-row allocator (pages come from and go back to it); mapping: int64
    [logical ids + 1] on the device, the allocator's logical -> device table (mutated in
    place, never reassigned). scan_on_release: :meth:`release` also clears every mapping
    entry pointing into the released rows by scanning the whole mapping, as before it was made
    proportional (default: only with ``SGLANG_HISPARSE_UNFUSED_BOOKKEEPING``).
    """

    def __init__(
        self, rows: PagedIdAllocator, mapping: torch.Tensor, *, scan_on_release: bool | None = None
    ) -> None:
        if scan_on_release is None:
            from sglang_hisparse import envs

            scan_on_release = bool(envs.get("SGLANG_HISPARSE_UNFUSED_BOOKKEEPING"))
        self.scan_on_release = scan_on_release
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

    # ---- mutation --------------------------------------------------------------------------
    def adopt(self, req_slot: int, token_rows: torch.Tensor, hot_size: int) -> torch.Tensor:
        """Make the prefill rows of a request's tokens its hot buffer, freeing the pages no
        hot slot needs.

        token_rows: int64 [n] (CPU), the device row of each token 0..n-1 (all > 0; the caller
        has dropped their prefill ownership). Keeps the rows of tokens ``0..min(n, B)-1`` and,
        when ``n > B``, the newest token's row, with the whole pages holding them. Returns
        ``slot_rows`` int64 [B+1] (CPU): device row per slot, -1 where none yet.
        """
        self._require_new(req_slot, "shrink_to_hot_buffer")
        n, ps = token_rows.numel(), self.page_size
        k = min(n, hot_size)
        slot_rows = torch.full((hot_size + 1,), -1, dtype=torch.int64)
        slot_rows[:k] = token_rows[:k]
        if n > hot_size:
            slot_rows[hot_size] = token_rows[n - 1]
        assigned = slot_rows[slot_rows >= 0]
        pages = torch.unique(token_rows // ps)
        keep = torch.unique(assigned // ps)
        drop = pages[~torch.isin(pages, keep)]
        self.rows.check_freeable(drop)
        self.rows.free_pages(drop)
        spare = self.rows.page_ids_to_ids(keep)
        self._add(req_slot, keep.tolist(), spare[~torch.isin(spare, assigned)].tolist())
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
        return slot_rows

    def rows_to_grow(self, req_slots: list[int], hot_size: int) -> int:
        """Device rows the next decode step's hot-buffer growth takes (a query; nothing changes).

        A request whose buffer holds fewer than ``hot_size + 1`` slot rows and has no spare row
        left takes one fresh page (``page_size`` rows) when its next token needs a slot; slots
        are filled one per step, so one page per request is the most one step can take.
        Request slots without a hot buffer (still staging) take none.
        """
        need = 0
        for r in req_slots:
            buf = self._bufs.get(r)
            if buf is None or buf.spare:
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
        return torch.tensor(out, dtype=torch.int64)

    def release(self, req_slot: int) -> None:
        """Return all pages of a request's hot buffer, in time proportional to its pages.

        The mapping is left to the caller's ``free(logical_ids)``, which follows at once
        (``DualSpaceAllocator.free_request``; in a server SGLang's ``release_kv_cache`` right
        after ``request_finished``) and unmaps every id it frees. NOTE: that is enough because
        only the request's own logical ids ever point into its hot rows: prefill maps a token's
        own id, a decode step maps the new token's id onto its slot (``map_last_loc``: the
        previous newest stays mapped, harmlessly, until now), a verify round maps the window's
        ids (``prepare_spec``); and the caller frees all of them (an id freed earlier, a
        rejected draft, was unmapped then). The rejected alternative, clearing entries here by
        scanning the whole mapping (``scan_on_release``), costs O(logical ids) per finished
        request: a 10^7-entry gather + fill on the GPU for one request of a few thousand rows.
        Between this call and the free the stale entries point at free rows; nothing
        translates a finished request's ids then, and ``check_integrity`` runs after the free.
        """
        buf = self._buffer(req_slot, "hot.release")
        pages = torch.tensor(buf.pages, dtype=torch.int64)
        self.rows.check_freeable(pages)
        if self.scan_on_release:
            released = self._released_scratch()
            rows = self.rows.page_ids_to_ids(pages).to(released.device, non_blocking=True)
            released[rows] = True
            # mapping values are >= 0 here (the -1 sentinel is excluded); row 0 is never released
            self.mapping[:-1].masked_fill_(released[self.mapping[:-1]], UNMAPPED)
            released[rows] = False
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
