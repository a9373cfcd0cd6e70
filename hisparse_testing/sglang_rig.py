"""SGLang 0.5.23's real ``Scheduler`` on CPU, driving the plugin, with a stand-in model worker.

What runs for real: SGLang's argument pipeline (our validation hook included), ``Scheduler``
and everything it builds (input handling, ``get_next_batch_to_run``, schedule policy,
chunked prefill, ``run_batch``, the batch result processor, retraction, abort, the idle
memory self-check, PD decode's prealloc/transfer queues with the ``fake`` backend),
``ScheduleBatch.prepare_for_decode`` (which calls ``map_last_loc_to_buffer``),
``ReqToTokenPool``, and SGLang's own ``ModelRunner.maybe_init_hisparse_coordinator``, which
builds our coordinator through the plugin's REPLACE hooks. What is stood in for, and why:

```
TpModelWorker / ModelRunner   StandInWorker / StandInRunner (rig_worker): no weights,
                              no attention backend, no CUDA graphs on CPU. The runner builds
                              the pools with the kwargs kv_cache_configurator passes (classes
                              looked up in SGLang's modules: the plugin's replacements run)
                              and runs a TokenModel forward making the calls SGLang's model
                              runner and DSA backend make: wait_for_pending_backup,
                              num_real_reqs.fill_, KV writes through the pool
                              (set_mla_kv_buffer: logical -> device translation), per layer
                              swap_in_selected_pages on decode, translate_loc_to_hisparse_device
                              on prefill.
sampling                      the stand-in returns the greedy token itself (TokenModel.next_token)
tokenizer manager             the rig binds its two ZMQ sockets: requests go in over the
                              scheduler's real input socket, BatchTokenIDOutput deltas come back
PD prefill instance           FakePrefill: writes the prompt's KV into the published host rows
                              (fake backend); over Mooncake TCP a real prefill Rig in its own
                              process (hisparse_testing.rig_mooncake)
```

:class:`Rig` sends ``TokenizedGenerateReqInput`` / ``AbortReq`` and steps
``event_loop_normal``'s body (or ``event_loop_normal_disagg_decode``'s) one iteration at a
time, so a scenario can abort, fail a transfer or inspect between steps.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hisparse_testing.rig_worker import (
    M3_HEAD_DIM,
    StandInWorker,
    allow_fake_transfer_with_decode_radix,
    keep_overlap_for_speculative,
    pretend_sm90,
    write_toy_model,
)
from hisparse_testing.token_model import TokenModel

__all__ = ["FakePrefill", "Finished", "Rig", "RigConfig", "pretend_sm90"]

logger = logging.getLogger("sglang_hisparse.rig")


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
    #: staging copies report done only on their N-th poll, as a GPU copy finishes some steps
    #: after it was queued (on CPU they are done at once)
    staging_polls: int = 0
    #: SGLang's default overlap scheduler (``event_loop_overlap``) instead of the normal loop
    overlap: bool = False
    #: speculative decoding: NEXTN chain with this many verify tokens W (W - 1 draft steps,
    #: top-k 1) through SGLang's EAGLEWorkerV2 with the toy draft of ``hisparse_testing.rig_spec``,
    #: whose proposals are each wrong with probability ``draft_miss``; needs ``overlap``
    draft_tokens: int = 0
    draft_miss: float = 0.3
    #: ``--hisparse-config`` residency ("pressure", SGLang-hisparse's default, or "always_hot")
    #: and its watermark (None: the default)
    residency: str = "pressure"
    residency_watermark: float | None = None
    #: ``--hisparse-config`` "policy", the hot buffers' replacement policy (None: not written,
    #: the server's default, slru)
    policy: str | None = None
    #: SGLang's radix cache on (the rig's other groups run --disable-radix-cache)
    radix: bool = False
    extra_args: tuple[str, ...] = ()
    #: MiniMax-M3 instead of DSA: layer 0 dense, the others sparse, each selecting
    #: top_k / m3_block blocks of m3_block positions (the last a forced local block), MHA K/V
    #: of one head of M3_HEAD_DIM (``rig_worker.write_toy_model``)
    m3_block: int = 0
    #: M3: whether its sparse layers keep an index value (False: K-only, as PD decode needs)
    m3_index_values: bool = True
    #: DeepSeek-V4 instead of DSA: C4 entries (one per 4 tokens, top_k of them a step in each
    #: of the toy's two C4 layers) through SGLang's own V4 pools (``hisparse_testing.rig_v4``)
    v4: bool = False

    def model(self) -> Any:
        if self.v4:
            from hisparse_testing.rig_v4 import C4TokenModel

            return C4TokenModel(top_k=self.top_k)
        if self.m3_block:
            return TokenModel(num_layers=self.num_layers, top_k=self.top_k, nope_dim=M3_HEAD_DIM,
                              rope_dim=M3_HEAD_DIM, block_size=self.m3_block,
                              block_layers=tuple(range(1, self.num_layers)))
        return TokenModel(num_layers=self.num_layers, top_k=self.top_k, shared=self.shared)

    def argv(self, model_dir: Path) -> list[str]:
        argv = [
            "--model-path", str(model_dir), "--skip-tokenizer-init", "--device", "cpu",
            *(("--kv-cache-dtype", "fp8_e4m3") if self.v4 else ()),
            *(() if self.radix else ("--disable-radix-cache",)),
            "--max-running-requests", str(self.max_running_requests),
            "--page-size", str(self.page_size),
            "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
        ]
        if self.hisparse:
            argv += ["--enable-hisparse", "--hisparse-config", json.dumps({
                "top_k": self.top_k, "device_buffer_size": self.buffer_size,
                "host_to_device_ratio": self.host_to_device_ratio, "swap_in_block_size": 64,
                "residency": self.residency,
                **({} if self.residency_watermark is None else {"residency_watermark": self.residency_watermark}),
                **({} if self.policy is None else {"policy": self.policy}),
            })]
        if self.chunked_prefill_size is not None:
            argv += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if not self.overlap:
            argv.append("--disable-overlap-schedule")
        if self.draft_tokens:
            argv += [
                "--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "1",
                "--speculative-num-steps", str(self.draft_tokens - 1),
                "--speculative-num-draft-tokens", str(self.draft_tokens),
            ]
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
        model_dir = write_toy_model(workdir / "model", num_layers=config.num_layers, top_k=config.top_k,
                                    m3_block=config.m3_block, v4=config.v4,
                                    m3_index_values=config.m3_index_values)
        if config.draft_tokens and not config.overlap:
            raise ValueError("RigConfig: draft_tokens needs overlap=True (HiSparse with speculative "
                             "decoding runs on SGLang's overlap scheduler; arg_scope refuses it without)")
        if config.overlap:  # NOTE: a patch of SGLang's argument resolution (see its docstring)
            keep_overlap_for_speculative()
        if "--disaggregation-decode-enable-radix-cache" in config.extra_args:  # NOTE: likewise
            allow_fake_transfer_with_decode_radix()
        self.server_args = prepare_server_args(config.argv(model_dir))
        self.server_args.resolve_once()
        self.server_args.check_server_args()
        self.port_args = PortArgs.init_new(self.server_args)
        publish(self.server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
        args = list(config.extra_args)
        self.pd_mode = args[args.index("--disaggregation-mode") + 1] if "--disaggregation-mode" in args else None
        self.pd_decode, self.pd_prefill = self.pd_mode == "decode", self.pd_mode == "prefill"
        #: a real transfer engine (``hisparse_testing.rig_mooncake``), else None (``fake``)
        self.wire = None
        if self.pd_mode and self.server_args.disaggregation_transfer_backend == "mooncake":
            from hisparse_testing.rig_mooncake import Wire

            self.wire = Wire.start(prefill=self.pd_prefill)
        # NOTE: the one patch of SGLang's own code: the model worker class the scheduler
        # instantiates (Scheduler.init_tp_model_worker imports it from tp_worker at call time).
        StandInWorker.toy, StandInWorker.device_rows = self.toy, config.device_rows
        if config.v4:
            from hisparse_testing.rig_v4 import V4StandInRunner

            StandInWorker.runner_cls = V4StandInRunner
        tp_worker.TpModelWorker = StandInWorker  # type: ignore[misc]
        self.patches = ["tp_worker.TpModelWorker"]
        if config.draft_tokens:
            # NOTE: speculative decoding adds the draft model and six Triton-only kernels
            # (hisparse_testing/rig_spec.py says which and why)
            from sglang.srt.speculative import eagle_worker_v2

            from hisparse_testing.rig_spec import StandInDraftWorker, install_chain_kernels

            StandInDraftWorker.toy, StandInDraftWorker.miss = self.toy, config.draft_miss
            eagle_worker_v2.EagleDraftWorker = StandInDraftWorker  # type: ignore[misc]
            self.patches += ["eagle_worker_v2.EagleDraftWorker", *install_chain_kernels()]
        # the tokenizer manager's ends of the two sockets: it binds, the scheduler connects
        ctx = zmq.Context.instance()
        self._out = ctx.socket(zmq.PULL)
        self._out.bind(self.port_args.tokenizer_ipc_name)
        self._in = ctx.socket(zmq.PUSH)
        self._in.bind(self.port_args.scheduler_input_ipc_name)
        from sglang.srt.managers.scheduler import Scheduler

        self.scheduler = Scheduler(self.server_args, self.port_args)
        self.scheduler.tp_worker.model_runner.pad_decode = config.pad_decode
        self.scheduler.tp_worker.model_runner.wire = self.wire is not None
        if self.wire is not None:
            self.wire.check_registered()
            self.patches += self.wire.patches
        if config.staging_polls and self.coordinator is not None:
            streams = self.coordinator.core.streams
            streams.new_event = lambda polls=config.staging_polls: SlowEvent(polls)
        self.results: dict[str, Finished] = {}
        #: overlap loop: (batch, result) launched and not yet processed
        self._launched: deque = deque()
        if config.overlap:  # what run_event_loop / event_loop_overlap set before looping
            self.scheduler.enable_skip_finishing_decode = True
            self.scheduler._war_barrier_enabled = False  # is_cuda() is False here
        self.steps = 0
        if config.v4:
            # NOTE: the stand-in worker reports no hybrid SWA (SGLang's SWA radix and per-layer
            # token accounting are not stood in), so the scheduler has no window; PD decode's
            # SWA state payload reads it (decode.py:1674): the toy's, as a V4 worker reports it
            self.scheduler.sliding_window_size = self.scheduler.tp_worker.model_runner.sliding_window_size
        #: PD: bootstrap room -> prompt, for the stand-in prefill side (:class:`FakePrefill`)
        self.prefill = FakePrefill(self) if self.pd_decode and self.wire is None else None

    # -- plumbing -------------------------------------------------------------------------
    @property
    def coordinator(self) -> Any:
        return self.scheduler.hisparse_coordinator

    def submit(self, rid: str, prompt: list[int], max_new_tokens: int,
               stop_token_ids: list[int] | None = None, room: int | None = None) -> None:
        """A tokenized request, sent over the scheduler's real input socket (PD decode: with
        the fake backend's bootstrap host, so the fake receiver serves its transfer; over a real
        transfer engine, the prefill's bootstrap address and ``room``, as the router sends the
        same request to both instances).

        Without ``stop_token_ids`` the request runs with ``ignore_eos`` (exactly
        ``max_new_tokens`` outputs, and SGLang reserves all of them at admission); with them it
        stops at the first output in the set, as at an EOS, so SGLang admits on its estimated
        output length and may over-admit and retract (``hisparse_testing.rig_traffic``)."""
        from array import array

        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput, sock_send
        from sglang.srt.sampling.sampling_params import SamplingParams

        # what TokenizerManager does to the sampling params before it sends them
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                ignore_eos=stop_token_ids is None, stop_token_ids=stop_token_ids)
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
        elif self.wire is not None:
            if room is None:
                raise ValueError(f"Rig.submit: {rid}: a PD request over a real transfer needs its bootstrap room")
            req.bootstrap_host, req.bootstrap_port = self.wire.bootstrap_host, self.wire.bootstrap_port
            req.bootstrap_room = room
        sock_send(self._in, req)
        self.results[rid] = Finished(rid)

    def abort(self, rid: str) -> None:
        from sglang.srt.managers.io_struct import AbortReq, sock_send

        sock_send(self._in, AbortReq(rid=rid))

    def _drain_outputs(self) -> None:
        import zmq
        from sglang.srt.managers.io_struct import AbortReq, BatchTokenIDOutput, sock_recv

        while True:
            try:
                out = sock_recv(self._out, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if isinstance(out, AbortReq):  # send_abort_output: e.g. a retraction with no backup
                res = self.results.setdefault(out.rid, Finished(out.rid))
                res.finish_reason = out.finished_reason or {"type": "abort"}
                continue
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
        if self.pd_prefill:  # event_loop_normal_disagg_prefill's body
            s.ingest_requests()
            s.waiting_queue.extend(s.disagg_prefill_bootstrap_queue.pop_bootstrapped())
            plan = s.get_next_disagg_prefill_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
            s.running_batch = plan.running_batch
            batch = s.ngram_embedding_manager.prepare_for_forward(plan.batch_to_run, chunked_req=s.chunked_req)
            s.cur_batch_for_debug = batch
            if batch:
                s.process_batch_result(batch, s.run_batch(batch))
            else:
                s._sched_idled = True
                s.on_idle()
            s.process_disagg_prefill_inflight_queue()
            s.last_batch = batch
            self._drain_outputs()
            self.steps += 1
            return bool(batch)
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
        if self.config.overlap:
            self._overlap_tail(batch)
        elif batch:
            result = s.run_batch(batch)
            s.process_batch_result(batch, result)
        else:
            s._sched_idled = True
            s.on_idle()
        s.last_batch = batch
        self._drain_outputs()
        self.steps += 1
        return bool(batch)

    def _overlap_tail(self, batch: Any) -> None:
        """The rest of one ``event_loop_overlap`` iteration: the previous batch's result is
        processed after this batch is launched (or first, where the loop disables overlap)."""
        s = self.scheduler
        queue = self._launched
        no_overlap = s.is_disable_overlap_for_batch(batch, last_batch=s.last_batch)
        if no_overlap and queue:
            s.process_batch_result(*queue.popleft())
        result = None
        if batch:
            result = s.run_batch(batch)
            s._apply_war_barrier()
            queue.append((batch.copy(), result))
        else:
            s._sched_idled = True
        if s.last_batch and not no_overlap:
            s.process_batch_result(*queue.popleft())
        elif not s.last_batch and batch is None:
            s.on_idle()
        if s.is_generation:
            s.launch_batch_sample_if_needed(result, batch)

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
            # (V4: the token ids are the SWA allocator's; the core's are compressed ids)
            alloc = s.token_to_kv_pool_allocator
            free_ids = (coord.dual.logical.available_size() if coord.family.rows_hold_core_ids
                        else alloc.logical_attn_allocator.full_available_size())
            stats = dataclasses.replace(stats, full_available_size=free_ids)
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
        if self.config.radix:
            # the tree keeps finished requests' ids (SGLang's check above counted them as
            # evictable): evict all of it through the real path (our free), then check strictly
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            s.tree_cache.evict(EvictParams(num_tokens=s.tree_cache.evictable_size()))
            if s.tree_cache.evictable_size() or s.tree_cache.protected_size():
                raise AssertionError(f"idle: the radix tree keeps {s.tree_cache.evictable_size()} "
                                     f"evictable / {s.tree_cache.protected_size()} protected tokens after evicting all")
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
        if int(host.allocated_lens.sum()):
            raise AssertionError(f"idle: host pool still binds {int(host.allocated_lens.sum())} positions")
        if dual._held:
            raise AssertionError(f"idle: request slots {sorted(dual._held)} still hold prefill pages")
        busy = [r for r in range(core.state.num_reqs) if core.state.phase[r].value != "free"]
        if busy or core.has_ongoing_staging():
            raise AssertionError(f"idle: request slots {busy} not FREE (staging {core.has_ongoing_staging()})")


class SlowEvent:
    """A CPU event that reports done on its ``polls``-th ``query()`` (see ``staging_polls``)."""

    def __init__(self, polls: int) -> None:
        self.left = polls

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        self.left = 0

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0


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
        self.delivered: dict[str, int] = {}  # positions written per request (the suffix)
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

    def _deliver_c4(self, rid: str, host: Any, kv_indices: Any, tokens: torch.Tensor) -> None:
        """DeepSeek-V4: the prompt's C4 entries (one per completed 4-token group) into the
        published host slots, as the prefill's C4 pages land in the decode host pool's pages;
        the rest of a V4 transfer (windows, C128, indexer keys) goes device to device, which
        the toy does not read (its keys are functions of the tokens)."""
        from hisparse_testing.rig_v4 import RATIO

        clen = tokens.numel() // RATIO
        rows = torch.as_tensor(kv_indices, dtype=torch.int64).reshape(-1)[:clen]
        if rows.numel() != clen:
            raise AssertionError(f"FakePrefill: {rid} got {rows.numel()} destination slots for {clen} C4 entries")
        if clen:
            # what the transfer addresses: the host page of every 64 slots (slot // 64, decode.py
            # _transfer_page_indices); the slots must be those pages' entries, in order
            page = host.layout.entries
            pages = rows[::page] // page
            spanned = (pages.repeat_interleave(page) * page + torch.arange(pages.numel() * page) % page)[:clen]
            if not torch.equal(spanned, rows):
                raise AssertionError(f"FakePrefill: {rid}'s host slots are not whole pages in order: {rows[:8].tolist()}...")
            groups, c = tokens[: clen * RATIO].view(clen, RATIO), torch.arange(clen)
            for layer in range(self.rig.toy.c4_layers):
                host.write(rows, self.rig.toy.entry(groups, c, layer), layer)

    def _deliver_m3(self, rid: str, host: Any, kv_indices: Any, tokens: torch.Tensor, logical: torch.Tensor,
                    m: int) -> None:
        """MiniMax-M3: the sparse layers' K and V into the published host rows (the host pool's
        K and V arrays, as the prefill's ``get_sparse_kv_buf_infos`` pairs them); the dense
        layers' K/V at the request's logical locations (the MINIMAX_DENSE_KV state a real
        transfer sends device to device; the index keys likewise)."""
        from hisparse_testing.rig_worker import _Layer

        n = tokens.numel()
        if not host.layout.host_split:
            raise AssertionError("FakePrefill: a PD decode server's M3 host pool must keep K and V apart")
        rows = torch.as_tensor(kv_indices, dtype=torch.int64).reshape(-1)[: n - m]
        if rows.numel() != n - m:
            raise AssertionError(f"FakePrefill: {rid} got {rows.numel()} destination rows for positions {m}..{n - 1}")
        toy, pos = self.rig.toy, torch.arange(n, dtype=torch.int64)
        pool = self.rig.scheduler.tp_worker.model_runner.token_to_kv_pool
        sparse = 0
        for layer in range(toy.num_layers):
            kv = toy.kv(tokens, pos, layer)[:, None, :]
            if toy.selects_blocks(layer):  # K then V: the HiSparse row
                host.write(rows, kv.reshape(n, -1).contiguous().view(torch.uint8).reshape(n, -1)[m:], sparse)
                sparse += 1
            else:
                pool.set_kv_buffer(_Layer(layer), logical, kv[..., : toy.nope_dim].contiguous(),
                                   kv[..., toy.nope_dim:].contiguous())

    def _deliver(self, decode_req: Any, kv_indices: Any) -> None:
        req = decode_req.req
        rid, prompt = self.rooms[int(req.bootstrap_room)]
        n = len(prompt)
        # with the decode radix cache the destination covers only the unmatched suffix
        m = int(req.kv.cache_protected_len)
        host = self.rig.coordinator.host_pool
        tokens = torch.tensor(prompt, dtype=torch.int64)
        runner = self.rig.scheduler.tp_worker.model_runner
        logical = runner.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
        if self.rig.config.v4:
            self._deliver_c4(rid, host, kv_indices, tokens)
        elif self.rig.config.m3_block:
            self._deliver_m3(rid, host, kv_indices, tokens, logical, m)
            runner.index_keys[logical] = self.rig.toy.index_key(tokens, torch.arange(n, dtype=torch.int64))
        else:
            rows = torch.as_tensor(kv_indices, dtype=torch.int64).reshape(-1)[: n - m]
            if rows.numel() != n - m:
                raise AssertionError(f"FakePrefill: {rid} got {rows.numel()} destination rows for positions {m}..{n - 1}")
            pos = torch.arange(n, dtype=torch.int64)
            for layer in range(self.rig.toy.num_layers):
                kv = self.rig.toy.kv(tokens, pos, layer).contiguous().view(torch.uint8).reshape(n, -1)
                host.write(rows, kv[m:], layer)
            runner.index_keys[logical] = self.rig.toy.index_key(tokens, pos)
        self.delivered[rid] = n - m
        # SGLang never inserts a fake-bootstrap request into the radix tree (its KV is not
        # written, schedule_batch.py: skip_radix_cache_insert); here it is, as a real transfer's
        req.skip_radix_cache_insert = False
        runner.token_at[logical] = tokens
        self.receivers[rid] = decode_req.kv_receiver
        self.published[rid] = n
        if rid in self.held:  # in flight until released or failed
            decode_req.kv_receiver.has_sent_metadata = False
