"""Per decode step, before the forward: write-through backup, growth, newest-token mapping.

SGLang calls ``map_last_loc_to_buffer`` from ``prepare_for_decode`` after ``seq_lens += 1``
and after allocating one logical id per request (``out_cache_loc``). For a request whose
length just became ``n`` (new token ``p = n-1``, previous newest ``q = n-2``)::

    backup   q's KV (all layers) from its slot (q if q < B, else B) -> host row of q,
             on the backup stream after the producer (the previous forward wrote it);
             skipped on the first step after staging / direct admission (host has it)
    grow     the new token's slot s = min(p, B) gets a device row if it has none
             (short requests, and slot B on the first growth past B)
    map      slot_tokens[:, r, s] = p;  mapping[out_cache_loc] = slot_rows[r, s], so the
             forward's KV write of p lands in the hot buffer (``allocator.rebind``, which
             also frees a device row SGLang's page_size-1 ``alloc()`` may have given p);
             host_rows[r, p] = out_cache_loc (the host row of a logical id is the id)

The forward must not overwrite slot B before the backup read it:
:meth:`StepMapper.wait_for_pending_backup` (SGLang calls it before the decode forward)
orders the current stream after the backup stream's fence.

NOTE: the previous newest token's mapping entry is left in place rather than cleared: with
the overlap scheduler the previous forward may still be translating it on the forward
stream. Stale entries are the request's own ids pointing into its own hot rows; the
caller's ``allocator.free`` of those ids at finish unmaps them (``memory/hot.py``, release).

Host work is O(batch) Python on ``seq_lens_cpu`` / ``req_pool_indices_cpu`` (SGLang passes
both); device work is a handful of indexed writes plus one all-layer copy launch for the
backup, with no host sync on CUDA beyond the transfer fallback noted in ``transfer``.
"""

from __future__ import annotations

import torch

from sglang_hisparse.coordinator import transfer
from sglang_hisparse.coordinator.context import CoreContext
from sglang_hisparse.coordinator.state import Phase
from sglang_hisparse.kernels.reference import int32_bits


class StepMapper:
    """Implements the per-step protocol above (the backup's fence is ``streams.backup_fence``)."""

    def __init__(self, ctx: CoreContext) -> None:
        self.ctx = ctx

    def map_last_loc(
        self,
        *,
        req_index: torch.Tensor,
        seq_lens: torch.Tensor,
        new_logical: torch.Tensor,
        req_index_cpu: list[int],
        seq_lens_cpu: list[int],
        new_logical_cpu: torch.Tensor | None = None,
        grows: list[bool] | None = None,
    ) -> None:
        """``req_index``/``seq_lens``/``new_logical`` int [bs] on the device (lengths already
        include the new token); the ``_cpu`` lists carry the same values on the host.
        ``new_logical_cpu`` (optional; the adapter passes ``allocator.cpu_ids_of(new_logical)``)
        lets the allocator free device rows a page_size-1 ``alloc()`` gave the new ids without
        reading them back (see ``allocator.rebind``).

        ``grows`` (a compressed layout, docs/v4-m3.md): per request of the step's batch whether
        it gains an entry; those that do not keep their length and state (``seq_lens_cpu`` is
        their current length), and ``new_logical`` holds the ids of the growing ones only. The
        batch-level state (the residency's relief, ``batch_all_resident``) covers every request."""
        if grows is not None and not all(grows):
            self._map_growing(req_index_cpu, seq_lens_cpu, new_logical, grows)
            return
        self._map(req_index=req_index, seq_lens=seq_lens, new_logical=new_logical,
                  req_index_cpu=req_index_cpu, seq_lens_cpu=seq_lens_cpu,
                  new_logical_cpu=new_logical_cpu, relieve=True)

    def _map(self, *, req_index: torch.Tensor, seq_lens: torch.Tensor, new_logical: torch.Tensor,
             req_index_cpu: list[int], seq_lens_cpu: list[int], new_logical_cpu: torch.Tensor | None,
             relieve: bool) -> None:
        ctx, st, B = self.ctx, self.ctx.state, self.ctx.buffer_size
        if len(req_index_cpu) != len(seq_lens_cpu):
            raise ValueError(
                f"map_last_loc: {len(req_index_cpu)} request slots but {len(seq_lens_cpu)} seq_lens."
            )
        residency = ctx.residency
        if residency is not None and relieve:
            residency.begin_step(req_index_cpu)
        hot = ctx.allocator.hot
        back_r: list[int] = []
        back_slot: list[int] = []
        back_pos: list[int] = []
        res_back: list[tuple[int, int, int]] = []  # (request slot, row, position) of residents
        res_new: list[tuple[int, int]] = []  # (batch index, row) of residents' new tokens
        new_slot: list[int] = []
        for i, (r, n) in enumerate(zip(req_index_cpu, seq_lens_cpu, strict=True)):
            if st.phase[r] is not Phase.DECODING:
                raise ValueError(
                    f"map_last_loc: request slot {r} is {st.phase[r].value}; only collected or "
                    f"directly admitted requests decode."
                )
            if n != st.seq_len[r] + 1:
                raise ValueError(
                    f"map_last_loc: request slot {r} has seq_len {n}, expected {st.seq_len[r] + 1} "
                    f"(one new token per step, seq_lens already incremented)."
                )
            p, q = n - 1, n - 2
            if st.skip_backup[r]:
                st.skip_backup[r] = False
            elif st.is_resident[r]:
                res_back.append((r, hot.resident_row(r, q), q))
            else:
                back_r.append(r)
                back_slot.append(q if q < B else B)
                back_pos.append(q)
            new_slot.append(p if p < B else B)
            if p == B and not st.is_resident[r] and residency is not None:
                residency.make_resident(r, B)  # a short request reaching slot B may stay resident
            if st.is_resident[r]:
                res_new.append((i, residency.next_row(r)))

        if back_r:
            self._backup(back_r, back_slot, back_pos)
        if res_back:
            self._backup_resident(res_back)
        grow = [(r, s) for r, s in zip(req_index_cpu, new_slot, strict=True) if not st.is_resident[r]]
        self._grow([r for r, _ in grow], [s for _, s in grow])
        for r, n in zip(req_index_cpu, seq_lens_cpu, strict=True):
            st.seq_len[r] = n
        st.batch_all_resident = residency is not None and all(st.is_resident[r] for r in req_index_cpu)

        dev = ctx.device
        r_dev = req_index.to(dev, torch.int64)
        s_dev = torch.tensor(new_slot, dtype=torch.int64).to(dev, non_blocking=True)
        st.slot_tokens[:, r_dev, s_dev] = (seq_lens.to(dev) - 1).to(torch.int32)
        if st.resident is not None:
            self._hint_short_growth(req_index_cpu, new_slot)
        rows = st.slot_rows[r_dev, s_dev]
        if res_new:
            at = torch.tensor([i for i, _ in res_new], dtype=torch.int64).to(dev, non_blocking=True)
            got = torch.tensor([row for _, row in res_new], dtype=rows.dtype).to(dev, non_blocking=True)
            rows = rows.index_copy(0, at, got)
        ctx.allocator.rebind(new_logical, rows, logical_ids_cpu=new_logical_cpu)
        ctx.host.bind_positions(req_index_cpu, [n - 1 for n in seq_lens_cpu], new_logical,
                                req_t=r_dev, pos_t=seq_lens.to(dev, torch.int64) - 1)
        if ctx.recorder is not None:
            ctx.recorder.begin_step(req_index_cpu, seq_lens_cpu)
        ctx.telemetry.add_step()
        backed = len(back_r) + len(res_back)
        ctx.telemetry.add_backup(backed, backed * ctx.item_bytes * ctx.num_layers)
        ctx.telemetry.maybe_log()

    def _map_growing(self, req_index_cpu: list[int], seq_lens_cpu: list[int], new_logical: torch.Tensor,
                     grows: list[bool]) -> None:
        """:meth:`map_last_loc` for a batch of which only some requests gain an entry."""
        ctx, st = self.ctx, self.ctx.state
        if not len(req_index_cpu) == len(seq_lens_cpu) == len(grows):
            raise ValueError(
                f"map_last_loc: {len(req_index_cpu)} request slots, {len(seq_lens_cpu)} seq_lens and "
                f"{len(grows)} grows flags; need one each per request of the batch."
            )
        for r, n, g in zip(req_index_cpu, seq_lens_cpu, grows, strict=True):
            if not g and (st.phase[r] is not Phase.DECODING or n != st.seq_len[r]):
                raise ValueError(
                    f"map_last_loc: request slot {r} gains no entry but has seq_len {n} (state: "
                    f"{st.phase[r].value}, length {st.seq_len[r]}); it must be decoding at its length."
                )
        rs = [r for r, g in zip(req_index_cpu, grows, strict=True) if g]
        ns = [n for n, g in zip(seq_lens_cpu, grows, strict=True) if g]
        if ctx.residency is not None:
            ctx.residency.begin_step(req_index_cpu)
        if rs:
            dev = ctx.device
            self._map(req_index=torch.tensor(rs, dtype=torch.int64).to(dev, non_blocking=True),
                      seq_lens=torch.tensor(ns, dtype=torch.int64).to(dev, non_blocking=True),
                      new_logical=new_logical, req_index_cpu=rs, seq_lens_cpu=ns, new_logical_cpu=None,
                      relieve=False)  # relieved above, for the whole batch
        else:
            ctx.telemetry.add_step()
        st.batch_all_resident = ctx.residency is not None and all(st.is_resident[r] for r in req_index_cpu)

    def _hint_short_growth(self, rs: list[int], slots: list[int]) -> None:
        """A short request's new token p lives in history slot p: set its resident-hint bit."""
        st, B, dev = self.ctx.state, self.ctx.buffer_size, self.ctx.device
        grown = [(r, s) for r, s in zip(rs, slots, strict=True) if s < B]
        if not grown:
            return
        r_t = torch.tensor([r for r, _ in grown], dtype=torch.int64).to(dev, non_blocking=True)
        w_t = torch.tensor([s >> 5 for _, s in grown], dtype=torch.int64).to(dev, non_blocking=True)
        bit_t = int32_bits(torch.tensor([1 << (s & 31) for _, s in grown], dtype=torch.int64))
        st.resident[:, r_t, w_t] |= bit_t.to(dev, non_blocking=True)

    def _backup(self, rs: list[int], slots: list[int], positions: list[int]) -> None:
        """Write-through of hot requests' previous newest tokens, read from their slots: the
        forward overwrites slot B, so it waits on the backup fence this arms."""
        st, dev = self.ctx.state, self.ctx.device
        r_t = torch.tensor(rs, dtype=torch.int64).to(dev, non_blocking=True)
        s_t = torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True)
        self._write_through(rs, positions, st.slot_rows[r_t, s_t].to(torch.int64), r_t=r_t,
                            done=self.ctx.streams.backup_fence)

    def _backup_resident(self, entries: list[tuple[int, int, int]]) -> None:
        """Write-through of resident requests' previous newest tokens (request, row, position).
        Their new token has a row of its own, so the forward need not wait for this copy: it
        records no fence (a shrink and a release order themselves after the whole backup
        stream)."""
        rows = torch.tensor([row for _, row, _ in entries], dtype=torch.int64)
        self._write_through([r for r, _, _ in entries], [q for _, _, q in entries],
                            rows.to(self.ctx.device, non_blocking=True), done=None)

    def _write_through(self, rs: list[int], positions: list[int], dev_rows: torch.Tensor, *,
                       done, r_t: torch.Tensor | None = None) -> None:
        """Device rows ``dev_rows`` -> the host rows of (request, position), all layers, on the
        backup stream after the forward that wrote them; ``done`` recorded behind (or None)."""
        ctx, dev = self.ctx, self.ctx.device
        if r_t is None:
            r_t = torch.tensor(rs, dtype=torch.int64).to(dev, non_blocking=True)
        q_t = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        transfer.to_host_async(ctx, dev_rows, ctx.host.host_rows[r_t, q_t], side=ctx.streams.backup,
                               done=done)

    def _grow(self, rs: list[int], slots: list[int]) -> None:
        ctx, st = self.ctx, self.ctx.state
        grow_r: list[int] = []
        grow_s: list[int] = []
        rows: list[torch.Tensor] = []
        for r, s in zip(rs, slots, strict=True):
            # the rows follow from the length, which map_last_loc checked grows by one per
            # step: the new token's slot s has a row already iff the buffer held slot B before
            if st.rows_held(r) > s:
                continue
            got = ctx.allocator.hot.grow(r, 1)
            if got is None:
                raise RuntimeError(
                    f"map_last_loc: no free device row to grow request slot {r}'s hot buffer to "
                    f"{s + 1} slots ({ctx.allocator.rows.available_size()} rows free)."
                )
            grow_r.append(r)
            grow_s.append(s)
            rows.append(got)
        if grow_r:
            dev = ctx.device
            r_t = torch.tensor(grow_r, dtype=torch.int64).to(dev, non_blocking=True)
            s_t = torch.tensor(grow_s, dtype=torch.int64).to(dev, non_blocking=True)
            st.slot_rows[r_t, s_t] = torch.cat(rows).to(torch.int32).to(dev, non_blocking=True)

    def wait_for_pending_backup(self) -> None:
        """Order the current stream (SGLang's forward stream: model_runner.py calls this before
        each decode forward) after the last backup, once per backup (``streams.Fence``)."""
        streams = self.ctx.streams
        streams.backup_fence.wait(streams.current())
