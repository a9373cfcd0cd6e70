"""A CPU stand-in for "this tensor lives on the GPU": reading its values raises.

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` turns every device-to-host copy into an
error. On CPU nothing syncs, so a per-step path that reads a device tensor back (``.cpu()``,
``.item()``, ``.tolist()``, ``int(t)``, ``if t:``, ``torch.equal``, ``nonzero``, boolean-mask
indexing: the calls that sync on CUDA) passes silently. Marking the tensors SGLang hands over on
the device, and the coordinator's device state, as :class:`DeviceSide` makes those reads raise
:class:`DeviceReadError` inside :func:`forbid_device_reads`::

    loc = device_side(allocator.alloc(bs))      # or mark_device_state(core) for its tensors
    with forbid_device_reads():
        coordinator.map_last_loc_to_buffer(...)  # raises at the first read of a marked value

Results of operations on a marked tensor are marked too (``__torch_function__`` keeps the
subclass), so a value derived on the device stays device-side. Outside the ``with`` block the
tensors behave as plain ones (integrity checks may read them).

NOTE: a tensor subclass rather than patching ``Tensor.cpu`` and friends globally: host-side
tensors (the ``*_cpu`` lists SGLang passes, the allocator's CPU ownership table) are read on
purpose, and only the tensor itself knows which side it stands for. Not caught: moves
(``.to("cpu")``, ``copy_`` into a CPU tensor), because on a CPU test device ``x.to(ctx.device)``
is the same call; the CUDA sync debug mode catches those on the GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["DeviceReadError", "DeviceSide", "device_side", "forbid_device_reads", "mark_device_state"]

_armed = 0

#: calls that read a tensor's values back to the host (each syncs on CUDA)
_READS = {
    torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
    torch.Tensor.equal, torch.equal, torch.Tensor.nonzero, torch.nonzero, torch.argwhere,
    torch.Tensor.unique, torch.unique, torch.Tensor.masked_select, torch.masked_select,
}


class DeviceReadError(RuntimeError):
    """A marked (device-side) tensor's values were read on the host inside ``forbid_device_reads``."""


def _bool_index(args: tuple[Any, ...]) -> bool:
    idx = args[1] if len(args) > 1 else None
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class DeviceSide(torch.Tensor):
    """A CPU tensor standing for a device tensor (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _armed and (func in _READS or (func is torch.Tensor.__getitem__ and _bool_index(args))):
            name = getattr(func, "__name__", str(func))
            raise DeviceReadError(
                f"{name}() read a device-side tensor on the host: on CUDA this is a "
                f"device-to-host sync in a path that must not sync."
            )
        return super().__torch_function__(func, types, args, kwargs or {})


def device_side(t: torch.Tensor) -> DeviceSide:
    """A view of ``t`` (same storage) marked device-side."""
    return t.as_subclass(DeviceSide)


@contextlib.contextmanager
def forbid_device_reads(*, cuda: bool = False) -> Iterator[None]:
    """Within the block, reading a :class:`DeviceSide` tensor's values raises (nests).

    ``cuda``: also ``torch.cuda.set_sync_debug_mode("error")``, so any synchronizing CUDA call
    (a blocking device-to-host copy, ``.item()``, ``nonzero``, a stream synchronize) raises
    ``RuntimeError``; the previous mode is restored on exit.
    """
    global _armed
    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    _armed += 1
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        _armed -= 1
        if previous is not None:
            torch.cuda.set_sync_debug_mode(previous)


def mark_device_state(core: Any) -> None:
    """Mark, in place, the device tensors a ``HiSparseCore`` keeps: its slot state, the host
    pool's ``host_rows`` page table, the allocator's ``mapping``, the per-layer device KV (when
    it is a list of layers) and ``num_real_reqs``. The views share storage, so the coordinator's writes land as before."""
    holders = [
        (core.ctx.state, ("slot_tokens", "slot_rows", "lru", "resident")),
        (core.ctx.host, ("host_rows",)),
        (core.ctx.allocator, ("mapping",)),
    ]
    for obj, names in holders:
        for name in names:
            t = getattr(obj, name, None)
            if isinstance(t, torch.Tensor) and not isinstance(t, DeviceSide):
                setattr(obj, name, device_side(t))
    kv = core.ctx.device_kv
    if isinstance(kv, list):  # the adapter's per-layer views (the harness passes one [L, ...] tensor)
        kv[:] = [device_side(t) for t in kv]
    # the model runner fills num_real_reqs in place; the resolver holds the same tensor
    core.num_real_reqs = core.resolver.num_real_reqs = device_side(core.num_real_reqs)
