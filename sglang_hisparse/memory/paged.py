"""Paged id allocator: the free-list building block of both HiSparse address spaces.

Ids are grouped in pages of ``page_size`` consecutive ids; page ``p`` holds ids
``p*page_size .. p*page_size + page_size - 1``. Page 0 is reserved: it is SGLang's padding
slot (graph-padded rows and dummy tokens write there), so it is never handed out. With
``size`` usable ids the id space is ``0 .. (size // page_size + 1) * page_size - 1``::

    page:  0 (reserved)   1            2                 num_pages
    ids:   [0 .. P-1]     [P .. 2P-1]  [2P .. 3P-1]  ...  [num_pages*P .. (num_pages+1)*P-1]

Bookkeeping (free list, ownership bitmap) lives on the CPU; ids are returned on
``device``. NOTE: SGLang keeps its free list on the GPU and fills ids with a Triton kernel.
We keep it on the CPU because every allocation size here is known on the CPU already
(``seq_lens_cpu``) and a CPU bitmap lets ``free()`` reject double frees and foreign ids
exactly; results travel to the device with ``non_blocking=True`` (pageable memory is staged
by the driver at call time, so no stream wait), which keeps the overlap scheduler free of
host syncs on the decode path.

Free-list order (asserted by tests): initially ascending; ``alloc`` takes pages from the
front; ``free`` puts the freed pages, ascending, in front, so the most recently freed pages
are reused first.
"""

from __future__ import annotations

import torch

__all__ = ["PagedIdAllocator", "ceil_div"]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _as_cpu_int64(x: torch.Tensor | list[int], name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name}: dtype {t.dtype} is not an integer id type; pass int32 or int64 ids."
        )
    return t.reshape(-1).to("cpu", torch.int64)


class PagedIdAllocator:
    """Free list of page-grouped int64 ids with exact ownership tracking.

    size:      usable ids (rounded down to whole pages; page 0 comes on top of it)
    page_size: ids per page (>= 1)
    device:    where returned id tensors live
    name:      used in error messages ("logical ids", "device rows", ...)
    """

    def __init__(
        self,
        size: int,
        page_size: int = 1,
        *,
        device: str | torch.device = "cpu",
        name: str = "ids",
    ):
        if page_size < 1:
            raise ValueError(f"{name}: page_size = {page_size} must be >= 1.")
        if size < page_size:
            raise ValueError(
                f"{name}: size = {size} must hold at least one page of page_size = {page_size}; "
                f"give the pool more memory or use a smaller page size."
            )
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        #: ids 0..total_ids-1 exist (page 0 included); size arrays indexed by id with this
        self.total_ids = (self.num_pages + 1) * page_size
        self.device = torch.device(device)
        self.name = name
        self.clear()

    # ---- queries -------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free ids (whole pages)."""
        return self._free.numel() * self.page_size

    def available_pages(self) -> int:
        return self._free.numel()

    def used_size(self) -> int:
        return self._num_used * self.page_size

    def is_used(self, ids: torch.Tensor) -> torch.Tensor:
        """bool [n] (CPU): whether the page of each id is currently handed out."""
        return self._used[_as_cpu_int64(ids, "ids") // self.page_size]

    # ---- mutation ------------------------------------------------------------------------
    def clear(self) -> None:
        """Return every page; the free list restarts ascending from page 1."""
        self._free = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self._used = torch.zeros(self.num_pages + 1, dtype=torch.bool)
        self._num_used = 0

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        """Take ``num_pages`` pages from the front of the free list.

        Returns page ids int64 [num_pages] on the CPU, or None (nothing changed) when fewer
        are free.
        """
        if num_pages < 0:
            raise ValueError(f"{self.name}: num_pages = {num_pages} must be >= 0.")
        if num_pages > self._free.numel():
            return None
        pages, self._free = self._free[:num_pages], self._free[num_pages:]
        self._used[pages] = True
        self._num_used += num_pages
        return pages

    def claim_pages(self, pages: torch.Tensor) -> bool:
        """Hand out the given distinct free pages (an id space whose pages another allocator
        decides: DeepSeek-V4's compressed ids follow SGLang's full-token pages). False, nothing
        changed, when any of them is in use; ValueError for pages outside 1..num_pages."""
        pages = _as_cpu_int64(pages, f"{self.name} pages to claim")
        if pages.numel() == 0:
            return True
        if int(pages.min()) < 1 or int(pages.max()) > self.num_pages or torch.unique(pages).numel() != pages.numel():
            raise ValueError(f"{self.name}: claim_pages({pages.tolist()[:8]}...): pages must be distinct, in "
                             f"1..{self.num_pages}.")
        if bool(self._used[pages].any()):
            return False
        self._used[pages] = True
        self._num_used += pages.numel()
        self._free = self._free[~torch.isin(self._free, pages)]
        return True

    def alloc(self, n: int) -> torch.Tensor | None:
        """Allocate ``n`` ids, a multiple of ``page_size`` (SGLang's paged ``alloc`` contract).

        Returns int64 [n] on ``device``: whole pages, each page's ids ascending, or None when
        there is no room.
        """
        if n < 0 or n % self.page_size:
            raise ValueError(
                f"{self.name}: alloc({n}) must ask for a non-negative multiple of page_size = "
                f"{self.page_size}; round the request up to whole pages."
            )
        pages = self.alloc_pages(n // self.page_size)
        if pages is None:
            return None
        return self.page_ids_to_ids(pages).to(self.device, non_blocking=True)

    def page_ids_to_ids(self, pages: torch.Tensor) -> torch.Tensor:
        """int64 [len(pages) * page_size] (CPU): every id of each page, page by page."""
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages.to("cpu", torch.int64)[:, None] * self.page_size + offsets).reshape(-1)

    def free(self, ids: torch.Tensor | list[int]) -> None:
        """Return the pages of ``ids`` (SGLang semantics: any id of a page frees the whole page).

        Raises ValueError (nothing changed) for an id outside the pool, the reserved page 0, or
        a page that is not handed out (double free).
        """
        cpu = _as_cpu_int64(ids, f"{self.name} to free")
        if cpu.numel() == 0:
            return
        self.free_pages(torch.unique(cpu // self.page_size))

    def free_pages(self, pages: torch.Tensor) -> None:
        """Return distinct page ids (see ``free`` for the errors)."""
        pages = _as_cpu_int64(pages, f"{self.name} pages to free")
        if pages.numel() == 0:
            return
        self.check_freeable(pages)
        self._used[pages] = False
        self._num_used -= pages.numel()
        self._free = torch.cat((torch.sort(pages).values, self._free))

    def check_freeable(self, pages: torch.Tensor) -> None:
        """Raise the ``free`` errors for distinct page ids without changing anything."""
        pages = _as_cpu_int64(pages, f"{self.name} pages to free")
        if pages.numel() == 0:
            return
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 1 or hi > self.num_pages:
            bad = pages[(pages < 1) | (pages > self.num_pages)][:8].tolist()
            raise ValueError(
                f"{self.name}: cannot free page(s) {bad}: valid pages are 1..{self.num_pages} "
                f"(page 0 is the reserved padding page; page_size = {self.page_size}). "
                f"The ids do not belong to this pool."
            )
        if torch.unique(pages).numel() != pages.numel():
            raise ValueError(
                f"{self.name}: free_pages got duplicate page ids {pages.tolist()[:16]}."
            )
        used = self._used[pages]
        if not bool(used.all()):
            bad = pages[~used][:8].tolist()
            raise ValueError(
                f"{self.name}: double free of page(s) {bad} (ids {bad[0] * self.page_size}.. ): "
                f"they are already free ({self.available_size()} of {self.size} ids free)."
            )

    # ---- paged extend / decode (SGLang's alloc_extend / alloc_decode layout) ---------------
    def pages_needed_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor) -> int:
        """New pages an extend from ``prefix_lens`` to ``seq_lens`` (CPU, per request) needs."""
        p = _as_cpu_int64(prefix_lens, "prefix_lens")
        s = _as_cpu_int64(seq_lens, "seq_lens")
        ps = self.page_size
        return int(((s + ps - 1) // ps - (p + ps - 1) // ps).clamp_(min=0).sum())

    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """``alloc_extend_cpu``, returned on ``device``."""
        ids = self.alloc_extend_cpu(prefix_lens, seq_lens, last_loc)
        return None if ids is None else ids.to(self.device, non_blocking=True)

    def alloc_extend_cpu(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """Ids for positions ``prefix_lens[i] .. seq_lens[i]-1`` of each request, concatenated.

        A request whose prefix ends mid-page continues that page (``last_loc[i] + 1, ...``);
        the rest takes fresh pages, position ``q`` at offset ``q % page_size``. All inputs are
        per-request int tensors (CPU, or ``last_loc`` anywhere: it is read only when a prefix
        ends mid-page). Returns int64 [sum(seq-prefix)] on the CPU, or None (no change).
        """
        p = _as_cpu_int64(prefix_lens, "prefix_lens")
        s = _as_cpu_int64(seq_lens, "seq_lens")
        if p.shape != s.shape or bool((s < p).any()):
            raise ValueError(
                f"{self.name}: alloc_extend needs seq_lens >= prefix_lens per request, got {p.tolist()} / {s.tolist()}."
            )
        ps = self.page_size
        pages = self.alloc_pages(self.pages_needed_extend(p, s))
        if pages is None:
            return None
        mid_page = (p % ps != 0) & (s > p)
        last = _as_cpu_int64(last_loc, "last_loc") if bool(mid_page.any()) else None
        out, used = [], 0
        for i, (pi, si) in enumerate(zip(p.tolist(), s.tolist(), strict=True)):
            q = pi
            if pi % ps and si > pi:
                head = min(si, ceil_div(pi, ps) * ps) - pi
                start = int(last[i]) + 1
                out.append(torch.arange(start, start + head, dtype=torch.int64))
                q += head
            n_new = ceil_div(si, ps) - ceil_div(q, ps) if si > q else 0
            if n_new:
                ids = self.page_ids_to_ids(pages[used : used + n_new])[: si - q]
                out.append(ids)
                used += n_new
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """One id per request for the token at position ``seq_lens[i] - 1`` (seq_lens CPU).

        Requests whose new token opens a page get a fresh page's first id; the others get
        ``last_loc + 1``, computed on ``last_loc``'s device without a host sync. Returns int64
        [bs] on ``last_loc``'s device, or None (no change).
        """
        s = _as_cpu_int64(seq_lens, "seq_lens")
        if self.page_size == 1:
            pages = self.alloc_pages(s.numel())
            return None if pages is None else pages.to(self.device, non_blocking=True)
        opens = (s - 1) % self.page_size == 0
        pages = self.alloc_pages(int(opens.sum()))
        if pages is None:
            return None
        starts = torch.zeros(s.numel(), dtype=torch.int64)
        starts[opens] = pages * self.page_size
        dev = last_loc.device
        return torch.where(
            opens.to(dev, non_blocking=True),
            starts.to(dev, non_blocking=True),
            last_loc.to(torch.int64) + 1,
        )

    # ---- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ValueError unless free + used == capacity and the free list is consistent."""
        free, used, cap = self._free.numel(), self._num_used, self.num_pages
        ps = self.page_size
        if free + used != cap or int(self._used.sum()) != used:
            raise ValueError(
                f"{self.name}: integrity broken: free {free * ps} + used {used * ps} != capacity "
                f"{cap * ps} ids (bitmap says {int(self._used.sum()) * ps} used)."
            )
        if free and (
            torch.unique(self._free).numel() != free
            or bool(self._used[self._free].any())
            or int(self._free.min()) < 1
        ):
            raise ValueError(
                f"{self.name}: free list corrupt: free {free * ps} + used {used * ps} == capacity "
                f"{cap * ps} ids, but it holds duplicates, page 0, or pages marked used."
            )
        if bool(self._used[0]):
            raise ValueError(
                f"{self.name}: reserved page 0 is marked used (free {free * ps}, used {used * ps}, capacity {cap * ps})."
            )
