"""Address map: the logical id -> device row table (part of ``DualSpaceAllocator``).

Every KV access by logical id translates through one int64 table on the pool's device::

    logical id:  0 | 1   2   3   4   5   ...   total_ids-1 | total_ids
    mapping:     0 | 7   8   0   0   3   ...   0           | -1
                     │   │           │
                     ▼   ▼           ▼
    device row:  0 | 1 2 3 4 5 6 7 8 ...   (row 0 = the padding row, never handed out)

An entry is the device row the id's KV lives in, or ``UNMAPPED`` (0) when it has none. The
owners of the rows (prefill rows, hot buffers) write their entries here; the map itself owns
no row and frees nothing.

NOTE: the "not on device" sentinel is 0, i.e. device row 0, the padding row, rather than -1.
The pool's KV writes translate ``out_cache_loc`` through ``mapping`` without a check (a
check would be a host sync on every layer); an unmapped id then writes harmlessly into the
padding row instead of faulting at row -1 or corrupting another request's row. The extra
last element is -1 so that SGLang's ``last_loc = -1`` ("no prefix") translates to -1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_hisparse.memory.hot import UNMAPPED

if TYPE_CHECKING:
    from sglang_hisparse.memory.paged import PagedIdAllocator

__all__ = ["UNMAPPED", "AddressMap"]


class AddressMap:
    """``mapping``: int64 [logical.total_ids + 1] on ``device``, the device row of each
    logical id of ``logical`` (the logical-id allocator: its ids size the table, and
    :meth:`check_integrity` reads which are in use). ``mapping`` is written in place; a holder
    may rebind the attribute to a view of the same storage (the sync guard's device-side
    marking), which every method here then uses."""

    def __init__(self, logical: PagedIdAllocator, device: str | torch.device = "cpu") -> None:
        self.logical = logical
        self.device = torch.device(device)
        self.mapping = torch.zeros(logical.total_ids + 1, dtype=torch.int64, device=self.device)
        self.clear()

    def clear(self) -> None:
        """Every id unmapped; the trailing sentinel -1."""
        self.mapping.zero_()
        self.mapping[-1] = -1

    def translate(self, logical_ids: torch.Tensor) -> torch.Tensor:
        """Device rows of ``logical_ids`` (any shape, on ``device``): UNMAPPED (0) if none, -1 for -1."""
        return self.mapping[logical_ids.to(torch.int64)]

    def map_tokens(self, logical_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Point logical ids (without prefill rows) at hot-buffer rows. No host sync."""
        self.mapping[logical_ids.to(self.device, torch.int64)] = rows.to(self.device, torch.int64)

    def bind(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Point CPU int64 ``ids`` at the CPU int64 ``rows`` (a prefill's own rows); the rows
        travel with ``non_blocking=True``, so this never waits for the device."""
        self.mapping[ids.to(self.device)] = rows.to(self.device, non_blocking=True)

    def unmap(self, logical_ids: torch.Tensor) -> None:
        """Drop mappings (e.g. the previous newest token once it is on host, freed ids)."""
        self.mapping[logical_ids.to(self.device, torch.int64)] = UNMAPPED

    def check_integrity(self) -> None:
        """The sentinel is -1 and every mapped id is a logical id in use. Syncs."""
        if int(self.mapping[-1]) != -1:
            raise ValueError(
                f"mapping sentinel corrupted: last element is {int(self.mapping[-1])}, expected -1."
            )
        mapped = torch.nonzero(self.mapping[:-1].cpu() > 0).reshape(-1)
        used = self.logical.is_used(mapped)
        if mapped.numel() and not bool(used.all()):
            raise ValueError(f"mapping: free logical ids still mapped: {mapped[~used][:8].tolist()}.")
