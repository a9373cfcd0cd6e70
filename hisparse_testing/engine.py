"""A decode engine that drives ``HiSparseCore`` with SGLang 0.5.23's call protocol.

It plays the scheduler, the model runner and the DSA backend for a :class:`ToyModel`:

```
prefill(req)      req slot; allocator.alloc_extend (logical ids + device rows, mapped);
                  prompt KV written through the mapping; core.admit_staging
admit_direct(req) PD: req slot; logical ids only; KV written straight into host rows;
                  core.admit_direct
collect()         core.collect_ready -> those requests join the running batch
retract_decode()  SGLang's check_decode_mem / retract_decode: while the next step's logical
                  ids or device rows (temporary alloc() rows + hot-buffer growth pages) do not
                  fit, retract the request SGLang would (fewest outputs, then longest prompt);
                  the last one left is aborted
step()            alloc_decode (one logical id each), seq_lens += 1, core.map_last_loc,
                  core.wait_for_pending_backup, num_real_reqs.fill_(bs); per layer: the new
                  token's KV written through the mapping, indexer top-k (anchors) or the
                  anchor's top-k (shared), core.swap_in, attention on the resolved rows;
                  compared bit for bit with the all-resident oracle
finish/abort/retract(req)   core.finish, then allocator.free(logical ids) (release_kv_cache);
                  a retracted request re-queues with its generated tokens as prompt
```

Radix mode (``radix=True``, SGLang's radix cache on; ``toy_radix.py``): a request's
tokens are (seed, position) pairs, except that its first ``shared_len`` positions use
``prefix_seed``, so requests with one ``prefix_seed`` share a prompt prefix (a system prompt)
and a retracted request re-matches its own prompt. ``prefill`` matches the tree (whole pages,
at least one token left to compute), locks the path, allocates only the rest, and calls
``core.prepare_prefix`` with the matched ids and the computed ones; ``flush_prefills`` then
checkpoints each prefilled request into the tree in admission order (a page another request
inserted meanwhile is a duplicate: its ids are freed, the row repointed to the tree's and
those held with ``prepare_prefix``) and stages it. ``release`` checkpoints a finished request's
prompt + output, frees what the tree does not keep, and unlocks; an abort or retraction keeps
the pages its prefill inserted. The oracle's KV of a position follows the same seeds.

Admission (``can_admit``) is SGLang's PrefillAdder reservation: the prompt's ids and rows
now, plus ``new_token_ratio`` x what the running requests and this one may still grow (logical
ids for the remaining tokens, device rows for the hot-buffer slots not yet held). At ratio 1
no step can run short, so ``retract_decode`` retracts nothing; below 1 it models SGLang's
decode retraction under memory pressure. ``check_integrity`` runs after every step in the
scenarios.

Device-agnostic and SGLang-free, so ``benchmarks/`` can run it on CUDA at realistic sizes
(``check=False`` skips the oracle when only timing matters). ``guard_device_reads`` marks the
core's device state and the per-step device arguments device-side (``sync_guard``), so a
``map_last_loc`` / ``wait_for_pending_backup`` that reads one back raises even on CPU; on CUDA
those calls and ``swap_in`` also run under ``torch.cuda.set_sync_debug_mode("error")`` (on CPU
``swap_in`` runs the pure-torch reference, which reads its inputs by design).
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field

import torch

from hisparse_testing.device_pool import DeviceKVPool
from hisparse_testing.sync_guard import device_side, forbid_device_reads, mark_device_state
from hisparse_testing.toy_model import ToyModel
from hisparse_testing.toy_radix import ToyRadixTree
from sglang_hisparse.coordinator.core import HiSparseCore
from sglang_hisparse.kernels.row_layout import TOKEN, RowLayout
from sglang_hisparse.memory.allocator import DualSpaceAllocator
from sglang_hisparse.memory.host_pool import HostKVPool


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    STAGING = "staging"
    RUNNING = "running"
    DONE = "done"


@dataclass
class ToyRequest:
    """What the coordinator needs of a request (the SGLang ``Req`` equivalent).

    ``seq_len`` counts tokens with KV; a request generates ``max_new`` tokens in total.
    """

    rid: int
    seed: int
    prompt_len: int
    max_new: int
    direct: bool = False
    req_pool_idx: int = -1
    seq_len: int = 0
    generated: int = 0
    status: ReqStatus = ReqStatus.WAITING
    history: list[str] = field(default_factory=list)
    #: radix mode: positions < shared_len are the shared prefix's (prefix_seed) tokens
    prefix_seed: int = -1
    shared_len: int = 0
    #: radix mode, while admitted: locked tree path, cache-protected length, matched length
    locked: list[int] = field(default_factory=list)
    cpl: int = 0
    matched: int = 0

    def token_keys(self, n: int) -> list[tuple[int, int]]:
        return [(self.prefix_seed if p < self.shared_len else self.seed, p) for p in range(n)]


@dataclass
class EngineSizes:
    """R request slots, B hot slots, device rows, host/device ratio, max context, batch pad."""

    num_reqs: int = 8
    buffer_size: int = 8
    device_rows: int = 512
    host_to_device_ratio: int = 4
    max_ctx: int = 256
    page_size: int = 1


class Mismatch(AssertionError):
    """Attention output of the HiSparse path differs from the all-resident oracle."""


def warm_and_capture(fn) -> torch.cuda.CUDAGraph:
    """``fn()`` run once on a side stream (JIT builds, workspaces and allocations happen outside
    capture), then captured into a CUDA graph, which is returned (not replayed)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def capture_inert(core: HiSparseCore, layers) -> torch.cuda.CUDAGraph:
    """``layers()`` (one decode step's swap-ins) warmed up on a side stream, then captured.

    Both run with ``core.num_real_reqs`` = 0, so every launch is inert: a warm-up that resolved
    would mutate the hot state for a step the engine never takes. Set ``num_real_reqs`` to the
    real batch before each ``replay()``."""
    core.num_real_reqs.fill_(0)
    return warm_and_capture(layers)


class DecodeEngine:
    """See the module docstring. ``prefetch``/``skip_io`` are passed to the core (None: env)."""

    def __init__(
        self,
        model: ToyModel,
        sizes: EngineSizes,
        *,
        device: torch.device | str = "cpu",
        prefetch: bool | None = None,
        skip_io: bool | None = None,
        check: bool = True,
        max_batch: int = 16,
        decode_alloc_rows: bool = False,
        num_draft_tokens: int = 0,
        new_token_ratio: float = 1.0,
        guard_device_reads: bool = False,
        policy: str = "lru",
        residency: str = "always_hot",
        watermark_rows: int = 0,
        radix: bool = False,
        compress_ratio: int = 1,
        block_size: int = 0,
        fewer_blocks: int = 0,
        row_layout: RowLayout = TOKEN,
    ) -> None:
        self.model, self.sizes, self.check = model, sizes, check
        #: block top-k: pass this many block columns fewer than top_k / block_size (as an M3
        #: step whose merged selection is narrower than the most it may select)
        self.fewer_blocks = fewer_blocks
        #: tokens per KV entry (DeepSeek-V4's C4 layout: 4); > 1 steps with ``_step_compressed``
        self.compress_ratio = compress_ratio
        #: block top-k (MiniMax-M3): the toy's selection as blocks of this many positions (0: off)
        self.block_size = block_size
        if block_size and model.top_k % block_size:
            raise ValueError(f"block_size = {block_size} must divide top_k = {model.top_k}")
        if compress_ratio > 1 and (radix or decode_alloc_rows or num_draft_tokens):
            raise ValueError("compress_ratio > 1: without radix, decode_alloc_rows and speculative decoding")
        self.tree = ToyRadixTree(sizes.page_size) if radix else None
        self._pending: list[ToyRequest] = []  # prefilled, not yet checkpointed and staged
        self.new_token_ratio = new_token_ratio
        self._prefetch_asked = prefetch
        # SGLang's page_size-1 decode takes ids with ``alloc(bs)``, which maps fresh device
        # rows; the coordinator's rebind must hand them back. Off: logical-only alloc_decode.
        self.decode_alloc_rows = decode_alloc_rows and sizes.page_size == 1
        self.device = torch.device(device)
        L, item = model.num_layers, model.item_bytes
        self.allocator = DualSpaceAllocator(
            sizes.device_rows, host_to_device_ratio=sizes.host_to_device_ratio,
            page_size=sizes.page_size, device=self.device,
        )
        #: where the device rows live (DeepSeek-V4's paged C4 entries: 592-byte rows whose last
        #: 8 bytes the layout does not store, so the toy's KV keeps them zero)
        self.row_layout = row_layout
        self.pool = DeviceKVPool(
            num_layers=L, item_bytes=item, allocator=self.allocator, index_item_bytes=4 * model.index_dim,
            row_layout=row_layout,
        )
        self.host = HostKVPool(
            num_layers=L, item_bytes=item, capacity_tokens=sizes.device_rows * sizes.host_to_device_ratio,
            page_size=sizes.page_size, max_requests=sizes.num_reqs, max_context=sizes.max_ctx,
            device=self.device, layout=row_layout,
        )
        self.core = HiSparseCore(
            top_k=model.top_k, buffer_size=sizes.buffer_size, num_reqs=sizes.num_reqs,
            allocator=self.allocator, host=self.host, device_kv=self.pool.kv,
            host_kv=self.host.kv, device=self.device, shared_index_layers=list(model.shared),
            max_batch=max_batch, prefetch=prefetch, skip_io=skip_io, num_draft_tokens=num_draft_tokens,
            policy=policy,
            residency=residency, watermark_rows=watermark_rows, cache_finished=radix,
            row_layout=row_layout,
        )
        self.guard = guard_device_reads
        if self.guard:
            mark_device_state(self.core)
        self.req_to_token = torch.zeros(sizes.num_reqs, sizes.max_ctx, dtype=torch.int64, device=self.device)
        self.free_slots = list(range(sizes.num_reqs))
        self.running: list[ToyRequest] = []
        self.staging: list[ToyRequest] = []
        self.steps = 0
        self.checked_outputs = 0
        self.pressure_retracts = 0  # requests retract_decode retracted
        self.pressure_aborts = 0  # the last request, aborted when even it did not fit

    @property
    def prefetch_coverage(self) -> str:
        """What this engine's runs cover of the shared-index prefetch: "replayed" only when it is
        on and a shared layer exists to replay the anchor's plan into; otherwise why not."""
        if self.core.prefetch_enabled and any(self.model.shared):
            return "replayed"
        asked = self._prefetch_asked
        if asked is None:  # the env switch decides
            from sglang_hisparse import envs

            asked = not envs.get("SGLANG_HISPARSE_DISABLE_PREFETCH")
        return "on, but no shared layer: nothing replayed" if asked and not any(self.model.shared) else "off"

    # -- admission ------------------------------------------------------------------------------
    def can_admit(self, req: ToyRequest) -> bool:
        """SGLang's admission: the prompt now plus ``new_token_ratio`` x the decode growth still
        ahead of every running or staging request and of this one (module docstring)."""
        n, ps = req.prompt_len, self.sizes.page_size
        if not self.free_slots or n + req.max_new - req.generated > self.sizes.max_ctx:
            return False
        B = self.sizes.buffer_size
        prompt_rows = _pages(min(n, B) + (n > B), ps) if req.direct else _pages(n, ps)
        alive = self.running + self.staging
        grow_ids = sum(q.max_new - q.generated for q in alive) + req.max_new - req.generated
        grow_rows = sum(self._rows_ahead(q) for q in alive) + self._rows_ahead(req, prompt=True)
        ratio = self.new_token_ratio
        need_ids = _pages(n, ps) + ps + int(ratio * grow_ids + 0.999)
        if self.tree is not None and self.allocator.logical.available_size() < need_ids:
            # SGLang's admission counts the tree's evictable ids and evicts for the shortfall
            short = need_ids - self.allocator.logical.available_size()
            self.allocator.free(self.tree.evict(-(-short // ps)))
        return (
            self.allocator.logical.available_size() >= need_ids
            and self.allocator.available_rows() >= prompt_rows + int(ratio * grow_rows + 0.999)
        )

    def _rows_ahead(self, req: ToyRequest, *, prompt: bool = False) -> int:
        """Device rows a request's hot buffer still has to grow by (pages), plus, with
        ``decode_alloc_rows``, the temporary row its next decode step takes."""
        B, ps = self.sizes.buffer_size, self.sizes.page_size
        final = min(req.prompt_len + req.max_new - req.generated if prompt else req.seq_len + req.max_new - req.generated,
                    B + 1)
        held = min(req.prompt_len if prompt else req.seq_len, B + 1)
        return max(_pages(final, ps) - _pages(held, ps), 0) + (1 if self.decode_alloc_rows else 0)

    # -- memory pressure: SGLang's check_decode_mem / retract_decode -----------------------------
    def decode_demand(self, batch: list[ToyRequest]) -> tuple[int, int]:
        """(logical ids, device rows) the next decode step of ``batch`` takes."""
        ps = self.sizes.page_size
        ids = sum(ps for q in batch if q.seq_len % ps == 0)  # a new page where the last one is full
        rows = len(batch) if self.decode_alloc_rows else 0  # alloc(bs): prefill-style rows, rebound
        rows += self.allocator.hot.rows_to_grow([q.req_pool_idx for q in batch], self.sizes.buffer_size)
        return ids, rows

    def check_decode_mem(self, batch: list[ToyRequest]) -> bool:
        ids, rows = self.decode_demand(batch)
        return self.allocator.logical.available_size() >= ids and self.allocator.available_rows() >= rows

    def retract_decode(self) -> tuple[list[ToyRequest], list[ToyRequest]]:
        """SGLang 0.5.23's ``retract_decode``: (retracted, aborted). Keeps the requests with the
        most output (then the shortest prompt); retracts from the other end while the next step
        does not fit; aborts the last one if even it does not fit."""
        if self.check_decode_mem(self.running):
            return [], []
        keep = sorted(self.running, key=lambda q: (q.generated, -q.prompt_len), reverse=True)
        retracted: list[ToyRequest] = []
        while len(keep) > 1 and not self.check_decode_mem(keep):
            victim = keep.pop()
            self.release(victim, "retract")
            retracted.append(victim)
        aborted = []
        if not self.check_decode_mem(keep):
            self.release(keep[0], "abort")
            aborted.append(keep[0])
        self.pressure_retracts += len(retracted)
        self.pressure_aborts += len(aborted)
        return retracted, aborted

    def prefill(self, req: ToyRequest, *, defer: bool = False) -> None:
        """Co-located prefill: device rows for the prompt (radix: for what the tree does not
        hold), then checkpoint and staging (``defer``: at :meth:`flush_prefills`, so several
        requests prefill as one batch before any checkpoints)."""
        r, n = self._take_slot(req)
        m, prefix = 0, torch.empty(0, dtype=torch.int64)
        if self.tree is not None:
            req.locked, prefix = self.tree.match(req.token_keys(n))
            self.tree.lock(req.locked)
            m = prefix.numel()
        req.matched = req.cpl = m
        ids = self.allocator.alloc_extend(torch.tensor([m]), torch.tensor([n]), torch.full((1,), -1, dtype=torch.int64, device=self.device))
        if ids is None:
            raise RuntimeError("prefill: allocator full (can_admit should have refused)")
        self.req_to_token[r, :m] = prefix.to(self.device)
        self.req_to_token[r, m:n] = ids
        if self.tree is not None and not self.core.prepare_prefix(r, prefix, computed_ids=ids.cpu()):
            raise RuntimeError("prefill: no device rows for the matched prefix (can_admit should have refused)")
        pos = torch.arange(m, n, device=self.device)
        for layer in range(self.model.num_layers):
            self.pool.write(layer, ids, self._kv(req, pos, layer))
        self._write_index(req, ids, pos)
        req.status = ReqStatus.STAGING
        self.staging.append(req)
        req.history.append(f"prefill n={n} r={r} matched={m}")
        self._pending.append(req)
        if not defer:
            self.flush_prefills()

    def flush_prefills(self) -> None:
        """Checkpoint (radix) and stage every prefilled request, in admission order."""
        pending, self._pending = self._pending, []
        for req in pending:
            r, n = req.req_pool_idx, req.seq_len
            if self.tree is not None:
                self._checkpoint(req, n)
            self.core.admit_staging(r, self.req_to_token[r, :n], req)

    def _checkpoint(self, req: ToyRequest, n: int) -> None:
        """SGLang's checkpoint_kv_cache after a prefill: insert the whole pages past ``cpl``;
        a duplicate page's own ids are freed and the row repointed to the tree's, which the
        request then holds (prepare_prefix, before staging); the lock moves to the new path."""
        r, ps = req.req_pool_idx, self.sizes.page_size
        row = self.req_to_token[r, :n].cpu()
        keys, dups = self.tree.checkpoint(req.token_keys(n), row, req.cpl // ps)
        for j, tree_ids in dups:
            self.allocator.free(row[j * ps : (j + 1) * ps])
            self.req_to_token[r, j * ps : (j + 1) * ps] = tree_ids.to(self.device)
        if dups:
            repointed = torch.cat([t for _, t in dups])
            if not self.core.prepare_prefix(r, repointed):
                raise RuntimeError("checkpoint: no device rows for the repointed pages")
        self.tree.lock(keys)
        self.tree.unlock(req.locked)
        req.locked, req.cpl = keys, len(keys) * ps

    def _kv(self, req: ToyRequest, pos: torch.Tensor, layer: int) -> torch.Tensor:
        """KV bytes of ``req``'s positions (radix mode: the shared prefix's seed below shared_len)."""
        kv = _by_seed(self.model.kv, req, pos, layer)
        if self.row_layout.paged:  # the bytes past data + tail are not stored
            kv[:, self.row_layout.data + self.row_layout.tail:] = 0
        return kv

    def _index_keys(self, req: ToyRequest, pos: torch.Tensor, layer: int) -> torch.Tensor:
        return _by_seed(self.model.index_keys, req, pos, layer)

    def admit_direct(self, req: ToyRequest) -> None:
        """PD decode side: logical ids only; the 'prefill instance' writes host rows."""
        r, n = self._take_slot(req)
        zero = torch.zeros(1, dtype=torch.int64)
        ids = self.allocator.alloc_logical_extend(zero, torch.tensor([n]), torch.full((1,), -1, dtype=torch.int64))
        if ids is None:
            raise RuntimeError("admit_direct: logical ids exhausted (can_admit should have refused)")
        self.req_to_token[r, :n] = ids
        self._write_index(req, ids, torch.arange(n, device=self.device))
        self.host.bind(r, 0, ids)  # alloc_paged_token_slots: the host rows are the ids
        host_rows = self.host.host_rows[r, :n]
        pos = torch.arange(n, device=self.device)
        for layer in range(self.host.num_layers):
            self.host.write(host_rows, self._kv(req, pos, layer), layer)
        self.core.admit_direct(r, n)
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        req.history.append(f"direct n={n} r={r}")

    def _write_index(self, req: ToyRequest, ids: torch.Tensor, pos: torch.Tensor) -> None:
        """Indexer keys of anchor layers, by logical id (the DSA indexer's K cache)."""
        for layer in range(self.model.num_layers):
            if not self.model.shared[layer]:
                keys = self._index_keys(req, pos, layer)
                self.pool.write_index(layer, ids, keys.view(torch.uint8))

    def _take_slot(self, req: ToyRequest) -> tuple[int, int]:
        r = self.free_slots.pop(0)
        req.req_pool_idx, req.seq_len = r, req.prompt_len
        return r, req.prompt_len

    def collect(self) -> list[ToyRequest]:
        ready = [entry.req for entry in self.core.collect_ready()]
        for req in ready:
            self.staging.remove(req)
            req.status = ReqStatus.RUNNING
            self.running.append(req)
        return ready

    # -- release --------------------------------------------------------------------------------
    def release(self, req: ToyRequest, why: str) -> None:
        """finish / abort / retract: coordinator first, then the logical ids (release_kv_cache)."""
        r = req.req_pool_idx
        if req in self._pending:  # released before its checkpoint (never in a scenario)
            self._pending.remove(req)
        self.core.finish(r, self.req_to_token[r, : req.seq_len])
        if self.tree is None:
            self.allocator.free(self.req_to_token[r, : req.seq_len])
        else:
            self._release_kv(req, checkpoint=why == "finish")
        self.req_to_token[r].zero_()
        if req in self.running:
            self.running.remove(req)
        if req in self.staging:
            self.staging.remove(req)
        self.free_slots.append(r)
        req.req_pool_idx = -1
        req.history.append(why)
        if why == "retract":
            # SGLang re-prefills a retracted request from its prompt + generated tokens.
            req.prompt_len, req.status = req.seq_len, ReqStatus.WAITING
        else:
            req.status = ReqStatus.DONE

    def _release_kv(self, req: ToyRequest, *, checkpoint: bool) -> None:
        """SGLang's release_kv_cache with the tree: a finish first inserts prompt + output
        (whole pages; duplicates freed), then the ids past the tree's part are freed and the
        path unlocked. An abort or retraction inserts nothing; the tree keeps ``[0, cpl)``."""
        r, n, ps = req.req_pool_idx, req.seq_len, self.sizes.page_size
        row = self.req_to_token[r, :n].cpu()
        if checkpoint:
            keys, dups = self.tree.checkpoint(req.token_keys(n), row, req.cpl // ps)
            for j, _ in dups:
                self.allocator.free(row[j * ps : (j + 1) * ps])
            self.tree.lock(keys)
            self.tree.unlock(req.locked)
            req.locked, req.cpl = keys, len(keys) * ps
        if n > req.cpl:
            self.allocator.free(row[req.cpl :])
        self.tree.unlock(req.locked)
        req.locked, req.cpl = [], 0

    # -- one decode step ------------------------------------------------------------------------
    def step(self, pad_to: int | None = None) -> None:
        """One decode step for every running request (see the module docstring)."""
        batch = list(self.running)
        if not batch:
            return
        if self.compress_ratio > 1:
            self._step_compressed(batch, pad_to)
            return
        dev, bs = self.device, len(batch)
        seq_cpu = torch.tensor([q.seq_len + 1 for q in batch], dtype=torch.int64)
        req_cpu = torch.tensor([q.req_pool_idx for q in batch], dtype=torch.int64)
        last = self.req_to_token[req_cpu.to(dev), seq_cpu.to(dev) - 2]
        if self.decode_alloc_rows:
            new_ids = self.allocator.alloc(bs)
        else:
            new_ids = self.allocator.alloc_decode(seq_cpu, last)
        if new_ids is None:
            raise RuntimeError("step: logical ids exhausted (retract_decode should have made room)")
        for q, nid in zip(batch, new_ids.tolist(), strict=True):
            q.seq_len += 1
            q.generated += 1
            self.req_to_token[q.req_pool_idx, q.seq_len - 1] = nid
        req_index, seq_lens = req_cpu.to(dev), seq_cpu.to(dev)
        mark = device_side if self.guard else (lambda x: x)
        with self._no_sync():
            # as the SGLang adapter: the CPU copy alloc() kept, None for alloc_decode's ids
            self.core.map_last_loc(
                req_index=mark(req_index), seq_lens=mark(seq_lens), new_logical=mark(new_ids),
                req_index_cpu=req_cpu.tolist(), seq_lens_cpu=seq_cpu.tolist(),
                new_logical_cpu=self.allocator.cpu_ids_of(new_ids),
            )
            self.core.wait_for_pending_backup()
        self.core.num_real_reqs.fill_(bs)
        width = max(pad_to or bs, bs)
        if width > bs:  # CUDA-graph padding: inert rows (slot 0, length 1), like SGLang's fill values
            req_index = torch.cat([req_index, torch.zeros(width - bs, dtype=torch.int64, device=dev)])
            seq_lens = torch.cat([seq_lens, torch.ones(width - bs, dtype=torch.int64, device=dev)])
        self._forward(batch, req_index, seq_lens, new_ids, width)
        self.steps += 1

    def _as_blocks(self, top_k: torch.Tensor, seq_lens: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A toy block indexer: the blocks of the toy's selected positions, in order of first
        selection, ``top_k / block_size`` of them (-1 padded); and, computed here for the
        oracle (not by ``expand_blocks``), the positions they stand for."""
        size, width = self.block_size, top_k.shape[1]
        n_blocks = width // size
        blocks = torch.full((top_k.shape[0], n_blocks), -1, dtype=torch.int32, device=top_k.device)
        positions = torch.full_like(top_k, -1)
        for b in range(bs):
            seen: list[int] = []
            for p in top_k[b].tolist():
                if p >= 0 and p // size not in seen and len(seen) < n_blocks:
                    seen.append(p // size)
            n = int(seq_lens[b])
            pos = [blk * size + j if blk * size + j < n else -1 for blk in seen for j in range(size)]
            blocks[b, : len(seen)] = torch.tensor(seen, dtype=torch.int32)
            positions[b, : len(pos)] = torch.tensor(pos, dtype=top_k.dtype)
        return blocks, positions

    def _step_compressed(self, batch: list[ToyRequest], pad_to: int | None) -> None:
        """A compressed layout (docs/v4-m3.md): every request generates a token, but gains an
        entry (a logical id, a write, a backup) only every ``compress_ratio`` tokens; the whole
        batch resolves over its entries every step (``map_last_loc(grows=)``)."""
        dev, bs, c = self.device, len(batch), self.compress_ratio
        grows = [(q.generated + 1) % c == 0 for q in batch]
        growing = [q for q, g in zip(batch, grows, strict=True) if g]
        new_ids = torch.empty(0, dtype=torch.int64, device=dev)
        if growing:
            seq_g = torch.tensor([q.seq_len + 1 for q in growing], dtype=torch.int64)
            req_g = torch.tensor([q.req_pool_idx for q in growing], dtype=torch.int64)
            new_ids = self.allocator.alloc_decode(seq_g, self.req_to_token[req_g.to(dev), seq_g.to(dev) - 2])
            if new_ids is None:
                raise RuntimeError("step: logical ids exhausted (retract_decode should have made room)")
            for q, nid in zip(growing, new_ids.tolist(), strict=True):
                q.seq_len += 1
                self.req_to_token[q.req_pool_idx, q.seq_len - 1] = nid
        for q in batch:
            q.generated += 1
        seq_cpu = [q.seq_len for q in batch]
        req_cpu = [q.req_pool_idx for q in batch]
        req_index = torch.tensor(req_cpu, dtype=torch.int64).to(dev)
        seq_lens = torch.tensor(seq_cpu, dtype=torch.int64).to(dev)
        with self._no_sync():
            self.core.map_last_loc(req_index=req_index, seq_lens=seq_lens, new_logical=new_ids,
                                   req_index_cpu=req_cpu, seq_lens_cpu=seq_cpu, grows=grows)
            self.core.wait_for_pending_backup()
        self.core.num_real_reqs.fill_(bs)
        width = max(pad_to or bs, bs)
        if width > bs:
            req_index = torch.cat([req_index, torch.zeros(width - bs, dtype=torch.int64, device=dev)])
            seq_lens = torch.cat([seq_lens, torch.ones(width - bs, dtype=torch.int64, device=dev)])
        self._forward(batch, req_index, seq_lens, new_ids, width,
                      writers=[b for b, g in enumerate(grows) if g])
        self.steps += 1

    def _forward(self, batch, req_index, seq_lens, new_ids, width, writers: list[int] | None = None) -> None:
        """``writers``: the batch rows whose new entry this forward writes (``new_ids`` in that
        order); None: every row (a compressed layout writes only on aligned steps)."""
        m, dev, bs = self.model, self.device, len(batch)
        writers = list(range(bs)) if writers is None else writers
        new_pos = torch.tensor([q.seq_len - 1 for q in batch], device=dev)
        top_k = torch.full((width, m.top_k), -1, dtype=torch.int32, device=dev)
        for layer in range(m.num_layers):
            # set_kv_buffer: the new entries' KV (and indexer keys) by logical id
            if writers:
                self.pool.write(layer, new_ids, torch.cat([
                    self._kv(batch[b], new_pos[b : b + 1], layer) for b in writers
                ]))
            if not m.shared[layer]:
                for j, b in enumerate(writers):
                    self.pool.write_index(layer, new_ids[j : j + 1], self._index_keys(batch[b], new_pos[b : b + 1], layer).view(torch.uint8))
                for b, q in enumerate(batch):
                    ids = self.req_to_token[q.req_pool_idx, : q.seq_len]
                    keys = self.pool.read_index(layer, ids).view(torch.float32)
                    top_k[b] = m.select(keys, q.seed, layer)
            if self.block_size:  # block top-k (MiniMax-M3): blocks of the selection, expanded
                blocks, top_k = self._as_blocks(top_k, seq_lens, bs)
                if self.fewer_blocks:
                    blocks = blocks[:, : blocks.shape[1] - self.fewer_blocks].contiguous()
                    top_k[:, blocks.shape[1] * self.block_size:] = -1
                rows = self.core.swap_in_blocks(req_index, seq_lens, blocks, layer, self.block_size)
                if rows.shape[1] < top_k.shape[1]:  # the narrower selection's rows, then none
                    rows = torch.cat([rows, rows.new_full((rows.shape[0], top_k.shape[1] - rows.shape[1]), -1)], 1)
            else:
                with self._no_sync() if dev.type == "cuda" else contextlib.nullcontext():
                    rows = self.core.swap_in(req_index, seq_lens, top_k, layer)
            if not self.check:
                continue
            if bool((rows[bs:] != -1).any()):
                raise Mismatch(f"layer {layer}: padding rows resolved to {rows[bs:].tolist()}, expected -1")
            valid = top_k[:bs] >= 0
            if not torch.equal(valid, rows[:bs] >= 0):
                raise Mismatch(f"layer {layer}: -1 pattern of rows {rows[:bs].tolist()} != top_k {top_k[:bs].tolist()}")
            got = m.attend(self.pool.read_rows(layer, rows[:bs].clamp(min=0).reshape(-1)).view(
                bs, -1, self.pool.item_bytes), valid)
            want_bytes = torch.stack([
                self._kv(q, top_k[b].clamp(min=0).long(), layer) for b, q in enumerate(batch)
            ])
            want = m.attend(want_bytes, valid)
            if not torch.equal(got, want):
                bad = [q.rid for b, q in enumerate(batch) if not torch.equal(got[b], want[b])]
                raise Mismatch(f"step {self.steps} layer {layer}: attention differs for requests {bad}")
            self.checked_outputs += bs

    def _no_sync(self) -> contextlib.AbstractContextManager:
        """``forbid_device_reads`` (with the CUDA sync debug mode on CUDA) when guarding."""
        if not self.guard:
            return contextlib.nullcontext()
        return forbid_device_reads(cuda=self.device.type == "cuda")

    def close(self) -> None:
        """Drain side streams and unpin the host pool (a later pool may reuse the address)."""
        self.core.destroy()
        self.host.destroy()

    # -- integrity ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every allocator and pool balances now (run after every step by the scenarios)."""
        self.allocator.check_integrity()
        self.host.check_integrity()
        held = sum(len(self.allocator.hot.pages(q.req_pool_idx)) for q in self.running)
        if held * self.sizes.page_size > self.allocator.rows.used_size():
            raise AssertionError(f"hot buffers hold {held} pages, more than the {self.allocator.rows.used_size()} rows in use")

    # -- leak check -----------------------------------------------------------------------------
    def check_no_leaks(self) -> None:
        """With no request alive: every allocator and pool is back to empty and consistent
        (radix mode: once the idle tree, which may keep pages, is evicted through the allocator)."""
        if self.tree is not None:
            self.tree.check()
            self.allocator.check_integrity()
            self.allocator.free(self.tree.evict(len(self.tree.nodes)))
        self.allocator.check_integrity()
        self.host.check_integrity()
        problems = []
        if self.allocator.logical.used_size():
            problems.append(f"{self.allocator.logical.used_size()} logical ids still used")
        if self.allocator.rows.used_size():
            problems.append(f"{self.allocator.rows.used_size()} device rows still used")
        if int(self.host.allocated_lens.sum()):
            problems.append(f"{int(self.host.allocated_lens.sum())} host-row positions still bound")
        if int(self.allocator._readers.abs().sum()) or self.allocator._held:
            problems.append(f"prefill pages still held by request slots {sorted(self.allocator._held)}")
        if int((self.allocator.mapping[:-1] != 0).sum()):
            problems.append("mapping entries left")
        st = self.core.state
        if any(p.value != "free" for p in st.phase) or bool((st.slot_rows != -1).any()):
            problems.append("coordinator state not reset")
        if self.core.has_ongoing_staging():
            problems.append("staging queue not empty")
        if problems:
            raise AssertionError("leaks after all requests ended: " + "; ".join(problems))


def _by_seed(fn, req: ToyRequest, pos: torch.Tensor, layer: int) -> torch.Tensor:
    """``fn(seed, pos, layer)`` rows of ``req``: the shared prefix's seed below ``shared_len``."""
    out = fn(req.seed, pos, layer)
    if req.shared_len:
        shared = pos < req.shared_len
        if bool(shared.any()):
            out = torch.where(shared[:, None], fn(req.prefix_seed, pos, layer), out)
    return out


def _pages(n: int, page_size: int) -> int:
    """Rows of the whole pages ``n`` rows occupy."""
    return -(-n // page_size) * page_size
