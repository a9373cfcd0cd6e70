"""All-layer row copies in one launch: ``dst.layers[l][dst_rows] = src.layers[l][src_rows]``.

The coordinator moves the same rows of every layer between device KV and host KV (staging
after prefill, the per-step write-through backup, the verify commit, the PD preload). Done per
layer that is an ``index_select`` and an ``index_copy_``: two launches a layer, 122 / 156 per
decode step at 61 / 78 layers. Here each side's layers are described once by a
:class:`LayerTable` (int64 [L, 3] on the device: base address, row stride in bytes, rows), and
:func:`copy_rows` copies every layer's rows in one launch of ``jit_kernels/layer_copy.cuh``.
Host layers enter the table through their device-mapped views (``transfer.cuda_alias``), so the
kernel reads HBM and stores straight into pinned host memory over the link.

Contract (the kernel and :func:`reference_copy_rows` agree on every in-range pair):

* ``src_rows``, ``dst_rows``: int64 [n], contiguous, on the tables' device; pair ``j`` copies
  row ``src_rows[j]`` of every source layer to row ``dst_rows[j]`` of the same destination layer.
* Rows are in ``[0, rows of the layer)``. NOTE: out-of-range pairs are caller bugs; the kernel
  skips them (memory stays safe, no error) and the reference's behaviour is unspecified, as for
  the resolve kernel's positions: checking on the device would need a host sync per copy.
* Destinations of one call are distinct, or share equal bytes (the verify commit sends every
  rejected row to the host padding row, whose content no one reads).

CUDA path: no host sync, no allocation, one launch on the current stream: capturable. CPU
tensors run the reference (one ``index_select`` + ``index_copy_`` per layer, the pre-fusion
code, which stays the fallback for a host pool that is not pinned).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .row_layout import TOKEN, RowLayout

__all__ = ["LayerTable", "copy_rows", "reference_copy_rows"]


@dataclass(frozen=True)
class LayerTable:
    """One side of a copy: per-layer uint8 [rows, I] tensors and their address table.

    layers: the tensors (kept alive here: the table holds their raw addresses); on CUDA, host
        layers are their device-mapped views. table: int64 [L, 3] on the layers' device, row l =
        (address, row stride in bytes, rows) of layer l. item: I, bytes per (host) row (a
        multiple of 16). layout: where a row lives in a layer (``kernels.row_layout``); for
        ``C4_PAGED`` a layer is uint8 [pages, 37440], its table row (address, page stride,
        entries).
    """

    layers: tuple[torch.Tensor, ...]
    table: torch.Tensor
    item: int
    layout: RowLayout = TOKEN

    @classmethod
    def build(cls, layers: Sequence[torch.Tensor], name: str = "layers", layout: RowLayout = TOKEN) -> LayerTable:
        """Describe ``layers`` (all uint8 [rows_l, I] with one I, rows contiguous and 16-byte
        aligned, on one device; or pages of ``layout``). Reads only shapes and addresses."""
        if len(layers) == 0:
            raise ValueError(f"LayerTable: {name} is empty; need >= 1 layer.")
        if layout.paged:
            for t in layers:
                layout.check_device(t, layout.host_item())
            rows = [[t.data_ptr(), t.stride(0), layout.device_rows(t)] for t in layers]
            table = torch.tensor(rows, dtype=torch.int64).to(layers[0].device)
            return cls(layers=tuple(layers), table=table, item=layout.host_item(), layout=layout)
        if layout.kind == 3:  # rows split in halves: uint8 [2H, I/2], a table row (address, half, H)
            halves = LayerTable.build(layers, name)  # the token checks, on the half rows
            rows = [[t.data_ptr(), t.stride(0), t.shape[0] // 2] for t in layers]
            table = torch.tensor(rows, dtype=torch.int64).to(layers[0].device)
            return cls(layers=halves.layers, table=table, item=2 * halves.item, layout=layout)
        first = layers[0]
        item = int(first.shape[1]) if first.dim() == 2 else -1
        for i, t in enumerate(layers):
            if t.dim() != 2 or t.dtype != torch.uint8 or t.shape[1] != item:
                raise ValueError(
                    f"LayerTable: {name}[{i}] is {t.dtype} {tuple(t.shape)}; every layer must be "
                    f"uint8 [rows, {item}] (one row width for all layers)."
                )
            if item < 16 or item % 16:
                raise ValueError(f"LayerTable: rows of {item} bytes; need a positive multiple of 16.")
            if t.device != first.device:
                raise ValueError(f"LayerTable: {name}[{i}] is on {t.device}, {name}[0] on {first.device}.")
            if t.shape[1] > 1 and t.stride(1) != 1:
                raise ValueError(f"LayerTable: {name}[{i}] rows are not contiguous (stride {t.stride()}).")
            if t.data_ptr() % 16 or t.stride(0) % 16:
                raise ValueError(
                    f"LayerTable: {name}[{i}] is not 16-byte aligned (address {t.data_ptr():#x}, row "
                    f"stride {t.stride(0)} B); the copy moves 16-byte pieces."
                )
        rows = [[t.data_ptr(), t.stride(0), t.shape[0]] for t in layers]
        table = torch.tensor(rows, dtype=torch.int64).to(first.device)
        return cls(layers=tuple(layers), table=table, item=item)

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _check(src: LayerTable, dst: LayerTable, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    if src.num_layers != dst.num_layers or src.item != dst.item:
        raise ValueError(
            f"copy_rows: source has {src.num_layers} layers of {src.item} B rows, destination "
            f"{dst.num_layers} of {dst.item} B; they must match."
        )
    for name, r in (("src_rows", src_rows), ("dst_rows", dst_rows)):
        if r.dim() != 1 or r.dtype != torch.int64:
            raise ValueError(f"copy_rows: {name} must be int64 [n], got {r.dtype} {tuple(r.shape)}.")
    if src_rows.shape != dst_rows.shape:
        raise ValueError(
            f"copy_rows: {src_rows.numel()} source rows but {dst_rows.numel()} destination rows."
        )


def reference_copy_rows(
    *, src: LayerTable, dst: LayerTable, src_rows: torch.Tensor, dst_rows: torch.Tensor
) -> None:
    """Pure-torch spec (test oracle, CPU path): per layer ``dst[dst_rows] = src[src_rows]``."""
    _check(src, dst, src_rows, dst_rows)
    if src_rows.numel() == 0:
        return
    for s, d in zip(src.layers, dst.layers, strict=True):
        if src.layout.kind or dst.layout.kind:
            dst.layout.write(d, dst_rows, src.layout.read(s, src_rows))
        else:
            d.index_copy_(0, dst_rows.to(d.device), s.index_select(0, src_rows.to(s.device)))


@torch.no_grad()
def copy_rows(
    *, src: LayerTable, dst: LayerTable, src_rows: torch.Tensor, dst_rows: torch.Tensor
) -> None:
    """Copy rows ``src_rows`` of every source layer to rows ``dst_rows`` of the same
    destination layer (the module docstring has the contract). CUDA tables: one launch of
    ``jit_kernels/layer_copy.cuh`` on the current stream; CPU: :func:`reference_copy_rows`."""
    if src.table.device.type != "cuda" or dst.table.device.type != "cuda":
        reference_copy_rows(src=src, dst=dst, src_rows=src_rows, dst_rows=dst_rows)
        return
    _check(src, dst, src_rows, dst_rows)
    if src_rows.numel() == 0:
        return
    from ._jit import layer_copy_module

    layer_copy_module(src.item, src.layout.kind, dst.layout.kind).layer_copy(
        src.table, dst.table, src_rows.contiguous(), dst_rows.contiguous()
    )
