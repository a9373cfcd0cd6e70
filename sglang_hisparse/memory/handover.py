"""Handover: a prefilled request's prefill rows become its hot or resident buffer (part of
``DualSpaceAllocator``).

A used device page has exactly one owner at any time: prefill rows (``memory.prefill_rows``)
or a hot buffer (``memory.hot``). Once the request's prompt is safe on host the handover moves
its rows from the first owner to the second, freeing what the buffer does not keep::

    prefill rows of tokens 0..n-1          hot buffer of request slot r (B slots + newest)
    ┌────┬────┬────┬────┬────┬────┐        ┌────┬────┬────┐     ┌────┐
    │ t0 │ t1 │ t2 │ t3 │ t4 │ t5 │  ───►  │ t0 │ t1 │ t2 │ ... │ t5 │   pages of t3, t4 freed
    └────┴────┴────┴────┴────┴────┘        └────┴────┴────┘     └────┘   only t5 stays mapped

* :meth:`shrink_to_hot_buffer`: the request's own rows become its hot buffer.
* :meth:`keep_resident`: every row stays, as a resident buffer, all mapped.
* :meth:`take_staged_rows` then :meth:`adopt_staged_hot`: a request that read a shared prefix
  (``memory.prefix_share``) gets the rows of pages nobody else holds, and private copies of
  the positions its buffer needs from pages others still hold.

The handover owns no state; :meth:`check_integrity` proves the two owners partition the used
device pages. NOTE: rejected, a handover inside ``HotBuffers``: the hot buffers would then
read prefill ownership and prefix holds, and the buffer's own invariants (one owner per page,
spare rows inside its pages) would be tested only through the whole allocator.
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
    from sglang_hisparse.memory.prefix_share import PrefixShare

__all__ = ["Handover"]


class Handover:
    """Moves rows from ``prefill`` to ``hot`` (see the module docstring).

    rows: the device-row allocator; share: the prefix holds a collect drops; address_map:
    where the buffer's tokens but the newest are unmapped.
    """

    def __init__(self, rows: PagedIdAllocator, prefill: PrefillRows, share: PrefixShare,
                 hot: HotBuffers, address_map: AddressMap) -> None:
        self.rows, self.prefill, self.share = rows, prefill, share
        self.hot, self.address_map = hot, address_map
        self.page_size = rows.page_size

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
        rows = self.prefill.rows_of(ids)
        if bool((rows <= 0).any()):
            raise self._no_prefill_row("shrink_to_hot_buffer", req_slot, ids, rows, "shrink")
        self.prefill.disown(ids)
        return self.adopt_staged_hot(req_slot, ids, rows, torch.zeros(n, dtype=torch.bool), hot_size)

    def keep_resident(self, req_slot: int, logical_ids: torch.Tensor) -> list[int] | None:
        """Keep every prefill row of a request (its prompt safe on host) as a resident buffer
        (``HotBuffers.adopt_resident``): all stay mapped. Returns its pages in position order,
        or None (nothing changed) when the rows are not laid out by position; the caller then
        shrinks it with :meth:`shrink_to_hot_buffer`."""
        ids = _as_cpu_int64(logical_ids, "logical_ids")
        rows = self.prefill.rows_of(ids)
        if ids.numel() < 1 or bool((rows <= 0).any()):
            raise ValueError(
                f"keep_resident: request slot {req_slot}: every logical id needs a prefill device row."
            )
        pages = self.hot.adopt_resident(req_slot, rows)
        if pages is not None:
            self.prefill.disown(ids)
        return pages

    def take_staged_rows(
        self, req_slot: int, logical_ids: torch.Tensor, need: torch.Tensor, *, room: Room
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A staged request's rows, for its hot or resident buffer, at collect.

        logical_ids: int64 [n] (CPU), the request's tokens in order, all with prefill rows;
        need: bool [n], the positions its buffer keeps. Drops the request's holds first. Rows
        of pages nobody else holds are handed over (their prefill ownership ends); for the
        needed positions of pages another request still holds, fresh private rows are taken
        (same in-page offset, after ``room``) and the caller copies ``src -> dst`` device to
        device.

        Returns (token_rows int64 [n], 0 where a shared position is not needed; shared bool
        [n]; src; dst), or None when the private rows are short (holds restored, nothing else
        changed)."""
        ids = _as_cpu_int64(logical_ids, "logical_ids")
        held = self.share.drop_holds(req_slot)
        shared = self.share.readers(ids // self.page_size) > 0
        rows = self.prefill.rows_of(ids).clone()
        if bool((rows <= 0).any()):
            self.share.restore_holds(req_slot, held)
            raise self._no_prefill_row("take_staged_rows", req_slot, ids, rows, "be collected")
        copy = shared & need
        src = dst = torch.empty(0, dtype=torch.int64)
        if bool(copy.any()):
            src_pages = torch.unique(rows[copy] // self.page_size)
            if not room(int(src_pages.numel())):
                self.share.restore_holds(req_slot, held)
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
        self.prefill.disown(ids[~shared])
        return rows, shared, src, dst

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
            self.address_map.unmap(ids[own])
        return slot_rows

    @staticmethod
    def _no_prefill_row(op: str, req_slot: int, ids: torch.Tensor, rows: torch.Tensor,
                        what: str) -> ValueError:
        return ValueError(
            f"{op}: request slot {req_slot}: logical ids {ids[rows <= 0][:8].tolist()} have no "
            f"prefill device row. Only a prefilled request can {what}; admit logical-only (PD) "
            f"requests with hot.alloc."
        )

    def check_integrity(self) -> None:
        """Prefill pages + hot pages == used device pages (disjoint), and every mapping that
        is not a prefill row's points into a hot buffer. Syncs."""
        ps = self.page_size
        m, own = self.address_map.mapping[:-1].cpu(), self.prefill.row
        prefill = self.prefill.owned_pages()
        hot = self.hot.owned_pages()
        others = set(torch.unique(m[(m > 0) & (own <= 0)] // ps).tolist())
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
