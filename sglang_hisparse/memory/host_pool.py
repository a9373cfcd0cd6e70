"""Pinned host KV pool: the authoritative copy of every logical id's KV, addressed by id.

Layout (layer first, per TP rank)::

    kv        uint8 [L, host_rows_total, I]   kv[l] is layer l's host KV (the kernels' host_cache)
    host_rows int64 [R, max_ctx] on `device`  host row of each logical position; -1 unbound
    allocated_lens int64 [R] (CPU)            positions bound, per request slot

**The host row of logical id ``l`` is row ``l``** (docs/prefix-cache.md, decision 1). The pool
has exactly the logical space's rows (``capacity_tokens = device rows x host_to_device_ratio``,
page 0 the padding page in both), so owning a logical id is owning its host row, whoever owns
the id: a request, or SGLang's radix tree after the request finished. ``host_rows`` is the
kernels' per-position table; :meth:`bind` writes a request's logical ids into it (so several
requests read one shared prefix's rows simply because their rows hold the same ids), and
:meth:`unbind` clears it at release. The pool allocates nothing per request and cannot run
short of rows while the logical space has ids.

The pool is sized, then checked against available host memory (``budget``), and only
then allocated and pinned, so a too-large ratio fails with both figures in GiB instead of an
OOM kill half-way through pinning. On CUDA the whole buffer is pinned with one
``cudaHostRegister``; with unified addressing the host pointer is then directly readable by GPU
threads, which is what the resolve kernel does. On CPU the memory is left unpinned.

NOTE: one registration, not chunks. A DMA copy (``Tensor.copy_`` → ``cudaMemcpyAsync``) whose
host range crosses the boundary between two registrations fails with ``invalid argument``;
the H200 end-to-end run hit exactly that with 1 GiB chunks on an 84 GiB pool (a layer's rows
span many chunks). Pinning 83.86 GiB took 40.4 s in one call vs 43.8 s in 1 GiB chunks.

NOTE: rejected, host pages allocated per request (the layout before identity addressing): a
finished request's KV then had no owner once SGLang's radix tree kept its ids, a shared prefix
needed one host copy per reader, and PD decode could exhaust host rows with logical ids free.
"""

from __future__ import annotations

import torch

from sglang_hisparse.kernels.row_layout import TOKEN, RowLayout
from sglang_hisparse.memory.budget import GIB, check_host_budget

__all__ = ["HostKVPool", "host_pool_bytes"]

# cudaHostRegisterPortable | cudaHostRegisterMapped: visible to every context, device-mapped
_REGISTER_FLAGS = 0x1 | 0x2


def host_pool_bytes(
    *, num_layers: int, item_bytes: int, capacity_tokens: int, page_size: int, layout: RowLayout = TOKEN
) -> int:
    """Bytes of the KV buffer for ``capacity_tokens`` usable rows (+ the padding page); with
    ``layout.host_paged`` the rows live in ``layout``'s pages (``page_size`` = its entries)."""
    rows_total = (capacity_tokens // page_size + 1) * page_size
    if layout.host_paged:
        return num_layers * -(-rows_total // layout.entries) * layout.page_bytes
    return num_layers * rows_total * item_bytes  # (split halves: the same bytes)


class HostKVPool:
    """Pinned host KV addressed by logical id, with the per-position ``host_rows`` table.

    num_layers:      L layers held by this rank
    item_bytes:      I bytes per KV row (multiple of 16)
    capacity_tokens: usable host rows (rounded down to pages): the logical capacity,
                     ``device_rows * host_to_device_ratio`` (every logical id is a row)
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
    layout:          a ``kernels.row_layout`` with ``host_paged`` (``C4_PAGED_HOST``): each layer
                     is uint8 [ceil(host_rows_total / entries), page bytes] of its pages (row h in
                     page h // entries, as the device's); ``item_bytes`` is still the row's (592);
                     or ``host_split`` (``KV_SPLIT_HOST``): uint8 [2 x host_rows_total, I/2],
                     row h's halves at rows h and host_rows_total + h
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
        layout: RowLayout = TOKEN,
    ):
        if layout.host_split and (item_bytes % 32 or storage is not None):
            raise ValueError(f"HostKVPool: the {layout.name} layout splits rows in halves of whole 16-byte pieces; "
                             f"item_bytes = {item_bytes} must be a multiple of 32, and no storage given.")
        if layout.host_paged and (item_bytes != layout.host_item() or storage is not None):
            raise ValueError(
                f"HostKVPool: the {layout.name} layout holds rows of {layout.host_item()} B in its own pages; "
                f"build it with item_bytes = {layout.host_item()} and no storage (got {item_bytes}, "
                f"storage {'given' if storage is not None else 'none'}).")
        self.layout = layout
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
        if page_size < 1 or capacity_tokens < page_size:
            raise ValueError(
                f"HostKVPool: capacity_tokens = {capacity_tokens} must hold at least one page of "
                f"page_size = {page_size} (>= 1)."
            )
        #: usable rows and all rows (usable + the padding page), as the logical space's
        self.capacity = capacity_tokens // page_size * page_size
        self.total_rows = self.capacity + page_size
        self.num_layers, self.item_bytes, self.page_size = num_layers, item_bytes, page_size
        self.max_requests, self.max_context = max_requests, max_context
        self.device = torch.device(device)
        required = host_pool_bytes(
            num_layers=num_layers,
            item_bytes=item_bytes,
            capacity_tokens=capacity_tokens,
            page_size=page_size,
            layout=layout,
        )
        if storage is not None:
            # Someone else (SGLang's HiCache pool) sized, budget-checked, allocated and pinned it.
            want = (num_layers, self.total_rows, item_bytes)
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
            what=f"HiSparse host KV pool ({num_layers} layers x {self.total_rows} rows x {item_bytes} B)",
            available_bytes=available_bytes,
            ranks_per_host=ranks_per_host,
        )
        self.nbytes = required
        #: uint8 [L, host_rows_total, I] (or [L, pages, page bytes]); kv[l] is layer l
        if layout.host_paged:
            shape = (num_layers, -(-self.total_rows // layout.entries), layout.page_bytes)
        elif layout.host_split:
            shape = (num_layers, 2 * self.total_rows, item_bytes // 2)
        else:
            shape = (num_layers, self.total_rows, item_bytes)
        self.kv = torch.empty(shape, dtype=torch.uint8)
        # the padding page reads as zeros (the pages holding its rows, in a paged layout)
        self.kv[:, : -(-self.page_size // layout.entries) if layout.host_paged else self.page_size].zero_()
        if layout.host_split:
            self.kv[:, self.total_rows : self.total_rows + self.page_size].zero_()
        #: int64 [R, max_ctx]: host row (= logical id) of each position, -1 unbound
        self.host_rows = torch.full(
            (max_requests, max_context), -1, dtype=torch.int64, device=self.device
        )
        self._init_bookkeeping()
        self._registered: list[int] = []
        want_pin = torch.cuda.is_available() if pin is None else pin
        if want_pin:
            self._pin()

    def _init_bookkeeping(self) -> None:
        #: int64 [R] (CPU): ``allocated_len`` of every request slot, kept in step by
        #: ``bind`` / ``unbind``. SGLang's PD decode reads it (and our
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
        """Usable host rows: the logical capacity."""
        return self.capacity

    def layer(self, layer_id: int) -> torch.Tensor:
        """uint8 [host_rows_total, I]: layer ``layer_id``'s host KV (the resolve kernel's ``host_cache``)."""
        return self.kv[layer_id]

    def allocated_len(self, req_slot: int) -> int:
        """Positions ``0..allocated_len-1`` of the request are bound (have a host row)."""
        return int(self.allocated_lens[req_slot])

    # ---- mutation --------------------------------------------------------------------------
    def bind(self, req_slot: int, start: int, logical_ids: torch.Tensor) -> None:
        """Positions ``start..start+n-1`` of request slot ``req_slot`` hold ``logical_ids``
        (int [n], any device): their host rows are those ids. Non-blocking device write; no
        host sync. ``start`` may not leave a gap after the bound positions."""
        self._check_slot(req_slot, "bind")
        n = logical_ids.numel()
        end = start + n
        have = int(self.allocated_lens[req_slot])
        if not 0 <= start <= have:
            raise ValueError(
                f"bind: request slot {req_slot} has positions 0..{have - 1} bound; binding from "
                f"position {start} would leave a gap (bind in position order)."
            )
        self._check_len(req_slot, end, "bind")
        if n:
            self.host_rows[req_slot, start:end] = logical_ids.reshape(-1).to(self.device, torch.int64, non_blocking=True)
        self.allocated_lens[req_slot] = max(have, end)

    def bind_positions(
        self, req_slots: list[int], positions: list[int], logical_ids: torch.Tensor,
        *, req_t: torch.Tensor | None = None, pos_t: torch.Tensor | None = None,
    ) -> None:
        """Decode / verify growth: position ``positions[i]`` of ``req_slots[i]`` holds
        ``logical_ids[i]`` (int, on ``device``; SGLang's ``out_cache_loc``). One scatter on the
        device, no host sync; ``req_t`` / ``pos_t``: the same lists already on ``device``."""
        for r, q in zip(req_slots, positions, strict=True):
            self._check_slot(r, "bind_positions")
            have = int(self.allocated_lens[r])
            if not 0 <= q <= have:
                raise ValueError(
                    f"bind_positions: request slot {r} has positions 0..{have - 1} bound; position "
                    f"{q} would leave a gap."
                )
            self._check_len(r, q + 1, "bind_positions")
            self.allocated_lens[r] = max(have, q + 1)
        if not req_slots:
            return
        if req_t is None:
            req_t = torch.tensor(req_slots, dtype=torch.int64).to(self.device, non_blocking=True)
        if pos_t is None:
            pos_t = torch.tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        self.host_rows[req_t, pos_t] = logical_ids.reshape(-1).to(self.device, torch.int64)

    def unbind(self, req_slot: int) -> None:
        """Release: reset the request's ``host_rows`` row to -1. The rows themselves belong
        to the logical ids, which SGLang frees or keeps in its tree."""
        n = int(self.allocated_lens[req_slot])
        if n:
            self.host_rows[req_slot, :n] = -1
            self.allocated_lens[req_slot] = 0

    def _check_slot(self, req_slot: int, op: str) -> None:
        if not 0 <= req_slot < self.max_requests:
            raise ValueError(f"{op}: req_slot = {req_slot} outside 0..{self.max_requests - 1}.")

    def _check_len(self, req_slot: int, length: int, op: str) -> None:
        if length > self.max_context:
            raise ValueError(
                f"{op}: length {length} of request slot {req_slot} exceeds max_context = "
                f"{self.max_context}; raise the pool's max_context (the model's context length)."
            )

    # ---- data movement (reference paths: CPU harness, tests, staging fallback) ------------
    def write(
        self, host_rows: torch.Tensor, data: torch.Tensor, layer_id: int | None = None
    ) -> None:
        """Store rows: ``data`` uint8 [L, n, I] (all layers) or [n, I] (``layer_id``), any device."""
        idx = host_rows.to("cpu", torch.int64)
        src = data.to("cpu")
        if self.layout.kind:
            for li in range(self.num_layers) if layer_id is None else (layer_id,):
                self.layout.host_write(self.kv[li], idx, src[li] if layer_id is None else src)
        elif layer_id is None:
            self.kv[:, idx] = src
        else:
            self.kv[layer_id, idx] = src

    def read(self, host_rows: torch.Tensor, layer_id: int | None = None) -> torch.Tensor:
        """uint8 [L, n, I] (or [n, I] for one layer), CPU."""
        idx = host_rows.to("cpu", torch.int64)
        if self.layout.kind:
            if layer_id is not None:
                return self.layout.host_read(self.kv[layer_id], idx)
            return torch.stack([self.layout.host_read(kv, idx) for kv in self.kv])
        return self.kv[:, idx] if layer_id is None else self.kv[layer_id, idx]

    # ---- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every request's bound positions are set, in range, and nothing else is set. Syncs."""
        # Only per-row counts and reductions come back to the CPU: the full [R, max_ctx] table
        # can be gigabytes.
        bound = self.host_rows != -1
        filled = bound.sum(dim=1).cpu()
        for r in range(self.max_requests):
            n = int(self.allocated_lens[r])
            if int(filled[r]) != n or (n and not bool(bound[r, :n].all())):
                raise ValueError(
                    f"host pool: host_rows[{r}] has {int(filled[r])} rows set, but positions "
                    f"0..{n - 1} are bound."
                )
        if bool(bound.any()):
            vals = self.host_rows[bound]
            lo, hi = int(vals.min()), int(vals.max())
            if lo < self.page_size or hi >= self.total_rows:
                raise ValueError(
                    f"host pool: host_rows holds rows {lo}..{hi}, outside the usable rows "
                    f"{self.page_size}..{self.total_rows - 1} (page 0 is padding)."
                )
