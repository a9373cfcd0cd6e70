"""Per-layer resolve of top-k positions into device rows, with shared-index prefetch groups.

Models may reuse one layer's top-k for the following layers (``index_topk_freq`` /
``index_topk_pattern``; SGLang's ``resolve_shared_index_layers`` turns that into a per-layer
``list[bool]``, True = "reuses the previous compute layer's index"). Consecutive shared
layers form a group under the compute layer before them (the anchor)::

    layers     0(anchor)  1(shared)  2(shared)  3(anchor)  4(shared)
    groups     {0: [1, 2], 3: [4]}

    anchor 0:  resolve (records the MissPlan) ──► prefetch stream: replay plan into layer 1's
               KV, event[1]; replay into layer 2's KV, event[2]
    shared 1:  current stream waits event[1] only; returns the anchor's out_rows
    shared 2:  waits event[2]; returns the anchor's out_rows

This is exact because every layer's hot buffer evolves in lockstep: slot rows are shared,
the same positions are selected, and all admissions/backups/preloads touch every layer, so
a shared layer's slot state equals its anchor's and only the bytes differ. With prefetch
off (or no sharing) each layer resolves synchronously against its own state.

NOTE: one ``out_rows`` buffer and one plan buffer serve all layers. Reuse is safe because
groups are consecutive: the next anchor resolves only after the forward consumed every
shared layer of the previous group, and each of those waited for its replay's event.
The buffers are sized for ``max_batch`` rows, allocated once (before any CUDA-graph capture).

The mode is fixed when the resolver is built, from ``state.num_draft_tokens`` W:

```
W = 0 (decode)   top_k int32 [bs, k]     ops.resolve (+ the resident hint)   out [max_batch, k]
W >= 1 (verify)  top_k int32 [bs, W, k]  verify_ops.resolve_verify over the  out [max_batch, W, k]
                 seq_lens [bs*W]         union of each request's W rows      plan W*k columns
```

Only that mode's buffers exist and only its shape is accepted. Shared layers replay the
anchor's plan with the unchanged ``ops.replay`` in both modes (its ``k`` is the plan's columns).

One launch per anchor on the current stream, its group's replays on the prefetch stream at
the default priority with the replay kernel's own CTA count: under CUDA graphs no other
arrangement measured faster (sliced anchors, 16 CTAs per replay, a high-priority prefetch
stream: 0.83-1.00x at 61/78 layers x 32K/128K, benchmarks/E2E.md "Results"), so none is kept.
"""

from __future__ import annotations

import math

import torch

from sglang_hisparse.coordinator.context import CoreContext
from sglang_hisparse.kernels import MissPlan, ResolveMode, ops, verify_ops
from sglang_hisparse.kernels.reference import expand_blocks


def build_prefetch_groups(shared: list[bool]) -> dict[int, list[int]]:
    """Anchor layer -> its consecutive shared layers (indices into ``shared``)."""
    groups: dict[int, list[int]] = {}
    anchor: int | None = None
    for i, is_shared in enumerate(shared):
        if not is_shared:
            anchor = i
            continue
        if anchor is None:
            raise ValueError(
                f"shared_index_layers[{i}] is True but no earlier layer computes an index; "
                f"the first layer must compute its own top-k (pattern {shared[:8]}...)."
            )
        groups.setdefault(anchor, []).append(i)
    return groups


class Resolver:
    """``swap_in`` for one TP rank (see the module docstring).

    shared_index_layers: per model layer (as SGLang passes it) or None; ``start_layer`` maps
    model layer ids to local ones. ``prefetch``: use the groups (else resolve every layer).
    ``num_real_reqs``: int32 [1] device tensor the caller fills with the real batch size.
    ``block_size``: CUDA threads per resolve CTA (``swap_in_block_size``; None: kernel default).
    With the resident hint (decode only) the kernel fetches probable misses before its
    bookkeeping proves them (docs/kernels.md, "Early fetch"). Decode or verify follows from
    ``ctx.state.num_draft_tokens`` (module docstring).
    """

    def __init__(
        self,
        ctx: CoreContext,
        *,
        num_real_reqs: torch.Tensor,
        max_batch: int,
        shared_index_layers: list[bool] | None,
        start_layer: int = 0,
        prefetch: bool = True,
        mode: ResolveMode = ResolveMode.COPY,
        block_size: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.num_real_reqs = num_real_reqs
        self.start_layer = start_layer
        self.mode = mode
        self._replay_extra: dict = {}
        if ctx.row_layout.kind:  # where the rows live (token rows on both sides: the ops' default)
            self._replay_extra["row_layout"] = ctx.row_layout
        st, k = ctx.state, ctx.top_k
        #: W verify rows per request (0: decode); fixed for the resolver's life
        self.num_draft_tokens = W = st.num_draft_tokens
        #: the shape of one request's top-k / out rows: [k] (decode) or [W, k] (verify)
        self.row_shape: tuple[int, ...] = (W, k) if W else (k,)
        self._kernel = verify_ops.resolve_verify if W else ops.resolve
        self._reserve = verify_ops.reserve_verify_workspace if W else ops.reserve_workspace
        # keyword arguments every launch of the chosen kernel shares
        self._fixed: dict = {"mode": mode}
        if block_size and ctx.device.type == "cuda":
            self._fixed["block_size"] = block_size
        if ctx.row_layout.kind:
            self._fixed["row_layout"] = ctx.row_layout
        #: the decode kernel reads and keeps the resident hint (verify has none)
        self._hint = st.resident is not None
        if st.resident_rows is not None and not W:
            # first level: fully resident requests resolve through their page table
            self._fixed["resident_rows"] = st.resident_rows
        L = ctx.num_layers
        shared = [False] * L
        if shared_index_layers is not None:
            local = [bool(x) for x in list(shared_index_layers)[start_layer : start_layer + L]]
            # Layers past the pattern (e.g. a pool holding an extra next-n layer) compute
            # their own index: resolving them synchronously is always correct.
            shared = local + [False] * (L - len(local))
        groups = build_prefetch_groups(shared)
        self.prefetch = bool(prefetch and groups)
        self.groups = groups if self.prefetch else {}
        self.is_shared = shared if self.prefetch else [False] * L
        self.events = {s: ctx.streams.new_event() for g in self.groups.values() for s in g}
        #: whether the last anchor forked its replays (its shared layers then wait on them)
        self._forked = True
        self._alloc(max_batch)

    def record_layers(self) -> list[int]:
        """Per local layer, the layer whose resolve runs for it (its anchor when it replays a
        shared index, else itself): where a resident request's selection record is kept."""
        out = list(range(len(self.is_shared)))
        for anchor, members in self.groups.items():
            for s in members:
                out[s] = anchor
        return out

    def _alloc(self, max_batch: int) -> None:
        """``out_rows`` int32 [max_batch, *row_shape], a plan of ``prod(row_shape)`` columns,
        the batch ids and (CUDA) the kernel's arrival counters."""
        dev = self.ctx.device
        self.max_batch = max_batch
        self.out_rows = torch.full((max_batch, *self.row_shape), -1, dtype=torch.int32, device=dev)
        self.plan = MissPlan.empty(max_batch, math.prod(self.row_shape), dev)
        self._batch_ids = torch.arange(max_batch, dtype=torch.int32, device=dev)
        if dev.type == "cuda":
            self._reserve(dev, max_batch)  # the kernel's per-row counters, before capture

    def _check_top_k(self, top_k: torch.Tensor) -> None:
        if tuple(top_k.shape[1:]) == self.row_shape:
            return
        k, W, shape = self.ctx.top_k, self.num_draft_tokens, tuple(top_k.shape)
        if top_k.dim() == 3:
            raise ValueError(
                f"swap_in: top_k has shape {shape}; a verify step needs [bs, W, {k}] with W = "
                f"num_draft_tokens = {W} (0: the coordinator was built without speculative decoding)."
            )
        if W:
            raise ValueError(
                f"swap_in: top_k has shape {shape} but this coordinator serves speculative verify "
                f"steps only (num_draft_tokens = {W}): pass [bs, {W}, {k}] after prepare_spec."
            )
        raise ValueError(
            f"swap_in: top_k has shape {shape}; expected [bs, {k}] (or [bs, W, {k}] for a "
            f"speculative verify step)."
        )

    def swap_in(
        self,
        req_index: torch.Tensor,
        seq_lens: torch.Tensor,
        top_k: torch.Tensor,
        layer_id: int,
        selection_block: int = 0,
    ) -> torch.Tensor:
        """Device rows of ``top_k`` for model layer ``layer_id``, aligned with it.

        Decode: ``top_k`` int32 [bs, k], ``seq_lens`` [bs] -> int32 [bs, k]. Verify:
        ``top_k`` [bs, W, k], ``seq_lens`` [bs*W] or [bs, W] (SGLang's
        ``dsa_seqlens_expanded``: row j of a request has length s + 1 + j) -> int32 [bs, W, k]
        (SGLang views it [bs*W, k]). -1 for padding entries and rows ``>= num_real_reqs``.
        A view of a reused buffer: consume it before the next anchor layer resolves.

        ``selection_block`` > 0 (decode only): ``top_k`` is int32 [bs, k / selection_block]
        block ids (MiniMax-M3), expanded by the kernel (``ops.resolve``); the rows are [bs, k]."""
        ctx = self.ctx
        if selection_block:
            k = ctx.top_k
            if self.num_draft_tokens or top_k.dim() != 2 or top_k.shape[1] * selection_block != k:
                raise ValueError(
                    f"swap_in: block selection {tuple(top_k.shape)} of block size {selection_block}: needs "
                    f"[bs, {k} / {selection_block}] block ids and a coordinator without speculative decoding.")
        else:
            self._check_top_k(top_k)
        bs = top_k.shape[0]
        if bs > self.max_batch:
            # NOTE: allocation on the hot path, only when a batch exceeds every earlier one;
            # servers size max_batch from the CUDA-graph batch sizes so this happens eagerly.
            self._alloc(bs)
        out = self.out_rows[:bs]
        li = layer_id - self.start_layer
        if self.is_shared[li]:
            if self._forked:
                self.events[li].wait(ctx.streams.current())
            return out
        group = self.groups.get(li, [])
        plan = MissPlan(self.plan.src[:bs], self.plan.dst[:bs], self.plan.count[:bs])
        top_k = top_k if top_k.dtype == torch.int32 else top_k.to(torch.int32)
        st = ctx.state
        extra = {**self._fixed, "resident": st.resident[li]} if self._hint else self._fixed
        if st.policy_state is not None:  # a policy with state (not lru)
            extra = {**extra, "policy": st.policy, "policy_state": st.policy_state[li]}
        seq_lens = seq_lens.reshape(bs, self.num_draft_tokens) if self.num_draft_tokens else seq_lens

        self._kernel(
            top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real_reqs=self.num_real_reqs,
            slot_tokens=st.slot_tokens[li], slot_rows=st.slot_rows, lru=st.lru[li],
            host_rows=ctx.host.host_rows, host_cache=ctx.host_kv[li], device_cache=ctx.device_kv[li],
            out_rows=out, plan=plan, **extra,
            **({"selection_block": selection_block} if selection_block else {}),
        )
        real = self._batch_ids[:bs] < self.num_real_reqs
        # NOTE: a batch the host knows is all resident (``state.batch_all_resident``, set by
        # map_last_loc) copies nothing: its shared layers skip the replays, their events and
        # waits, and telemetry adds only the selections (~6 host calls per shared layer and 6
        # per anchor fewer, what an eager step spends over the plugin off). Never while a CUDA
        # graph is captured: a graph must hold the replays for the batches it serves later.
        self._forked = not (st.batch_all_resident and not self._capturing())
        # a block selection's valid positions are the rows the kernel resolved (-1 elsewhere)
        selected = out if selection_block else top_k.reshape(bs, -1)
        if self._forked:
            ctx.telemetry.add_resolve(
                top_k=selected, miss_count=plan.count, real_mask=real,
                item_bytes=ctx.item_bytes, copies=1 + len(group),
            )
        else:
            ctx.telemetry.add_selected(top_k=selected, real_mask=real)
        # NOTE: the trace recorder models single-row decode steps; verify steps are not recorded.
        if ctx.recorder is not None and not self.num_draft_tokens:
            positions = expand_blocks(top_k, seq_lens, selection_block) if selection_block else top_k
            ctx.recorder.record(layer_id=layer_id, req_index=req_index, seq_lens=seq_lens, top_k=positions)
        if group and self._forked:
            streams = ctx.streams
            streams.prefetch.wait_stream(streams.current())
            with streams.on(streams.prefetch):
                for s in group:
                    if self.mode is ResolveMode.COPY:
                        ops.replay(
                            plan=plan, num_real_reqs=self.num_real_reqs,
                            host_cache=ctx.host_kv[s], device_cache=ctx.device_kv[s],
                            **self._replay_extra,
                        )
                    self.events[s].record()
        return out

    def _capturing(self) -> bool:
        return self.ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
