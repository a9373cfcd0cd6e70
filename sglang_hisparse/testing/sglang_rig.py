"""SGLang 0.5.23's real ``Scheduler`` on CPU, driving the plugin, with a stand-in model worker.

What runs for real: SGLang's argument pipeline (our validation hook included), ``Scheduler``
and everything it builds (input handling, ``get_next_batch_to_run``, schedule policy,
chunked prefill, ``run_batch``, the batch result processor, retraction, abort, the idle
memory self-check, PD decode's prealloc/transfer queues with the ``fake`` backend),
``ScheduleBatch.prepare_for_decode`` (which calls ``map_last_loc_to_buffer``),
``ReqToTokenPool``, and SGLang's own ``ModelRunner.maybe_init_hisparse_coordinator``, which
builds our coordinator through the plugin's REPLACE hooks. What is stood in for, and why:

```
TpModelWorker / ModelRunner   StandInWorker / StandInRunner: no weights, no attention backend,
                              no CUDA graphs on CPU. The runner builds the pools with the
                              kwargs kv_cache_configurator passes (the classes are looked up
                              in SGLang's modules, so the plugin's replacements are what run)
                              and runs a TokenModel forward making the calls SGLang's model
                              runner and DSA backend make: wait_for_pending_backup,
                              num_real_reqs.fill_, KV writes through the pool
                              (set_mla_kv_buffer: logical -> device translation), per layer
                              swap_in_selected_pages on decode, translate_loc_to_hisparse_device
                              on prefill.
sampling                      the stand-in returns the greedy token itself (TokenModel.next_token)
IPC sockets                   created for real; outputs are captured from send_to_detokenizer
```

:class:`Rig` submits ``TokenizedGenerateReqInput`` through ``process_input_requests`` and
steps ``event_loop_normal``'s body (or the PD decode loop's) one iteration at a time, so a
test can abort or inspect between steps.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sglang_hisparse.testing.token_model import TokenModel

logger = logging.getLogger("sglang_hisparse.rig")

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


def write_toy_model(root: Path, *, num_layers: int, top_k: int, **overrides: Any) -> Path:
    """A config-only model directory SGLang's ModelConfig accepts as a DSA model."""
    root.mkdir(parents=True, exist_ok=True)
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
        #: int64 [logical ids + page]: the toy indexer's keys, addressed by logical location
        self.index_keys: torch.Tensor | None = None
        #: pad decode batches to the next power of two, as the CUDA-graph runner pads to its
        #: captured sizes (padding rows: request slot 0, seq_len 1, top-k all -1)
        self.pad_decode = False

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
        if self.enable_hisparse:
            from sglang.srt.mem_cache.sparsity import parse_hisparse_config

            pool_cls = kvc.HiSparseDSATokenToKVPool
            pool_kwargs["host_to_device_ratio"] = parse_hisparse_config().host_to_device_ratio
        else:
            pool_cls = kvc.DSATokenToKVPool
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
        # SGLang's own post-pool wiring (model_runner.py), unbound on us: the n-gram manager
        # the scheduler consults every batch, and the coordinator, built through the
        # plugin's REPLACE of HiSparseCoordinator
        ModelRunner.init_ngram_embedding_manager(self)
        ModelRunner.maybe_init_hisparse_coordinator(self)

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
            pool.set_mla_kv_buffer(
                _Layer(layer), locs, kv[..., : toy.nope_dim].contiguous(), kv[..., toy.nope_dim:].contiguous()
            )
        self.index_keys[locs.to(torch.int64)] = self.toy.index_key(tokens, positions)

    def _select(self, r: int, n: int, last_token: int, layer: int) -> torch.Tensor:
        locs = self.req_to_token_pool.req_to_token[r, :n].to(torch.int64)
        return self.toy.select(self.index_keys[locs], last_token, layer)

    def _gather(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        buf = self.token_to_kv_pool.kv_buffer[layer]
        rows = rows.to(torch.int64)
        out = buf[rows.clamp(min=0)].reshape(*rows.shape, -1).clone()
        out[rows < 0] = 0
        return out

    def _check(self, req: Any, sel: torch.Tensor, got: torch.Tensor, layer: int, what: str) -> None:
        tokens = self._tokens_of(req)
        ok = sel >= 0
        p = sel[ok].to(torch.int64)
        want = self.toy.kv(tokens[p], p, layer)
        if not torch.equal(got[ok].view(torch.int16), want.view(torch.int16)):
            bad = (got[ok].view(torch.int16) != want.view(torch.int16)).any(1).nonzero()[:, 0]
            raise AssertionError(
                f"{what}: request {req.rid} layer {layer}: {bad.numel()} of {p.numel()} selected "
                f"rows hold the wrong KV (first positions {p[bad[:8]].tolist()})"
            )

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
            last = int(self._tokens_of(req)[n - 1])
            gathered, sel = [], None
            for layer in range(toy.num_layers):
                if not toy.shared[layer]:
                    sel = self._select(r, n, last, layer)
                logical = self.req_to_token_pool.req_to_token[r, sel.clamp(min=0).to(torch.int64)].to(torch.int64)
                logical = torch.where(sel >= 0, logical, -1)
                rows = pool.translate_loc_to_hisparse_device(logical) if self.enable_hisparse else logical
                got = self._gather(layer, rows)
                self._check(req, sel, got, layer, "prefill")
                gathered.append(got)
            out.append(toy.next_token(gathered))
        return out

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
        self._write(locs, tokens, seq_lens - 1)
        gathered: list[list[torch.Tensor]] = [[] for _ in range(bs)]
        topk = None
        for layer in range(toy.num_layers):
            if not toy.shared[layer]:
                topk = torch.stack([
                    self._select(int(req.kv.req_pool_idx), int(seq_lens[i]), int(tokens[i]), layer)
                    for i, req in enumerate(batch.reqs)
                ])
            if coord is not None:
                ri, sl, tk = batch.req_pool_indices, batch.seq_lens, topk
                if self.pad_decode:
                    ri, sl, tk = _pad_rows(ri, sl, tk)
                rows = coord.swap_in_selected_pages(ri, sl, tk, layer)
                if self.pad_decode and (rows[bs:] != -1).any():
                    raise AssertionError(f"decode: padding rows {bs}..{rows.shape[0] - 1} were not left inert (-1)")
            else:
                rt = self.req_to_token_pool.req_to_token[batch.req_pool_indices.to(torch.int64)]
                rows = torch.where(topk >= 0, torch.gather(rt, 1, topk.clamp(min=0).to(torch.int64)), -1)
            got = self._gather(layer, rows[:bs])
            for i, req in enumerate(batch.reqs):
                self._check(req, topk[i], got[i], layer, "decode")
                gathered[i].append(got[i])
        return [toy.next_token(g) for g in gathered]


class StandInWorker:
    """Stands in for ``TpModelWorker`` (same constructor); see the module docstring."""

    #: set by :class:`Rig` before the scheduler is built
    toy: TokenModel | None = None
    device_rows: int = 0

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, **_: Any) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.runtime_context import get_parallel, get_schedule

        self.server_args = server_args
        self.gpu_id = gpu_id
        self.model_config = ModelConfig.from_server_args(server_args)
        R = get_schedule().max_running_requests
        self._runner = StandInRunner(server_args, self.model_config, self.toy,
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

    def forward_batch_generation(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

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


# -- the rig --------------------------------------------------------------------------------------
@dataclass
class RigConfig:
    """One scheduler's setup. ``hisparse`` off runs the same stand-in over SGLang's plain DSA
    pool and paged allocator (the full-KV A/B)."""

    num_layers: int = 2
    top_k: int = 16
    buffer_size: int = 32
    host_to_device_ratio: int = 2
    device_rows: int = 2048
    max_running_requests: int = 8
    page_size: int = 64
    chunked_prefill_size: int | None = None
    hisparse: bool = True
    shared: tuple[bool, ...] = ()
    pad_decode: bool = False
    extra_args: tuple[str, ...] = ()

    def model(self) -> TokenModel:
        return TokenModel(num_layers=self.num_layers, top_k=self.top_k, shared=self.shared)

    def argv(self, model_dir: Path) -> list[str]:
        argv = [
            "--model-path", str(model_dir), "--skip-tokenizer-init", "--device", "cpu",
            "--disable-radix-cache", "--disable-overlap-schedule",
            "--max-running-requests", str(self.max_running_requests),
            "--page-size", str(self.page_size),
            "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
        ]
        if self.hisparse:
            argv += ["--enable-hisparse", "--hisparse-config", json.dumps({
                "top_k": self.top_k, "device_buffer_size": self.buffer_size,
                "host_to_device_ratio": self.host_to_device_ratio, "swap_in_block_size": 64,
            })]
        if self.chunked_prefill_size is not None:
            argv += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        return argv + list(self.extra_args)


@dataclass
class Finished:
    """One request's outcome as the scheduler reported it (``BatchTokenIDOutput``)."""

    rid: str
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None


class Rig:
    """A live ``Scheduler`` (see the module docstring). One per process: SGLang's parallel
    runtime and its published configuration are process-global."""

    def __init__(self, config: RigConfig, workdir: Path) -> None:
        import zmq
        from sglang.srt.managers import tp_worker
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import PortArgs, prepare_server_args

        self.config = config
        self.toy = config.model()
        model_dir = write_toy_model(workdir / "model", num_layers=config.num_layers, top_k=config.top_k)
        self.server_args = prepare_server_args(config.argv(model_dir))
        self.server_args.resolve_once()
        self.server_args.check_server_args()
        self.port_args = PortArgs.init_new(self.server_args)
        publish(self.server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
        # NOTE: the one patch of SGLang's own code: the model worker class the scheduler
        # instantiates (Scheduler.init_tp_model_worker imports it from tp_worker at call time).
        StandInWorker.toy, StandInWorker.device_rows = self.toy, config.device_rows
        tp_worker.TpModelWorker = StandInWorker  # type: ignore[misc]
        # the tokenizer manager's ends of the two sockets: it binds, the scheduler connects
        ctx = zmq.Context.instance()
        self._out = ctx.socket(zmq.PULL)
        self._out.bind(self.port_args.tokenizer_ipc_name)
        self._in = ctx.socket(zmq.PUSH)
        self._in.bind(self.port_args.scheduler_input_ipc_name)
        from sglang.srt.managers.scheduler import Scheduler

        self.scheduler = Scheduler(self.server_args, self.port_args)
        self.scheduler.tp_worker.model_runner.pad_decode = config.pad_decode
        self.results: dict[str, Finished] = {}
        self.steps = 0
        self.pd_decode = "--disaggregation-mode" in config.extra_args
        #: PD: bootstrap room -> prompt, for the stand-in prefill side (:class:`FakePrefill`)
        self.prefill = FakePrefill(self) if self.pd_decode else None

    # -- plumbing -------------------------------------------------------------------------
    @property
    def coordinator(self) -> Any:
        return self.scheduler.hisparse_coordinator

    def submit(self, rid: str, prompt: list[int], max_new_tokens: int) -> None:
        """A tokenized request, sent over the scheduler's real input socket (PD decode: with
        the fake backend's bootstrap host, so the fake receiver serves its transfer)."""
        from array import array

        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput, sock_send
        from sglang.srt.sampling.sampling_params import SamplingParams

        # what TokenizerManager does to the sampling params before it sends them
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        params.normalize(None)
        params.verify(self.toy.vocab)
        req = TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=array("q", prompt), input_embeds=None,
            mm_inputs=None, token_type_ids=None,
            sampling_params=params,
            return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
            token_ids_logprob=None, stream=False,
        )
        if self.prefill is not None:
            from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

            req.bootstrap_host, req.bootstrap_port = FAKE_BOOTSTRAP_HOST, 0
            req.bootstrap_room = self.prefill.register(rid, prompt)
        sock_send(self._in, req)
        self.results[rid] = Finished(rid)

    def abort(self, rid: str) -> None:
        from sglang.srt.managers.io_struct import AbortReq, sock_send

        sock_send(self._in, AbortReq(rid=rid))

    def _drain_outputs(self) -> None:
        import zmq
        from sglang.srt.managers.io_struct import BatchTokenIDOutput, sock_recv

        while True:
            try:
                out = sock_recv(self._out, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if not isinstance(out, BatchTokenIDOutput):
                continue
            for i, rid in enumerate(out.rids):
                res = self.results.setdefault(rid, Finished(rid))
                if out.output_ids is not None:  # deltas, as TokenizerManager accumulates them
                    res.output_ids.extend(out.output_ids[i])
                if out.finished_reasons[i] is not None:
                    res.finish_reason = out.finished_reasons[i]

    def step(self) -> bool:
        """One iteration of ``event_loop_normal``'s body; True when a batch ran."""
        import time

        s = self.scheduler
        time.sleep(0)  # let zmq deliver what was sent
        if self.pd_decode:  # event_loop_normal_disagg_decode's body
            s.disagg_decode_prealloc_queue.prefetch_prefill_dp_rank_queries()
            s.ingest_requests()
            s.process_decode_queue()
            plan = s.get_next_disagg_decode_batch_to_run(running_batch=s.running_batch)
            s.running_batch = plan.running_batch
            batch = s.ngram_embedding_manager.prepare_for_forward(plan.batch_to_run, chunked_req=s.chunked_req)
        else:
            s.ingest_requests()
            plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
            s.running_batch = plan.running_batch
            batch = plan.batch_to_run
        s.cur_batch_for_debug = batch
        if batch:
            result = s.run_batch(batch)
            s.process_batch_result(batch, result)
        else:
            s._sched_idled = True
            s.on_idle()
        s.last_batch = batch
        self._drain_outputs()
        self.steps += 1
        return bool(batch)

    def run_until_idle(self, max_steps: int = 10_000, on_step: Callable[[Rig], None] | None = None) -> None:
        """Step until every submitted request finished and the scheduler is idle."""
        idle = 0
        for _ in range(max_steps):
            ran = self.step()
            if on_step is not None:
                on_step(self)
            done = all(r.finish_reason is not None for r in self.results.values())
            idle = 0 if ran else idle + 1
            if done and idle >= 2:
                return
        pending = [r.rid for r in self.results.values() if r.finish_reason is None]
        raise AssertionError(f"rig: {len(pending)} requests unfinished after {max_steps} steps: {pending[:8]}")

    # -- checks ---------------------------------------------------------------------------
    def check_idle(self) -> None:
        """At idle: SGLang's own leak checks and ours.

        SGLang's ``on_idle`` skips its pool check under HiSparse (its in-tree pools' counters
        diverge during backup); ours must pass it, so the rig runs it explicitly, with
        ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE`` semantics (a leak raises)."""
        import dataclasses

        s = self.scheduler
        if not s.is_fully_idle():
            raise AssertionError("check_idle: the scheduler is not idle")
        stats = s.pool_stats_observer.get_pool_stats()
        coord = self.coordinator
        if coord is not None:
            # NOTE: the allocator's available_size() is an admission figure, min(free logical
            # ids, free device rows), and logical capacity is ratio x device rows, so at idle it
            # can never equal the total: that is why SGLang skips this check under HiSparse.
            # The conservation law it checks is about logical ids (what req_to_token holds), so
            # it gets the logical free count; device rows and host rows are checked below.
            stats = dataclasses.replace(stats, full_available_size=coord.dual.logical.available_size())
        has_leak, messages = s.invariant_checker._check_all_pools(stats)
        if has_leak:
            raise AssertionError("SGLang's idle pool check found a leak: " + " ".join(messages))
        free = len(s.req_to_token_pool.free_slots)
        if free != s.req_to_token_pool.size + s.req_to_token_pool.pre_alloc_size:
            raise AssertionError(f"req_to_token_pool leak: {free} free of {s.req_to_token_pool.size}")
        if coord is None:
            return
        alloc = s.token_to_kv_pool_allocator
        alloc.check_integrity()
        core = coord.core
        dual = coord.dual
        if dual.logical.available_size() != dual.size_full or dual.rows.available_size() != dual.size_device:
            raise AssertionError(
                f"idle: logical ids {dual.logical.available_size()}/{dual.size_full} and device rows "
                f"{dual.rows.available_size()}/{dual.size_device} free; everything must be free"
            )
        host = coord.host_pool
        host.check_integrity()
        if host.available_size() != host.size:
            raise AssertionError(f"idle: host pool {host.available_size()}/{host.size} rows free")
        busy = [r for r in range(core.state.num_reqs) if core.state.phase[r].value != "free"]
        if busy or core.has_ongoing_staging():
            raise AssertionError(f"idle: request slots {busy} not FREE (staging {core.has_ongoing_staging()})")


class FakePrefill:
    """Stands in for the prefill instance and the wire of a PD transfer.

    SGLang's ``fake`` backend moves no bytes. This wraps the decode prealloc queue's
    ``_send_kv_metadata`` (where the decode side publishes a request's destination host
    rows to its receiver): after it ran, the prompt's KV, as the toy model computes it, is
    written into exactly those host rows, as the RDMA write would, and its indexer keys into
    the request's logical locations (the device-to-device part of a DSA transfer). Decode
    then reads only what the published destinations hold. A request can be ``hold``-en (the
    transfer stays in flight), ``fail``-ed (the receiver concludes Failed, as on a transfer
    error or a receiver's waiting timeout) or ``release``-d.
    """

    def __init__(self, rig: Rig) -> None:
        from sglang.srt.disaggregation.decode import DecodePreallocQueue

        self.rig = rig
        self.rooms: dict[int, tuple[str, list[int]]] = {}
        self.receivers: dict[str, Any] = {}
        self.held: set[str] = set()
        self.published: dict[str, int] = {}
        original = DecodePreallocQueue._send_kv_metadata
        fake = self

        def send_kv_metadata(queue: Any, decode_req: Any, kv_indices: Any, page_size: int, *a: Any, **kw: Any) -> None:
            original(queue, decode_req, kv_indices, page_size, *a, **kw)
            fake._deliver(decode_req, kv_indices)

        # NOTE: wraps, not changes, SGLang's prealloc queue: the fake backend stands in for a
        # transfer engine, and this for the bytes that engine would have written.
        DecodePreallocQueue._send_kv_metadata = send_kv_metadata

    def register(self, rid: str, prompt: list[int]) -> int:
        room = 1000 + len(self.rooms)
        self.rooms[room] = (rid, list(prompt))
        return room

    def hold(self, rid: str) -> None:
        self.held.add(rid)

    def release(self, rid: str) -> None:
        self.held.discard(rid)
        if rid in self.receivers:
            self.receivers[rid].has_sent_metadata = True

    def fail(self, rid: str) -> None:
        self.held.discard(rid)
        self.receivers[rid].abort()

    def _deliver(self, decode_req: Any, kv_indices: Any) -> None:
        req = decode_req.req
        rid, prompt = self.rooms[int(req.bootstrap_room)]
        n = len(prompt)
        host = self.rig.coordinator.host_pool
        rows = torch.as_tensor(kv_indices, dtype=torch.int64).reshape(-1)[:n]
        pos = torch.arange(n, dtype=torch.int64)
        tokens = torch.tensor(prompt, dtype=torch.int64)
        for layer in range(self.rig.toy.num_layers):
            host.kv[layer][rows] = self.rig.toy.kv(tokens, pos, layer).contiguous().view(torch.uint8).reshape(n, -1)
        runner = self.rig.scheduler.tp_worker.model_runner
        logical = runner.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
        runner.index_keys[logical] = self.rig.toy.index_key(tokens, pos)
        self.receivers[rid] = decode_req.kv_receiver
        self.published[rid] = n
        if rid in self.held:  # in flight until released or failed
            decode_req.kv_receiver.has_sent_metadata = False
