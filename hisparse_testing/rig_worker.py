"""The stand-ins of the real-scheduler rig: SGLang's model worker and model runner.

``StandInWorker`` replaces ``TpModelWorker`` (the one class of SGLang the rig swaps; see
``hisparse_testing.sglang_rig``). Its ``StandInRunner`` builds the pools with the kwargs SGLang's
``kv_cache_configurator`` passes (classes looked up in SGLang's modules, so the plugin's
replacements are what run), lets SGLang's own ``ModelRunner`` post-pool methods build the
n-gram manager and our coordinator, and runs a :class:`TokenModel` forward that makes the
calls SGLang's model runner and DSA backend make.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hisparse_testing.token_model import TokenModel

#: DeepSeek-V3.2-shaped config, tiny; ``index_topk`` and the layer count are set per rig
TOY_DSA_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_head_dim": 128,
    "index_n_heads": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
}


def pretend_sm90() -> None:
    """Stand in for the GPU query SGLang's DSA argument defaults make (compute capability,
    device name): on a CPU-only machine they would pick no DSA backend. Call before
    ``load_plugins()``."""
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"


def keep_overlap_for_speculative() -> None:
    """Stand in for the device the plugin runs on in SGLang's argument resolution: on a CPU
    device it turns the overlap scheduler off for speculative decoding
    (``speculative_hook._disable_overlap_schedule_for_cpu``: its CPU engine has no overlap
    path). On CUDA overlap is the default, and HiSparse with speculative decoding needs it
    (``arg_scope.check_serving_paths``). Call before ``prepare_server_args``."""
    from sglang.srt.arg_groups import speculative_hook

    speculative_hook._disable_overlap_schedule_for_cpu = lambda server_args: None


def allow_fake_transfer_with_decode_radix() -> None:
    """SGLang refuses its decode radix cache with the ``fake`` transfer backend (that backend
    moves no bytes, so a matched prefix means nothing to it); the rig's ``FakePrefill`` writes
    the bytes, so its PD decode radix group reads the backend as a real one while the PD flags
    are validated. Call before ``prepare_server_args``."""
    import functools

    from sglang.srt.arg_groups import pd_disaggregation_hook as pd

    from sglang_hisparse.sglang_adapter.radix_hooks import hidden

    step = pd.handle_pd_disaggregation

    @functools.wraps(step)
    def handle_pd_disaggregation(server_args: Any) -> None:
        with hidden(server_args, disaggregation_transfer_backend="mooncake"):
            step(server_args)

    pd.handle_pd_disaggregation = handle_pd_disaggregation


#: MiniMax-M3's head_dim in the rig's toy (one KV head: K and V rows of 64 bf16, 256 B together)
M3_HEAD_DIM = 64


def toy_m3_config(*, num_layers: int, top_k: int, block: int, index_values: bool = True) -> dict[str, Any]:
    """A MiniMax-M3 config (``is_minimax_sparse``): layer 0 dense, the rest sparse; each
    decode step selects ``top_k / block`` blocks, the indexer's ``top_k / block - 1`` and one
    forced local block (``arg_scope.m3_selection`` counts them). ``index_values`` False: every
    layer drops its index value (``sparse_disable_index_value``), which SGLang's PD transfer
    needs."""
    extra = {} if index_values else {"sparse_disable_index_value": [1] * num_layers}
    return {
        "architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax",
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": M3_HEAD_DIM, "num_hidden_layers": num_layers, "vocab_size": 1000,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "intermediate_size": 512,
        "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "sparse_attention_config": {
            "sparse_attention_freq": [0] + [1] * (num_layers - 1), "sparse_block_size": block,
            "sparse_topk_blocks": top_k // block - 1, "sparse_init_block": 0, "sparse_local_block": 1,
            "sparse_index_dim": 32, "sparse_num_index_heads": 1, **extra,
        },
    }


#: the V4 toy's layer pattern: compress ratio 4 at layers 0 and 2 (the C4 layers), 128 at 1 and 3
COMPRESS_RATIOS = (4, 128, 4, 128)


def toy_v4_config(*, top_k: int, base: dict[str, Any]) -> dict[str, Any]:
    """A config SGLang's ModelConfig reads as DeepSeek-V4 (``is_deepseek_v4``), from the rig's
    DSA toy config ``base``."""
    return dict(base, architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", index_topk=top_k,
                num_hidden_layers=len(COMPRESS_RATIOS), compress_ratios=list(COMPRESS_RATIOS), sliding_window=128,
                window_size=128, hidden_size=4096, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
                qk_nope_head_dim=448, v_head_dim=512, q_lora_rank=1024, o_lora_rank=1024, o_groups=8,
                max_position_embeddings=65536)


def write_toy_model(root: Path, *, num_layers: int, top_k: int, m3_block: int = 0, v4: bool = False,
                    m3_index_values: bool = True, **overrides: Any) -> Path:
    """A config-only model directory SGLang's ModelConfig accepts as a DSA model (or, with
    ``m3_block``, as MiniMax-M3: :func:`toy_m3_config`; with ``v4``, as DeepSeek-V4:
    :func:`toy_v4_config`)."""
    root.mkdir(parents=True, exist_ok=True)
    if v4:
        cfg = dict(toy_v4_config(top_k=top_k, base=TOY_DSA_CONFIG), **overrides)
    elif m3_block:
        cfg = dict(toy_m3_config(num_layers=num_layers, top_k=top_k, block=m3_block,
                                 index_values=m3_index_values), **overrides)
    else:
        cfg = dict(TOY_DSA_CONFIG, num_hidden_layers=num_layers, index_topk=top_k, **overrides)
    (root / "config.json").write_text(json.dumps(cfg))
    return root


# -- the stand-in model runner and worker ------------------------------------------------------
class StandInRunner:
    """What ``Scheduler`` and ``kv_cache_builder`` read of ``ModelRunner``, plus a
    :class:`TokenModel` forward (see the module docstring)."""

    def __init__(self, server_args: Any, model_config: Any, model: TokenModel, *,
                 device_rows: int, max_running_requests: int) -> None:
        from sglang.srt.runtime_context import get_memory, get_parallel, get_schedule, get_spec
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.server_args = server_args
        self.model_config = model_config
        self.toy = model
        self.device = "cpu"
        self.gpu_id = 0
        self.forward_stream = torch.get_device_module("cpu").Stream()
        self.enable_hisparse = bool(get_memory().enable_hisparse)
        self.spec_algorithm = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
        self.page_size = get_schedule().page_size
        self.pp_group = get_parallel().pp_group
        self.max_total_num_tokens = device_rows
        self.max_running_requests = max_running_requests
        self.hisparse_coordinator = None
        self.memory_pool_config = None
        self.req_to_token_pool = None
        self.token_to_kv_pool = None
        self.token_to_kv_pool_allocator = None
        self.is_hybrid_swa = False
        self.sliding_window_size = None
        self.mtp_draft_device_pools = None
        self.mtp_draft_mamba_pools = None
        self.weight_exporter = None
        self.weight_updater = None
        self.prefill_cuda_graph_runner = None
        self.device_timer = None
        self.kv_cache_dtype_str = "bfloat16"
        self.swa_max_total_num_tokens = None
        self.full_max_total_num_tokens = None
        self.canary_manager = None
        self.lora_manager = None
        self.eplb_manager = None
        self.ngram_embedding_manager = None
        self.attn_backend = None
        self.model = None
        self.graph_memory_usage = {}
        self.graph_time_usage = {}
        self.weight_load_time = 0.0
        self.preloaded_weights_bytes = 0
        self.weight_load_mem_usage = 0.0
        self._pending_elastic_scale_update = None
        self.prefill_aware_swa = False
        # what ForwardBatch.init_new reads (speculative verify builds one on this runner)
        self.is_draft_worker = False
        self.watermark_state = None
        self.prefill_attention_backend_str = server_args.prefill_attention_backend
        self.kv_index_translator = None
        self.decode_cuda_graph_runner = None
        #: int64 [logical ids + page]: the toy indexer's keys, addressed by logical location
        self.index_keys: torch.Tensor | None = None
        #: int64 [logical ids + page]: the token whose KV was last written at each location
        self.token_at: torch.Tensor | None = None
        #: pad decode batches to the next power of two, as the CUDA-graph runner pads to its
        #: captured sizes (padding rows: request slot 0, seq_len 1, top-k all -1)
        self.pad_decode = False
        #: PD over a real transfer engine (``hisparse_testing.rig_mooncake``): the indexer keys
        #: live in SGLang's own index-K buffer (what the transfer's DSA state moves), not only in
        #: :attr:`index_keys`, and a decode request's prompt tokens are read off the request
        self.wire = False

    # capacity SGLang reads back (model_runner.py max_token_pool_size & co.)
    @property
    def logical_max_total_num_tokens(self) -> int:
        return self.token_to_kv_pool_allocator.size

    effective_logical_max_total_num_tokens = logical_max_total_num_tokens

    @property
    def max_token_pool_size(self) -> int:
        return self.token_to_kv_pool_allocator.size_full if self.enable_hisparse else self.max_total_num_tokens

    def account_preloaded_weights(self, nbytes: int) -> None:
        return None

    def prewarm_sampling(self) -> None:
        return None

    def alloc_memory_pool(self, memory_pool_config: Any = None, **_: Any) -> None:
        """Build the pools as ``kv_cache_configurator`` does (``_build_dsa_kv_pool``,
        ``_build_token_to_kv_pool_allocator``, the plain ``ReqToTokenPool``)."""
        from sglang.srt.mem_cache import kv_cache_configurator as kvc
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.runtime_context import get_disagg, get_schedule

        cfg = self.model_config
        rows, R = self.max_total_num_tokens, self.max_running_requests
        disagg = get_disagg()
        if disagg.disaggregation_mode == "decode":  # _build_decode_req_pool
            from sglang.srt.disaggregation.decode import DecodeReqToTokenPool

            self.req_to_token_pool = DecodeReqToTokenPool(
                size=R, max_context_len=cfg.context_len + 4, device="cpu", enable_memory_saver=False,
                pre_alloc_size=disagg.disaggregation_decode_extra_slots or 0,
            )
        else:
            self.req_to_token_pool = ReqToTokenPool(
                size=R, max_context_len=cfg.context_len + 4, device="cpu", enable_memory_saver=False
            )
        pool_kwargs: dict[str, Any] = {}
        if self.toy.block_size:
            self.token_to_kv_pool = self._m3_pool(rows, R)
        elif self.enable_hisparse:
            from sglang.srt.mem_cache.sparsity import parse_hisparse_config

            pool_cls = kvc.HiSparseDSATokenToKVPool
            pool_kwargs["host_to_device_ratio"] = parse_hisparse_config().host_to_device_ratio
        else:
            pool_cls = kvc.DSATokenToKVPool
        if not self.toy.block_size:
            self.token_to_kv_pool = pool_cls(
                rows, page_size=get_schedule().page_size, dtype=torch.bfloat16,
                kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
                layer_num=self.toy.num_layers, device="cpu", kv_cache_dim=self.toy.kv_dim,
                enable_memory_saver=False, start_layer=0, end_layer=self.toy.num_layers,
                index_head_dim=128, index_kpool=1, index_kpool_compress=False,
                tail_extra_slots=0, max_running_requests=R, **pool_kwargs,
            )
        if self.enable_hisparse:
            from sglang.srt.mem_cache.sparsity import parse_hisparse_config

            self.token_to_kv_pool_allocator = kvc.HiSparseTokenToKVPoolAllocator(
                rows, page_size=get_schedule().page_size, dtype=torch.bfloat16, device="cpu",
                kvcache=self.token_to_kv_pool, need_sort=False,
                host_to_device_ratio=parse_hisparse_config().host_to_device_ratio,
            )
        else:
            self.token_to_kv_pool_allocator = kvc.PagedTokenToKVPoolAllocator(
                rows, page_size=get_schedule().page_size, dtype=torch.bfloat16, device="cpu",
                kvcache=self.token_to_kv_pool, need_sort=False,
            )
        logical = self.token_to_kv_pool_allocator.size
        self.index_keys = torch.zeros(logical + 2 * get_schedule().page_size, dtype=torch.int64)
        self.token_at = torch.zeros_like(self.index_keys)
        # SGLang's own post-pool wiring (model_runner.py), unbound on us: the n-gram manager
        # the scheduler consults every batch, the KV index translator ForwardBatch binds,
        # and the coordinator, built through the plugin's REPLACE of HiSparseCoordinator
        ModelRunner.init_ngram_embedding_manager(self)
        ModelRunner.init_kv_index_translator(self)
        ModelRunner.maybe_init_hisparse_coordinator(self)

    def _m3_pool(self, rows: int, R: int) -> Any:
        """MiniMax-M3's pool as ``kv_cache_configurator._build_minimax_sparse_kv_pool`` builds it
        (SGLang's ``MiniMaxSparseKVPool``, whose HiSparse main pool is the plugin's)."""
        from sglang.srt.configs.model_config import (
            get_minimax_sparse_attention_config,
            get_minimax_sparse_disable_value_layer_ids,
            get_minimax_sparse_layer_ids,
        )
        from sglang.srt.mem_cache import kv_cache_configurator as kvc
        from sglang.srt.runtime_context import get_schedule

        sparse_cfg = get_minimax_sparse_attention_config(self.model_config.hf_config)
        dense, sparse = get_minimax_sparse_layer_ids(sparse_cfg)
        extra: dict[str, Any] = {}
        if self.enable_hisparse:
            from sglang.srt.mem_cache.sparsity import parse_hisparse_config

            extra["host_to_device_ratio"] = parse_hisparse_config().host_to_device_ratio
        return kvc.MiniMaxSparseKVPool(
            size=rows, page_size=get_schedule().page_size, dtype=torch.bfloat16, index_dtype=torch.bfloat16,
            head_num=1, head_dim=self.toy.nope_dim, idx_head_dim=sparse_cfg["sparse_index_dim"],
            dense_layer_ids=dense, sparse_layer_ids=sparse, device="cpu", enable_memory_saver=False,
            disable_value_sparse_layer_ids=get_minimax_sparse_disable_value_layer_ids(sparse_cfg),
            start_layer=0, end_layer=self.toy.num_layers, enable_hisparse=self.enable_hisparse, **extra,
        )

    # -- the forward ------------------------------------------------------------------------
    def forward(self, batch: Any) -> list[int]:
        """One forward of a ``ScheduleBatch``: the next token of every request in it.

        Extend (prefill, chunked or not): the new tokens' KV and index keys are written
        through the pool (logical ids translated to device rows), then each request's
        selection reads its rows through ``translate_loc_to_hisparse_device``, as the DSA
        prefill does. Decode: ``wait_for_pending_backup`` and ``num_real_reqs`` as
        ``ModelRunner`` does, the new token's KV written, then per layer the indexer's
        top-k resolved by ``swap_in_selected_pages`` as the DSA backend does."""
        mode = batch.forward_mode
        if mode.is_idle() or not batch.reqs:
            return []
        if mode.is_decode():
            return self._decode(batch)
        if mode.is_extend():
            return self._extend(batch)
        raise NotImplementedError(f"stand-in runner: forward mode {mode} is not modelled")

    def _tokens_of(self, req: Any) -> torch.Tensor:
        return torch.tensor(list(req.origin_input_ids) + list(req.output_ids), dtype=torch.int64)

    def _write(self, locs: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        pool, toy = self.token_to_kv_pool, self.toy
        for layer in range(toy.num_layers):
            kv = toy.kv(tokens, positions, layer)[:, None, :]
            k, v = kv[..., : toy.nope_dim].contiguous(), kv[..., toy.nope_dim:].contiguous()
            if toy.block_size:  # M3: MHA K and V (the sparse layers' through our main pool)
                pool.set_kv_buffer(_Layer(layer), locs, k, v)
            else:
                pool.set_mla_kv_buffer(_Layer(layer), locs, k, v)
        self.index_keys[locs.to(torch.int64)] = self.toy.index_key(tokens, positions)
        self.token_at[locs.to(torch.int64)] = tokens
        if self.wire:
            keys, at = self._pool_keys(locs.to(torch.int64))
            keys[at] = self.toy.index_key(tokens, positions)

    def _pool_keys(self, locs: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(int64 [pages, page_size] view, the index of ``locs`` in it): the toy's key of a
        location sits in the first 8 bytes of its token's 128-byte slot in layer 0 of SGLang's
        index-K buffer (a page row holds ``page_size`` keys, then their scales:
        ``IndexKeyCache``'s layout).

        NOTE: a stand-in for ``SetKAndS`` / ``GetKAndS`` (Triton only): the bytes sit where the
        indexer's quantized keys sit, so the PD transfer's DSA state moves them page by page."""
        pool = self.token_to_kv_pool
        buf = pool.index_key_cache.buffer[0]
        ps, head = pool.page_size, pool.index_head_dim
        keys = buf[:, : ps * head].view(buf.shape[0], ps, head)[:, :, :8].view(torch.int64)[..., 0]
        return keys, (locs // ps, locs % ps)

    def _keys(self, r: int, n: int) -> torch.Tensor:
        locs = self.req_to_token_pool.req_to_token[r, :n].to(torch.int64)
        if self.wire:
            keys, at = self._pool_keys(locs)
            return keys[at]
        return self.index_keys[locs]

    def _select(self, r: int, n: int, last_token: int, layer: int) -> torch.Tensor:
        return self.toy.positions(self._keys(r, n), last_token, layer)

    def _gather(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        pool = self.token_to_kv_pool
        rows = rows.to(torch.int64)
        if self.toy.block_size:  # M3: the layer's K then V (dense pool or our main pool)
            k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
            at = rows.clamp(min=0)
            out = torch.cat([k[at].reshape(*rows.shape, -1), v[at].reshape(*rows.shape, -1)], -1)
            out[rows < 0] = 0
            return out
        buf = pool.kv_buffer[layer]
        out = buf[rows.clamp(min=0)].reshape(*rows.shape, -1).clone()
        out[rows < 0] = 0
        return out

    def _check(self, tokens: torch.Tensor, sel: torch.Tensor, got: torch.Tensor, layer: int,
               what: str) -> None:
        """``got`` holds the toy's KV of the selected positions ``sel``; ``tokens[p]`` is the
        token at position ``p`` (the request's tokens, or :attr:`token_at` of its locations)."""
        ok = sel >= 0
        p = sel[ok].to(torch.int64)
        want = self.toy.kv(tokens[p], p, layer)
        if not torch.equal(got[ok].view(torch.int16), want.view(torch.int16)):
            bad = (got[ok].view(torch.int16) != want.view(torch.int16)).any(1).nonzero()[:, 0]
            raise AssertionError(
                f"{what} layer {layer}: {bad.numel()} of {p.numel()} selected rows hold the wrong KV "
                f"(first positions {p[bad[:8]].tolist()})"
            )

    def _full_kv_rows(self, req_index: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        """HiSparse off: the locations of ``top_k`` ([bs, ...] positions; -1 stays -1)."""
        rt = self.req_to_token_pool.req_to_token[req_index.to(torch.int64)]
        flat = top_k.reshape(top_k.shape[0], -1).clamp(min=0).to(torch.int64)
        return torch.where(top_k >= 0, torch.gather(rt, 1, flat).view_as(top_k), -1)

    def _extend(self, batch: Any) -> list[int]:
        toy, pool = self.toy, self.token_to_kv_pool
        locs = batch.out_cache_loc.to(torch.int64)
        tokens = torch.as_tensor(batch.input_ids).to(torch.int64).reshape(-1)
        positions = torch.cat([
            torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(batch.prefix_lens, batch.extend_lens, strict=True)
        ])
        self._write(locs, tokens, positions)
        out = []
        for i, req in enumerate(batch.reqs):
            r, n = int(req.kv.req_pool_idx), int(batch.prefix_lens[i]) + int(batch.extend_lens[i])
            req_tokens = self._tokens_of(req)
            last = int(req_tokens[n - 1])
            gathered, sel = [], None
            for layer in range(toy.num_layers):
                if not toy.shared[layer]:
                    sel = self._select(r, n, last, layer)
                logical = self.req_to_token_pool.req_to_token[r, sel.clamp(min=0).to(torch.int64)].to(torch.int64)
                logical = torch.where(sel >= 0, logical, -1)
                rows = pool.translate_loc_to_hisparse_device(logical) if self._hisparse_layer(layer) else logical
                got = self._gather(layer, rows)
                self._check(req_tokens, sel, got, layer, f"prefill: request {req.rid}")
                gathered.append(got)
            out.append(toy.next_token(gathered))
        return out

    def _hisparse_layer(self, layer: int) -> bool:
        """Whether ``layer``'s KV goes through HiSparse (every DSA layer; M3's sparse ones)."""
        return self.enable_hisparse and (not self.toy.block_size or self.toy.selects_blocks(layer))

    def _decode(self, batch: Any) -> list[int]:
        toy = self.toy
        bs = len(batch.reqs)
        coord = self.hisparse_coordinator
        if coord is not None:
            coord.wait_for_pending_backup()
            coord.num_real_reqs.fill_(bs)
        seq_lens = batch.seq_lens.to(torch.int64)
        locs = batch.out_cache_loc.to(torch.int64)
        tokens = torch.as_tensor(batch.input_ids).to(torch.int64).reshape(-1)
        if self.wire:
            self._wire_prompts(batch)
        self._write(locs, tokens, seq_lens - 1)
        gathered: list[list[torch.Tensor]] = [[] for _ in range(bs)]
        # tokens by logical location (token_at): under the overlap scheduler output_ids lag
        req_tokens = self._tokens_at(batch.req_pool_indices)
        topk = None
        for layer in range(toy.num_layers):
            if not toy.shared[layer]:
                topk = torch.stack([
                    self._select(int(req.kv.req_pool_idx), int(seq_lens[i]), int(tokens[i]), layer)
                    for i, req in enumerate(batch.reqs)
                ])
            if coord is not None and toy.selects_blocks(layer):
                # M3 (minimax_sparse_backend._hisparse_swap_in_blocks): block ids, token lengths
                blocks = torch.stack([
                    toy.select_blocks(self._keys(int(req.kv.req_pool_idx), int(seq_lens[i])), int(tokens[i]), layer)
                    for i, req in enumerate(batch.reqs)
                ])
                rows = coord.swap_in_selected_blocks(
                    req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, top_k_blocks=blocks,
                    layer_id=layer, sparse_block_size=toy.block_size,
                )
            elif coord is not None and self._hisparse_layer(layer):
                ri, sl, tk = batch.req_pool_indices, batch.seq_lens, topk
                if self.pad_decode:
                    ri, sl, tk = _pad_rows(ri, sl, tk)
                rows = coord.swap_in_selected_pages(ri, sl, tk, layer)
                if self.pad_decode and (rows[bs:] != -1).any():
                    raise AssertionError(f"decode: padding rows {bs}..{rows.shape[0] - 1} were not left inert (-1)")
            else:
                rows = self._full_kv_rows(batch.req_pool_indices, topk)
            got = self._gather(layer, rows[:bs])
            for i, req in enumerate(batch.reqs):
                self._check(req_tokens[i], topk[i], got[i], layer, f"decode: request {req.rid}")
                gathered[i].append(got[i])
        return [toy.next_token(g) for g in gathered]

    def verify(self, fb: Any) -> torch.Tensor:
        """A speculative target-verify forward (``ForwardMode.TARGET_VERIFY``) of W tokens per
        request (the bonus token and W-1 drafts at positions ``seq_len .. seq_len+W-1``):
        ``num_real_reqs`` as ``ModelRunner`` sets it for an eager forward, the W tokens' KV
        written through the pool, then per layer every row's top-k resolved at once by
        ``swap_in_selected_pages`` with ``[bs, W, k]`` and the expanded lengths, as the DSA
        backend does. Returns the greedy token of each of the ``bs * W`` rows.

        The KV check reads tokens by logical location (:attr:`token_at`): under the overlap
        scheduler a request's ``output_ids`` lag the device by one round."""
        toy = self.toy
        coord = self.hisparse_coordinator
        bs = int(fb.req_pool_indices.shape[0])
        tokens = fb.input_ids.to(torch.int64).reshape(-1)
        w = tokens.numel() // bs
        if coord is not None:
            coord.num_real_reqs.fill_(bs)
        seq = fb.seq_lens.to(torch.int64)
        positions = (seq[:, None] + torch.arange(w)).reshape(-1)
        self._write(fb.out_cache_loc.to(torch.int64), tokens, positions)
        req = fb.req_pool_indices.to(torch.int64)
        lens = (seq[:, None] + 1 + torch.arange(w))  # row j of a request sees s + 1 + j tokens
        gathered: list[list[torch.Tensor]] = [[] for _ in range(bs * w)]
        req_tokens = self._tokens_at(req)
        topk = None
        for layer in range(toy.num_layers):
            if not toy.shared[layer]:
                topk = torch.stack([
                    torch.stack([
                        self._select(int(req[i]), int(lens[i, j]), int(tokens[i * w + j]), layer)
                        for j in range(w)
                    ]) for i in range(bs)
                ])
            if coord is not None:
                rows = coord.swap_in_selected_pages(fb.req_pool_indices, lens.reshape(-1), topk, layer)
            else:
                rows = self._full_kv_rows(req, topk)
            got = self._gather(layer, rows.reshape(bs, w, -1))
            for i in range(bs):
                for j in range(w):
                    self._check(req_tokens[i], topk[i, j], got[i, j], layer, f"verify row {j} of slot {int(req[i])}")
                    gathered[i * w + j].append(got[i, j])
        return torch.tensor([toy.next_token(g) for g in gathered], dtype=torch.int64)

    def _wire_prompts(self, batch: Any) -> None:
        """Over a real transfer the prompt's KV arrived by the wire: the oracle's tokens at its
        locations come from the request (what the router sent both instances)."""
        for req in batch.reqs:
            n = len(req.origin_input_ids)
            locs = self.req_to_token_pool.req_to_token[int(req.kv.req_pool_idx), :n].to(torch.int64)
            self.token_at[locs] = torch.tensor(list(req.origin_input_ids), dtype=torch.int64)

    def _tokens_at(self, req_index: torch.Tensor) -> torch.Tensor:
        """[bs, max_ctx] the token last written at each position's logical location."""
        locs = self.req_to_token_pool.req_to_token[req_index.to(torch.int64)].to(torch.int64)
        return self.token_at[locs]


class StandInWorker:
    """Stands in for ``TpModelWorker`` (same constructor); see the module docstring."""

    #: set by :class:`Rig` before the scheduler is built
    toy: TokenModel | None = None
    device_rows: int = 0
    #: the stand-in runner class (the V4 rig's ``rig_v4.V4StandInRunner`` builds SGLang's V4 pools)
    runner_cls: type = None  # type: ignore[assignment]

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, **_: Any) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.runtime_context import get_parallel, get_schedule

        self.server_args = server_args
        self.gpu_id = gpu_id
        self.model_config = ModelConfig.from_server_args(server_args)
        R = get_schedule().max_running_requests
        self._runner = (self.runner_cls or StandInRunner)(server_args, self.model_config, self.toy,
                                     device_rows=self.device_rows, max_running_requests=R)
        self.device = "cpu"
        self.pp_group = get_parallel().pp_group
        self.world_group = get_parallel().world_group
        self.random_seed = 0
        self.model_runner_list: list[Any] = []
        self.tokenizer = self.processor = None
        self.enable_overlap = False
        self.enable_spec = False

    @property
    def model_runner(self) -> StandInRunner:
        return self._runner

    # what Scheduler.init_model_worker & co. call
    def start_startup_weight_load(self) -> None:
        return None

    def finalize_startup_weight_load(self) -> None:
        return None

    @property
    def preloaded_weights_bytes(self) -> int:
        return 0

    @property
    def weight_load_time(self) -> float:
        return 0.0

    @property
    def graph_memory_usage(self) -> dict:
        return {}

    @property
    def graph_time_usage(self) -> dict:
        return {}

    @property
    def is_hybrid_swa(self) -> bool:
        return False

    @property
    def sliding_window_size(self) -> None:
        return None

    def alloc_memory_pool(self, *args: Any, **kwargs: Any) -> None:
        self._runner.alloc_memory_pool()

    def init_attention_backends(self) -> None:
        return None

    def init_cuda_graphs(self, capture_decode_cuda_graph: bool = True) -> None:
        return None

    def get_memory_pool(self) -> tuple[Any, Any]:
        return self._runner.req_to_token_pool, self._runner.token_to_kv_pool_allocator

    def get_pad_input_ids_func(self) -> None:
        return None

    def register_hisparse_coordinator(self, coordinator: Any) -> None:
        self._runner.hisparse_coordinator = coordinator

    def get_worker_info(self) -> tuple:
        from sglang.srt.runtime_context import get_schedule

        r = self._runner
        cap = r.effective_logical_max_total_num_tokens
        max_req_len = min(self.model_config.context_len - 1, cap - 1)
        return (
            r.logical_max_total_num_tokens, get_schedule().max_prefill_tokens,
            r.max_running_requests, get_schedule().max_queued_requests, max_req_len,
            max_req_len - 5, self.random_seed, self.device, r.forward_stream,
            r.req_to_token_pool.size, r.req_to_token_pool.max_context_len,
            r.token_to_kv_pool.size,
        )

    def forward_batch_generation(self, batch: Any, *args: Any, forward_batch: Any = None,
                                 is_verify: bool = False, **kwargs: Any) -> Any:
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        if is_verify:  # run_eagle_verify: logits whose argmax is the toy's greedy token
            tokens = self._runner.verify(forward_batch)
            logits = torch.zeros(tokens.numel(), self.model_config.vocab_size)
            logits[torch.arange(tokens.numel()), tokens] = 1.0
            hidden = torch.zeros(tokens.numel(), self.model_config.hidden_size, dtype=torch.bfloat16)
            return GenerationBatchResult(
                logits_output=LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden),
                can_run_cuda_graph=False,
            )
        tokens = self._runner.forward(batch)
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None),
            next_token_ids=torch.tensor(tokens, dtype=torch.int64),
            can_run_cuda_graph=False,
        )


def _pad_rows(req_index: torch.Tensor, seq_lens: torch.Tensor, top_k: torch.Tensor):
    """The decode inputs padded as ``DecodeCudaGraphRunner`` pads a batch to a captured size."""
    bs = req_index.shape[0]
    padded = 1 << max(bs - 1, 0).bit_length()
    if padded == bs:
        return req_index, seq_lens, top_k
    extra = padded - bs
    return (
        torch.cat([req_index, torch.zeros(extra, dtype=req_index.dtype)]),
        torch.cat([seq_lens, torch.ones(extra, dtype=seq_lens.dtype)]),
        torch.cat([top_k, torch.full((extra, top_k.shape[1]), -1, dtype=top_k.dtype)]),
    )


@dataclass(frozen=True)
class _Layer:
    """What ``set_mla_kv_buffer`` reads of a ``RadixAttention`` layer."""

    layer_id: int


