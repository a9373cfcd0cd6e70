"""Pressure-driven residency: requests keep all their device rows until HBM runs short.

``"residency": "pressure"`` (the default; ``"always_hot"`` is the earlier behaviour, every
request cut to its B-slot hot buffer as soon as it decodes)::

      staged / PD-admitted / short request growing past B
                 │ free device rows >= watermark (after taking its rows)
                 ▼
         RESIDENT: every position has a device row (res_pages); resolve = page-table lookup
                 │   (kernel first level: no hash, no LRU, no host read); the write-through
                 │   backup still runs, so the host copy stays complete
                 │ free rows < watermark before a step, or an allocation (prefill, PD
                 │ admission, growth) that cannot be met: shrink the longest resident first
                 ▼
         HOT: B history slots warm from the recent selections + slot B (the newest)

**Shrink** (all on the caller's stream after the forward, backup and prefetch streams, so no
in-flight step reads a row after it moved or was freed; nothing here is captured in a CUDA
graph, and the kernel reads the resident flag on the device, so a graph replayed later simply
takes the hot path): per layer, the B positions kept are those the request selected in the
last ``B // k`` steps (the resolve records them in its unused slot history,
``kernels.contract.ResidentRows``), then the most recent ones. Kept positions below B stay in
their own rows (slot p = position p); the others move, device to device, into the rows of the
positions below B that were not kept. The LRU order follows the same score (recorded first
as newest). Then every page but those of positions ``0..B-1`` and of the newest token is
freed, and mappings into them are cleared. No host IO: the host already holds every token.

NOTE: victims are the longest resident requests first: one shrink frees the most rows, and a
long context's B-slot buffer is the smallest share of it. Shrunk requests are not regrown:
regrowing means copying the whole context host -> device (``n`` rows x L layers), the IO this
mode exists to avoid, for a request that pressure may shrink again; new requests arriving once
pressure is gone start resident. Speculative decoding keeps ``always_hot`` (the verify kernel
has no resident level yet).
"""

from __future__ import annotations

import logging

import torch

from sglang_hisparse.coordinator import transfer
from sglang_hisparse.coordinator.context import CoreContext
from sglang_hisparse.coordinator.state import Phase
from sglang_hisparse.kernels.reference import resident_hint
from sglang_hisparse.memory.paged import ceil_div

logger = logging.getLogger("sglang_hisparse")

__all__ = ["Residency", "ShrinkPlan", "shrink_plan"]


class Residency:
    """The policy above for one TP rank (decisions use host-side counts only, so every rank
    of a TP group decides the same).

    mode: ``"pressure"`` or ``"always_hot"``; watermark_rows: free device rows kept in reserve
    (a step shrinks resident requests when fewer are free); record_layer: per local layer, the
    layer whose resolve records its selections (the anchor of a shared-index group, else
    itself).
    """

    def __init__(self, ctx: CoreContext, *, mode: str, watermark_rows: int,
                 record_layer: list[int]) -> None:
        self.ctx = ctx
        self.enabled = mode == "pressure" and ctx.state.resident_rows is not None
        self.watermark_rows = max(0, int(watermark_rows))
        self.record_layer = torch.tensor(record_layer, dtype=torch.int64, device=ctx.device)
        self.ring_blocks = max(1, ctx.buffer_size // ctx.top_k)
        self._step = 0
        self.shrinks = 0
        self.shrunk_rows = 0
        self.resident_admissions = 0
        if self.enabled:
            ctx.allocator.set_reclaimer(self)

    # -- queries ---------------------------------------------------------------------------
    @property
    def rows_free(self) -> int:
        return self.ctx.allocator.rows.available_size()

    def counts(self) -> dict[str, int]:
        """Requests resident / hot (decoding), free device rows, shrinks so far."""
        st = self.ctx.state
        resident = sum(st.is_resident)
        decoding = sum(1 for p in st.phase if p is Phase.DECODING)
        return {"resident": resident, "hot": decoding - resident, "free_rows": self.rows_free,
                "cached_rows": self.ctx.allocator.cached_rows,
                "cached_evicted_rows": self.ctx.allocator.cached_evicted_rows,
                "watermark_rows": self.watermark_rows, "shrinks": self.shrinks,
                "shrunk_rows": self.shrunk_rows, "resident_admissions": self.resident_admissions}

    def reclaimable_rows(self) -> int:
        return self.ctx.allocator.hot.reclaimable_rows(self.ctx.buffer_size)

    def _room(self, rows: int) -> bool:
        return self.rows_free - rows >= self.watermark_rows

    # -- admission -------------------------------------------------------------------------
    def wants_resident(self, n: int) -> bool:
        """Whether a staged request of ``n`` tokens should keep every row (its prefill rows
        are already held, so it costs none unless it copies rows another request reads)."""
        return self.enabled and n > self.ctx.buffer_size and self._room(0)

    def note_resident(self, r: int, pages: list[int], n: int) -> None:
        """A staged request kept all its rows as a resident buffer of ``pages``."""
        self.ctx.state.install_resident(r, pages, n)
        self.resident_admissions += 1
        self._log_change(f"request slot {r} ({n} tokens) stays resident", level=logging.DEBUG)

    def admit_direct(self, r: int, n: int) -> bool:
        """PD direct admission: take rows for all ``n`` tokens and load them from host when
        there is room; False: the caller gives it a hot buffer."""
        ctx = self.ctx
        need = ceil_div(n, ctx.allocator.page_size) * ctx.allocator.page_size
        if not self.enabled or n <= ctx.buffer_size or not self._room(need):
            return False
        pages = ctx.allocator.hot.alloc_resident(r, n)
        if pages is None:
            return False
        rows = ctx.allocator.hot.resident_rows(r).to(ctx.device, non_blocking=True)
        # NOTE: on the caller's stream, as the short preload: the first resolve reads them.
        transfer.to_device(ctx, ctx.host.host_rows[r, :n], rows)
        ctx.state.install_resident(r, pages, n)
        ctx.telemetry.add_direct(n, n * ctx.item_bytes * ctx.num_layers)
        self.resident_admissions += 1
        self._log_change(f"PD request slot {r} ({n} tokens) admitted resident", level=logging.DEBUG)
        return True

    def make_resident(self, r: int, length: int) -> bool:
        """A short request whose next token needs slot B stays resident instead (when the
        rows of its next page leave the watermark); False: it grows past B as a hot buffer."""
        ps = self.ctx.allocator.page_size
        if not self.enabled or not self._room(ps):
            return False
        pages = self.ctx.allocator.hot.make_resident(r, length)
        if pages is None:
            return False
        self.ctx.state.install_resident(r, pages, length)
        self.resident_admissions += 1
        return True

    # -- per step --------------------------------------------------------------------------
    def begin_step(self, req_slots: list[int]) -> None:
        """Before a decode step's growth: advance the selection record and relieve pressure
        (free rows for this step's growth plus the watermark)."""
        if not self.enabled:
            return
        self._step += 1
        rr = self.ctx.state.resident_rows
        assert rr is not None
        if self.ring_blocks > 1:
            rr.ring.fill_(self._step % self.ring_blocks)
        hot, B = self.ctx.allocator.hot, self.ctx.buffer_size
        need = hot.rows_to_grow(req_slots, B)
        self.relieve(need + self.watermark_rows, why="free rows below the watermark")
        # Not enough to shrink outside the batch: the batch's own resident requests that need
        # a page this step become hot instead (before their growth, so nothing is half done).
        growing = [r for r in req_slots if hot.resident_growth_rows([r])]
        for r in sorted(growing, key=lambda r: -hot.reclaimable_rows_of(r, B)):
            if self.rows_free >= hot.rows_to_grow(req_slots, B):
                break
            self.shrink(r)
            self._log_change(f"shrank request slot {r} in the batch (no page for its next token)")

    def next_row(self, r: int) -> int:
        """The row of resident request ``r``'s new token (a new page when it opens one).
        :meth:`begin_step` has made room; raises if there is none."""
        hot = self.ctx.allocator.hot
        got = hot.grow_resident(r)
        if got is None:
            raise RuntimeError(
                f"map_last_loc: no free device page for resident request slot {r}'s next token "
                f"({self.rows_free} rows free) and nothing left to shrink."
            )
        row, taken = got
        if taken is not None:
            self.ctx.state.set_resident_page(r, *taken)
        return row

    # -- pressure ----------------------------------------------------------------------------
    def relieve(self, target_free: int, *, why: str) -> int:
        """Drop cached prefix rows, then shrink resident requests (longest first), until
        ``target_free`` rows are free or none is left; returns the rows freed."""
        freed = self.ctx.allocator.evict_cached(max(0, target_free - self.rows_free))
        return freed + self._shrink_until(lambda _: self.rows_free >= target_free, why=why)

    def reclaim(self, rows: int) -> int:
        """Allocator hook: free at least ``rows`` more device rows if cached prefix rows or
        resident requests hold them (an allocation that cannot be met otherwise)."""
        cached = self.ctx.allocator.evict_cached(rows)
        return cached + self._shrink_until(lambda freed: cached + freed >= rows,
                                           why=f"an allocation of {rows} rows found the device short")

    def _shrink_until(self, done, *, why: str) -> int:
        freed, shrunk = 0, []
        while not done(freed):
            victim = self._victim()
            if victim is None:
                break
            freed += self.shrink(victim)
            shrunk.append(victim)
        if shrunk:
            self._log_change(f"shrank {len(shrunk)} request(s) {shrunk[:8]} to hot buffers "
                             f"({freed} rows freed; {why})")
        return freed

    def _victim(self) -> int | None:
        st, hot, B = self.ctx.state, self.ctx.allocator.hot, self.ctx.buffer_size
        best, best_rows = None, 0
        for r in hot.resident_slots():
            if not st.is_resident[r]:
                continue
            rows = hot.reclaimable_rows_of(r, B)
            if rows > best_rows or (rows == best_rows and best is not None and r < best):
                best, best_rows = r, rows
        return best

    def shrink(self, r: int) -> int:
        """Turn resident request ``r`` into a hot buffer (module docstring). Returns rows freed."""
        ctx, st, B = self.ctx, self.ctx.state, self.ctx.buffer_size
        hot = ctx.allocator.hot
        n = st.seq_len[r]
        if hot.resident_length(r) != n:
            raise RuntimeError(
                f"shrink: resident request slot {r} covers {hot.resident_length(r)} positions but "
                f"its length is {n}; shrink only between steps."
            )
        streams = ctx.streams
        streams.current_after(streams.backup, streams.prefetch)
        rr = st.resident_rows
        assert rr is not None
        plan = shrink_plan(st.slot_tokens[:, r, : self.ring_blocks * ctx.top_k][self.record_layer],
                           n=n, buffer_size=B)
        ps = rr.page_size
        table = rr.pages[r].to(torch.int64)

        def row(p: torch.Tensor) -> torch.Tensor:
            return table[p // ps] * ps + p % ps

        src = torch.where(plan.valid, row(plan.movers), 0)
        dst = torch.where(plan.valid, row(plan.free_slots), 0)
        for li, kv in enumerate(ctx.device_kv):
            ctx.row_layout.write(kv, dst[li], ctx.row_layout.read(kv, src[li]))
        st.slot_tokens[:, r, :B] = plan.slot_tokens.to(torch.int32)
        st.slot_tokens[:, r, B].fill_(n - 1)
        # the rows of positions 0..B-1 and of the newest, from the host's copy of the table
        slot_rows = [hot.resident_row(r, p) for p in range(B)] + [hot.resident_row(r, n - 1)]
        st.slot_rows[r, : B + 1] = torch.tensor(slot_rows, dtype=torch.int32).to(ctx.device, non_blocking=True)
        st.lru[:, r] = plan.lru.to(torch.int16)
        if st.policy_state is not None:  # fra: the warm slots start as never selected
            st.policy_state[:, r].zero_()
        if st.resident is not None:
            st.resident[:, r] = resident_hint(plan.slot_tokens, B, st.resident.shape[2])
        st.clear_resident(r)
        freed = hot.shrink_resident(r, B)
        hot.unmap_rows(freed)
        self.shrinks += 1
        self.shrunk_rows += freed.numel()
        return freed.numel()

    def _log_change(self, what: str, *, level: int = logging.INFO) -> None:
        """One line per change: INFO for shrinks (HBM ran short), DEBUG for the admissions
        that keep a request resident (every request, while there is room)."""
        if not logger.isEnabledFor(level):
            return
        c = self.counts()
        logger.log(
            level,
            "HiSparse residency: %s; now %d resident, %d hot, %d device rows free (watermark %d).",
            what, c["resident"], c["hot"], c["free_rows"], c["watermark_rows"],
        )


class ShrinkPlan:
    """Per layer (tensors [L, B]): the positions each history slot holds after a shrink, the
    movers and their destination slots (``valid`` marks real moves), and the new LRU order."""

    def __init__(self, slot_tokens, movers, free_slots, valid, lru) -> None:
        self.slot_tokens, self.movers, self.free_slots = slot_tokens, movers, free_slots
        self.valid, self.lru = valid, lru


def shrink_plan(record: torch.Tensor, *, n: int, buffer_size: int) -> ShrinkPlan:
    """Which B of the history positions ``0..n-2`` each layer keeps, and where they go.

    record: int [L, c] positions the layer selected recently (-1 none; all < n-1). Score of
    position p: ``recorded * (n-1) + p`` (recorded first, then the most recent). Kept positions
    below B stay in slot p; the others take the slots below B whose positions were not kept, in
    ascending order. LRU order: ascending score. Needs ``n - 1 >= B``. No host sync.
    """
    L, B, H = record.shape[0], buffer_size, n - 1
    if H < B:
        raise ValueError(f"shrink_plan: {H} history positions < B = {B}; a short request keeps slot p = p.")
    dev = record.device
    rec = record.to(torch.int64)
    mark = torch.zeros(L, H + 1, dtype=torch.bool, device=dev)
    mark.scatter_(1, torch.where((rec >= 0) & (rec < H), rec, H), True)
    pos = torch.arange(H, device=dev)
    score = mark[:, :H].to(torch.int64) * H + pos
    keep = score.topk(B, dim=1).indices  # [L, B] distinct positions
    inplace = keep < B
    low = torch.zeros(L, B + 1, dtype=torch.bool, device=dev)
    low.scatter_(1, torch.where(inplace, keep, B), True)
    low = low[:, :B]
    free_slots = torch.argsort(low.to(torch.int8), dim=1, stable=True)
    movers = keep.gather(1, torch.argsort(inplace.to(torch.int8), dim=1, stable=True))
    valid = torch.arange(B, device=dev)[None, :] < (~inplace).sum(1, keepdim=True)
    hist = torch.arange(B, device=dev).expand(L, B)
    slot_tokens = torch.where(low, hist, -1)
    slot_tokens = slot_tokens.scatter(1, free_slots, torch.where(valid, movers, slot_tokens.gather(1, free_slots)))
    lru = torch.argsort(score.gather(1, slot_tokens), dim=1, stable=True)
    return ShrinkPlan(slot_tokens, movers, free_slots, valid, lru)

