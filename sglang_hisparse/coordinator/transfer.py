"""Row copies between the device KV arrays and the host KV arrays, all layers at once.

``to_host(ctx, dev_rows, host_rows)``: ``host_kv[l][host_rows] = device_kv[l][dev_rows]`` for
every layer (staging after prefill, per-step write-through backup).
``to_device(ctx, host_rows, dev_rows)``: the reverse (PD direct admission preload).
Rows are int64 1-D tensors of equal length on the coordinator's device. Both run on whatever
stream is current. ``to_host_async(ctx, dev_rows, host_rows, side=, done=)`` is the one
device -> host sequence the coordinator uses (staging, per-step backup, verify commit): after
the rows' producer, on a side stream, ``done`` recorded behind the copy.

On CUDA the pinned host pool is also seen through :func:`cuda_alias`: a CUDA tensor over the
same (registered, device-mapped) host memory. Gathers and ``index_copy_`` then run as GPU
kernels that read/write host rows directly over the link, with no host sync, exactly as the
resolve kernel reads them. NOTE: the rejected alternative, a gather into a bounce buffer and
an ``index_copy_`` on the CPU, needs the host row ids and the data on the CPU, i.e. a sync
per backup that would stall the overlap scheduler; it stays only as the fallback when the
host memory is not pinned (then correct but synchronous).

Every layer in one launch: ``kernels.layer_copy.copy_rows`` over two ``LayerTable``s (device
layers, host views) built on the first copy and kept on the context. NOTE: a gather +
``index_copy_`` per layer costs two launches per layer (122 / 156 per decode step at 61 / 78
layers, on the critical path of ``map_last_loc``); the one launch measured 1-38 % of their GPU
time and 1-3 % of their host time (``benchmarks/results/step_overhead_h200.json``). The
per-layer copy remains only for a CUDA coordinator whose host pool has no device-mapped view
(not pinned). On CPU the one-launch copy runs the same per-layer torch ops.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from sglang_hisparse.kernels.layer_copy import LayerTable, copy_rows

if TYPE_CHECKING:
    from sglang_hisparse.coordinator.context import CoreContext

logger = logging.getLogger("sglang_hisparse")

_KDLCUDA = 2  # DLPack device type of CUDA memory


def cuda_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor over ``host``'s memory (same shape/dtype), or None when impossible.

    Requires pinned, device-mapped host memory under unified addressing (cudaHostRegister
    with the mapped flag, or ``pin_memory``): the GPU then dereferences the host pointer
    itself. Built by re-labelling the device of a DLPack capsule of ``host``; the capsule's
    owner keeps ``host`` alive as long as the alias lives.
    """
    if device.type != "cuda" or host.device.type != "cpu" or not host.is_pinned():
        return None
    try:
        capsule = torch.utils.dlpack.to_dlpack(host)
        get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
        get_pointer.restype = ctypes.c_void_p
        get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        managed = get_pointer(capsule, b"dltensor")
        # DLManagedTensor starts with DLTensor {void* data; DLDevice {int32 type, int32 id}; ...}
        dl_device = (ctypes.c_int32 * 2).from_address(managed + ctypes.sizeof(ctypes.c_void_p))
        dl_device[0] = _KDLCUDA
        dl_device[1] = device.index if device.index is not None else torch.cuda.current_device()
        alias = torch.utils.dlpack.from_dlpack(capsule)
    except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
        logger.warning("HiSparse: no CUDA view of the pinned host pool (%s); host copies will sync.", exc)
        return None
    if alias.device.type != "cuda" or alias.data_ptr() != host.data_ptr():
        return None
    return alias


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
    gathered = src.index_select(0, src_rows.to(src.device))
    dst.index_copy_(0, dst_rows.to(dst.device), gathered.to(dst.device, non_blocking=False))


def _host_layers(ctx: CoreContext) -> Sequence[torch.Tensor]:
    return ctx.host_kv_cuda if ctx.host_kv_cuda is not None else ctx.host_kv


def layer_tables(ctx: CoreContext) -> tuple[LayerTable, LayerTable] | None:
    """(device, host) tables of the one-launch copy, built on the first call and kept in
    ``ctx.layer_tables``; None when copies run per layer (a CUDA coordinator whose host pool
    has no device-mapped view)."""
    if ctx.layer_tables is None:
        if ctx.device.type == "cuda" and ctx.host_kv_cuda is None:
            ctx.layer_tables = False
        else:
            rl = ctx.row_layout
            ctx.layer_tables = (LayerTable.build(ctx.device_kv, "device_kv", layout=rl.device_side),
                                LayerTable.build(_host_layers(ctx), "host_kv", layout=rl.host_side))
    return ctx.layer_tables or None


def _copy(ctx: CoreContext, src: str, src_rows: torch.Tensor, dst: str, dst_rows: torch.Tensor) -> None:
    """Rows ``src_rows`` of every ``src`` layer ("device" / "host") to rows ``dst_rows`` of the
    same ``dst`` layer: one launch over the layer tables, or per layer without them."""
    tables = layer_tables(ctx)
    if tables is not None:
        side = {"device": tables[0], "host": tables[1]}
        copy_rows(src=side[src], dst=side[dst], src_rows=src_rows.to(ctx.device, torch.int64),
                  dst_rows=dst_rows.to(ctx.device, torch.int64))
        return
    layers = {"device": ctx.device_kv, "host": _host_layers(ctx)}
    layout = {"device": ctx.row_layout.device_side, "host": ctx.row_layout.host_side}
    for s_kv, d_kv in zip(layers[src], layers[dst], strict=True):
        if ctx.row_layout.kind and src_rows.numel():
            layout[dst].write(d_kv, dst_rows, layout[src].read(s_kv, src_rows))
        else:
            _copy_rows(s_kv, src_rows, d_kv, dst_rows)


def to_host(ctx: CoreContext, dev_rows: torch.Tensor, host_rows: torch.Tensor) -> None:
    """Copy device rows to host rows for every layer (see the module docstring)."""
    _copy(ctx, "device", dev_rows, "host", host_rows)


def to_host_async(
    ctx: CoreContext, dev_rows: torch.Tensor, host_rows: torch.Tensor, *, side: Any, done: Any,
    after_forward: bool = True,
) -> None:
    """:func:`to_host` on the side stream ``side``, then ``done.record()`` there (an event, or
    a ``streams.Fence``; None: nothing recorded). ``after_forward``: order the copy after the forward stream's KV writes
    and the caller's stream; False: after the caller's stream only (KV the host has already
    seen written, see ``Lifecycle.admit_staging``). The row tensors are kept alive for
    ``side`` (they may be temporaries of the caller)."""
    streams = ctx.streams
    if after_forward:
        streams.after_producer(side)
    else:
        streams.after_current(side)
    with streams.on(side):
        to_host(ctx, dev_rows, host_rows)
        if done is not None:
            done.record()
    streams.keep_alive(dev_rows, side)
    streams.keep_alive(host_rows, side)


def device_to_device(ctx: CoreContext, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Copy device rows to other device rows for every layer, on the current stream (a
    collect's private copy of rows another request still reads)."""
    _copy(ctx, "device", src_rows, "device", dst_rows)


def to_device(ctx: CoreContext, host_rows: torch.Tensor, dev_rows: torch.Tensor) -> None:
    """Copy host rows to device rows for every layer (see the module docstring)."""
    _copy(ctx, "host", host_rows, "device", dev_rows)
