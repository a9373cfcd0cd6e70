"""Row copies between the device KV arrays and the host KV arrays, all layers at once.

``to_host(ctx, dev_rows, host_rows)``: ``host_kv[l][host_rows] = device_kv[l][dev_rows]`` for
every layer (staging after prefill, per-step write-through backup).
``to_device(ctx, host_rows, dev_rows)``: the reverse (PD direct admission preload).
Rows are int64 1-D tensors of equal length on the coordinator's device.

They run on whatever stream is current; the callers put them on the staging/backup stream.

NOTE: when both arrays live on the same device (CPU tests, or a host pool mirrored on the
device) this is a gather + ``index_copy_``. Across devices (pinned host, CUDA device) it uses
the kernel layer's row-copy op when it has one; otherwise it falls back to a gather on the
source side and an ``index_copy_`` on the destination side, which needs the destination
row ids on the destination's device (a device→host read of the ids, i.e. a host sync for
device→host copies). The fallback is correct but not overlap-friendly; a zero-copy kernel
(GPU threads writing the pinned host rows directly, as the resolve kernel reads them) is
the intended GPU path.
"""

from __future__ import annotations

import torch

from sglang_hisparse.coordinator.context import CoreContext


def _copy_rows(
    src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor
) -> None:
    if src_rows.numel() == 0:
        return
    if src.device == dst.device:
        dst.index_copy_(
            0, dst_rows.to(dst.device), src.index_select(0, src_rows.to(src.device))
        )
        return
    from sglang_hisparse.kernels import ops

    copy_rows = getattr(ops, "copy_rows", None)
    if copy_rows is not None:
        copy_rows(src=src, src_rows=src_rows, dst=dst, dst_rows=dst_rows)
        return
    gathered = src.index_select(0, src_rows.to(src.device))
    dst.index_copy_(0, dst_rows.to(dst.device), gathered.to(dst.device, non_blocking=False))


def to_host(ctx: CoreContext, dev_rows: torch.Tensor, host_rows: torch.Tensor) -> None:
    """Copy device rows to host rows for every layer (see the module docstring)."""
    for dev_kv, host_kv in zip(ctx.device_kv, ctx.host_kv, strict=True):
        _copy_rows(dev_kv, dev_rows, host_kv, host_rows)


def to_device(ctx: CoreContext, host_rows: torch.Tensor, dev_rows: torch.Tensor) -> None:
    """Copy host rows to device rows for every layer (see the module docstring)."""
    for dev_kv, host_kv in zip(ctx.device_kv, ctx.host_kv, strict=True):
        _copy_rows(host_kv, host_rows, dev_kv, dev_rows)
