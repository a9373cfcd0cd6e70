"""Pinned host KV pool: the authoritative copy of every active request's KV, paged per request.

Layout (layer first, per TP rank)::

    kv        uint8 [L, host_rows_total, I]   kv[l] is layer l's host KV (the kernels' host_cache)
    host_rows int64 [R, max_ctx] on `device`  host row of each logical position; -1 unallocated
    allocated_lens int64 [R] (CPU)            positions with a host row, per request slot

Host rows come from a ``PagedIdAllocator`` (row 0 / page 0 is the padding page, never handed
out). A request's pages are taken lazily by ``ensure(req_slot, length)`` as it grows; its
positions ``p`` live at ``page[p // P] * P + p % P``. ``free_request`` returns them all.

The pool is sized, then checked against available host memory (``budget``), and only
then allocated and pinned, so a too-large ratio fails with both figures in GiB instead of an
OOM kill half-way through pinning. On CUDA the whole buffer is pinned with one
``cudaHostRegister``; with unified addressing the host pointer is then directly readable by GPU
threads, which is what the resolve kernel does. On CPU the memory is left unpinned.

NOTE: one registration, not chunks. A DMA copy (``Tensor.copy_`` → ``cudaMemcpyAsync``) whose
host range crosses the boundary between two registrations fails with ``invalid argument``;
the H200 end-to-end run hit exactly that with 1 GiB chunks on an 84 GiB pool (a layer's rows
span many chunks). Pinning 83.86 GiB took 40.4 s in one call vs 43.8 s in 1 GiB chunks.
"""

from __future__ import annotations

import torch

from sglang_hisparse.memory.budget import GIB, check_host_budget
from sglang_hisparse.memory.paged import PagedIdAllocator, ceil_div

__all__ = ["HostKVPool", "host_pool_bytes"]

# cudaHostRegisterPortable | cudaHostRegisterMapped: visible to every context, device-mapped
_REGISTER_FLAGS = 0x1 | 0x2


def host_pool_bytes(
    *, num_layers: int, item_bytes: int, capacity_tokens: int, page_size: int
) -> int:
    """Bytes of the KV buffer for ``capacity_tokens`` usable rows (+ the padding page)."""
    rows_total = (capacity_tokens // page_size + 1) * page_size
    return num_layers * rows_total * item_bytes


class HostKVPool:
    """Per-request, lazily paged, pinned host KV.

    num_layers:      L layers held by this rank
    item_bytes:      I bytes per KV row (multiple of 16)
    capacity_tokens: usable host rows (rounded down to pages); size it as
                     ``device_rows * host_to_device_ratio`` so every logical id fits
    page_size:       rows per page (SGLang's page size)
    max_requests:    R request slots (``req_to_token_pool`` size)
    max_context:     columns of ``host_rows`` (longest request, in tokens)
    device:          where ``host_rows`` lives (the GPU the kernels run on)
    pin:             pin with cudaHostRegister; default: when CUDA is available
    available_bytes: override the measured free host memory (tests)
    ranks_per_host:  processes on this machine that each build this pool (the budget check
                     counts all of them; ``budget.ranks_per_host``)
    storage:         an existing uint8 [L, host_rows_total, I] buffer to use instead of
                     allocating (already budget-checked and pinned by its owner)
    """

    def __init__(
        self,
        *,
        num_layers: int,
        item_bytes: int,
        capacity_tokens: int,
        page_size: int,
        max_requests: int,
        max_context: int,
        device: str | torch.device = "cpu",
        pin: bool | None = None,
        available_bytes: int | None = None,
        ranks_per_host: int = 1,
        storage: torch.Tensor | None = None,
    ):
        for name, value in (
            ("num_layers", num_layers),
            ("max_requests", max_requests),
            ("max_context", max_context),
        ):
            if value < 1:
                raise ValueError(f"HostKVPool: {name} = {value} must be >= 1.")
        if item_bytes < 16 or item_bytes % 16:
            raise ValueError(
                f"HostKVPool: item_bytes = {item_bytes} must be a positive multiple of 16 (KV rows are copied in 16-byte vectors)."
            )
        self.rows = PagedIdAllocator(capacity_tokens, page_size, name="host rows")
        self.num_layers, self.item_bytes, self.page_size = num_layers, item_bytes, page_size
        self.max_requests, self.max_context = max_requests, max_context
        self.device = torch.device(device)
        required = host_pool_bytes(
            num_layers=num_layers,
            item_bytes=item_bytes,
            capacity_tokens=capacity_tokens,
            page_size=page_size,
        )
        if storage is not None:
            # Someone else (SGLang's HiCache pool) sized, budget-checked, allocated and pinned it.
            want = (num_layers, self.rows.total_ids, item_bytes)
            if storage.dtype != torch.uint8 or tuple(storage.shape) != want:
                raise ValueError(
                    f"HostKVPool: storage is {storage.dtype} {tuple(storage.shape)}, expected uint8 {want}."
                )
            self.nbytes, self.kv = required, storage
            self.host_rows = torch.full(
                (max_requests, max_context), -1, dtype=torch.int64, device=self.device
            )
            self._init_bookkeeping()
            self._registered: list[int] = []
            return
        check_host_budget(
            required,
            what=f"HiSparse host KV pool ({num_layers} layers x {self.rows.total_ids} rows x {item_bytes} B)",
            available_bytes=available_bytes,
            ranks_per_host=ranks_per_host,
        )
        self.nbytes = required
        #: uint8 [L, host_rows_total, I]; kv[l] is layer l
        self.kv = torch.empty((num_layers, self.rows.total_ids, item_bytes), dtype=torch.uint8)
        self.kv[:, : self.page_size].zero_()  # padding rows read as zeros
        #: int64 [R, max_ctx]: host row of each position, -1 unallocated
        self.host_rows = torch.full(
            (max_requests, max_context), -1, dtype=torch.int64, device=self.device
        )
        self._init_bookkeeping()
        self._registered: list[int] = []
        want_pin = torch.cuda.is_available() if pin is None else pin
        if want_pin:
            self._pin()

    def _init_bookkeeping(self) -> None:
        #: host pages of each request slot, in position order
        self._pages: list[list[int]] = [[] for _ in range(self.max_requests)]
        #: int64 [R] (CPU): ``allocated_len`` of every request slot, kept in step by
        #: ``ensure`` / ``free_request``. SGLang's PD decode reads it (and our
        #: ``alloc_paged_token_slots`` writes it) per request, so it is one tensor updated in
        #: place rather than rebuilt per access.
        self.allocated_lens = torch.zeros(self.max_requests, dtype=torch.int64)

    # ---- pinning ---------------------------------------------------------------------------
    def _pin(self) -> None:
        cudart = torch.cuda.cudart()
        base, total = self.kv.data_ptr(), self.kv.numel()
        err = cudart.cudaHostRegister(base, total, _REGISTER_FLAGS)
        if int(err) != 0:
            raise RuntimeError(
                f"cudaHostRegister of the {total / GIB:.2f} GiB host KV pool failed ({err}). "
                f"Check the locked-memory limit (ulimit -l) or lower 'host_to_device_ratio'."
            )
        self._registered.append(base)

    @property
    def pinned(self) -> bool:
        return bool(self._registered)

    def destroy(self) -> None:
        """Unregister every pinned chunk (idempotent). The pool is unusable for kernels afterwards."""
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered = []

    # ---- queries ---------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.rows.size

    def available_size(self) -> int:
        return self.rows.available_size()

    def layer(self, layer_id: int) -> torch.Tensor:
        """uint8 [host_rows_total, I]: layer ``layer_id``'s host KV (the resolve kernel's ``host_cache``)."""
        return self.kv[layer_id]

    def allocated_len(self, req_slot: int) -> int:
        """Positions of the request that have a host row (a page multiple, capped at max_context)."""
        return min(len(self._pages[req_slot]) * self.page_size, self.max_context)

    def host_row_ids(self, req_slot: int, start: int, end: int) -> torch.Tensor:
        """int64 [end-start] (CPU): host rows of positions ``start..end-1`` (must be ensured)."""
        if not 0 <= start <= end <= self.allocated_len(req_slot):
            raise ValueError(
                f"host_row_ids: positions {start}..{end} of request slot {req_slot} are outside its "
                f"{self.allocated_len(req_slot)} allocated positions; call ensure() first."
            )
        pos = torch.arange(start, end, dtype=torch.int64)
        pages = torch.tensor(self._pages[req_slot], dtype=torch.int64)
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    # ---- mutation --------------------------------------------------------------------------
    def ensure(self, req_slot: int, length: int) -> bool:
        """Give positions ``0..length-1`` of the request host rows, taking pages lazily.

        Returns False (nothing changed) when the pool is short. Writes the new rows into
        ``host_rows[req_slot]`` (non-blocking upload).
        """
        if not 0 <= req_slot < self.max_requests:
            raise ValueError(f"ensure: req_slot = {req_slot} outside 0..{self.max_requests - 1}.")
        if length > self.max_context:
            raise ValueError(
                f"ensure: length {length} of request slot {req_slot} exceeds max_context = "
                f"{self.max_context}; raise the pool's max_context (the model's context length)."
            )
        have = len(self._pages[req_slot])
        need = ceil_div(length, self.page_size) - have
        if need <= 0:
            return True
        pages = self.rows.alloc_pages(need)
        if pages is None:
            return False
        start = have * self.page_size
        self._pages[req_slot].extend(pages.tolist())
        end = self.allocated_len(req_slot)
        self.allocated_lens[req_slot] = end
        rows = self.rows.page_ids_to_ids(pages)[: end - start]
        self.host_rows[req_slot, start:end] = rows.to(self.device, non_blocking=True)
        return True

    def free_request(self, req_slot: int) -> None:
        """Return all of the request's pages and reset its ``host_rows`` row to -1."""
        pages = self._pages[req_slot]
        if pages:
            self.rows.free_pages(torch.tensor(pages, dtype=torch.int64))
            self.host_rows[req_slot, : self.allocated_len(req_slot)] = -1
            self._pages[req_slot] = []
            self.allocated_lens[req_slot] = 0

    # ---- data movement (reference paths: CPU harness, tests, staging fallback) ------------
    def write(
        self, host_rows: torch.Tensor, data: torch.Tensor, layer_id: int | None = None
    ) -> None:
        """Store rows: ``data`` uint8 [L, n, I] (all layers) or [n, I] (``layer_id``), any device."""
        idx = host_rows.to("cpu", torch.int64)
        src = data.to("cpu")
        if layer_id is None:
            self.kv[:, idx] = src
        else:
            self.kv[layer_id, idx] = src

    def read(self, host_rows: torch.Tensor, layer_id: int | None = None) -> torch.Tensor:
        """uint8 [L, n, I] (or [n, I] for one layer), CPU."""
        idx = host_rows.to("cpu", torch.int64)
        return self.kv[:, idx] if layer_id is None else self.kv[layer_id, idx]

    # ---- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + used == capacity; request page lists are disjoint and match ``host_rows``."""
        self.rows.check_integrity()
        owned = [pg for pages in self._pages for pg in pages]
        ps = self.page_size
        free, used, cap = self.rows.available_size(), len(owned) * ps, self.rows.size
        if len(set(owned)) != len(owned) or free + used != cap or used != self.rows.used_size():
            raise ValueError(
                f"host pool: free {free} + used {used} != capacity {cap} rows, or request page lists "
                f"overlap ({len(owned) - len(set(owned))} duplicate pages, allocator says {self.rows.used_size()} used)."
            )
        # Only per-row counts and the allocated prefixes come back to the CPU: the full
        # [R, max_ctx] table can be gigabytes.
        filled = (self.host_rows != -1).sum(dim=1).cpu()
        for r in range(self.max_requests):
            n = self.allocated_len(r)
            if int(self.allocated_lens[r]) != n:
                raise ValueError(
                    f"host pool: allocated_lens[{r}] = {int(self.allocated_lens[r])}, but {n} positions are allocated."
                )
            if int(filled[r]) != n:
                raise ValueError(
                    f"host pool: host_rows[{r}] has {int(filled[r])} rows set, but {n} positions are allocated."
                )
            if n and not torch.equal(self.host_rows[r, :n].cpu(), self.host_row_ids(r, 0, n)):
                raise ValueError(
                    f"host pool: host_rows[{r}, :{n}] disagrees with the request's pages {self._pages[r][:8]}."
                )
