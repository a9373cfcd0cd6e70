"""Request lifecycle: prefix, staging, TP-consistent collection, direct admission, release.

```
 prepare_prefix (radix hit: hold the matched prefix's pages, loading from host those no
    │            device row holds; hold the pages the prefill computes)
 prefill (device rows for every computed prompt token, mapped)
    │ admit_staging: bind host rows (= logical ids); the computed tokens device→host on the
    ▼              staging stream
 STAGING ──collect_ready (event done on every TP rank)──► resident or hot buffer ─► DECODING
    │ abort_staging: wait for the staging stream, drop holds                             │
    ▼                                                                                    │
  FREE ◄──────── finish: wait for backup/prefetch copies, release hot rows, unbind ◄─────┘
    ▲  │
    │  └── finish on FREE: drops holds a prefill took / unbinds what PD pre-allocation bound
    └── admit_direct (PD: KV already in host rows) ─► hot buffer (preloaded if short) ─► DECODING
```

Ownership: the caller (SGLang's ``release_kv_cache``, or the harness) frees the request's
logical ids with ``allocator.free``, which also frees prefill rows still mapped (a request
aborted while staging), or leaves them to SGLang's radix tree; a logical id's host row is the
id's (``memory/host_pool.py``). The coordinator frees what it took: hot-buffer rows, and the
prefill rows of prefix pages nobody holds any more (``DualSpaceAllocator.drop_unread``).

With the radix cache a prefill row can be shared: while request A stages, request B may match
A's prompt and read A's rows. Every request holds the pages it reads from ``prepare_prefix``
until it is collected (or released), and at collect a request takes over only the rows of
pages no one else holds; the positions its buffer needs from the others are copied device to
device into private rows (``DualSpaceAllocator.take_staged_rows``). A hot buffer therefore
never aliases a row another request reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from sglang_hisparse.coordinator import transfer
from sglang_hisparse.coordinator.context import CoreContext
from sglang_hisparse.coordinator.state import Phase

logger = logging.getLogger("sglang_hisparse")


@dataclass
class StagingEntry:
    """One prompt being copied to host. ``req`` is the caller's handle (SGLang reads
    ``ack_staging_queue[i].req``); ``logical_ids`` int64 [n] are the prompt's ids."""

    req_slot: int
    logical_ids: torch.Tensor
    event: Any
    req: Any = None


def _tp_world_size(tp_group: Any) -> int:
    if tp_group is None or not torch.distributed.is_available():
        return 1
    if not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=tp_group)


class Lifecycle:
    """Admission and release of requests; see the module diagram."""

    def __init__(self, ctx: CoreContext, *, tp_group: Any = None) -> None:
        self.ctx = ctx
        self.tp_group = tp_group
        self.tp_world_size = _tp_world_size(tp_group)
        self.queue: list[StagingEntry] = []

    # -- staging (co-located prefill) -----------------------------------------------------
    # -- prefix (radix cache) --------------------------------------------------------------
    def prepare_prefix(self, r: int, prefix_ids: torch.Tensor, computed_ids: torch.Tensor | None = None) -> bool:
        """Before a prefill of request slot ``r`` whose prompt starts with ids it did not
        compute (a radix-cache match, or ids SGLang's checkpoint repointed to the tree's):
        hold the pages of ``prefix_ids`` (int, read on the CPU; whole pages of ids in use),
        giving those no device row holds fresh rows loaded from their host rows on the
        caller's stream, so the prefill (or the collect) reads them through the mapping.
        ``computed_ids``: the ids this prefill computes, held too (another request may match
        them while this one stages). Returns False when the device rows are short (nothing
        loaded; what was held stays held, released by :meth:`finish`)."""
        ctx = self.ctx
        self._require(r, Phase.FREE, "prepare_prefix")
        prefix_ids = prefix_ids.to("cpu", torch.int64).reshape(-1)  # read once: hold, load, hits
        if computed_ids is not None and computed_ids.numel():
            ctx.allocator.note_computed(r, computed_ids)
        if prefix_ids.numel() == 0:
            return True
        # held first: the load's allocation may take back cached rows, but not these
        new_pages = ctx.allocator.hold(r, prefix_ids)
        got = ctx.allocator.load_prefix(prefix_ids)
        if got is None:
            return False
        ids, rows, src = got
        # hits: prefix tokens first held now (a later chunk re-presents its earlier ones)
        hit = int(torch.isin(prefix_ids // ctx.allocator.page_size, new_pages).sum())
        dev, on_dev = ctx.device, src > 0
        # NOTE: on the caller's stream (the forward's): the prefill reads these rows next.
        # Ids a running resident request's buffer still maps are copied from its rows (device
        # to device, ~40x faster than the link); the rest from their host rows.
        if bool(on_dev.any()):
            transfer.device_to_device(ctx, src[on_dev].to(dev, non_blocking=True),
                                      rows[on_dev].to(dev, non_blocking=True))
            ctx.telemetry.add_prefix_copy(int(on_dev.sum()))
        loads = ~on_dev
        if bool(loads.any()):
            transfer.to_device(ctx, ids[loads].to(dev, non_blocking=True), rows[loads].to(dev, non_blocking=True))
        n_load = int(loads.sum())
        ctx.telemetry.add_prefix(hit, n_load, n_load * ctx.item_bytes * ctx.num_layers)
        return True

    # -- staging (co-located prefill) -----------------------------------------------------
    def admit_staging(
        self, r: int, logical_ids: torch.Tensor, req: Any = None, *, prompt_written: bool = False,
        own_start: int = 0,
    ) -> None:
        """Start copying the prefilled prompt of request slot ``r`` to host.

        ``logical_ids`` int [n]: the prompt's logical ids in position order, all mapped to
        device rows (by prefill, or by :meth:`prepare_prefix` for ids it did not compute).
        Only the ids this request computed are copied: those :meth:`prepare_prefix` recorded
        as computed and still its own (a checkpoint may have freed some as duplicates of the
        tree's), or without such a record ``logical_ids[own_start:]`` (ids before
        ``own_start`` are a radix-cache prefix: their host rows hold their KV already, or
        their owner's staging writes them). The request is not decodable until
        :meth:`collect_ready`. ``prompt_written``: the caller has seen the prefill forward
        finish on the host, so the copy waits only for the caller's stream (where the row
        translation is queued), not for the forward stream, which by then may already hold
        the next batch: waiting on it would make the request decodable a step later than
        necessary.
        """
        ctx, st = self.ctx, self.ctx.state
        self._require(r, Phase.FREE, "admit_staging")
        ids = logical_ids.to(ctx.device, torch.int64).reshape(-1)
        n = ids.numel()
        if n == 0:
            # a compressed layout's prompt with no entry yet (a DeepSeek-V4 prompt under 4
            # tokens): nothing to copy; it is ready at the next collect, its hot buffer empty
            event = ctx.streams.new_event()
            event.record()
            st.phase[r], st.seq_len[r] = Phase.STAGING, 0
            self.queue.append(StagingEntry(r, ids, event, req))
            return
        if not 0 <= own_start <= n:
            raise ValueError(f"admit_staging: own_start = {own_start} outside 0..{n} (prompt of request slot {r}).")
        ctx.host.bind(r, 0, ids)
        computed = ctx.allocator.computed_ids(r)
        own = ids[own_start:] if computed is None else computed.to(ctx.device, non_blocking=True)
        event = ctx.streams.new_event()
        transfer.to_host_async(ctx, ctx.allocator.translate(own), own, side=ctx.streams.staging, done=event,
                               after_forward=not prompt_written)
        st.phase[r] = Phase.STAGING
        st.seq_len[r] = n
        self.queue.append(StagingEntry(r, ids, event, req))
        ctx.telemetry.add_staging(own.numel())

    def has_ongoing_staging(self) -> bool:
        return bool(self.queue)

    def collect_ready(self) -> list[StagingEntry]:
        """Pop the staged requests whose copy finished, in admission order, and shrink each
        to its hot buffer. Every TP rank pops the same count (MIN over ``tp_group``).

        NOTE: an empty queue returns without the collective. Every rank admits the same
        requests in the same order, so the queues are empty on all ranks at once, and the
        scheduler calls this every iteration: a gloo all-reduce per idle iteration is waste."""
        if not self.queue:
            return []
        done = 0
        for entry in self.queue:
            if not entry.event.query():
                break
            done += 1
        done = self._agree(done)
        for entry in self.queue[:done]:
            self.ctx.allocator.mark_landed(entry.req_slot)
        taken = 0
        for entry in self.queue[:done]:
            if not self._take_rows(entry):
                break  # rows for its private copies, or a prefix page's host copy, missing now
            taken += 1
        ready, self.queue = self.queue[:taken], self.queue[taken:]
        return ready

    def _take_rows(self, entry: StagingEntry) -> bool:
        """A staged request's rows become its resident or hot buffer (module docstring).
        False (nothing changed) when the private copies of shared rows find no device rows;
        every TP rank decides the same from host-side counts."""
        ctx, B = self.ctx, self.ctx.buffer_size
        r, ids = entry.req_slot, entry.logical_ids.cpu()
        n = ids.numel()
        if n == 0:  # no entry yet (admit_staging): an empty hot buffer, grown by its first entry
            slot_rows = ctx.allocator.hot.alloc(r, 0, B)
            ctx.state.install(r, slot_rows[slot_rows >= 0].to(ctx.device), 0, resident=True)
            return True
        if ctx.allocator.host_pending(ids):
            # it shares pages with a prefill whose staging has not run (a chunked prompt still
            # prefilling): its misses would read their host rows before they are written
            return False
        hot_need = torch.zeros(n, dtype=torch.bool)
        hot_need[: min(n, B)] = True
        hot_need[n - 1] = True
        resident = ctx.residency is not None and ctx.residency.wants_resident(n)
        got = ctx.allocator.take_staged_rows(r, ids, torch.ones(n, dtype=torch.bool)) if resident else None
        if got is None:
            resident = False
            got = ctx.allocator.take_staged_rows(r, ids, hot_need)
        if got is None:
            return False
        rows, shared, src, dst = got
        if src.numel():
            dev = ctx.device
            transfer.device_to_device(ctx, src.to(dev, non_blocking=True), dst.to(dev, non_blocking=True))
            ctx.telemetry.add_prefix_copy(src.numel())
        if resident:
            pages = ctx.allocator.hot.adopt_resident(r, rows)
            if pages is not None:
                ctx.residency.note_resident(r, pages, n)
                return True
        slot_rows = ctx.allocator.adopt_staged_hot(r, ids, rows, shared, B)
        kept = slot_rows[slot_rows >= 0]  # slots 0..min(n,B)-1, then slot B when n > B
        ctx.state.install(r, kept.to(ctx.device, non_blocking=True), n, resident=True)
        return True

    def _agree(self, count: int) -> int:
        if self.tp_world_size <= 1:
            return count
        t = torch.tensor(count, dtype=torch.int32)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
        return int(t.item())

    # -- PD direct admission --------------------------------------------------------------
    def admit_direct(self, r: int, seq_len: int) -> None:
        """Request slot ``r`` arrived by PD transfer: host rows ``0..seq_len-1`` already hold
        its KV. Short requests (``seq_len <= B``) are preloaded into their slots; long ones
        get their newest token in slot B and start with empty slots 0..B-1 (the first step
        misses everything else it selects)."""
        ctx, B = self.ctx, self.ctx.buffer_size
        self._require(r, Phase.FREE, "admit_direct")
        if seq_len < 0:
            raise ValueError(f"admit_direct: request slot {r} has seq_len = {seq_len}; need >= 0.")
        self._require_bound(r, seq_len, "admit_direct")
        if seq_len and ctx.residency is not None and ctx.residency.admit_direct(r, seq_len):
            return
        slot_rows = ctx.allocator.hot.alloc(r, seq_len, B)
        if slot_rows is None and ctx.residency is not None:
            ctx.residency.reclaim(ctx.allocator.hot.max_pages(B) * ctx.allocator.page_size)
            slot_rows = ctx.allocator.hot.alloc(r, seq_len, B)
        if slot_rows is None:
            raise RuntimeError(
                f"admit_direct: no device rows for request slot {r}'s hot buffer "
                f"({min(seq_len, B) + (seq_len > B)} rows; {ctx.allocator.rows.available_size()} free). "
                f"The scheduler admits PD requests against the hot-buffer size; check the admission budget."
            )
        rows = slot_rows[slot_rows >= 0].to(ctx.device, non_blocking=True)
        short = seq_len <= B
        # NOTE: on the caller's stream, not a side stream: the first resolve of this request
        # reads these rows, and stream order is the cheapest way to guarantee it.
        if short:  # (seq_len 0: a compressed layout's request with no entry yet, nothing to load)
            if seq_len:
                transfer.to_device(ctx, ctx.host.host_rows[r, :seq_len], rows.to(torch.int64))
            preload = seq_len
        else:
            # slot B holds the newest token for the resolve (install marks it so): a step maps a
            # new token there first in DSA, but a compressed layout resolves before its next
            # entry arrives (docs/v4-m3.md)
            transfer.to_device(ctx, ctx.host.host_rows[r, seq_len - 1 : seq_len], rows[B:].to(torch.int64))
            preload = 1
        ctx.state.install(r, rows, seq_len, resident=short)
        ctx.telemetry.add_direct(preload, preload * ctx.item_bytes * ctx.num_layers)

    # -- release ----------------------------------------------------------------------------
    def finish(self, r: int, logical_ids: torch.Tensor | None = None) -> None:
        """Release request slot ``r`` in any phase (finished, aborted or retracted); calling
        it again, or for a slot never admitted, is a no-op past freeing what is left.
        ``logical_ids`` (int, on the device: the request's ids): those mapped into its hot
        rows are unmapped here, for the ids the caller does not free (the radix tree keeps
        them); without it the caller's free must cover every id.

        FREE (finished during prefill, or a PD request released before admission): only host
        rows can be held, and they are freed. STAGING: :meth:`abort_staging`. DECODING: order
        the caller's stream after in-flight backup/prefetch copies (which read or write this
        request's rows), then return hot rows and host rows and reset state.
        """
        phase = self.ctx.state.phase[r]
        if phase is Phase.FREE:
            # PD decode binds host rows for the transfer destination while the slot is still
            # FREE (``alloc_paged_token_slots``, before ``admit_direct``); a transfer failure,
            # abort or timeout then releases the request without admitting it. A prefill
            # released before staging (aborted between chunks) holds pages. Every exit from
            # FREE sets the phase last, so a FREE slot's device state is already reset.
            self.ctx.host.unbind(r)
            self._stage_computed(r)
            self._drop_holds(r)
            return
        if phase is Phase.STAGING:
            self.abort_staging(r)
            return
        ctx = self.ctx
        self._backup_newest(r)
        ctx.streams.current_after(ctx.streams.backup, ctx.streams.prefetch)
        if ctx.cache_finished and ctx.state.is_resident[r] and logical_ids is not None:
            # radix cache: its rows stay on the device as cached prefix rows of its ids
            # (the tree may keep them) until an allocation or the watermark takes them back
            ctx.allocator.cache_resident(r, logical_ids.cpu())
        else:
            ctx.allocator.hot.release(r, unmap_ids=logical_ids)
        ctx.host.unbind(r)
        ctx.state.reset(r)
        if ctx.recorder is not None:
            ctx.recorder.release(r)

    def abort_staging(self, r: int) -> None:
        """Drop a staging request: dequeue it, wait for the staging copy, drop its holds (the
        prefill rows of pages nobody else holds are freed; the ids stay with the caller, whose
        ``allocator.free`` frees them, or with the radix tree, their host rows written)."""
        self._require(r, Phase.STAGING, "abort_staging")
        self.queue = [e for e in self.queue if e.req_slot != r]
        self.ctx.streams.current_after(self.ctx.streams.staging)
        self.ctx.allocator.mark_landed(r)
        self.ctx.host.unbind(r)
        self._drop_holds(r)
        self.ctx.state.reset(r)

    def _backup_newest(self, r: int) -> None:
        """The newest token's KV reaches host only with the next step's write-through, which a
        finished request never runs; SGLang's radix tree may keep its id (prompt + output are
        inserted at finish), so it is written now. Speculative rounds write every accepted
        token at commit; a request that never decoded has its newest token on host already."""
        ctx, st = self.ctx, self.ctx.state
        if st.num_draft_tokens or st.skip_backup[r]:
            return
        n, B = st.seq_len[r], ctx.buffer_size
        if st.is_resident[r]:
            row = torch.tensor([ctx.allocator.hot.resident_row(r, n - 1)], dtype=torch.int64).to(ctx.device, non_blocking=True)
        else:
            row = st.slot_rows[r, min(n - 1, B) : min(n - 1, B) + 1].to(torch.int64)
        transfer.to_host_async(ctx, row, ctx.host.host_rows[r, n - 1 : n], side=ctx.streams.backup, done=None)
        ctx.telemetry.add_backup(1, ctx.item_bytes * ctx.num_layers)

    def _stage_computed(self, r: int) -> None:
        """A prefill released before staging (finished at its prefill, aborted between
        chunks): the radix tree may keep the ids it computed, so their KV goes to host before
        their prefill rows are dropped (the caller's stream waits for the copy)."""
        ctx = self.ctx
        own = ctx.allocator.computed_ids(r)
        if own is None or own.numel() == 0:
            return
        ids = own.to(ctx.device, non_blocking=True)
        transfer.to_host_async(ctx, ctx.allocator.translate(ids), ids, side=ctx.streams.staging,
                               done=None, after_forward=True)
        ctx.streams.current_after(ctx.streams.staging)
        ctx.allocator.mark_landed(r)

    def _drop_holds(self, r: int) -> None:
        alloc = self.ctx.allocator
        alloc.drop_unread(alloc.unhold(r))

    # -- helpers ----------------------------------------------------------------------------
    def _require(self, r: int, phase: Phase, op: str) -> None:
        st = self.ctx.state
        if not 0 <= r < st.num_reqs:
            raise ValueError(f"{op}: request slot {r} is outside [0, {st.num_reqs}) (req_to_token_pool size).")
        if st.phase[r] is not phase:
            raise ValueError(
                f"{op}: request slot {r} is {st.phase[r].value}, expected {phase.value}. "
                f"Each request slot must be finished before it is admitted again."
            )

    def _require_bound(self, r: int, n: int, op: str) -> None:
        have = self.ctx.host.allocated_len(r)
        if have < n:
            raise ValueError(
                f"{op}: request slot {r} has host rows bound for {have} of its {n} tokens; bind "
                f"its logical ids first (HostKVPool.bind; PD: alloc_paged_token_slots)."
            )
