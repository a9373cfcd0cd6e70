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

Speculative verify steps (``num_draft_tokens`` W >= 1) pass ``top_k`` int32 [bs, W, k]: the anchor runs
``verify_ops.resolve_verify`` over the union of each request's W rows into its own buffers
(``out_verify`` [max_batch, W, k], a plan of ``W*k`` columns); shared layers replay that plan
with the unchanged ``ops.replay`` and return the anchor's ``out_verify`` exactly as above.
"""

from __future__ import annotations

import logging

import torch

from sglang_hisparse.coordinator.context import CoreContext
from sglang_hisparse.kernels import MissPlan, ResolveMode, ops, verify_ops

logger = logging.getLogger("sglang_hisparse")


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
    ``num_draft_tokens``: W verify rows per request (0: no speculative decoding; otherwise
    the state is built ``B + W`` slots wide and only 3-D verify top-k is served).
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
        num_draft_tokens: int = 0,
    ) -> None:
        self.ctx = ctx
        self.spec = num_draft_tokens > 0
        self.window = max(1, num_draft_tokens)
        self.num_real_reqs = num_real_reqs
        self.start_layer = start_layer
        self.mode = mode
        self.block_size = block_size
        from sglang_hisparse import envs

        #: with the resident hint, let the kernel fetch probable misses before its bookkeeping
        self.early_fetch = bool(envs.get("SGLANG_HISPARSE_EARLY_FETCH"))
        if ctx.state.resident is not None and not self.early_fetch:
            logger.info("HiSparse: early fetch off (%s); misses are fetched after the bookkeeping.",
                        envs.source("SGLANG_HISPARSE_EARLY_FETCH"))
        elif ctx.state.resident is not None and ctx.device.type == "cuda" and mode == ResolveMode.COPY:
            logger.info("HiSparse: early fetch on: every decode batch uses fetch warps, every "
                        "probable miss in flight at once (docs/kernels.md, 'Fetch warps').")
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
        self._alloc(max_batch)

    def _alloc(self, max_batch: int) -> None:
        k, dev = self.ctx.top_k, self.ctx.device
        self.max_batch = max_batch
        self.out_rows = torch.full((max_batch, k), -1, dtype=torch.int32, device=dev)
        self.plan = MissPlan.empty(max_batch, k, dev)
        self._batch_ids = torch.arange(max_batch, dtype=torch.int32, device=dev)
        if dev.type == "cuda":
            ops.reserve_workspace(dev, max_batch)  # the kernel's per-row counters, before capture
        W = self.window
        if self.spec:
            self.out_verify = torch.full((max_batch, W, k), -1, dtype=torch.int32, device=dev)
            self.plan_verify = MissPlan.empty(max_batch, W * k, dev)
            if dev.type == "cuda":
                verify_ops.reserve_verify_workspace(dev, max_batch)  # its own counters

    def swap_in(
        self,
        req_index: torch.Tensor,
        seq_lens: torch.Tensor,
        top_k: torch.Tensor,
        layer_id: int,
    ) -> torch.Tensor:
        """Device rows of ``top_k`` for model layer ``layer_id``, aligned with it.

        Decode: ``top_k`` int32 [bs, k], ``seq_lens`` [bs] -> int32 [bs, k]. Verify (W > 1):
        ``top_k`` [bs, W, k], ``seq_lens`` [bs*W] or [bs, W] (SGLang's
        ``dsa_seqlens_expanded``: row j of a request has length s + 1 + j) -> int32 [bs, W, k]
        (SGLang views it [bs*W, k]). -1 for padding entries and rows ``>= num_real_reqs``.
        A view of a reused buffer: consume it before the next anchor layer resolves."""
        ctx = self.ctx
        verify = top_k.dim() == 3
        if verify:
            if not self.spec or tuple(top_k.shape[1:]) != (self.window, ctx.top_k):
                raise ValueError(
                    f"swap_in: top_k has shape {tuple(top_k.shape)}; a verify step needs "
                    f"[bs, W, {ctx.top_k}] with W = num_draft_tokens = {self.window if self.spec else 0} "
                    f"(0: the coordinator was built without speculative decoding)."
                )
        elif self.spec:
            raise ValueError(
                f"swap_in: top_k has shape {tuple(top_k.shape)} but this coordinator serves "
                f"speculative verify steps only (num_draft_tokens = {self.window}): pass "
                f"[bs, {self.window}, {ctx.top_k}] after prepare_spec."
            )
        elif top_k.dim() != 2 or top_k.shape[1] != ctx.top_k:
            raise ValueError(
                f"swap_in: top_k has shape {tuple(top_k.shape)}; expected [bs, {ctx.top_k}] "
                f"(or [bs, W, {ctx.top_k}] for a speculative verify step)."
            )
        bs = top_k.shape[0]
        if bs > self.max_batch:
            # NOTE: allocation on the hot path, only when a batch exceeds every earlier one;
            # servers size max_batch from the CUDA-graph batch sizes so this happens eagerly.
            self._alloc(bs)
        out = self.out_verify[:bs] if verify else self.out_rows[:bs]
        li = layer_id - self.start_layer
        if self.is_shared[li]:
            self.events[li].wait(ctx.streams.current())
            return out
        group = self.groups.get(li, [])
        full = self.plan_verify if verify else self.plan
        plan = MissPlan(full.src[:bs], full.dst[:bs], full.count[:bs])
        kw = dict(
            top_k=top_k if top_k.dtype == torch.int32 else top_k.to(torch.int32),
            req_index=req_index,
            seq_lens=seq_lens.reshape(bs, self.window) if verify else seq_lens,
            num_real_reqs=self.num_real_reqs,
            slot_tokens=ctx.state.slot_tokens[li],
            slot_rows=ctx.state.slot_rows,
            lru=ctx.state.lru[li],
            host_rows=ctx.host.host_rows,
            host_cache=ctx.host_kv[li],
            device_cache=ctx.device_kv[li],
            out_rows=out,
            plan=plan,
            mode=self.mode,
            **({"block_size": self.block_size} if self.block_size and top_k.is_cuda else {}),
        )
        if not verify and ctx.state.resident is not None:
            kw.update(resident=ctx.state.resident[li], early_rows=None if self.early_fetch else 0)
        (verify_ops.resolve_verify if verify else ops.resolve)(**kw)
        real = self._batch_ids[:bs] < self.num_real_reqs
        ctx.telemetry.add_resolve(
            top_k=kw["top_k"].reshape(bs, -1), miss_count=plan.count, real_mask=real,
            item_bytes=ctx.item_bytes, copies=1 + len(group),
        )
        # NOTE: the trace recorder models single-row decode steps; verify steps are not recorded.
        if ctx.recorder is not None and not verify:
            ctx.recorder.record(layer_id=layer_id, req_index=req_index, seq_lens=seq_lens, top_k=top_k)
        if group:
            streams = ctx.streams
            streams.prefetch.wait_stream(streams.current())
            with streams.on(streams.prefetch):
                for s in group:
                    if self.mode is ResolveMode.COPY:
                        ops.replay(
                            plan=plan, num_real_reqs=self.num_real_reqs,
                            host_cache=ctx.host_kv[s], device_cache=ctx.device_kv[s],
                        )
                    self.events[s].record()
        return out
