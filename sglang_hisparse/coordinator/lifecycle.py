"""Request lifecycle: staging, TP-consistent collection, direct admission, finish/abort.

```
 prefill (device rows for every prompt token, mapped)
    │ admit_staging: host rows for the prompt; all layers device→host on the staging stream
    ▼
 STAGING ──collect_ready (event done on every TP rank)──► shrink to the hot buffer ─► DECODING
    │ abort_staging: wait for the staging stream, free host rows                         │
    ▼                                                                                    │
  FREE ◄──────── finish: wait for backup/prefetch copies, release hot rows + host rows ◄─┘
    ▲  │
    │  └── finish on FREE: frees host rows PD pre-allocation took (released before admission)
    └── admit_direct (PD: KV already in host rows) ─► hot buffer (preloaded if short) ─► DECODING
```

Ownership: the caller (SGLang's ``release_kv_cache``, or the harness) frees the request's
logical ids with ``allocator.free``, which also frees prefill rows still mapped (a request
aborted while staging). The coordinator frees what it took: host rows and hot-buffer rows.
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
    def admit_staging(
        self, r: int, logical_ids: torch.Tensor, req: Any = None, *, prompt_written: bool = False
    ) -> None:
        """Start copying the prefilled prompt of request slot ``r`` to host.

        ``logical_ids`` int [n]: the prompt's logical ids in position order, all mapped to
        device rows by prefill. The request is not decodable until :meth:`collect_ready`.
        ``prompt_written``: the caller has seen the prefill forward finish on the host, so
        the copy waits only for the caller's stream (where the row translation is queued),
        not for the forward stream, which by then may already hold the next batch: waiting
        on it would make the request decodable a step later than necessary.
        """
        ctx, st = self.ctx, self.ctx.state
        self._require(r, Phase.FREE, "admit_staging")
        ids = logical_ids.to(ctx.device, torch.int64).reshape(-1)
        n = ids.numel()
        if n < 1:
            raise ValueError(f"admit_staging: request slot {r} has an empty prompt; nothing to stage.")
        self._ensure_host(r, n, "admit_staging")
        dev_rows = ctx.allocator.translate(ids)
        host_rows = ctx.host.host_rows[r, :n]
        event = ctx.streams.new_event()
        transfer.to_host_async(ctx, dev_rows, host_rows, side=ctx.streams.staging, done=event,
                               after_forward=not prompt_written)
        st.phase[r] = Phase.STAGING
        st.seq_len[r] = n
        self.queue.append(StagingEntry(r, ids, event, req))
        ctx.telemetry.add_staging(n)

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
        ready, self.queue = self.queue[:done], self.queue[done:]
        ctx, B = self.ctx, self.ctx.buffer_size
        for entry in ready:
            r, n = entry.req_slot, entry.logical_ids.numel()
            if ctx.residency is not None and ctx.residency.admit_prefilled(r, entry.logical_ids, n):
                continue  # keeps every prefill row (coordinator/residency.py)
            slot_rows = ctx.allocator.shrink_to_hot_buffer(r, entry.logical_ids, B)
            rows = slot_rows[slot_rows >= 0]  # slots 0..min(n,B)-1, then slot B when n > B
            ctx.state.install(r, rows.to(ctx.device, non_blocking=True), n, resident=True)
        return ready

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
        start with empty slots 0..B-1 (the first step misses everything it selects)."""
        ctx, B = self.ctx, self.ctx.buffer_size
        self._require(r, Phase.FREE, "admit_direct")
        if seq_len < 1:
            raise ValueError(f"admit_direct: request slot {r} has seq_len = {seq_len}; need >= 1.")
        self._ensure_host(r, seq_len, "admit_direct")
        if ctx.residency is not None and ctx.residency.admit_direct(r, seq_len):
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
        preload = 0
        if short:
            # NOTE: on the caller's stream, not a side stream: the first resolve of this
            # request reads these rows, and stream order is the cheapest way to guarantee it.
            transfer.to_device(ctx, ctx.host.host_rows[r, :seq_len], rows.to(torch.int64))
            preload = seq_len
        ctx.state.install(r, rows, seq_len, resident=short)
        ctx.telemetry.add_direct(preload, preload * ctx.item_bytes * ctx.num_layers)

    # -- release ----------------------------------------------------------------------------
    def finish(self, r: int) -> None:
        """Release request slot ``r`` in any phase (finished, aborted or retracted); calling
        it again, or for a slot never admitted, is a no-op past freeing what is left.

        FREE (finished during prefill, or a PD request released before admission): only host
        rows can be held, and they are freed. STAGING: :meth:`abort_staging`. DECODING: order
        the caller's stream after in-flight backup/prefetch copies (which read or write this
        request's rows), then return hot rows and host rows and reset state.
        """
        phase = self.ctx.state.phase[r]
        if phase is Phase.FREE:
            # PD decode takes host rows for the transfer destination while the slot is still
            # FREE (``alloc_paged_token_slots``, before ``admit_direct``); a transfer failure,
            # abort or timeout then releases the request without admitting it. Every exit
            # from FREE sets the phase last, so a FREE slot's device state is already reset.
            self.ctx.host.free_request(r)
            return
        if phase is Phase.STAGING:
            self.abort_staging(r)
            return
        ctx = self.ctx
        ctx.streams.current_after(ctx.streams.backup, ctx.streams.prefetch)
        ctx.allocator.hot.release(r)
        ctx.host.free_request(r)
        ctx.state.reset(r)
        if ctx.recorder is not None:
            ctx.recorder.release(r)

    def abort_staging(self, r: int) -> None:
        """Drop a staging request: dequeue it, wait for the staging copy, free its host rows.
        Its prefill rows stay mapped; the caller's ``allocator.free(logical ids)`` frees them."""
        self._require(r, Phase.STAGING, "abort_staging")
        self.queue = [e for e in self.queue if e.req_slot != r]
        self.ctx.streams.current_after(self.ctx.streams.staging)
        self.ctx.host.free_request(r)
        self.ctx.state.reset(r)

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

    def _ensure_host(self, r: int, n: int, op: str) -> None:
        if not self.ctx.host.ensure(r, n):
            raise RuntimeError(
                f"{op}: the host KV pool has no room for request slot {r}'s {n} tokens. The host "
                f"pool must cover the logical capacity the scheduler admits against."
            )
