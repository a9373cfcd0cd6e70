"""Device KV pool of the harness and benchmarks: per-layer KV rows addressed by logical id.

A server never builds this: its device KV is SGLang's DSA pool
(``sglang_adapter.memory.HiSparseDSAPool``, the same translation over SGLang's buffers). The
decode engine (``hisparse_testing.engine``), the core tests and ``benchmarks/e2e_engine.py`` drive
``HiSparseCore`` over this one without SGLang.

Layout (per TP rank)::

    kv       uint8 [L, device_rows_total, I]            kv[l] is layer l's device KV
    index_k  uint8 [L, logical_total, index_I] or None  DSA indexer keys, LOGICAL space

``device_rows_total`` / ``logical_total`` include the padding page 0 of each space (the
allocator's ``total_ids``). Attention KV lives on the device only for hot rows, so every KV
access by logical id goes through ``allocator.mapping``; unmapped ids land in padding row 0
(see ``allocator``'s sentinel note); the per-layer ``write``/``read`` translate a forward's
ids once (``memory.translation``, as ``HiSparseDSAPool`` does). The indexer's compact keys (a few dozen bytes a token)
stay on the device for every logical id: the indexer scores all positions each step, so
keeping them in logical space needs no translation and no host traffic.

All helpers are destination-style, sync-free tensor ops usable inside CUDA graphs.
"""

from __future__ import annotations

import torch

from sglang_hisparse.kernels.row_layout import TOKEN, RowLayout
from sglang_hisparse.memory.allocator import DualSpaceAllocator
from sglang_hisparse.memory.translation import ForwardTranslation

__all__ = ["DeviceKVPool"]


class DeviceKVPool:
    """Device KV arrays of one rank, sized from a ``DualSpaceAllocator``.

    num_layers:       L
    item_bytes:       I bytes per KV row (multiple of 16; 656 for fp8 DSA, 1152 for bf16 MLA)
    allocator:        supplies the row counts and the mapping (must live on ``device``)
    index_item_bytes: bytes per indexer key (None: no indexer cache)
    row_layout:       where a row lives in a layer (``kernels.row_layout``): token rows, or
                      DeepSeek-V4's paged C4 entries (``kv`` then [L, pages, 37440]; ``item_bytes``
                      must be the layout's host row, 592; rows read back with zeros past 584 B)
    """

    def __init__(
        self,
        *,
        num_layers: int,
        item_bytes: int,
        allocator: DualSpaceAllocator,
        index_item_bytes: int | None = None,
        row_layout: RowLayout = TOKEN,
    ):
        if row_layout.paged and item_bytes != row_layout.host_item():
            raise ValueError(f"DeviceKVPool: the {row_layout.name} layout takes {row_layout.host_item()}-byte rows, "
                             f"got item_bytes = {item_bytes}.")
        self.row_layout = row_layout
        if num_layers < 1:
            raise ValueError(f"DeviceKVPool: num_layers = {num_layers} must be >= 1.")
        if item_bytes < 16 or item_bytes % 16:
            raise ValueError(
                f"DeviceKVPool: item_bytes = {item_bytes} must be a positive multiple of 16."
            )
        if index_item_bytes is not None and index_item_bytes < 1:
            raise ValueError(
                f"DeviceKVPool: index_item_bytes = {index_item_bytes} must be >= 1 or None."
            )
        self.allocator = allocator
        self.device = allocator.device
        self.num_layers, self.item_bytes, self.index_item_bytes = (
            num_layers,
            item_bytes,
            index_item_bytes,
        )
        #: uint8 [L, device_rows_total, I] (paged: [L, pages, page bytes])
        rows = allocator.rows.total_ids
        self.kv = torch.zeros(
            (num_layers, rows, item_bytes) if not row_layout.paged
            else (num_layers, -(-rows // row_layout.entries), row_layout.page_bytes),
            dtype=torch.uint8,
            device=self.device,
        )
        #: the per-forward translation of ``write`` / ``read`` (``memory.translation``)
        self.per_forward = ForwardTranslation(lambda mapping, ids: mapping[ids.to(torch.int64)])
        #: uint8 [L, logical_total, index_I] or None
        self.index_k = (
            None
            if index_item_bytes is None
            else torch.zeros(
                (num_layers, allocator.logical.total_ids, index_item_bytes),
                dtype=torch.uint8,
                device=self.device,
            )
        )

    @staticmethod
    def device_bytes(
        *,
        num_layers: int,
        item_bytes: int,
        device_rows: int,
        host_to_device_ratio: int,
        page_size: int,
        index_item_bytes: int = 0,
    ) -> int:
        """HBM of KV + logical-space indexer keys, for capacity planning."""
        rows_total = (device_rows // page_size + 1) * page_size
        logical_total = (device_rows * host_to_device_ratio // page_size + 1) * page_size
        return num_layers * (rows_total * item_bytes + logical_total * index_item_bytes)

    @property
    def mapping(self) -> torch.Tensor:
        return self.allocator.mapping

    def layer(self, layer_id: int) -> torch.Tensor:
        """uint8 [device_rows_total, I]: layer ``layer_id``'s KV (the resolve kernel's ``device_cache``)."""
        return self.kv[layer_id]

    def translate(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """int64, same shape: device row per logical id (0 = not on device, -1 for -1)."""
        return self.mapping[logical_ids.to(torch.int64)]

    # ---- KV rows ---------------------------------------------------------------------------
    def write(self, layer_id: int, logical_ids: torch.Tensor, data: torch.Tensor) -> None:
        """New-token / prefill KV write: ``data`` uint8 [n, I] to the rows of ``logical_ids`` [n]."""
        self.write_rows(layer_id, self.per_forward(self.mapping, logical_ids, layer_id), data)

    def read(self, layer_id: int, logical_ids: torch.Tensor) -> torch.Tensor:
        """uint8 [n, I]: KV of ``logical_ids`` [n] (padding row for ids not on device)."""
        return self.read_rows(layer_id, self.per_forward(self.mapping, logical_ids, layer_id))

    def write_rows(self, layer_id: int, rows: torch.Tensor, data: torch.Tensor) -> None:
        """Write by device row (the coordinator's slot rows), ``data`` uint8 [n, I]."""
        if self.row_layout.paged:
            self.row_layout.write(self.kv[layer_id], rows, data)
            return
        self.kv[layer_id].index_copy_(0, rows.to(torch.int64), data)

    def read_rows(self, layer_id: int | None, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [n, I] (one layer) or [L, n, I] (``layer_id`` None) by device row."""
        idx = rows.to(torch.int64)
        if self.row_layout.paged:
            if layer_id is None:
                return torch.stack([self.row_layout.read(kv, idx) for kv in self.kv])
            return self.row_layout.read(self.kv[layer_id], idx)
        return self.kv[:, idx] if layer_id is None else self.kv[layer_id].index_select(0, idx)

    # ---- indexer keys (logical space) ------------------------------------------------------
    def write_index(self, layer_id: int, logical_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Indexer key write, ``data`` uint8 [n, index_I], addressed by logical id (no translation)."""
        self._index()[layer_id].index_copy_(0, logical_ids.to(torch.int64), data)

    def read_index(self, layer_id: int, logical_ids: torch.Tensor) -> torch.Tensor:
        return self._index()[layer_id].index_select(0, logical_ids.to(torch.int64))

    def _index(self) -> torch.Tensor:
        if self.index_k is None:
            raise ValueError(
                "DeviceKVPool: built with index_item_bytes=None, so it has no indexer key cache."
            )
        return self.index_k

    def check_integrity(self) -> None:
        """The allocator balances (free + used == capacity in both spaces) and shapes agree."""
        self.allocator.check_integrity()
        rows, logical = self.allocator.rows.total_ids, self.allocator.logical.total_ids
        have = self.row_layout.device_rows(self.kv[0]) if self.row_layout.paged else self.kv.shape[1]
        if have < rows or (not self.row_layout.paged and have != rows) or (
            self.index_k is not None and self.index_k.shape[1] != logical
        ):
            raise ValueError(
                f"DeviceKVPool: arrays ({have} rows, indexer "
                f"{None if self.index_k is None else self.index_k.shape[1]}) disagree with the allocator "
                f"({rows} device rows, {logical} logical ids)."
            )
