"""What every coordinator component shares: sizes, memory handles, state, streams, counters.

The memory layer is reached through two narrow duck-typed handles so the coordinator runs
over our own pools (``allocator.DualSpaceAllocator`` + ``host_pool``) in CPU tests and the
GPU benchmark, and over the SGLang-facing wrappers in a server:

``allocator`` (a :class:`~sglang_hisparse.memory.allocator.DualSpaceAllocator`)
    ``shrink_to_hot_buffer``, ``hot`` (``alloc``, ``grow``, ``release``: a
    :class:`~sglang_hisparse.memory.hot.HotBuffers`), ``translate``, ``rebind``, ``rows``.

``host`` (:class:`HostTable`, e.g. :class:`~sglang_hisparse.memory.host_pool.HostKVPool`)
    ``host_rows`` int64 [R, max_ctx] on the coordinator's device (-1 = unbound): the host
    row of each position, which is its logical id; ``total_rows`` (>= the logical space's
    ids); ``bind(r, start, ids)`` / ``bind_positions(rs, ps, ids, req_t=, pos_t=)`` write it,
    ``allocated_len(r)`` how much is bound, ``unbind(r)`` (idempotent) clears it.

Per-layer KV arrays are plain tensor lists: ``device_kv[l]`` uint8 [device_rows, I] and
``host_kv[l]`` uint8 [host_rows_total, I] (pinned when the device is CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sglang_hisparse.coordinator.state import SlotState
from sglang_hisparse.coordinator.streams import Streams
from sglang_hisparse.kernels.row_layout import TOKEN, RowLayout
from sglang_hisparse.telemetry import Telemetry


class HostTable(Protocol):
    """The host pool as the coordinator uses it (see the module docstring)."""

    host_rows: torch.Tensor
    total_rows: int

    def bind(self, r: int, start: int, logical_ids: torch.Tensor) -> None: ...

    def bind_positions(self, req_slots: list[int], positions: list[int], logical_ids: torch.Tensor,
                       *, req_t: torch.Tensor | None = None, pos_t: torch.Tensor | None = None) -> None: ...

    def allocated_len(self, r: int) -> int: ...

    def unbind(self, r: int) -> None: ...


@dataclass
class CoreContext:
    """Sizes and handles shared by lifecycle, step and resolver (one per TP rank).

    top_k: k; buffer_size: B; item_bytes: I (bytes per host KV row, all layers equal);
    device_kv / host_kv: per local layer (length L); device rows as ``row_layout`` places them.
    """

    top_k: int
    buffer_size: int
    item_bytes: int
    device: torch.device
    allocator: Any
    host: HostTable
    device_kv: Sequence[torch.Tensor]
    host_kv: Sequence[torch.Tensor]
    state: SlotState
    streams: Streams
    telemetry: Telemetry
    #: ``traces.recorder.LiveTraceRecorder`` when SGLANG_HISPARSE_RECORD_TRACE is set, else None
    recorder: Any = None
    #: CUDA views of ``host_kv`` (``transfer.cuda_alias``) for sync-free row copies, or None
    host_kv_cuda: Sequence[torch.Tensor] | None = None
    #: ``coordinator.residency.Residency`` when ``"residency": "pressure"`` applies, else None
    residency: Any = None
    #: ``transfer.layer_tables``' (device, host) tables of the one-launch copy (``HiSparseCore``
    #: builds them at construction); False: copies run per layer; None: not built yet
    layer_tables: Any = None
    #: radix cache on: a finished resident request's rows stay as cached prefix rows
    #: (``DualSpaceAllocator.cache_resident``) instead of being freed
    cache_finished: bool = False
    #: where a row lives in a ``device_kv`` layer (``kernels.row_layout``): token rows, or
    #: DeepSeek-V4's paged C4 entries (each layer uint8 [pages, 37440]; ``item_bytes`` is the
    #: host row's 592)
    row_layout: RowLayout = TOKEN

    @property
    def num_layers(self) -> int:
        return len(self.device_kv)
