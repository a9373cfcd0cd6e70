"""Hot-buffer ownership of device rows: the per-request half of ``DualSpaceAllocator``.

Once a request's prompt is safe on host it keeps only the device rows its hot slots need
(docs/architecture.md, hot-buffer rules)::

    prompt of n tokens, hot size B          slot:  0   1  ..  B-1 |  B
    n <= B : rows of tokens 0..n-1                 t0  t1 .. (empty)| (empty)
    n >  B : rows of tokens 0..B-1 + newest        t0  t1 .. tB-1   | t(n-1)

Whole pages holding those rows are kept (page_size > 1: the other rows of a kept page become
*spare* rows, handed out first when the buffer grows); every other prefill page is freed.
The mixin only touches bookkeeping shared with ``DualSpaceAllocator`` through ``self``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang_hisparse.memory.paged import _as_cpu_int64, ceil_div

if TYPE_CHECKING:
    from sglang_hisparse.memory.paged import PagedIdAllocator

UNMAPPED = 0


@dataclass
class HotBuffer:
    """Device pages owned by one request's hot buffer, and the rows not yet given to a slot."""

    pages: list[int] = field(default_factory=list)
    spare: list[int] = field(default_factory=list)  # ascending


class HotBufferMixin:
    """shrink / alloc / grow / release of per-request hot buffers (see module docstring)."""

    rows: PagedIdAllocator
    mapping: torch.Tensor
    page_size: int
    device: torch.device
    _prefill_row: torch.Tensor
    _hot: dict[int, HotBuffer]
    _hot_page_owner: dict[int, int]

    def max_hot_pages(self, hot_size: int) -> int:
        """Worst-case device pages of one hot buffer of ``hot_size`` (B) slots + the newest slot."""
        return ceil_div(hot_size, self.page_size) + 1

    def hot_request_slots(self) -> list[int]:
        return sorted(self._hot)

    def hot_pages(self, req_slot: int) -> list[int]:
        return list(self._hot[req_slot].pages) if req_slot in self._hot else []

    def hot_spare_rows(self, req_slot: int) -> list[int]:
        return list(self._hot[req_slot].spare) if req_slot in self._hot else []

    def shrink_to_hot_buffer(
        self, req_slot: int, logical_ids: torch.Tensor, hot_size: int
    ) -> torch.Tensor:
        """Cut a prefilled request (its prompt safe on host) down to its hot buffer.

        logical_ids: int [n] (any device; read on the CPU), the request's tokens 0..n-1 in
        order, all with prefill rows. Keeps the rows of tokens ``0..min(n, B)-1`` (slots
        0..) and, when ``n > B``, the newest token's row (slot B), with the whole pages
        holding them; frees every other prefill page. Afterwards only the newest token stays
        mapped (slots get reused by the LRU, so any older mapping would go stale), and all of
        the request's rows belong to the hot buffer. Never allocates.

        Returns ``slot_rows`` int64 [B+1] (CPU): device row per slot, -1 where none yet.
        """
        if req_slot in self._hot:
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
                f"alloc_hot_buffer."
            )
        ps = self.page_size
        k = min(n, hot_size)
        slot_rows = torch.full((hot_size + 1,), -1, dtype=torch.int64)
        slot_rows[:k] = rows[:k]
        if n > hot_size:
            slot_rows[hot_size] = rows[n - 1]
        assigned = slot_rows[slot_rows >= 0]
        pages = torch.unique(rows // ps)
        keep = torch.unique(assigned // ps)
        drop = pages[~torch.isin(pages, keep)]
        self.rows.check_freeable(drop)
        self.rows.free_pages(drop)
        self._prefill_row[ids] = UNMAPPED
        self.mapping[ids[:-1].to(self.device)] = UNMAPPED
        spare = self.rows.page_ids_to_ids(keep)
        self._adopt(req_slot, keep.tolist(), spare[~torch.isin(spare, assigned)].tolist())
        return slot_rows

    def alloc_hot_buffer(self, req_slot: int, length: int, hot_size: int) -> torch.Tensor | None:
        """Hot buffer for a request with no device rows (PD direct admission).

        Allocates rows for slots ``0..min(length, B)-1`` and, when ``length > B``, slot B, in
        ascending row order. Maps nothing. Returns ``slot_rows`` int64 [B+1] (CPU, -1 where
        none) or None when the device is short (nothing changed).
        """
        if req_slot in self._hot:
            raise ValueError(
                f"alloc_hot_buffer: request slot {req_slot} already has a hot buffer; release it first."
            )
        if length < 0 or hot_size < 1:
            raise ValueError(
                f"alloc_hot_buffer: length = {length} must be >= 0 and hot_size = {hot_size} >= 1."
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
        self._adopt(req_slot, pages.tolist(), rows[need:].tolist())
        return slot_rows

    def hot_rows_to_grow(self, req_slots: list[int], hot_size: int) -> int:
        """Device rows the next decode step's hot-buffer growth takes (a query; nothing changes).

        A request whose buffer holds fewer than ``hot_size + 1`` slot rows and has no spare row
        left takes one fresh page (``page_size`` rows) when its next token needs a slot; slots
        are filled one per step, so one page per request is the most one step can take.
        Request slots without a hot buffer (still staging) take none.
        """
        need = 0
        for r in req_slots:
            buf = self._hot.get(r)
            if buf is None or buf.spare:
                continue
            if len(buf.pages) * self.page_size < hot_size + 1:
                need += self.page_size
        return need

    def grow_hot_buffer(self, req_slot: int, count: int = 1) -> torch.Tensor | None:
        """``count`` more rows for a request's hot buffer (a short request filling its next slot,
        or slot B when it first grows past B).

        Spare rows of its pages come first (lowest first), then fresh pages. Returns int64
        [count] (CPU) or None when the device is short (nothing changed).
        """
        buf = self._buffer(req_slot, "grow_hot_buffer")
        missing = count - len(buf.spare)
        if missing > 0:
            pages = self.rows.alloc_pages(ceil_div(missing, self.page_size))
            if pages is None:
                return None
            for pg in pages.tolist():
                self._hot_page_owner[pg] = req_slot
            buf.pages.extend(pages.tolist())
            buf.spare.extend(self.rows.page_ids_to_ids(pages).tolist())
        out, buf.spare = buf.spare[:count], buf.spare[count:]
        return torch.tensor(out, dtype=torch.int64)

    def release_hot_buffer(self, req_slot: int) -> None:
        """Return all pages of a request's hot buffer and unmap any logical id pointing there."""
        buf = self._buffer(req_slot, "release_hot_buffer")
        pages = torch.tensor(buf.pages, dtype=torch.int64)
        self.rows.check_freeable(pages)
        # A device-side lookup table instead of a CPU scan of the mapping: no host sync, and
        # O(logical ids) of trivially parallel work on the GPU.
        released = self._released_scratch()
        rows = self.rows.page_ids_to_ids(pages).to(self.device, non_blocking=True)
        released[rows] = True
        # mapping values are >= 0 here (the -1 sentinel is excluded); row 0 is never released
        self.mapping[:-1].masked_fill_(released[self.mapping[:-1]], UNMAPPED)
        released[rows] = False
        self.rows.free_pages(pages)
        for pg in buf.pages:
            del self._hot_page_owner[pg]
        del self._hot[req_slot]

    def free_request(self, req_slot: int, logical_ids: torch.Tensor) -> None:
        """Everything a finished / aborted / retracted request holds: hot buffer (if any),
        logical ids, their prefill rows and all mappings."""
        if req_slot in self._hot:
            self.release_hot_buffer(req_slot)
        self.free(logical_ids)  # type: ignore[attr-defined]

    def _released_scratch(self) -> torch.Tensor:
        """bool [device total rows] on ``device``, all False between calls (reused, not reallocated)."""
        scratch = getattr(self, "_released", None)
        if scratch is None:
            scratch = self._released = torch.zeros(
                self.rows.total_ids, dtype=torch.bool, device=self.device
            )
        return scratch

    def _buffer(self, req_slot: int, op: str) -> HotBuffer:
        if req_slot not in self._hot:
            raise ValueError(
                f"{op}: request slot {req_slot} has no hot buffer (slots with one: {self.hot_request_slots()[:16]})."
            )
        return self._hot[req_slot]

    def _adopt(self, req_slot: int, pages: list[int], spare: list[int]) -> None:
        for pg in pages:
            self._hot_page_owner[pg] = req_slot
        self._hot[req_slot] = HotBuffer(pages=list(pages), spare=sorted(spare))
