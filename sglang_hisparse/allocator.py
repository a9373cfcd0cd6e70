"""Dual address space: logical ids (what SGLang schedules) over a smaller set of device rows.

::

    logical ids (req_to_token holds these; capacity = host_to_device_ratio * device rows)
      0 | 1 2 3 4 5 6 7 8 9 ... size_full              (page 0 reserved; + trailing sentinel)
            │   │       │
            ▼   ▼       ▼        mapping: int64 [logical total_ids + 1] on the pool's device
      0 | 1 2 3 4 ... size_device
    device rows (real HBM KV rows; row 0 = padding row, never handed out)

A device row is owned in exactly one of two ways:

* **mapped** (prefill): ``alloc_extend`` / ``alloc`` give every new logical id a device row
  and record it in ``mapping``; ``free(logical_ids)`` returns those rows.
* **hot buffer** of request slot ``r``: ``shrink_to_hot_buffer`` keeps the prompt rows the
  hot slots need and returns the rest; ``alloc_hot_buffer`` (PD direct admission) and
  ``grow_hot_buffer`` add rows; ``release_hot_buffer`` returns them all. A logical id may be
  mapped into a hot-buffer row (the newest token, so its KV write lands in slot B); such rows
  are never freed through ``free()``, and releasing the buffer unmaps whatever points there.

NOTE: the "not on device" sentinel is 0, i.e. device row 0, the padding row, rather than -1.
The pool's KV writes translate ``out_cache_loc`` through ``mapping`` without a check (a
check would be a host sync on every layer); an unmapped id then writes harmlessly into the
padding row instead of faulting at row -1 or corrupting another request's row. The extra
last element is -1 so that SGLang's ``last_loc = -1`` ("no prefix") translates to -1.

Everything is query-then-mutate: allocation returns None with nothing changed when either
space is short; bad frees raise ``ValueError`` before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_hisparse.memory_paged import PagedIdAllocator, _as_cpu_int64, ceil_div

__all__ = ["UNMAPPED", "DualSpaceAllocator", "PagedIdAllocator", "ceil_div"]

#: mapping value of a logical id with no device row (device row 0 = the padding row)
UNMAPPED = 0


@dataclass
class _HotBuffer:
    pages: list[int] = field(default_factory=list)  # device pages owned by the request
    spare: list[int] = field(
        default_factory=list
    )  # rows in those pages not given to a slot, ascending


class DualSpaceAllocator:
    """Logical-id allocator + device-row allocator + the logical → device ``mapping``.

    device_rows:          usable device KV rows (SGLang's ``max_total_num_tokens``)
    host_to_device_ratio: logical capacity = ratio * device_rows
    page_size:            ids per page, shared by both spaces (in-page offsets agree)
    device:               where ``mapping`` and returned ids live
    """

    def __init__(
        self,
        device_rows: int,
        *,
        host_to_device_ratio: int,
        page_size: int = 1,
        device: str | torch.device = "cpu",
    ):
        if host_to_device_ratio < 1:
            raise ValueError(
                f"host_to_device_ratio = {host_to_device_ratio} must be >= 1; use 1 (no oversubscription) or more."
            )
        self.page_size = page_size
        self.host_to_device_ratio = host_to_device_ratio
        self.device = torch.device(device)
        self.logical = PagedIdAllocator(
            device_rows * host_to_device_ratio, page_size, device=device, name="logical ids"
        )
        self.rows = PagedIdAllocator(device_rows, page_size, device=device, name="device rows")
        #: int64 [logical.total_ids + 1]: device row of each logical id, UNMAPPED (0) if none; last = -1
        self.mapping = torch.zeros(
            self.logical.total_ids + 1, dtype=torch.int64, device=self.device
        )
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
        """Ids a prefill could take now: min of free logical ids and free device rows."""
        return min(self.logical.available_size(), self.rows.available_size())

    def max_hot_pages(self, hot_size: int) -> int:
        """Worst-case device pages of one hot buffer of ``hot_size`` (B) slots + the newest slot."""
        return ceil_div(hot_size, self.page_size) + 1

    def hot_request_slots(self) -> list[int]:
        return sorted(self._hot)

    def hot_pages(self, req_slot: int) -> list[int]:
        return list(self._hot[req_slot].pages) if req_slot in self._hot else []

    # ---- SGLang-shaped allocation ----------------------------------------------------------
    def clear(self) -> None:
        self.logical.clear()
        self.rows.clear()
        self.mapping.zero_()
        self.mapping[-1] = -1
        self._hot: dict[int, _HotBuffer] = {}
        self._hot_page_owner: dict[int, int] = {}  # device page -> request slot

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` (page multiple) logical ids, each mapped to a fresh device row; int64 [n] or None."""
        if n // self.page_size > min(self.logical.available_pages(), self.rows.available_pages()):
            return None
        ids, rows = self.logical.alloc(n), self.rows.alloc(n)
        self.mapping[ids] = rows
        return ids

    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """Prefill: logical ids AND device rows for positions ``prefix_lens..seq_lens-1``, mapped.

        Layout as ``PagedIdAllocator.alloc_extend`` in both spaces (a chunk that continues a
        mid-page prefix continues the prefix's device page too, found through ``mapping``).
        prefix_lens / seq_lens: int [bs] (CPU); last_loc: int64 [bs] logical id of each
        request's last prefix token (-1 if none). Returns logical ids int64 [extend tokens]
        on ``device``, or None (nothing changed).
        """
        need = self.logical.pages_needed_extend(prefix_lens, seq_lens)
        if need > self.logical.available_pages() or need > self.rows.available_pages():
            return None
        p = _as_cpu_int64(prefix_lens, "prefix_lens")
        mid = (p % self.page_size != 0) & (_as_cpu_int64(seq_lens, "seq_lens") > p)
        dev_last = torch.full_like(p, -1)
        if bool(mid.any()):
            dev_last = self.mapping[last_loc.to(self.device, torch.int64)].cpu()
            in_hot = torch.tensor(
                [int(r) // self.page_size in self._hot_page_owner for r in dev_last.tolist()],
                dtype=torch.bool,
            )
            if bool((dev_last[mid] <= 0).any() or in_hot[mid].any()):
                raise ValueError(
                    f"alloc_extend: prefix tokens {last_loc.cpu()[mid & ((dev_last <= 0) | in_hot)].tolist()} (logical) have no "
                    f"prefill device row, so a chunk cannot continue their page. Chunked prefill must run before the "
                    f"request is shrunk to its hot buffer."
                )
        ids = self.logical.alloc_extend(p, seq_lens, last_loc)
        rows = self.rows.alloc_extend(p, seq_lens, dev_last)
        self.mapping[ids] = rows
        return ids

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """Decode: one logical id per request (no device row: the coordinator maps it to slot B)."""
        return self.logical.alloc_decode(seq_lens, last_loc)

    def alloc_logical_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """PD / speculative paths: logical ids only, unmapped. Same layout as ``alloc_extend``."""
        return self.logical.alloc_extend(prefix_lens, seq_lens, last_loc)

    def free(self, logical_ids: torch.Tensor) -> None:
        """Free logical ids (whole pages), unmap them, and free the mapped device rows.

        Rows that belong to a hot buffer are only unmapped (``release_hot_buffer`` returns
        them). Raises ValueError, nothing changed, on a double free or foreign id in either
        space. Syncs with the device (it reads the mapping on the CPU).
        """
        ids = _as_cpu_int64(logical_ids, "logical ids to free")
        if ids.numel() == 0:
            return
        if int(ids.min()) < 0 or int(ids.max()) >= self.logical.total_ids:
            raise ValueError(
                f"free: logical id(s) outside 0..{self.logical.total_ids - 1}: "
                f"{ids[(ids < 0) | (ids >= self.logical.total_ids)][:8].tolist()}; they are not from this allocator."
            )
        dev_ids = ids.to(self.device)
        rows = self.mapping[dev_ids].cpu()
        pages = torch.unique(rows[rows > 0] // self.page_size)
        owned = torch.tensor(
            [pg not in self._hot_page_owner for pg in pages.tolist()], dtype=torch.bool
        )
        pages = pages[owned] if pages.numel() else pages
        log_pages = torch.unique(ids // self.page_size)
        self.logical.check_freeable(log_pages)
        self.rows.check_freeable(pages)
        self.logical.free_pages(log_pages)
        self.rows.free_pages(pages)
        self.mapping[dev_ids] = UNMAPPED

    # ---- mapping ---------------------------------------------------------------------------
    def translate(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """Device rows of ``logical_ids`` (any shape, on ``device``): UNMAPPED (0) if none, -1 for -1."""
        return self.mapping[logical_ids.to(torch.int64)]

    def map_tokens(self, logical_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Point logical ids at device rows (the coordinator's newest-token write target). No sync."""
        self.mapping[logical_ids.to(self.device, torch.int64)] = rows.to(self.device, torch.int64)

    def unmap(self, logical_ids: torch.Tensor) -> None:
        self.mapping[logical_ids.to(self.device, torch.int64)] = UNMAPPED

    # ---- hot buffers (coordinator) ---------------------------------------------------------
    def shrink_to_hot_buffer(
        self, req_slot: int, logical_ids: torch.Tensor, hot_size: int
    ) -> torch.Tensor:
        """Cut a prefilled request (its prompt safe on host) down to its hot buffer.

        logical_ids: int [n], the request's tokens 0..n-1 in order, all mapped by prefill.
        Keeps the rows of tokens ``0..min(n, B)-1`` (slots 0..) and, when ``n > B``, the newest
        token's row (slot B), with the whole pages holding them; frees every other prefill
        page. Afterwards only the newest token stays mapped (slots get reused by the LRU, so
        any older mapping would go stale). Never allocates.

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
        rows = self.mapping[ids.to(self.device)].cpu()
        if bool((rows <= 0).any()):
            bad = ids[rows <= 0][:8].tolist()
            raise ValueError(
                f"shrink_to_hot_buffer: request slot {req_slot}: logical ids {bad} have no device row. Only a "
                f"prefilled request can shrink; admit logical-only (PD) requests with alloc_hot_buffer."
            )
        ps = self.page_size
        pages = torch.unique(rows // ps)
        if any(pg in self._hot_page_owner for pg in pages.tolist()):
            raise ValueError(
                f"shrink_to_hot_buffer: request slot {req_slot}: its rows overlap another hot buffer."
            )
        k = min(n, hot_size)
        slot_rows = torch.full((hot_size + 1,), -1, dtype=torch.int64)
        slot_rows[:k] = rows[:k]
        if n > hot_size:
            slot_rows[hot_size] = rows[n - 1]
        assigned = slot_rows[slot_rows >= 0]
        keep = torch.unique(assigned // ps)
        drop = pages[~torch.isin(pages, keep)]
        self.rows.check_freeable(drop)
        self.rows.free_pages(drop)
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

    def grow_hot_buffer(self, req_slot: int, count: int = 1) -> torch.Tensor | None:
        """``count`` more rows for a request's hot buffer (a short request growing a slot).

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
        # A device-side lookup table instead of a CPU scan: no sync, O(logical ids) on the GPU.
        released = torch.zeros(self.rows.total_ids, dtype=torch.bool, device=self.device)
        released[self.rows.page_ids_to_ids(pages).to(self.device)] = True
        # mapping values are >= 0 here (the -1 sentinel is excluded); row 0 is never released
        hit = released[self.mapping[:-1]]
        self.mapping[:-1].masked_fill_(hit, UNMAPPED)
        self.rows.free_pages(pages)
        for pg in buf.pages:
            del self._hot_page_owner[pg]
        del self._hot[req_slot]

    def free_request(self, req_slot: int, logical_ids: torch.Tensor) -> None:
        """Everything a finished / aborted / retracted request holds: hot buffer (if any),
        logical ids, their device rows and mappings."""
        if req_slot in self._hot:
            self.release_hot_buffer(req_slot)
        self.free(logical_ids)

    def _buffer(self, req_slot: int, op: str) -> _HotBuffer:
        if req_slot not in self._hot:
            raise ValueError(
                f"{op}: request slot {req_slot} has no hot buffer (slots with one: {self.hot_request_slots()[:16]})."
            )
        return self._hot[req_slot]

    def _adopt(self, req_slot: int, pages: list[int], spare: list[int]) -> None:
        for pg in pages:
            self._hot_page_owner[pg] = req_slot
        self._hot[req_slot] = _HotBuffer(pages=list(pages), spare=sorted(spare))

    # ---- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Both spaces balance, and every used device page is owned exactly once.

        Mapped pages (rows referenced by ``mapping`` outside hot buffers) + hot pages must
        equal the used device pages; every mapped logical id must be in use. Syncs.
        """
        self.logical.check_integrity()
        self.rows.check_integrity()
        ps = self.page_size
        m = self.mapping[:-1].cpu()
        if int(self.mapping[-1]) != -1:
            raise ValueError(
                f"mapping sentinel corrupted: last element is {int(self.mapping[-1])}, expected -1."
            )
        mapped_ids = torch.nonzero(m > 0).reshape(-1)
        if mapped_ids.numel() and not bool(self.logical._used[mapped_ids // ps].all()):
            raise ValueError(
                f"mapping: free logical ids still mapped: {mapped_ids[~self.logical._used[mapped_ids // ps]][:8].tolist()}."
            )
        mapped_pages = set(torch.unique(m[mapped_ids] // ps).tolist())
        hot = set(self._hot_page_owner)
        prefill = mapped_pages - hot
        used = set(torch.nonzero(self.rows._used).reshape(-1).tolist())
        cap, free = self.rows.num_pages, self.rows.available_pages()
        if prefill | hot != used or free + len(prefill) + len(hot) != cap:
            raise ValueError(
                f"device rows: free {free * ps} + used {(len(prefill) + len(hot)) * ps} (prefill {len(prefill) * ps}, "
                f"hot {len(hot) * ps}) != capacity {cap * ps}, or owned pages disagree with the allocator "
                f"(unowned used pages {sorted(used - prefill - hot)[:8]}, owned free pages {sorted((prefill | hot) - used)[:8]})."
            )
        for r, buf in self._hot.items():
            own = set(
                self.rows.page_ids_to_ids(torch.tensor(buf.pages, dtype=torch.int64)).tolist()
            )
            if not set(buf.spare) <= own:
                raise ValueError(
                    f"hot buffer of request slot {r}: spare rows outside its pages {buf.pages}."
                )
