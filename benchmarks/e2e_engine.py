"""Batched decode runners for the end-to-end benchmark: full-KV residency and HiSparse.

Both run the same per-step model work (:mod:`e2e_model`) on ``bs`` requests that all have
the same length (so the indexer gathers one ``[bs, n]`` block and nothing syncs on lengths):

```
FullKVRunner   every token's KV row on the device: request r owns rows r*cap .. r*cap+cap-1;
               attention reads rows r*cap + top_k directly.
HiSparseRunner HiSparseCore driven with SGLang's call protocol, as hisparse_testing/engine.py does
               (PD direct admission: prompt KV written straight into the pinned host pool;
               per step alloc_decode -> map_last_loc -> wait_for_pending_backup ->
               num_real_reqs -> per layer KV write, indexer, swap_in, attention), but
               vectorised over the batch instead of per-request Python loops.
```

Selections: with a ``SelectionTable`` (``e2e_selection``, the default) each anchor's top-k is
the calibrated process's, injected into the toy indexer (same indexer work); without one, the
toy indexer's own (``--selection toy``).

A compressed stack (``BenchModel.compress_ratio`` > 1, DeepSeek-V4's C4 layers): ``n`` counts
tokens, positions are entries (``e = n // ratio``), and a step adds an entry (an id, a KV
write, a backup) only when ``n`` reaches a multiple of the ratio; the other steps resolve
over the same entries (``map_last_loc(grows=)``), as SGLang's V4 decode does. Entries live in
``BenchModel.row_layout`` (C4 pages), and ``BenchModel.resident`` (windows, C128 entries) is
read every step by both runners.

The forward of a step (every layer: KV write, indexer, resolve, attention, dense) reads only
**static** per-step inputs (``_StepInputs``: token count, positions, new ids, seq_lens, the
calibrated selections), filled by the step's bookkeeping outside it, so on CUDA it is captured
once per (batch, grows, checked) into a CUDA graph and replayed (``graphs = True``), as SGLang's
CUDA-graph runner replays a decode forward; the coordinator's per-step protocol (alloc_decode,
map_last_loc, wait_for_pending_backup, num_real_reqs) stays outside the graph where SGLang calls
it. The indexer scores a fixed width (the runner's capacity ``cap``) and masks positions at or
past the step's length on the device, so one graph serves every step. Eager (``graphs = False``,
CPU) runs the same forward uncaptured.

``step(check=...)``: when ``check`` holds sampled request positions, the forward records every
layer's top-k and resolved rows into static buffers; afterwards each sampled request's toy
attention output (``ToyModel.attend``, float32) is recorded with its top-k and compared with the
same output on recomputed oracle bytes (what full-KV residency holds).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from e2e_model import BenchModel, ComputeStandIn
from e2e_selection import SelectionTable

from hisparse_testing.device_pool import DeviceKVPool
from sglang_hisparse.coordinator.core import HiSparseCore
from sglang_hisparse.memory.allocator import DualSpaceAllocator
from sglang_hisparse.memory.host_pool import HostKVPool
from sglang_hisparse.memory.paged import ceil_div


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class CheckLog:
    """Sampled outputs: key (rid, seq_len, layer) -> (top_k int32 [k], output float32 [I])."""

    outputs: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    compared: int = 0
    mismatches: list[str] = field(default_factory=list)
    churn: list[float] = field(default_factory=list)


class _Runner:
    """Shared batch bookkeeping, the static step inputs, the per-layer model work and its graphs."""

    def __init__(self, model: BenchModel, compute: ComputeStandIn, *, bs: int, n: int,
                 cap: int, device: torch.device, selections: SelectionTable | None = None,
                 seed0: int = 1000) -> None:
        self.model, self.compute, self.device = model, compute, device
        self.bs, self.n, self.cap = bs, n, cap
        self.selections = selections
        self._seeds_all = torch.arange(seed0, seed0 + bs, dtype=torch.int64, device=device)
        self._seeds_cpu_all = self._seeds_all.cpu().tolist()
        self._req_index_all = torch.arange(bs, dtype=torch.int64, device=device)
        #: int64 [bs, cap]: token id (full: device row; HiSparse: logical id) per position
        self._r2t_all = torch.zeros(bs, cap, dtype=torch.int64, device=device)
        toy, k = model.toy, model.toy.top_k
        # -- static step inputs (filled per step outside the forward; a graph reads them) -------
        #: int64 [1]: the step's entries e (index positions) and tokens n
        self._e_dev = torch.zeros(1, dtype=torch.int64, device=device)
        self._ntok_dev = torch.zeros(1, dtype=torch.int64, device=device)
        #: int64 [bs]: the new entry's position (e - 1), its id, the step's seq_lens (entries)
        self._pos_all = torch.zeros(bs, dtype=torch.int64, device=device)
        self._ids_all = torch.zeros(bs, dtype=torch.int64, device=device)
        self._seq_all = torch.ones(bs, dtype=torch.int64, device=device)
        A = len(model.anchors)
        #: int32 [A, bs, k]: the calibrated selections of this step (None: the toy indexer's own)
        self._forced_all = None if selections is None else torch.zeros(A, bs, k, dtype=torch.int32, device=device)
        # -- what a checked forward records ----------------------------------------------------
        self._topk_rec = torch.full((A, bs, k), -1, dtype=torch.int32, device=device)
        self._rows_rec = torch.full((toy.num_layers, bs, k), -1, dtype=torch.int64, device=device)
        self._anchor_slot = {a: i for i, a in enumerate(model.anchors)}
        #: int64 [A] anchor layer ids on the device (a graph's forward must not copy from the host)
        self._anchors_dev = torch.tensor(model.anchors, dtype=torch.int64, device=device)
        self._anchor_of = []
        last = 0
        for layer, shared in enumerate(toy.shared):
            last = last if shared else layer
            self._anchor_of.append(last)
        self._prev_topk: dict[int, torch.Tensor] = {}
        #: False: no dense stand-in in this runner's forward (the *_nodense modes)
        self.dense = True
        #: replay the forward from CUDA graphs (CUDA only; set before the first step)
        self.graphs = False
        self._graphs: dict[tuple[int, bool, bool], Any] = {}
        self._graph_pool = None
        #: steps replayed from a graph / run eagerly, and graph captures (the sanity lines read them)
        self.replays = self.eager_steps = self.captures = 0
        #: when a list: each replay appends its (start, end) CUDA events (e2e_measure.replay_spans)
        self.replay_events: list | None = None
        #: checked steps replay their own graph too (False: they run eagerly, e.g. the ramp's)
        self.check_in_graph = True
        #: request slots 0..active-1 decode (all ``bs`` unless a ramp changes it)
        self.active = bs
        self._views(bs)
        self._resident_setup(bs)

    @property
    def e(self) -> int:
        """Positions of the index space (entries; tokens unless the stack compresses)."""
        return self.model.entries(self.n)

    def _grows(self) -> bool:
        """Whether the step that made ``n`` tokens added an entry."""
        return self.n % self.model.compress_ratio == 0

    def _resident_setup(self, bs: int) -> None:
        """V4's windows and C128 entries: ``bs`` blocks of rows (uint8, 576 B read of 585 held)
        and, per C4 layer, the rows its step reads, int64 [bs, w]."""
        res = self.model.resident
        self.resident = None
        self._resident_ids: list[torch.Tensor] = []
        if res is None:
            return
        cap_tok = self.cap * self.model.compress_ratio
        rows = res.rows(cap_tok)
        held = torch.zeros(bs * rows * res.entry_bytes, dtype=torch.uint8, device=self.device)
        self.resident = held[: bs * rows * 576].view(bs * rows, 576)
        base = torch.arange(bs, dtype=torch.int64, device=self.device)[:, None] * rows
        for i in range(self.model.toy.num_layers):
            own = torch.tensor(res.read_rows(i, cap_tok), dtype=torch.int64, device=self.device)
            self._resident_ids.append((base + own[None, :]).contiguous())
        self._resident_held = held

    @property
    def slots(self) -> int:
        """Request slots this runner was built for (a ramp's largest level)."""
        return self._r2t_all.shape[0]

    def _views(self, c: int) -> None:
        """Point the per-step tensors at the first ``c`` request slots (views: writes land)."""
        self.bs = c
        self.seeds, self.seeds_cpu = self._seeds_all[:c], self._seeds_cpu_all[:c]
        self.req_index, self.req_to_token = self._req_index_all[:c], self._r2t_all[:c]

    # hooks ------------------------------------------------------------------------------------
    def _index_table(self, layer: int) -> torch.Tensor:
        """float32 [tokens, D]: the anchor layer's key cache, by token id."""
        raise NotImplementedError

    def _write_layer(self, layer: int, ids: torch.Tensor, kv: torch.Tensor, keys: torch.Tensor | None) -> None:
        """The new entries' KV rows ``kv`` uint8 [bs, I] (and an anchor's index keys float32
        [bs, D]) at ``ids``."""
        raise NotImplementedError

    def _attend(self, layer: int, top_k: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Resolve ``top_k`` to device rows and run the timed attention over them; the rows."""
        raise NotImplementedError

    def _bookkeeping(self) -> None:
        """The step's protocol outside the forward (after ``n`` advanced)."""
        raise NotImplementedError

    def _inert(self, inert: bool) -> None:
        """A graph's warm-up and capture must not change coordinator state (HiSparse overrides)."""

    def _read_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [n, I] of device rows ``rows`` of ``layer`` (through the row layout)."""
        kv = self._kv_layer(layer)
        lay = self.model.row_layout
        return lay.read(kv, rows) if lay.paged else kv[rows]

    def _kv_layer(self, layer: int) -> torch.Tensor:
        raise NotImplementedError

    # per step ---------------------------------------------------------------------------------
    def step(self, check: list[int] | None = None, log: CheckLog | None = None) -> None:
        """One decode step: bookkeeping, static inputs, the forward (a graph replay when
        ``graphs``), then the sampled checks."""
        self.n += 1
        grows, bs, e = self._grows(), self.bs, self.e
        self._fill_inputs(grows)
        self._bookkeeping()
        record = check is not None and log is not None
        if self.graphs and (self.check_in_graph or not record):
            key = (bs, grows, record)
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = self._capture(grows, record)
            if self.replay_events is None:
                graph.replay()
            else:
                pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                pair[0].record()
                graph.replay()
                pair[1].record()
                self.replay_events.append(pair)
            self.replays += 1
        else:
            self._forward(grows, record)
            self.eager_steps += 1
        if record:
            for layer in range(self.model.toy.num_layers):
                top_k = self._topk_rec[self._anchor_slot[self._anchor_of[layer]], :bs]
                if layer == self._anchor_of[layer]:
                    self._churn(layer, top_k, check, log)
                self._check(layer, top_k, self._rows_rec[layer, :bs], check, log)
        del e

    def _fill_inputs(self, grows: bool) -> None:
        """The static inputs of this step (device writes, no host sync)."""
        bs, e = self.bs, self.e
        self._e_dev.fill_(e)
        self._ntok_dev.fill_(self.n)
        self._pos_all[:bs].fill_(e - 1)
        self._seq_all[:bs].fill_(e)
        if self._forced_all is not None:
            self._forced_all[:, :bs].copy_(self.selections.get_all(self.n, bs))

    def _capture(self, grows: bool, record: bool):
        """The forward warmed up on a side stream, then captured (both inert for the coordinator:
        the warm-up's KV writes rewrite this step's rows with the same bytes)."""
        self._inert(True)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(grows, record)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                self._forward(grows, record)
        finally:
            self._inert(False)
        self.captures += 1
        return graph

    def _forward(self, grows: bool, record: bool) -> None:
        """Every layer of one step on the static inputs: a graph captures exactly this."""
        toy, bs = self.model.toy, self.bs
        pos, seq = self._pos_all[:bs], self._seq_all[:bs]
        ids = self._ids_all[:bs] if grows else None
        top_k = None
        # every anchor's query at once (the toy's hash takes ~25 launches per call)
        q_all = self.model.queries_layers(self.seeds, self._ntok_dev, self._anchors_dev)
        if ids is not None:  # the new entry's KV of every layer and its anchors' keys, at once
            kv_new = self.model.kv_rows_layers(self.seeds, pos, toy.num_layers)
            keys_new = self.model.index_key_rows_layers(self.seeds, pos, self._anchors_dev)
        for layer in range(toy.num_layers):
            if ids is not None:
                slot = self._anchor_slot.get(layer)
                self._write_layer(layer, ids, kv_new[layer], None if slot is None else keys_new[slot])
            if not toy.shared[layer]:
                keys = self._index_table(layer)[self.req_to_token]  # [bs, cap, D]: fixed width
                top_k = self._select(keys, layer, q_all[self._anchor_slot[layer]])
                if record:
                    self._topk_rec[self._anchor_slot[layer], :bs].copy_(top_k)
            rows = self._attend(layer, top_k, seq)
            if record:
                self._rows_rec[layer, :bs].copy_(rows)
            self._attend_resident(layer)
            if self.dense:
                self.compute.dense(layer, bs)

    def _select(self, keys: torch.Tensor, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The anchor's top-k over the step's ``e`` positions (a device scalar) under its query
        ``q`` at this step's tokens (``BenchModel.queries``)."""
        forced = None if self._forced_all is None else self._forced_all[self._anchor_slot[layer], : self.bs]
        return self.model.select(keys, q, self._e_dev, forced=forced)

    def _attend_resident(self, layer: int) -> None:
        if self.resident is not None:
            self.compute.bag(self.resident, self._resident_ids[layer][: self.bs])

    def _churn(self, layer: int, top_k: torch.Tensor, check: list[int], log: CheckLog) -> None:
        for b in check:
            prev = self._prev_topk.get(layer * 1_000_000 + b)
            if prev is not None:
                log.churn.append(1.0 - float(torch.isin(top_k[b], prev).float().mean()))
            self._prev_topk[layer * 1_000_000 + b] = top_k[b].clone()

    def _check(self, layer: int, top_k: torch.Tensor, rows: torch.Tensor, check: list[int],
               log: CheckLog) -> None:
        toy, m = self.model.toy, self.model
        for b in check:
            sel, valid = top_k[b], (top_k[b] >= 0)[None]
            got = toy.attend(self._read_rows(layer, rows[b].clamp(min=0).long())[None], valid)[0]
            want = toy.attend(m.oracle_kv(self.seeds_cpu[b], sel.clamp(min=0), layer)[None], valid)[0]
            key = (b, self.n, layer)
            log.compared += 1
            if not torch.equal(got, want) or not torch.equal(valid, (rows[b] >= 0)[None]):
                log.mismatches.append(f"request {b} len {self.n} layer {layer}: output != oracle")
            log.outputs[key] = (sel.to("cpu", copy=True), got.cpu())  # sel: a view of a static buffer


class FullKVRunner(_Runner):
    """All KV resident: ``kv`` uint8 [L, bs*cap, I] (C4 layout: [L, bs*cap/64 pages, 37440]);
    anchor keys float32 [A, bs*cap, D]. ``cap``: entries per request (tokens unless compressed)."""

    def __init__(self, model: BenchModel, compute: ComputeStandIn, *, bs: int, n: int, cap: int,
                 device: torch.device, selections: SelectionTable | None = None) -> None:
        lay = model.row_layout
        if lay.paged:
            cap = ceil_div(cap, lay.entries) * lay.entries  # whole pages per request
        super().__init__(model, compute, bs=bs, n=n, cap=cap, device=device, selections=selections)
        toy = model.toy
        shape = (toy.num_layers, bs * cap // lay.entries, lay.page_bytes) if lay.paged else (
            toy.num_layers, bs * cap, toy.item_bytes)
        self.kv = torch.empty(shape, dtype=torch.uint8, device=device)
        self.anchor_slot = {a: i for i, a in enumerate(model.anchors)}
        self.keys = torch.empty(len(model.anchors), bs * cap, toy.index_dim, dtype=torch.float32, device=device)
        self._r2t_all.copy_(torch.arange(bs * cap, device=device).view(bs, cap))
        #: per slot: positions 0..written-1 hold its KV (a ramp's late joiner catches up)
        self._written = [n] * bs

    @staticmethod
    def bytes_per_request(model: BenchModel, cap: int) -> int:
        """HBM per request: ``cap`` entries' rows (whole pages), index keys and r2t; resident."""
        toy, lay = model.toy, model.row_layout
        capp = ceil_div(cap, lay.entries) * lay.entries if lay.paged else cap
        own = capp * (toy.num_layers * model.device_row_bytes + len(model.anchors) * 4 * toy.index_dim + 8)
        res = model.resident
        return own + (0 if res is None else res.bytes_per_request(cap * model.compress_ratio))

    def _store(self, layer: int, rows: torch.Tensor, data: torch.Tensor) -> None:
        lay = self.model.row_layout
        if lay.paged:
            lay.write(self.kv[layer], rows, data)
        else:
            self.kv[layer].index_copy_(0, rows, data)

    def admit(self) -> None:
        """Prompt KV and keys of positions 0..e-1 straight into each request's rows."""
        m, toy, e = self.model, self.model.toy, self.e
        pos = torch.arange(e, device=self.device)
        for b, seed in enumerate(self.seeds_cpu):
            rows = self._r2t_all[b, :e]
            for layer in range(toy.num_layers):
                self._store(layer, rows, m.oracle_kv(seed, pos, layer))
                if layer in self.anchor_slot:
                    self.keys[self.anchor_slot[layer], rows] = toy.index_keys(seed, pos, layer)

    def _bookkeeping(self) -> None:
        if self._grows():
            self._ids_all[: self.bs].copy_(self.req_to_token[:, self.e - 1])
        self._written[: self.bs] = [self.n] * self.bs

    def set_concurrency(self, c: int) -> None:
        """Ramp: slots 0..c-1 decode; a joining slot gets the positions it did not decode."""
        if self.model.compress_ratio != 1:
            raise ValueError("the ramp runs token stacks only (compress_ratio 1)")
        toy = self.model.toy
        for b in range(self.active, c):
            pos = torch.arange(self._written[b], self.n, device=self.device)
            if pos.numel():
                seed, rows = self._seeds_cpu_all[b], self._r2t_all[b, pos]
                for layer in range(toy.num_layers):
                    self.kv[layer, rows] = toy.kv(seed, pos, layer)
                    if layer in self.anchor_slot:
                        self.keys[self.anchor_slot[layer], rows] = toy.index_keys(seed, pos, layer)
            self._written[b] = self.n
        self.active = c
        self._views(c)

    def _write_layer(self, layer, ids, kv, keys):
        self._store(layer, ids, kv)
        if keys is not None:
            self.keys[self.anchor_slot[layer]].index_copy_(0, ids, keys)

    def _index_table(self, layer):
        return self.keys[self.anchor_slot[layer]]

    def _attend(self, layer, top_k, seq_lens):
        rows = self.req_to_token.gather(1, top_k.long())
        self.compute.attention(self.kv[layer], rows)
        return rows

    def _kv_layer(self, layer):
        return self.kv[layer]


@dataclass(frozen=True)
class HiSparsePlan:
    """Sizes of one HiSparse engine: page size P, device rows, host/device ratio."""

    page: int
    device_rows: int
    ratio: int
    max_ctx: int


def hot_rows(buffer_size: int, page: int) -> int:
    """Device rows of one hot buffer at worst (``memory.hot.HotBuffers.max_pages``: the B slots'
    pages plus the newest slot's own page; a buffer shrunk from resident keeps that layout)."""
    return (ceil_div(buffer_size, page) + 1) * page


def hisparse_plan(*, bs: int, cap: int, buffer_size: int, page: int, device_rows: int = 0) -> HiSparsePlan:
    """``device_rows``: at least this many (the KV budget's rows, so residency has room)."""
    hot = hot_rows(buffer_size, page)
    device_rows = max(bs * hot + page, ceil_div(device_rows, page) * page)
    logical = bs * ceil_div(cap, page) * page + page
    return HiSparsePlan(page, device_rows, ceil_div(logical, device_rows), ceil_div(cap, page) * page)


def hisparse_bytes_per_request(model: BenchModel, *, cap: int, buffer_size: int, page: int) -> int:
    """HBM per request: hot rows (all layers), logical-space keys (the pool keeps them for
    every layer), mapping + host_rows + req_to_token entries, slot_tokens/slot_rows/lru;
    V4's resident state. ``cap``: entries."""
    toy, L = model.toy, model.toy.num_layers
    hot = hot_rows(buffer_size, page)
    capp = ceil_div(cap, page) * page
    res = model.resident
    extra = 0 if res is None else res.bytes_per_request(cap * model.compress_ratio)
    return (L * hot * model.device_row_bytes + capp * (L * 4 * toy.index_dim + 24)
            + (L * 6 + 4) * (buffer_size + 1) + extra)


class HiSparseRunner(_Runner):
    """HiSparseCore over a DeviceKVPool and a HostKVPool on ``storage`` (pinned by the owner)."""

    def __init__(self, model: BenchModel, compute: ComputeStandIn, *, bs: int, n: int, cap: int,
                 buffer_size: int, page: int, storage: torch.Tensor, prefetch: bool,
                 skip_io: bool, device: torch.device, selections: SelectionTable | None = None,
                 core_options: dict[str, Any] | None = None, device_rows: int = 0) -> None:
        super().__init__(model, compute, bs=bs, n=n, cap=cap, device=device, selections=selections)
        toy = model.toy
        plan = hisparse_plan(bs=bs, cap=cap, buffer_size=buffer_size, page=page, device_rows=device_rows)
        self.device_rows = plan.device_rows
        host_capacity = (storage.shape[1] // page - 1) * page
        need = bs * plan.max_ctx + page
        if host_capacity < need:
            raise ValueError(f"host storage holds {host_capacity} rows; {bs} requests of {plan.max_ctx} need {need}")
        # a logical id's host row is the id: the logical space is what the storage holds
        self.allocator = DualSpaceAllocator(
            plan.device_rows, host_to_device_ratio=plan.ratio, page_size=page, device=device,
            logical_capacity=max(plan.device_rows, min(plan.device_rows * plan.ratio, host_capacity)))
        self.pool = DeviceKVPool(num_layers=toy.num_layers, item_bytes=toy.item_bytes,
                                 allocator=self.allocator, index_item_bytes=4 * toy.index_dim,
                                 row_layout=model.row_layout)
        self.host = HostKVPool(num_layers=toy.num_layers, item_bytes=toy.item_bytes,
                               capacity_tokens=host_capacity, page_size=page, max_requests=bs,
                               max_context=plan.max_ctx, device=device, storage=storage)
        options = dict(core_options or {})
        #: int32 [bs, max_ctx]: logical ids per position, as SGLang's req_to_token, for a core
        #: whose residency takes it (the planned API did; the one that landed may not)
        self.r2t32 = None
        if "residency" in options:
            if "req_to_token" in inspect.signature(HiSparseCore.__init__).parameters:
                self.r2t32 = torch.zeros(bs, plan.max_ctx, dtype=torch.int32, device=device)
                options["req_to_token"] = self.r2t32
            frac = options.pop("watermark", None)
            if frac is not None:
                options["watermark_rows"] = int(frac * plan.device_rows)
        self.core = HiSparseCore(
            top_k=toy.top_k, buffer_size=buffer_size, num_reqs=bs, allocator=self.allocator,
            host=self.host, device_kv=list(self.pool.kv), host_kv=list(self.host.kv),
            device=device, shared_index_layers=list(toy.shared), max_batch=bs,
            prefetch=prefetch, skip_io=skip_io, log_interval_s=0.0, row_layout=model.row_layout,
            **options,
        )
        self.req_cpu = list(range(bs))

    def admit(self, fill_host: bool) -> None:
        """PD direct admission; ``fill_host``: write the prompt KV into the host rows (skip
        when an earlier engine on the same storage already did: same seeds, same rows)."""
        for b in range(self.bs):
            self._admit_one(b, fill_host)

    def _admit_one(self, b: int, fill_host: bool) -> None:
        toy, n, dev = self.model.toy, self.e, self.device
        seed = self._seeds_cpu_all[b]
        pos = torch.arange(n, device=dev)
        zero, none = torch.zeros(1, dtype=torch.int64), torch.full((1,), -1, dtype=torch.int64)
        ids = self.allocator.alloc_logical_extend(zero, torch.tensor([n]), none)
        if ids is None:
            raise RuntimeError(f"admit: request {b} does not fit (logical ids)")
        self.host.bind(b, 0, ids)  # a logical id's host row is the id
        self._r2t_all[b, :n] = ids
        if self.r2t32 is not None:
            self.r2t32[b, :n] = ids
        for a in self.model.anchors:
            self.pool.write_index(a, ids, toy.index_keys(seed, pos, a).view(torch.uint8))
        if fill_host:
            rows = ids.cpu()
            start = int(rows[0])
            contiguous = bool(torch.equal(rows, torch.arange(start, start + n)))
            for layer in range(toy.num_layers):
                data = self.model.oracle_kv(seed, pos, layer)
                if contiguous:  # one bulk device->pinned copy per layer
                    self.host.kv[layer, start : start + n].copy_(data)
                else:
                    self.host.kv[layer, rows] = data.cpu()
        self.core.admit_direct(b, n)

    def start_empty(self) -> None:
        """A ramp starts with no request admitted (``set_concurrency`` admits them)."""
        self.active = 0
        self._views(0)
        self.req_cpu = []

    def set_concurrency(self, c: int) -> None:
        """Ramp: slots 0..c-1 decode. A joining slot is admitted (PD) at the current length,
        so every active request keeps one length; a leaving one is finished and freed."""
        _sync(self.device)
        for b in range(self.active, c):
            self._admit_one(b, fill_host=True)
        for b in reversed(range(c, self.active)):
            self.core.finish(b)
            self.allocator.free(self._r2t_all[b, : self.e])
        self.active = c
        self._views(c)
        self.req_cpu = list(range(c))

    def _bookkeeping(self) -> None:
        """SGLang's per-step protocol: alloc_decode -> map_last_loc -> wait_for_pending_backup ->
        num_real_reqs (the static seq_lens already hold this step's length)."""
        n, bs, grows = self.e, self.bs, self._grows()
        seq_cpu = torch.full((bs,), n, dtype=torch.int64)
        if grows:
            last = self.req_to_token[:, n - 2]
            new_ids = self.allocator.alloc_decode(seq_cpu, last)
            if new_ids is None:
                raise RuntimeError("step: logical ids exhausted")
            self.req_to_token[:, n - 1] = new_ids
            self._ids_all[:bs].copy_(new_ids)
            if self.r2t32 is not None:
                self.r2t32[:bs, n - 1] = new_ids
        else:
            new_ids = torch.empty(0, dtype=torch.int64, device=self.device)
        # a compressed stack says which rows gained an entry (all or none: one length)
        flags = None if self.model.compress_ratio == 1 else [grows] * bs
        self.core.map_last_loc(req_index=self.req_index, seq_lens=self._seq_all[:bs], new_logical=new_ids,
                               req_index_cpu=self.req_cpu, seq_lens_cpu=seq_cpu.tolist(), grows=flags)
        self.core.wait_for_pending_backup()
        self.core.num_real_reqs.fill_(bs)

    def _inert(self, inert: bool) -> None:
        # num_real_reqs 0: every resolve and replay of the warm-up and capture does nothing
        self.core.num_real_reqs.fill_(0 if inert else self.bs)

    def _write_layer(self, layer, ids, kv, keys):
        self.pool.write(layer, ids, kv)
        if keys is not None:
            self.pool.write_index(layer, ids, keys.view(torch.uint8))

    def _index_table(self, layer):
        return self.pool.index_k[layer].view(torch.float32)

    def _attend(self, layer, top_k, seq_lens):
        rows = self.core.swap_in(self.req_index, seq_lens, top_k, layer)
        self.compute.attention(self.pool.kv[layer], rows)
        return rows

    def _kv_layer(self, layer):
        return self.pool.kv[layer]

    @property
    def backup_path(self) -> str:
        """How the coordinator writes the per-step backup to host (it changed over time)."""
        if getattr(self.core.ctx, "host_kv_cuda", None) is not None:
            return "zero-copy: GPU kernels on a CUDA alias of the pinned pool, no host sync"
        if self.device.type == "cuda":
            return "fallback: gather + blocking copy to host, one host sync per layer per step"
        return "cpu"

    def destroy(self) -> None:
        self.core.destroy()
