"""``HiSparseCore``: the engine-agnostic coordinator (no SGLang import).

It ties the pieces together and is what both the SGLang adapter
(``sglang_adapter.coordinator.SGLangHiSparseCoordinator``) and the exactness harness
(``hisparse_testing``) drive, with the same call protocol::

    prefill ─► admit_staging(r, ids) ─► collect_ready() ─┐      PD: admit_direct(r, n) ─┐
                                                         ▼                              ▼
    per step:  map_last_loc(...) ─► wait_for_pending_backup() ─► per layer swap_in(...) ─► attention
    end:       finish(r)   (finished, aborted or retracted; any phase)   then allocator.free(ids)

With speculative decoding (``num_draft_tokens`` W >= 1, SGLang's
``speculative_num_draft_tokens``) every decode step is a verify step and the per-step calls
are instead (``coordinator.spec.SpecWindow``; collect_ready/admit_direct also give each
request its W window rows)::

    reserve_spec(slots) at prefill allocation;   per step:  prepare_spec(...) ─► per layer
    swap_in(req_index, seq_lens [bs*W], top_k [bs, W, k], l) ─► attention ─► commit_spec(accept_index)

Components: ``state`` (:class:`SlotState` tensors), ``lifecycle`` (admission/release),
``step`` (per-step backup/growth/mapping), ``resolver`` (per-layer resolve + prefetch
groups), ``streams`` (CUDA streams or CPU no-ops), ``telemetry`` (counters).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from sglang_hisparse.config import RESIDENCY_MODES, check_buffer_holds_selection
from sglang_hisparse.coordinator import transfer
from sglang_hisparse.coordinator.context import CoreContext, HostTable
from sglang_hisparse.coordinator.lifecycle import Lifecycle, StagingEntry
from sglang_hisparse.coordinator.residency import Residency
from sglang_hisparse.coordinator.resolver import Resolver
from sglang_hisparse.coordinator.spec import SpecWindow
from sglang_hisparse.coordinator.state import SlotState
from sglang_hisparse.coordinator.step import StepMapper
from sglang_hisparse.coordinator.streams import Streams
from sglang_hisparse.kernel_limits import check_resolve_fits
from sglang_hisparse.kernels import ResolveMode
from sglang_hisparse.kernels.row_layout import TOKEN, RowLayout
from sglang_hisparse.telemetry import Telemetry

logger = logging.getLogger("sglang_hisparse")


def _env_switches() -> tuple[bool, bool, float]:
    """(prefetch disabled, skip IO, log interval) from the env registry: every switch is read
    here, once, and passed to the component it configures."""
    from sglang_hisparse import envs

    return (
        bool(envs.get("SGLANG_HISPARSE_DISABLE_PREFETCH")),
        bool(envs.get("SGLANG_HISPARSE_SKIP_IO")),
        float(envs.get("SGLANG_HISPARSE_LOG_INTERVAL")),
    )


def _log_switches(*, no_prefetch: bool, skip_io: bool, early_fetch: bool) -> None:
    """Say which switches are active and which environment name set them. ``early_fetch``:
    whether the decode kernel fetches early (a resident hint, COPY launches on CUDA)."""
    from sglang_hisparse import envs

    if no_prefetch:
        logger.info(
            "HiSparse: shared-index prefetch disabled (%s); shared layers resolve synchronously.",
            envs.source("SGLANG_HISPARSE_DISABLE_PREFETCH") or "constructor argument",
        )
    if skip_io:
        logger.warning(
            "HiSparse: skip-IO mode (%s): NO KV BYTES ARE COPIED HOST->DEVICE. Timing oracle "
            "only; MODEL OUTPUTS ARE INVALID.",
            envs.source("SGLANG_HISPARSE_SKIP_IO") or "constructor argument",
        )
    if early_fetch:
        logger.info("HiSparse: early fetch on: every decode batch uses fetch warps, every "
                    "probable miss in flight at once (docs/kernels.md, 'Fetch warps').")


def _make_recorder() -> Any:
    """The live trace recorder when SGLANG_HISPARSE_RECORD_TRACE is set, else None (zero cost)."""
    from sglang_hisparse import envs

    if not envs.get("SGLANG_HISPARSE_RECORD_TRACE"):
        return None
    from sglang_hisparse.traces.recorder import LiveTraceRecorder

    return LiveTraceRecorder.from_env()


def _host_alias(host_kv: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor] | None:
    """CUDA views of every host layer (see ``transfer.cuda_alias``), or None."""
    views = [transfer.cuda_alias(t, device) for t in host_kv]
    if any(v is None for v in views):
        if device.type == "cuda":
            logger.warning("HiSparse: host KV is not pinned; staging and backups will sync the host.")
        return None
    return views  # type: ignore[return-value]


class HiSparseCore:
    """The coordinator for one TP rank.

    top_k: k; buffer_size: B (>= k); allocator: a ``DualSpaceAllocator``; host: a
    :class:`HostTable`; device_kv / host_kv: per local layer uint8 [rows, I];
    num_reqs: R request slots; shared_index_layers: per model layer (SGLang's
    ``resolve_shared_index_layers``) or None; start_layer: first model layer on this rank;
    max_batch: rows of the per-step output buffers; tp_group: process group whose ranks must
    agree on staging collection (None or a single rank: no collective).
    ``prefetch``/``skip_io``/``log_interval_s`` default to the env registry; ``block_size`` is
    the resolve kernel's threads per CTA (``swap_in_block_size``). ``num_draft_tokens``: W
    verify rows per request under speculative decoding (0: off, as SGLang passes it); needs
    ``buffer_size >= W * top_k``. ``policy``: the hot buffers' replacement policy
    (``--hisparse-config`` ``"policy"``; ``"lru"`` or ``"slru"`` with speculative decoding).
    ``residency``: ``"always_hot"`` (every request in its hot
    buffer once it decodes; the default here) or ``"pressure"`` (requests keep all their device
    rows until fewer than ``watermark_rows`` are free: ``coordinator/residency.py``; the
    server's config defaults to it); speculative decoding always runs ``always_hot``.
    ``cache_finished`` (SGLang's radix cache on): a
    finished resident request's rows stay on the device as cached prefix rows of its ids
    (``DualSpaceAllocator.cache_resident``) until an allocation or the watermark takes them.
    ``row_layout``: where a row lives in a ``device_kv`` layer (``kernels.row_layout``; default
    token rows): ``C4_PAGED`` for DeepSeek-V4's compressed entries, each layer uint8 [pages,
    37440] with host rows of 592 B, or ``C4_PAGED_HOST`` with the host layers in the same pages
    (the host rows SGLang's PD transfer writes); not with speculative decoding: the verify
    kernel has no layout parameter.
    """

    def __init__(
        self,
        *,
        top_k: int,
        buffer_size: int,
        num_reqs: int,
        allocator: Any,
        host: HostTable,
        device_kv: Sequence[torch.Tensor],
        host_kv: Sequence[torch.Tensor],
        device: torch.device | str,
        shared_index_layers: list[bool] | None = None,
        start_layer: int = 0,
        max_batch: int = 256,
        tp_group: Any = None,
        prefetch: bool | None = None,
        skip_io: bool | None = None,
        log_interval_s: float | None = None,
        block_size: int | None = None,
        num_draft_tokens: int = 0,
        policy: str = "lru",
        residency: str = "always_hot",
        watermark_rows: int = 0,
        cache_finished: bool = False,
        row_layout: RowLayout = TOKEN,
    ) -> None:
        if residency not in RESIDENCY_MODES:
            raise ValueError(
                f"residency = {residency!r}: use 'pressure' (requests keep their device rows "
                f"until HBM is short) or 'always_hot' (every request in its hot buffer)."
            )
        if num_draft_tokens < 0:
            raise ValueError(
                f"num_draft_tokens = {num_draft_tokens} must be >= 0 (0 = no speculative decoding)."
            )
        check_buffer_holds_selection(buffer_size, top_k, num_draft_tokens)
        check_resolve_fits(top_k, buffer_size, int(host.host_rows.shape[1]), policy=policy)
        if int(host.total_rows) < allocator.logical.total_ids:
            raise ValueError(
                f"the host pool has {host.total_rows} rows but the logical space {allocator.logical.total_ids} "
                f"ids; a logical id's host row is the id, so build the host pool with capacity_tokens = "
                f"device rows x host_to_device_ratio ({allocator.size_full}) and the allocator's page size."
            )
        if len(device_kv) != len(host_kv) or len(device_kv) == 0:
            raise ValueError(
                f"device_kv has {len(device_kv)} layers and host_kv {len(host_kv)}; need the same, >= 1."
            )
        for layer in host_kv:
            row_layout.host_proxy(layer)  # raises naming the layout
        item = int(row_layout.host_proxy(host_kv[0]).shape[1])
        if row_layout.kind and num_draft_tokens:
            raise ValueError(
                f"row_layout {row_layout.name} with num_draft_tokens = {num_draft_tokens}: the verify "
                f"kernel stores token rows only; run the paged layout without speculative decoding."
            )
        for layer in device_kv:
            if row_layout.paged:
                row_layout.check_device(layer, item)
            elif layer.dim() != 2 or int(layer.shape[1]) != item:
                raise ValueError(f"device_kv rows are {tuple(layer.shape)}; host_kv rows are {item} B: they must match.")
        env_no_prefetch, env_skip_io, env_interval = _env_switches()
        device = torch.device(device)
        self.streams = Streams(device)
        self.telemetry = Telemetry(
            device, log_interval_s=env_interval if log_interval_s is None else log_interval_s
        )
        self.state = SlotState(
            num_layers=len(device_kv), num_reqs=num_reqs, buffer_size=buffer_size, device=device,
            num_draft_tokens=num_draft_tokens, hint_positions=int(host.host_rows.shape[1]),
            policy=policy,
            residency_page_size=(int(allocator.page_size)
                                 if residency == "pressure" and num_draft_tokens == 0 else 0),
        )
        self.ctx = CoreContext(
            top_k=top_k, buffer_size=buffer_size, item_bytes=item,
            device=device, allocator=allocator, host=host, device_kv=device_kv, host_kv=host_kv,
            state=self.state, streams=self.streams, telemetry=self.telemetry,
            recorder=_make_recorder(), host_kv_cuda=_host_alias(host_kv, device),
            cache_finished=cache_finished, row_layout=row_layout,
        )
        transfer.layer_tables(self.ctx)  # built here, outside any graph capture or sync guard
        #: int32 [1]: real batch size of the current forward (the model runner fills it)
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)
        self.skip_io = env_skip_io if skip_io is None else skip_io
        no_prefetch = env_no_prefetch if prefetch is None else not prefetch
        early = self.state.resident is not None and device.type == "cuda" and not self.skip_io
        _log_switches(no_prefetch=no_prefetch, skip_io=self.skip_io, early_fetch=early)
        self.lifecycle = Lifecycle(self.ctx, tp_group=tp_group)
        self.step = StepMapper(self.ctx)
        self.resolver = Resolver(
            self.ctx, num_real_reqs=self.num_real_reqs, max_batch=max_batch,
            shared_index_layers=shared_index_layers, start_layer=start_layer,
            prefetch=not no_prefetch,
            mode=ResolveMode.NO_IO if self.skip_io else ResolveMode.COPY, block_size=block_size,
        )
        #: block top-k with fewer blocks than top_k / block (swap_in_blocks): int32 [max_batch,
        #: top_k / block], -1 past the given blocks; built at the first such call
        self._block_pad: torch.Tensor | None = None
        self._max_batch = max_batch
        #: the verify windows (speculative decoding), or None; W is ``state.num_draft_tokens``
        self.spec = SpecWindow(self.ctx) if self.state.speculative else None
        self.residency = Residency(self.ctx, mode=residency, watermark_rows=watermark_rows,
                                   record_layer=self.resolver.record_layers())
        if self.residency.enabled:
            self.ctx.residency = self.residency
            self.telemetry.residency_counts = self.residency.counts
            logger.info(
                "HiSparse residency: pressure (requests keep all their device rows while more "
                "than %d of %d rows are free; then the longest shrink to B = %d hot slots).",
                self.residency.watermark_rows, allocator.size_device, buffer_size)
        elif residency == "pressure":
            logger.info("HiSparse residency: always_hot (speculative decoding: the verify kernel "
                        "has no resident level).")

    # -- sizes ------------------------------------------------------------------------------
    @property
    def top_k(self) -> int:
        return self.ctx.top_k

    @property
    def buffer_size(self) -> int:
        return self.ctx.buffer_size

    @property
    def prefetch_enabled(self) -> bool:
        return self.resolver.prefetch

    # -- lifecycle --------------------------------------------------------------------------
    def set_producer_stream(self, stream: Any) -> None:
        self.streams.set_producer(stream)

    def prepare_prefix(self, r: int, prefix_ids: torch.Tensor, computed_ids: torch.Tensor | None = None) -> bool:
        return self.lifecycle.prepare_prefix(r, prefix_ids, computed_ids)

    def admit_staging(
        self, r: int, logical_ids: torch.Tensor, req: Any = None, *, prompt_written: bool = False,
        own_start: int = 0,
    ) -> None:
        self.lifecycle.admit_staging(r, logical_ids, req, prompt_written=prompt_written, own_start=own_start)

    def collect_ready(self) -> list[StagingEntry]:
        ready = self.lifecycle.collect_ready()
        if self.spec is not None:
            for entry in ready:
                self.spec.admit(entry.req_slot)
        return ready

    def has_ongoing_staging(self) -> bool:
        return self.lifecycle.has_ongoing_staging()

    @property
    def staging_queue(self) -> list[StagingEntry]:
        return self.lifecycle.queue

    def admit_direct(self, r: int, seq_len: int) -> None:
        self.lifecycle.admit_direct(r, seq_len)
        if self.spec is not None:
            self.spec.admit(r)

    def finish(self, r: int, logical_ids: torch.Tensor | None = None) -> None:
        if self.spec is not None:
            self.spec.finish(r)  # before the lifecycle releases (and unmaps) the window rows
        self.lifecycle.finish(r, logical_ids)

    def residency_counts(self) -> dict[str, int]:
        """Requests resident / hot, free device rows, shrinks (``Residency.counts``)."""
        return self.residency.counts()

    @property
    def num_draft_tokens(self) -> int:
        """W verify rows per request (0: no speculative decoding)."""
        return self.state.num_draft_tokens

    # -- per step ---------------------------------------------------------------------------
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
        self.step.map_last_loc(
            req_index=req_index, seq_lens=seq_lens, new_logical=new_logical,
            req_index_cpu=req_index_cpu, seq_lens_cpu=seq_lens_cpu, new_logical_cpu=new_logical_cpu,
            grows=grows,
        )

    def wait_for_pending_backup(self) -> None:
        self.step.wait_for_pending_backup()

    # -- per verify step (speculative decoding) ---------------------------------------------
    def _require_spec(self, op: str) -> SpecWindow:
        if self.spec is None:
            raise ValueError(
                f"{op}: this coordinator was built with num_draft_tokens = 0 (no speculative "
                f"decoding); pass num_draft_tokens = speculative_num_draft_tokens."
            )
        return self.spec

    def reserve_spec(self, req_slots: list[int]) -> None:
        """Capacity check for new requests' verify windows (no-op without spec)."""
        if self.spec is not None:
            self.spec.reserve(list(req_slots))

    def prepare_spec(
        self, *, req_index: torch.Tensor, req_index_cpu: list[int], seq_lens_cpu: list[int],
        out_cache_loc: torch.Tensor, out_cache_loc_cpu: torch.Tensor | None = None,
    ) -> None:
        """Before a verify forward: ``seq_lens_cpu`` committed lengths s, ``out_cache_loc``
        int [bs*W] logical ids of positions s..s+W-1 (see ``SpecWindow.prepare``)."""
        self._require_spec("prepare_spec").prepare(
            req_index=req_index, req_index_cpu=req_index_cpu, seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=out_cache_loc, out_cache_loc_cpu=out_cache_loc_cpu,
        )
        self.telemetry.add_step()
        self.telemetry.maybe_log()

    def commit_spec(self, accept_index: torch.Tensor, *, validate: bool | None = None) -> None:
        """After verification: ``accept_index`` int [bs, D] flat rows ``b*W + j``, -1 padded."""
        self._require_spec("commit_spec").commit(accept_index=accept_index, validate=validate)

    def swap_in(
        self, req_index: torch.Tensor, seq_lens: torch.Tensor, top_k: torch.Tensor, layer_id: int,
    ) -> torch.Tensor:
        return self.resolver.swap_in(req_index, seq_lens, top_k, layer_id)

    def swap_in_blocks(
        self, req_index: torch.Tensor, seq_lens: torch.Tensor, top_k_blocks: torch.Tensor, layer_id: int,
        block_size: int,
    ) -> torch.Tensor:
        """Block top-k (MiniMax-M3): int32 ``top_k_blocks`` [bs, n_blocks] (-1 = none) ->
        int32 device rows [bs, n_blocks * block_size] of their positions
        (``kernels.reference.expand_blocks``; -1 past ``seq_lens``), resolved as one top-k of
        ``n_blocks * block_size`` = ``top_k`` positions. The resolve kernel takes the block ids
        and expands them itself (a block build, ``ops.resolve(selection_block=)``); on CPU the
        reference resolves the expanded positions."""
        n_blocks = top_k_blocks.shape[1]
        if block_size < 1 or self.top_k % block_size or n_blocks * block_size > self.top_k:
            raise ValueError(
                f"swap_in_blocks: {n_blocks} blocks of {block_size} = {n_blocks * block_size} positions, "
                f"but the coordinator resolves top_k = {self.top_k}; build it with top_k = the most "
                f"blocks a step selects x block size."
            )
        full = self.top_k // block_size
        if n_blocks == full:
            return self.resolver.swap_in(req_index, seq_lens, top_k_blocks, layer_id, selection_block=block_size)
        # fewer blocks than the build's: the rest -1 (no position), in a persistent buffer so the
        # call stays capturable; the rows of the given blocks come first
        bs = top_k_blocks.shape[0]
        pad = self._block_pad
        if pad is None or pad.shape[0] < bs or pad.shape[1] != full:
            # NOTE: allocation only when a batch exceeds every earlier one (as the resolver's)
            pad = self._block_pad = torch.full((max(bs, self._max_batch), full), -1, dtype=torch.int32,
                                               device=top_k_blocks.device)
        pad[:bs, :n_blocks].copy_(top_k_blocks)
        rows = self.resolver.swap_in(req_index, seq_lens, pad[:bs], layer_id, selection_block=block_size)
        return rows[:, : n_blocks * block_size]

    # -- teardown ---------------------------------------------------------------------------
    def destroy(self) -> None:
        """Drain the side streams (nothing may still read the host pool)."""
        self.streams.drain()
        if self.ctx.recorder is not None:
            self.ctx.recorder.close()
