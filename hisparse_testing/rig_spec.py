"""Speculative decoding on the real-scheduler rig: SGLang's ``EAGLEWorkerV2`` with a toy draft.

What runs for real: ``EAGLEWorkerV2.forward_batch_generation`` (prefill → draft extend,
decode → draft → verify → draft extend), ``build_eagle_verify_input``, ``run_eagle_verify``
(``eagle_prepare_for_verify`` with our ``prepare_spec_verify``, the target verify forward,
``eagle_sample``'s greedy acceptance, ``commit_spec_accept_tokens``), the scheduler's spec
allocation (``alloc_for_spec_decode``, ``allocate_spec_scratch``) and its result processing.

What is stood in for, and why:

* ``EagleDraftWorker`` (the draft model and its KV, attention backends and CUDA graphs) by
  :class:`StandInDraftWorker`: a chain draft (top-k 1) that proposes the reference
  continuation and corrupts each proposal with probability ``miss``, so accept lengths are
  random. The draft model's own KV is not modelled (the plugin does not touch it).
* Two tree kernels SGLang has only for CUDA, NPU, XPU and its CPU engine build
  (``build_tree_kernel_efficient_func``, ``verify_tree_greedy_func``), the verify-slot gather
  (``assign_extend_cache_locs_uniform_func``), the spec-decode ``req_to_token`` write
  (``assign_req_to_token_pool_func``), the overlap relay's gather (``gather_spec_extras``) and
  the bonus-token pick (``fill_bonus_tokens_func``), Triton-only off the CPU engine, by torch
  versions
  (:func:`install_chain_kernels`).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from hisparse_testing.token_model import TokenModel, reference_generate

__all__ = ["StandInDraftWorker", "install_chain_kernels"]


# -- the chain kernels ------------------------------------------------------------------------
def _build_chain_tree(parent_list, top_scores_index, seq_lens, tree_mask, positions,
                      retrieve_index, retrieve_next_token, retrieve_next_sibling,
                      topk, spec_steps, num_verify_tokens, tree_mask_mode) -> None:
    """``build_tree_kernel_efficient_func`` for top-k 1: verify token ``j`` of a request is
    draft depth ``j``, at position ``seq_len + j``, followed by token ``j + 1``."""
    if topk != 1:
        raise NotImplementedError("the rig's tree stand-in builds chains only (speculative_eagle_topk 1)")
    bs, w = seq_lens.numel(), num_verify_tokens
    cols = torch.arange(w, dtype=torch.int64)
    positions.copy_((seq_lens.to(torch.int64)[:, None] + cols).reshape(-1))
    retrieve_index.copy_(torch.arange(bs * w, dtype=torch.int64).view(bs, w))
    nxt = torch.where(cols + 1 < w, cols + 1, torch.full_like(cols, -1))
    retrieve_next_token.copy_(nxt.expand(bs, w))
    retrieve_next_sibling.fill_(-1)
    # QLEN_ONLY mask: token j sees tokens 0..j of its own chain (lower triangle per request)
    if tree_mask.dtype == torch.bool and tree_mask.numel() == bs * w * w:
        tri = torch.tril(torch.ones(w, w, dtype=torch.bool))
        tree_mask.copy_(tri.expand(bs, w, w).reshape(-1))


def _verify_chain_greedy(*, predicts, accept_index, accept_token_num, candidates, retrieve_index,
                         retrieve_next_token, retrieve_next_sibling, target_predict, topk=-1):
    """``verify_tree_greedy`` for a chain: accept drafts while each equals the target's greedy
    token of the position before it; the target's token after the last accepted one is the
    bonus. ``accept_token_num`` counts accepted drafts (the bonus excluded)."""
    bs, w = candidates.shape
    for b in range(bs):
        n = 0
        while n + 1 < w and int(candidates[b, n + 1]) == int(target_predict[b, n]):
            n += 1
        for j in range(n + 1):
            accept_index[b, j] = b * w + j
            predicts[b * w + j] = target_predict[b, j]
        accept_token_num[b] = n
    return predicts, accept_index, accept_token_num


def _assign_verify_locs(*, req_pool_indices, req_to_token, start_offset, batch_size,
                        draft_token_num, device, full_v2p=None, swa_v2p=None, full_out=None,
                        swa_out=None, page_size=1, positions_out=None, anchor_src=None,
                        anchor_out=None) -> torch.Tensor:
    """``assign_extend_cache_locs_uniform_func``: the ``draft_token_num`` slots past each
    request's ``seq_len``, read from ``req_to_token`` (the fused physical-window outputs,
    ``full_v2p`` & co., are not modelled)."""
    if any(t is not None for t in (full_v2p, swa_v2p, full_out, swa_out)):
        raise NotImplementedError("verify-slot stand-in: the fused v2p write windows are not modelled")
    cols = start_offset.to(torch.int64)[:, None] + torch.arange(draft_token_num, dtype=torch.int64)
    rows = req_to_token[req_pool_indices.to(torch.int64)]
    if positions_out is not None:
        positions_out.copy_(cols)
    if anchor_out is not None:
        anchor_out[:, 0].copy_(anchor_src.view(-1))
    return torch.gather(rows, 1, cols).reshape(-1).to(torch.int64)


def _assign_req_to_token(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                         batch_size) -> None:
    """``assign_req_to_token_pool_func``: request ``i``'s new slots ``[start, end)`` are the
    next ``end - start`` entries of ``out_cache_loc``."""
    at = 0
    for i in range(batch_size):
        r, a, b = int(req_pool_indices[i]), int(start_offset[i]), int(end_offset[i])
        req_to_token[r, a:b] = out_cache_loc[at:at + b - a].to(req_to_token.dtype)
        at += b - a


def _gather_spec_extras(indices, topk_p_buf, topk_index_buf, output_tokens_buf, hidden_states_buf):
    """``gather_spec_extras``: the relay buffers' rows at ``indices``, one gather each."""
    idx = indices.to(torch.int64)
    hidden = hidden_states_buf[idx] if hidden_states_buf is not None else None
    return topk_p_buf[idx], topk_index_buf[idx], output_tokens_buf[idx], hidden


def _fill_bonus_tokens(accept_tokens, accept_lens, bonus_tokens, accept_stride, batch_size) -> None:
    """``fill_bonus_tokens_func``: each request's last accepted token (its bonus)."""
    last = torch.arange(batch_size) * accept_stride + accept_lens.to(torch.int64) - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[last].to(bonus_tokens.dtype))


#: (module, attribute, stand-in): each SGLang call site looks the name up in that module
_STAND_INS = (
    ("sglang.srt.speculative.eagle_utils", "build_tree_kernel_efficient_func", _build_chain_tree),
    ("sglang.srt.speculative.eagle_utils", "verify_tree_greedy_func", _verify_chain_greedy),
    ("sglang.kernels.ops.speculative.cache_locs", "assign_extend_cache_locs_uniform_func", _assign_verify_locs),
    ("sglang.srt.mem_cache.allocation", "assign_req_to_token_pool_func", _assign_req_to_token),
    ("sglang.srt.managers.overlap_utils", "gather_spec_extras", _gather_spec_extras),
    ("sglang.srt.speculative.eagle_worker_common", "fill_bonus_tokens_func", _fill_bonus_tokens),
)


def install_chain_kernels() -> list[str]:
    """Install the stand-ins named in the module docstring; returns what was patched."""
    import importlib

    patched = []
    for module, name, fn in _STAND_INS:
        setattr(importlib.import_module(module), name, fn)
        patched.append(f"{module.rsplit('.', 1)[1]}.{name}")
    return patched


# -- the draft ----------------------------------------------------------------------------------
class _Layout:
    """What ``draft_tp_context`` reads of a ``DraftParallelLayout``: no draft TP group."""

    tp_group = None
    disable_cp = False
    local_dp = True


class _VerifyAttnBackend:
    """What the verify path reads of the target's attention backend: no preallocated tree
    mask (``verify_mask``), the context bound that sizes a fresh one."""

    verify_mask = None

    def __init__(self, max_context_len: int) -> None:
        self.max_context_len = max_context_len


class StandInDraftWorker:
    """Stands in for ``EagleDraftWorker`` (same constructor); see the module docstring."""

    #: set by the rig before the scheduler is built
    toy: TokenModel | None = None
    miss: float = 0.3
    seed: int = 0

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
        from sglang.srt.runtime_context import get_spec

        self.server_args = server_args
        self.target_worker = target_worker
        self.device = "cpu"
        self.topk = get_spec().speculative_eagle_topk
        self.speculative_num_steps = get_spec().speculative_num_steps
        self.speculative_num_draft_tokens = get_spec().speculative_num_draft_tokens
        self.parallel_layout = _Layout()
        runner = target_worker.model_runner
        if runner.attn_backend is None:
            runner.attn_backend = _VerifyAttnBackend(target_worker.model_config.context_len)
        self.draft_runner = target_worker.model_runner
        self.draft_runners = [self.draft_runner]
        self.draft_attn_backend = None
        self.draft_extend_attn_backend = None
        self.cuda_graph_runner = None
        self.cuda_graph_runner_for_draft_extend = None
        self.graph_memory_usage: dict = {}
        self.graph_time_usage: dict = {}
        self.weight_load_time = 0.0
        self.preloaded_weights_bytes = 0
        from sglang.srt.speculative.eagle_utils import default_tree_mask_mode

        self.tree_mask_mode = default_tree_mask_mode()
        #: (prompt tuple) -> reference continuation, grown on demand
        self._reference: dict[tuple[int, ...], list[int]] = {}
        self._rng = random.Random(self.seed)
        #: every draft proposal, how many were corrupted, and a histogram of verify's accept
        #: lengths (bonus token included: 1 .. W), for the scenario's report
        self.proposed = 0
        self.corrupted = 0
        self.accept_lengths: dict[int, int] = {}

    # what EAGLEWorkerV2 / the scheduler call on the draft worker
    def alloc_memory_pool(self, **_: Any) -> None:
        return None

    def init_attention_backends(self) -> None:
        return None

    def init_cuda_graphs(self) -> None:
        return None

    def init_hicache_draft_plan(self) -> None:
        return None

    # -- the toy draft --------------------------------------------------------------------
    def _continuation(self, req: Any, upto: int) -> list[int]:
        """The full-KV greedy reference of ``req``: its prompt and at least ``upto`` tokens
        in all (prompt included)."""
        prompt = tuple(req.origin_input_ids)
        ref = self._reference.get(prompt)
        if ref is None or len(ref) < upto:
            new = max(upto - len(prompt), 2 * (len(ref or prompt) - len(prompt)), 8)
            ref = list(prompt) + reference_generate(self.toy, list(prompt), new)
            self._reference[prompt] = ref
        return ref

    def _proposals(self, batch: Any) -> torch.Tensor:
        """[bs, steps] draft tokens: the reference tokens after each request's bonus token
        (position ``seq_len``), each corrupted with probability ``miss``. Positions come from
        the batch's ``seq_lens``: under the overlap scheduler ``output_ids`` lag a round."""
        steps = self.speculative_num_steps
        out = torch.empty(len(batch.reqs), steps, dtype=torch.int64)
        for i, req in enumerate(batch.reqs):
            s = int(batch.seq_lens[i])
            ref = self._continuation(req, s + 1 + steps)
            for j in range(steps):
                tok = ref[s + 1 + j]
                self.proposed += 1
                if self._rng.random() < self.miss:
                    tok = (tok + 1 + self._rng.randrange(self.toy.vocab - 1)) % self.toy.vocab
                    self.corrupted += 1
                out[i, j] = tok
        return out

    def _next_input(self, bs: int, bonus: torch.Tensor) -> Any:
        from sglang.srt.speculative.eagle_info import EagleDraftInput

        hidden = self.target_worker.model_config.hidden_size
        return EagleDraftInput(
            topk_p=torch.ones(bs, 1, dtype=torch.float32),
            topk_index=torch.zeros(bs, 1, dtype=torch.int64),
            hidden_states=torch.zeros(bs, hidden, dtype=torch.bfloat16),
            bonus_tokens=bonus,
            num_tokens_per_req=1,
            num_tokens_for_logprob_per_req=1,
        )

    def draft(self, batch: Any, *, with_topology: bool = False) -> Any:
        from sglang.srt.speculative.eagle_worker_common import build_eagle_verify_input

        bs = len(batch.reqs)
        parent_list = torch.empty(bs, 0, dtype=torch.int64)
        top_scores_index = torch.arange(self.speculative_num_steps, dtype=torch.int64).expand(bs, -1)
        verify_input = build_eagle_verify_input(
            batch, batch.spec_info, parent_list, top_scores_index, self._proposals(batch), None,
            target_worker=self.target_worker, topk=self.topk, num_steps=self.speculative_num_steps,
            num_draft_tokens=self.speculative_num_draft_tokens, tree_mask_mode=self.tree_mask_mode,
            device=self.device,
        )
        if with_topology:
            return verify_input, parent_list, top_scores_index
        return verify_input

    def _draft_extend_for_prefill(self, batch: Any, target_hidden_states: Any, next_token_ids: torch.Tensor,
                                  mm_input_embeds: Any = None, kv_loc_plan: Any = None) -> Any:
        return self._next_input(len(batch.reqs), next_token_ids.to(torch.int64))

    def _draft_extend_for_decode(self, batch: Any, batch_result: Any, *, kv_loc_plan: Any = None) -> None:
        nxt = batch_result.next_draft_input
        bs = len(batch.reqs)
        for n in batch_result.accept_lens.tolist():
            self.accept_lengths[int(n)] = self.accept_lengths.get(int(n), 0) + 1
        fresh = self._next_input(bs, nxt.bonus_tokens)
        nxt.topk_p, nxt.topk_index, nxt.hidden_states = fresh.topk_p, fresh.topk_index, fresh.hidden_states
