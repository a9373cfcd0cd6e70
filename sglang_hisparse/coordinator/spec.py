"""Speculative decoding (EAGLE / MTP, chain drafts): each request's verify window.

A verify round of request r with ``s`` committed tokens (positions ``0..s-1`` have KV) runs
W = ``speculative_num_draft_tokens`` query rows at positions ``s..s+W-1`` (the last verified
token, then the drafts). Per request the slot tables are ``B + W`` wide::

    slots   [ 0 .. B-1 : history (hot buffer, LRU) | B .. B+W-1 : verify window ]
    long  (s + W >  B)   window position s+j -> slot B+j, outside the LRU
    short (s + W <= B)   token p in slot p for every p < s+W (window too), no LRU

Call protocol (SGLang 0.5.23: ``mem_cache/allocation.py``, ``speculative/eagle_utils.py``,
``speculative/eagle_worker_common.py`` call the adapter, which calls this class)::

    allocate_spec_scratch(slots)    reserve(slots)     capacity check: W rows per request
    collect_ready / admit_direct    admit(r)           window rows = W more hot-buffer rows
    prepare_spec_verify(batch)      prepare(...)       host rows through s+W-1; short buffers
                                                       grown; window slot_tokens set; the W
                                                       logical ids mapped to their slots' rows
    (forward: per layer kernels.verify_ops.resolve_verify; the verify KV lands in the window)
    commit_spec_accept_tokens(...)  commit(...)        accepted rows -> host (write-through);
                                                       long: every window slot emptied; short:
                                                       rejected slots emptied
    request_finished / retract      finish(r)          then Lifecycle.finish releases the rows

Accepted tokens become host-resident history (a later selection misses and copies them
back, like any evicted token); rejected ones leave nothing behind. Nothing here reads device
memory: the accept lengths stay on the device (rejected rows are written to the host pool's
padding row 0 instead), so the host learns the committed length from the next ``prepare``.

NOTE: the window rows come from ``allocator.hot.grow`` at admission rather than a
separate reservation at ``allocate_spec_scratch`` time: as hot-buffer rows they are owned in
exactly one place (``check_integrity`` holds) and ``allocator.hot.release`` returns them at
finish (the caller's free unmaps the window ids mapped onto them). ``reserve`` therefore only checks capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_hisparse.config import check_buffer_holds_selection
from sglang_hisparse.coordinator import transfer
from sglang_hisparse.coordinator.context import CoreContext
from sglang_hisparse.kernels.contract import validation_enabled

#: host row that absorbs rejected rows' write-through (the host pool's padding row)
HOST_PADDING_ROW = 0


@dataclass(frozen=True)
class VerifyRound:
    """One prepared verify round, consumed by :meth:`SpecWindow.commit`. The tensors list
    the round's ``bs * W`` verify rows request-major (row ``b*W + j`` = request b, draft j),
    on the coordinator's device."""

    req_slots: list[int]  # [bs] request slot of each request (host)
    rows_req: torch.Tensor  # int64 [bs*W] request slot of each verify row
    slots: torch.Tensor  # int64 [bs*W] the row's window slot
    positions: torch.Tensor  # int64 [bs*W] the row's position s + j
    short: torch.Tensor  # bool [bs*W] the request is short (s + W <= B): accepted tokens stay

    @property
    def bs(self) -> int:
        return len(self.req_slots)


class SpecWindow:
    """Owns the verify window of every request (see the module docstring).

    W is ``ctx.state.num_draft_tokens`` (the state must be built with speculative decoding:
    ``slot_tokens`` int32 [L, R, B+W], ``slot_rows`` int32 [R, B+W]; ``lru`` stays [L, R, B]).
    The lengths live in ``state.seq_len`` (``s + W`` once a round is prepared, the admitted
    length before), the history rows follow from them (``state.history_rows``). Per request
    slot only the protocol flags are kept here: ``active`` (admitted, window rows held) and
    ``started`` (a round was prepared since admission).
    """

    def __init__(self, ctx: CoreContext) -> None:
        st, B = ctx.state, ctx.buffer_size
        W = st.num_draft_tokens
        if not st.speculative:
            raise ValueError(
                "SpecWindow: the state was built with num_draft_tokens = 0 (no speculative "
                "decoding); build SlotState with num_draft_tokens = speculative_num_draft_tokens."
            )
        check_buffer_holds_selection(B, ctx.top_k, W)
        self.ctx, self.W, self.B = ctx, W, B
        R = st.num_reqs
        self.active = [False] * R
        self.started = [False] * R
        self._round: VerifyRound | None = None

    # -- admission / release -------------------------------------------------------------
    def reserve(self, req_slots: list[int]) -> None:
        """``allocate_spec_scratch``: raise unless W free device rows exist per new request."""
        need = self.W * len(req_slots)
        free = self.ctx.allocator.rows.available_size()
        if need > free:
            raise RuntimeError(
                f"speculative window: {len(req_slots)} new requests need {need} device rows "
                f"({self.W} each), {free} free. Admission must charge the window per request."
            )

    def admit(self, r: int) -> None:
        """Give request ``r`` (hot buffer just installed by the lifecycle) its W window rows.

        A long install already holds slot B (the prompt's newest token, now plain history
        on host): that row becomes window slot B and W-1 rows are added; otherwise W.
        """
        if self.active[r]:
            raise ValueError(f"spec admit: request slot {r} already has a verify window.")
        ctx, st, B, W = self.ctx, self.ctx.state, self.B, self.W
        off = 1 if st.seq_len[r] > B else 0
        rows = ctx.allocator.hot.grow(r, W - off)
        if rows is None:
            raise RuntimeError(
                f"spec admit: no device rows for request slot {r}'s verify window ({W - off} "
                f"needed, {ctx.allocator.rows.available_size()} free)."
            )
        st.slot_rows[r, B + off:] = rows.to(torch.int32).to(st.device, non_blocking=True)
        st.slot_tokens[:, r, B:] = -1
        self.active[r], self.started[r] = True, False

    def finish(self, r: int) -> None:
        """Forget request ``r`` (call before ``Lifecycle.finish``, which frees the rows)."""
        if self._round is not None and r in self._round.req_slots:
            raise ValueError(f"spec finish: request slot {r} is in a verify round not yet committed.")
        self.active[r], self.started[r] = False, False

    # -- per verify round ------------------------------------------------------------------
    def prepare(self, *, req_index: torch.Tensor, req_index_cpu: list[int],
                seq_lens_cpu: list[int], out_cache_loc: torch.Tensor,
                out_cache_loc_cpu: torch.Tensor | None = None) -> None:
        """Set up one verify round. ``req_index`` int [bs] (device), ``seq_lens_cpu`` the
        committed lengths s, ``out_cache_loc`` int [bs*W] logical ids of positions s..s+W-1
        (request-major). After this, the forward's KV writes land in the window slots.

        The ids are moved onto the window rows with ``allocator.rebind``: SGLang's page_size-1
        spec path takes them with ``alloc()``, which maps fresh device rows that must go back
        (otherwise every accepted token would hold a device row until its request ends).
        ``out_cache_loc_cpu`` (same ids on the host) saves rebind its one read-back."""
        ctx, st, B, W = self.ctx, self.ctx.state, self.B, self.W
        if self._round is not None:
            raise ValueError("spec prepare: the previous verify round was never committed.")
        if len(req_index_cpu) != len(seq_lens_cpu) or out_cache_loc.numel() != W * len(seq_lens_cpu):
            raise ValueError(
                f"spec prepare: {len(req_index_cpu)} requests, {len(seq_lens_cpu)} seq_lens and "
                f"{out_cache_loc.numel()} out_cache_loc ids; need bs, bs and bs*W (W = {W})."
            )
        # the forward overwrites window rows the last write-through reads
        ctx.streams.backup_fence.wait(ctx.streams.current())
        slots: list[int] = []
        for r, s in zip(req_index_cpu, seq_lens_cpu, strict=True):
            self._check_len(r, s)
            short = s + W <= B
            self._grow_history(r, s + W if short else B)
            first = s if short else B
            slots.extend(range(first, first + W))
            st.seq_len[r], self.started[r] = s + W, True
        dev = ctx.device
        r_t = req_index.to(dev, torch.int64).repeat_interleave(W)
        s_t = torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True)
        base = torch.tensor(seq_lens_cpu, dtype=torch.int64).to(dev, non_blocking=True)
        pos = (base[:, None] + torch.arange(W, device=dev)).reshape(-1)
        short = (base + W <= B).repeat_interleave(W)
        st.slot_tokens[:, r_t, s_t] = pos.to(torch.int32)
        ctx.allocator.rebind(out_cache_loc, st.slot_rows[r_t, s_t], logical_ids_cpu=out_cache_loc_cpu)
        # the window's host rows are its ids (a rejected draft's entry is rebound next round)
        ctx.host.bind_positions(
            [r for r in req_index_cpu for _ in range(W)],
            [s + j for s in seq_lens_cpu for j in range(W)], out_cache_loc, req_t=r_t, pos_t=pos)
        self._round = VerifyRound(req_slots=list(req_index_cpu), rows_req=r_t, slots=s_t,
                                  positions=pos, short=short)

    def commit(self, *, accept_index: torch.Tensor, validate: bool | None = None) -> None:
        """Finish the round: ``accept_index`` int [bs, D] flat verify-row ids ``b*W + j`` of
        the accepted rows (a prefix j = 0..a per request), -1 padded (SGLang's
        ``accept_index``). Accepted window rows are written through to host; see the module
        docstring for what happens to the slots. No host sync."""
        rnd, ctx, st, W = self._round, self.ctx, self.ctx.state, self.W
        if rnd is None:
            if accept_index.numel() == 0 or accept_index.shape[0] == 0:
                return  # idle batch: nothing was prepared
            raise ValueError("spec commit: no verify round was prepared (call prepare first).")
        bs = rnd.bs
        if accept_index.dim() != 2 or accept_index.shape[0] != bs:
            raise ValueError(f"spec commit: accept_index has shape {tuple(accept_index.shape)}; "
                             f"need [bs={bs}, D] flat row ids b*W+j, -1 padded.")
        idx = accept_index.to(ctx.device, torch.int64)
        if validation_enabled(validate):
            self._validate_accept(idx)
        flat = idx.reshape(-1)
        hit = torch.zeros(bs * W, dtype=torch.int32, device=ctx.device)
        hit.scatter_reduce_(0, flat.clamp(0, max(bs * W - 1, 0)), (flat >= 0).int(), reduce="amax")
        ok = hit.bool()
        dev_rows = st.slot_rows[rnd.rows_req, rnd.slots].to(torch.int64)
        host_rows = ctx.host.host_rows[rnd.rows_req, rnd.positions]
        dst = torch.where(ok, host_rows, torch.full_like(host_rows, HOST_PADDING_ROW))
        transfer.to_host_async(ctx, dev_rows, dst, side=ctx.streams.backup, done=ctx.streams.backup_fence)
        keep = ok & rnd.short  # short: accepted tokens stay in slot p; all else emptied
        st.slot_tokens[:, rnd.rows_req, rnd.slots] = torch.where(keep, rnd.positions, -1).to(torch.int32)
        self._round = None

    # -- helpers ---------------------------------------------------------------------------
    def _check_len(self, r: int, s: int) -> None:
        if not self.active[r]:
            raise ValueError(f"spec prepare: request slot {r} has no verify window (admit it first).")
        # seq_len is s + W of the last round once one was prepared, the admitted length before
        started = self.started[r]
        prev = self.ctx.state.seq_len[r] - (self.W if started else 0)
        lo, hi = (prev + 1, prev + self.W) if started else (prev, prev)
        if not lo <= s <= hi:
            raise ValueError(
                f"spec prepare: request slot {r} has committed length {s}; expected {lo}..{hi} "
                f"(the last round started at {prev} with W = {self.W})."
            )

    def _grow_history(self, r: int, want: int) -> None:
        """History slots ``0..want-1`` get device rows (call before ``seq_len`` moves on)."""
        have = self.ctx.state.history_rows(r)
        if want <= have:
            return
        rows = self.ctx.allocator.hot.grow(r, want - have)
        if rows is None:
            raise RuntimeError(
                f"spec prepare: no device rows to grow request slot {r}'s hot buffer to {want} "
                f"history slots ({self.ctx.allocator.rows.available_size()} free)."
            )
        self.ctx.state.slot_rows[r, have:want] = rows.to(torch.int32).to(self.ctx.device, non_blocking=True)

    def _validate_accept(self, idx: torch.Tensor) -> None:
        cpu, W = idx.cpu(), self.W
        bs, D = cpu.shape
        n = (cpu >= 0).sum(1)
        col = torch.arange(D)[None, :]
        want = torch.where(col < n[:, None], torch.arange(bs)[:, None] * W + col, -1)
        if (n < 1).any() or (n > W).any() or not torch.equal(cpu, want):
            b = int(((cpu != want).any(1) | (n < 1) | (n > W)).nonzero()[0])
            raise ValueError(
                f"spec commit: accept_index[{b}] = {cpu[b].tolist()}; it must list rows "
                f"{b}*W+0 .. {b}*W+a (a chain prefix of 1..W = {W} rows), then -1."
            )

    def check_integrity(self) -> None:
        """Every active request's window and history slots hold distinct rows of its own hot
        buffer, and no inactive request holds window rows. Syncs (tests / debugging)."""
        st, B, al = self.ctx.state, self.B, self.ctx.allocator
        for r in range(st.num_reqs):
            rows = st.slot_rows[r].cpu()
            if not self.active[r]:
                continue
            h = st.history_rows(r)
            used = torch.cat([rows[:h], rows[B:]])
            own = set(al.rows.page_ids_to_ids(torch.tensor(al.hot.pages(r), dtype=torch.int64)).tolist())
            if (used < 0).any() or len(set(used.tolist())) != used.numel() or not set(used.tolist()) <= own:
                raise ValueError(
                    f"spec window of request slot {r}: slot rows {used.tolist()[:12]}... must be "
                    f"distinct rows of its hot buffer ({len(own)} rows); history slots {h}."
                )
