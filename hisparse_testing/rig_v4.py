"""The real-scheduler rig's toy DeepSeek-V4: C4 compressed entries through HiSparse (docs/v4-m3.md).

A token-level toy whose sparse layers read compressed entries, one per 4 tokens, as V4's C4
layers do, and the stand-in runner that builds SGLang 0.5.23's own V4 pools around ours::

    SGLang's DeepSeekV4TokenToKVPool (enable_hisparse)   its C4 pool: our HiSparseC4Pool
    SGLang's SWATokenToKVPoolAllocator (256-token pages)  wrapped by our HiSparseV4Allocator
    ModelRunner.maybe_init_hisparse_coordinator          our coordinator's V4 branch

The forward does what V4's compressor and indexer do with the pools: an entry is written
when its 4-token group completes (prefill: every completed group of the extend; decode: when
``seq_len % 4 == 0``), through the C4 pool's ``_translate_loc_to_hisparse_device`` of its
compressed id; prefill reads the selected entries through ``translate_loc_to_hisparse_device``;
decode fills ``raw_indices_buffer`` and calls ``swap_in_selected_pages(req_pool_indices,
seq_len // 4, raw_indices, C4 layer)``. Every entry read is checked against the toy's bytes
(from the tokens at its locations); the next token hashes the selected entries, so a wrong
row changes the output. The SWA, C128 and indexer pools are built and left unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hisparse_testing.rig_worker import COMPRESS_RATIOS, StandInRunner
from hisparse_testing.token_model import TokenModel
from hisparse_testing.toy_model import _mix
from sglang_hisparse.kernels.row_layout import C4_PAGED

__all__ = ["C4TokenModel", "V4StandInRunner"]

RATIO = 4
_MASK = (1 << 62) - 1


@dataclass(frozen=True)
class C4TokenModel:
    """Entries are pure functions of their 4 tokens, position and C4 layer. ``top_k`` entries
    a step per C4 layer (``c4_layers`` of them)."""

    top_k: int
    c4_layers: int = 2
    vocab: int = 1000

    def _group_hash(self, groups: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        g = groups.to(torch.int64)
        return _mix(g[:, 0] * 0x9E3779B1 + g[:, 1] * 0x85EBCA77 + g[:, 2] * 0xC2B2AE3D + g[:, 3] * 0x27D4EB2F
                    + c.to(torch.int64) * 0x165667B1 + 11)

    def entry(self, groups: torch.Tensor, c: torch.Tensor, layer: int) -> torch.Tensor:
        """uint8 [m, 592]: the entry of each 4-token group ``groups`` [m, 4] at compressed
        position ``c`` [m] in C4 layer ``layer``; bytes 584.. zero (the layout stores 584)."""
        h = self._group_hash(groups, c)[:, None] + layer * 0x632BE5AB
        j = torch.arange(C4_PAGED.data + C4_PAGED.tail, dtype=torch.int64)
        out = torch.zeros((groups.shape[0], C4_PAGED.host_item()), dtype=torch.uint8)
        out[:, : j.numel()] = (_mix(h * 31 + j) & 0xFF).to(torch.uint8)
        return out

    def keys(self, groups: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """int64 [m]: the indexer key of each entry."""
        return _mix(self._group_hash(groups, c) ^ 0x1B873593)

    def select(self, keys: torch.Tensor, last_token: int, layer: int) -> torch.Tensor:
        """int32 [top_k] compressed positions over ``keys`` [clen] (-1 padded)."""
        return TokenModel(num_layers=self.c4_layers, top_k=self.top_k).select(keys, last_token, layer)

    def next_token(self, gathered: list[torch.Tensor]) -> int:
        acc = 0
        for layer, rows in enumerate(gathered):
            words = rows.to(torch.int64)
            col = torch.arange(1, rows.shape[0] + 1, dtype=torch.int64)[:, None]
            acc = (acc * 1_000_003 + int((words * col).sum()) + layer) & _MASK
        return int(_mix(torch.tensor([acc]))[0]) % self.vocab

    def full_kv_step(self, tokens: list[int]) -> int:
        """The next token after ``tokens`` with every entry recomputed (HiSparse off;
        ``token_model.reference_generate`` steps it)."""
        t = torch.tensor(tokens, dtype=torch.int64)
        clen = len(tokens) // RATIO
        groups, c = t[: clen * RATIO].view(clen, RATIO), torch.arange(clen)
        keys = self.keys(groups, c)
        gathered = []
        for layer in range(self.c4_layers):
            sel = self.select(keys, tokens[-1], layer)
            rows = torch.zeros((self.top_k, C4_PAGED.host_item()), dtype=torch.uint8)
            ok = sel >= 0
            p = sel[ok].to(torch.int64)
            rows[ok] = self.entry(groups[p], p, layer)
            gathered.append(rows)
        return self.next_token(gathered)


class V4StandInRunner(StandInRunner):
    """The stand-in runner over SGLang's own V4 pools (module docstring)."""

    def alloc_memory_pool(self, memory_pool_config: Any = None, **_: Any) -> None:
        """The pools as ``kv_cache_configurator`` builds them for V4 under HiSparse: C4 device
        rows ``device_rows``, the token spaces ``device_rows x 4 x host_to_device_ratio``."""
        import sglang.srt.mem_cache.deepseek_v4_memory_pool as dsv4
        from sglang.srt.mem_cache import kv_cache_configurator as kvc
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.sparsity import parse_hisparse_config
        from sglang.srt.model_executor.model_runner import ModelRunner

        R, c4_rows = self.max_running_requests, self.max_total_num_tokens
        full = c4_rows * RATIO * parse_hisparse_config().host_to_device_ratio
        self.req_to_token_pool = ReqToTokenPool(size=R, max_context_len=self.model_config.context_len + 4,
                                                device="cpu", enable_memory_saver=False)
        self.token_to_kv_pool = dsv4.DeepSeekV4TokenToKVPool(
            max_num_reqs=R, swa_size=full, c4_size=c4_rows, c128_size=full // 128, c4_state_pool_size=256,
            c128_state_pool_size=256, page_size=256, swa_page_size=256, dtype=torch.float8_e4m3fn,
            c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
            indexer_head_dim=128, layer_num=len(COMPRESS_RATIOS), device="cpu", enable_memory_saver=False,
            compression_ratios=list(COMPRESS_RATIOS), sliding_window=128, enable_hisparse=True, num_req_slots=R + 1,
            full_size=full)
        swa = SWATokenToKVPoolAllocator(full, full, page_size=256, dtype=torch.float8_e4m3fn, device="cpu",
                                        kvcache=self.token_to_kv_pool, need_sort=False,
                                        req_to_token_pool=self.req_to_token_pool)
        # kv_cache_configurator's wrap, the name the plugin rebinds to our HiSparseV4Allocator
        self.token_to_kv_pool_allocator = kvc.DeepSeekV4HiSparseTokenToKVPoolAllocator(swa)
        self.is_hybrid_swa, self.sliding_window_size = True, 128
        self.swa_max_total_num_tokens = self.full_max_total_num_tokens = full
        self.token_at = torch.zeros(swa.size_full + 2 * 256, dtype=torch.int64)
        ModelRunner.init_ngram_embedding_manager(self)
        ModelRunner.init_kv_index_translator(self)
        ModelRunner.maybe_init_hisparse_coordinator(self)

    @property
    def max_token_pool_size(self) -> int:
        return self.token_to_kv_pool_allocator.size_full

    # -- the forward ------------------------------------------------------------------------
    def _c4(self) -> Any:
        return self.token_to_kv_pool.c4_kv_pool

    def _groups(self, r: int, clen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [clen, 4], group-end locations [clen]) of request slot ``r``'s first entries."""
        locs = self.req_to_token_pool.req_to_token[r, : clen * RATIO].to(torch.int64).view(clen, RATIO)
        return self.token_at[locs], locs[:, -1]

    def _write_entries(self, r: int, first: int, clen: int) -> None:
        """The compressor: entries ``first .. clen - 1`` of slot ``r`` at their device rows."""
        if clen <= first:
            return
        groups, ends = self._groups(r, clen)
        c = torch.arange(first, clen)
        c4 = self._c4()
        rows = c4._translate_loc_to_hisparse_device(ends[first:] // RATIO)
        for layer in range(self.toy.c4_layers):
            C4_PAGED.write(c4.kv_buffer[layer], rows, self.toy.entry(groups[first:], c, layer))

    def _read_check(self, layer: int, rows: torch.Tensor, sel: torch.Tensor, groups: torch.Tensor,
                    what: str) -> torch.Tensor:
        """The selected entries' bytes at device ``rows`` (int [k], -1 = none), checked."""
        out = torch.zeros((sel.numel(), C4_PAGED.host_item()), dtype=torch.uint8)
        ok = sel >= 0
        if bool(ok.any()):
            got = C4_PAGED.read(self._c4().kv_buffer[layer], rows[ok].to(torch.int64))
            p = sel[ok].to(torch.int64)
            want = self.toy.entry(groups[p], p, layer)
            if not torch.equal(got, want):
                bad = (got != want).any(1).nonzero()[:, 0]
                raise AssertionError(f"{what} C4 layer {layer}: {bad.numel()} of {p.numel()} selected entries "
                                     f"hold the wrong bytes (first positions {p[bad[:8]].tolist()})")
            out[ok] = got
        return out

    def _extend(self, batch: Any) -> list[int]:
        locs = batch.out_cache_loc.to(torch.int64)
        self.token_at[locs] = torch.as_tensor(batch.input_ids).to(torch.int64).reshape(-1)
        out = []
        c4 = self._c4()
        for i, req in enumerate(batch.reqs):
            r = int(req.kv.req_pool_idx)
            prefix, n = int(batch.prefix_lens[i]), int(batch.prefix_lens[i]) + int(batch.extend_lens[i])
            clen = n // RATIO
            self._write_entries(r, prefix // RATIO, clen)
            groups, ends = self._groups(r, clen)
            keys = self.toy.keys(groups, torch.arange(clen))
            last = int(self.token_at[self.req_to_token_pool.req_to_token[r, n - 1].to(torch.int64)])
            gathered = []
            for layer in range(self.toy.c4_layers):
                sel = self.toy.select(keys, last, layer)
                if clen == 0:  # under 4 tokens: no entry to select (FlashMLA reads none)
                    gathered.append(torch.zeros((sel.numel(), C4_PAGED.host_item()), dtype=torch.uint8))
                    continue
                compressed = torch.where(sel >= 0, ends[sel.clamp(min=0).to(torch.int64)] // RATIO, -1)
                rows = c4.translate_loc_to_hisparse_device(compressed)
                gathered.append(self._read_check(layer, rows, sel, groups, f"prefill: request {req.rid}"))
            out.append(self.toy.next_token(gathered))
        return out

    def _decode(self, batch: Any) -> list[int]:
        bs, coord = len(batch.reqs), self.hisparse_coordinator
        coord.wait_for_pending_backup()
        coord.num_real_reqs.fill_(bs)
        locs = batch.out_cache_loc.to(torch.int64)
        tokens = torch.as_tensor(batch.input_ids).to(torch.int64).reshape(-1)
        self.token_at[locs] = tokens
        seq = batch.seq_lens.to(torch.int64)
        for i, req in enumerate(batch.reqs):  # the compressor's write of a completed group
            if int(seq[i]) % RATIO == 0:
                self._write_entries(int(req.kv.req_pool_idx), int(seq[i]) // RATIO - 1, int(seq[i]) // RATIO)
        clens = seq // RATIO
        raw = coord.raw_indices_buffer
        per_req = [self._groups(int(req.kv.req_pool_idx), int(clens[i])) for i, req in enumerate(batch.reqs)]
        keys = [self.toy.keys(g, torch.arange(g.shape[0])) for g, _ in per_req]
        gathered: list[list[torch.Tensor]] = [[] for _ in range(bs)]
        for layer in range(self.toy.c4_layers):
            sels = [self.toy.select(keys[i], int(tokens[i]), layer) for i in range(bs)]
            raw[:bs] = torch.stack(sels)
            rows = coord.swap_in_selected_pages(batch.req_pool_indices, clens, raw[:bs], layer)
            for i, req in enumerate(batch.reqs):
                gathered[i].append(self._read_check(layer, rows[i], sels[i], per_req[i][0],
                                                    f"decode: request {req.rid}"))
        return [self.toy.next_token(g) for g in gathered]
