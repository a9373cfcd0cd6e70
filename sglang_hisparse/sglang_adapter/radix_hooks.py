"""Hooks that let SGLang's radix cache share prefixes with HiSparse (co-located).

SGLang 0.5.23's tree holds ``req_to_token`` values, i.e. our logical ids, and a logical id's
host row is the id (``memory/host_pool.py``), so the tree needs no change; four call paths
need our side of the protocol (docs/prefix-cache.md):

| hook | type | what ours adds |
|---|---|---|
| ``mem_cache.allocation.alloc_for_extend`` | AROUND | after SGLang wrote each request's prefix and new ids into ``req_to_token``: ``prepare_prefix`` holds the tree part of the row (loading from host what no device row holds) and the ids this extend computed |
| ``mem_cache.common.release_kv_cache`` | AROUND | a request released before staging without ``request_finished`` (aborted between chunks) gets it first: its computed ids go to host, its holds are dropped |
| ``managers.schedule_policy.PrefillAdder.add_one_req_ignore_eos`` | AROUND | the prompt against the device rows, then SGLang's whole-output simulation against the logical ids |
| ``mem_cache.prefill_budget.PrefillBudget._available_and_evictable`` | AROUND | the tree's evictable ids free logical ids, not device rows: what a prefill allocates is at most the rows (outputs still to decode take logical ids, not rows) |
| ``managers.schedule_policy.PrefillAdder._request_slot_reserve_for_req`` | AROUND | a new request's matched prefix may be loaded back into device rows: its page-rounded length is reserved |
| ``disaggregation.decode.DecodePreallocQueue._pre_alloc`` | AROUND | PD decode with its radix cache: SGLang's HiSparse branch asserts no prefix; ours runs it for the whole fill, then gives the matched positions back to the tree's ids (their host rows are the tree's) and returns only the suffix's host rows as the transfer destination |
| ``arg_groups.pd_disaggregation_hook.handle_pd_disaggregation`` | AROUND | its decode-radix branch refuses HiSparse inline: ours runs it with HiSparse hidden, after applying the HiSparse rules that hiding would skip |
| ``disaggregation.decode.DecodePreallocQueue._allocatable_token_budgets`` | AROUND | PD decode with its radix cache: SGLang's HiSparse budget counts free logical ids only; the tree's evictable ids are freed on demand in ``_pre_alloc``, so they count (without them a tree full of finished requests' ids blocks admission forever) |
| ``disaggregation.decode.DecodePreallocQueue._radix_full_available`` | AROUND | what ``_pre_alloc`` evicts the tree for: a HiSparse prealloc takes logical ids only, so the free logical ids (SGLang's figure is ``available_size()``, which also counts device rows that evicting never frees, and flushes the tree) |
| ``disaggregation.decode_schedule_batch_mixin.ScheduleBatchDisaggregationDecodeMixin.process_prebuilt`` | AROUND | its checkpoint inserts each request into the decode tree, which frees ids the tree already had and repoints ``req_to_token`` to the tree's: the request's host rows are rebound to what its row now holds, so the freed ids' host rows, reused by later transfers, are never read for it |

Each returns SGLang's result unchanged without a HiSparse allocator (``HiSparseTokenAllocator``
with a coordinator attached) or with the tree off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _coordinator(allocator: Any) -> Any:
    return getattr(allocator, "hisparse_coordinator", None)


def _sharing(tree_cache: Any) -> bool:
    if tree_cache is None:
        return False
    supports = getattr(tree_cache, "supports_prefix_sharing", None)
    return bool(supports()) if callable(supports) else not getattr(tree_cache, "disable", True)


def prepare_extend_prefixes(original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``alloc_for_extend(batch)`` -> ``(out_cache_loc, req_pool_indices, *_cpu)``.

    The new requests' matched pages that sit in the device-tier cache are protected while
    SGLang allocates the batch's new ids (an allocation short of rows evicts cached pages,
    oldest first, and would otherwise take the very prefix this batch is about to hold and
    load it back from host)."""
    tree = getattr(batch, "tree_cache", None)
    coord = _coordinator(getattr(tree, "token_to_kv_pool_allocator", None))
    if coord is None or not _sharing(tree):
        return original(batch, *args, **kwargs)
    coord.protect_matched(batch.reqs, tree)
    try:
        out = original(batch, *args, **kwargs)
    finally:
        coord.dual.release_protected()
    out_cache_loc, _, req_pool_indices_cpu = out
    coord.prepare_extend(batch.reqs, [int(r) for r in req_pool_indices_cpu.tolist()],
                         list(batch.extend_lens), out_cache_loc)
    return out


def release_unstaged(original: Callable[..., Any], req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``release_kv_cache(req, tree_cache, *, checkpoint)``."""
    coord = _coordinator(getattr(tree_cache, "token_to_kv_pool_allocator", None))
    if coord is not None:
        coord.release_unstaged(req)
    out = original(req, tree_cache, *args, **kwargs)
    if coord is not None and _sharing(tree_cache):
        # host rows the tree keeps (the tree's ids are ours): the tree_tokens gauge
        coord.core.telemetry.tree_tokens = int(tree_cache.evictable_size()) + int(tree_cache.protected_size())
    return out


def available_rows_bound(original: Callable[..., int], budget: Any, *args: Any, **kwargs: Any) -> int:
    """AROUND ``PrefillBudget._available_and_evictable``: SGLang's ``available + evictable``
    (logical ids), at most the device rows a prefill could get (free plus what resident
    requests give up) plus the decode headroom SGLang reserves out of the same figure.

    SGLang subtracts two offsets from this figure: ``current_offset``, what the admitted
    prefills allocate now (their prompts' pages), and in ``total_offset`` also each running
    and admitted request's expected remaining output (``max_new_tokens`` x new_token_ratio).
    The outputs take logical ids, but device rows only while a hot buffer grows to B + 1
    (resident requests give theirs up under pressure), which the decode check counts and
    retracts for (``HiSparseTokenAllocator.check_decode_capacity``). So the rows bound carries
    that headroom back: after SGLang's subtraction the budget is ``min(logical - total_offset,
    rows - current_offset)``.

    NOTE: charging the outputs against device rows (the bound without the headroom) capped a
    HiSparse decode batch by HBM again: under real traffic (``hisparse_testing.rig_traffic``) six
    requests ran where the logical space held sixteen, and SGLang never over-admitted."""
    total = original(budget, *args, **kwargs)
    allocator = getattr(budget, "allocator", None)
    if _coordinator(allocator) is None:
        return total
    if getattr(budget, "_hisparse_logical_only", False):  # admit_ignore_eos_on_both_spaces
        # SGLang's figure is available_size() (the smaller space) + evictable: the logical one
        return total - allocator.available_size() + allocator.core.logical.available_size()
    headroom = max(int(budget.total_offset) - int(budget.current_offset), 0)
    return min(total, allocator.core.available_rows() + headroom)


def pd_prealloc_with_prefix(original: Callable[..., Any], queue: Any, req: Any, prefix_indices: Any = None,
                            prefix_len: int | None = None, total_prefix_len: int | None = None) -> Any:
    """AROUND ``DecodePreallocQueue._pre_alloc(req, prefix_indices, prefix_len,
    total_prefix_len)`` -> the transfer destination (host rows under HiSparse)."""
    scheduler = getattr(queue, "scheduler", None)
    coord = getattr(scheduler, "hisparse_coordinator", None)
    m = int(prefix_len or 0)
    if coord is None or not getattr(scheduler, "enable_hisparse", False) or m == 0:
        return original(queue, req, prefix_indices, prefix_len, total_prefix_len)
    if total_prefix_len not in (None, m):
        raise NotImplementedError(
            f"HiSparse PD decode: a prefix of {total_prefix_len} tokens of which only {m} are on this "
            f"instance (decode HiCache) is not supported; it is refused at validation."
        )
    dst = original(queue, req, None, 0, 0)  # logical ids and host rows for every position
    return coord.adopt_pd_prefix(req, prefix_indices[:m], dst)


#: HiSparse refusals of ``handle_pd_disaggregation`` besides the decode-radix one (0.5.23)
_PD_RULES = (
    (lambda cfg: cfg.disaggregation_decode_host_receive_threshold < 1,
     "Decode host receive does not yet support HiSparse or role switching"),
    (lambda cfg: cfg.disaggregation_decode_allocation_policy == "prefill_complete",
     "--disaggregation-decode-allocation-policy prefill_complete does not support HiSparse"),
)


def allow_pd_decode_radix(original: Callable[..., None], server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND ``handle_pd_disaggregation(server_args)``: a HiSparse decode server may enable
    SGLang's decode radix cache (``--disaggregation-decode-enable-radix-cache``)."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    if not (cfg.enable_hisparse and cfg.disaggregation_mode == "decode"
            and cfg.disaggregation_decode_enable_radix_cache):
        return original(server_args, *args, **kwargs)
    for broken, message in _PD_RULES:
        if broken(cfg):
            raise ValueError(message)
    with hidden(server_args, enable_hisparse=False):
        return original(server_args, *args, **kwargs)


class hidden:
    """Within the block, resolution reads ``fields`` as given (one more declaration on top of
    ``server_args._resolved_overrides``, removed again on exit)."""

    def __init__(self, server_args: Any, **fields: Any) -> None:
        self.server_args, self.entry = server_args, ("sglang_hisparse", dict(fields))

    def __enter__(self) -> None:
        stack = getattr(self.server_args, "_resolved_overrides", None)
        if stack is None:
            stack = []
            object.__setattr__(self.server_args, "_resolved_overrides", stack)
        stack.append(self.entry)

    def __exit__(self, *exc: Any) -> None:
        stack = self.server_args._resolved_overrides
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self.entry:
                del stack[i]
                break


def reserve_prefix_rows(original: Callable[..., int], adder: Any, req: Any, *args: Any, **kwargs: Any) -> int:
    """AROUND ``PrefillAdder._request_slot_reserve_for_req(req, *, extend_input_len)``: plus
    the page-rounded matched prefix of a request without a slot yet (its load-back rows; an
    upper bound, as a prefix still on the device costs none)."""
    reserve = original(adder, req, *args, **kwargs)
    allocator = getattr(adder, "token_to_kv_pool_allocator", None)
    if _coordinator(allocator) is None or req.kv.req_pool_idx is not None:
        return reserve
    m = int(getattr(req, "prefix_len", 0) or 0)
    ps = allocator.page_size
    return reserve + -(-m // ps) * ps


def _pd_radix_coordinator(queue: Any) -> Any:
    """The coordinator of a HiSparse PD decode queue whose decode radix cache is on, or None."""
    scheduler = getattr(queue, "scheduler", None)
    coord = getattr(scheduler, "hisparse_coordinator", None)
    if coord is None or not getattr(scheduler, "enable_hisparse", False) or not _sharing(queue.tree_cache):
        return None
    return coord


def pd_budget_with_tree(original: Callable[..., int], queue: Any, *args: Any, **kwargs: Any) -> int:
    """AROUND ``DecodePreallocQueue._allocatable_token_budgets(...)``: plus the decode tree's
    evictable ids, which ``_pre_alloc`` evicts for (``pd_prealloc_evicts_logical``)."""
    budget = original(queue, *args, **kwargs)
    if _pd_radix_coordinator(queue) is None or queue._uses_swa_tail_prealloc():
        return budget
    return budget + int(queue._radix_full_evictable())


def pd_prealloc_evicts_logical(original: Callable[..., int], queue: Any, *args: Any, **kwargs: Any) -> int:
    """AROUND ``DecodePreallocQueue._radix_full_available()``: the free logical ids on a
    HiSparse decode server (``_pre_alloc`` evicts the tree until the fill fits in them)."""
    if _pd_radix_coordinator(queue) is None or queue.scheduler.tp_worker.is_hybrid_swa:
        return original(queue, *args, **kwargs)
    return int(queue.token_to_kv_pool_allocator.logical_attn_allocator.available_size())


def pd_rebind_after_checkpoint(original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``process_prebuilt(batch, future_map)``: after its checkpoints, every request's
    host rows follow its ``req_to_token`` row (the coordinator's ``rebind_tree_rows``)."""
    out = original(batch, *args, **kwargs)
    coord = _coordinator(getattr(batch, "token_to_kv_pool_allocator", None))
    if coord is not None and _sharing(getattr(batch, "tree_cache", None)):
        coord.rebind_tree_rows(batch.reqs)
    return out


def admit_on_both_spaces(original: Callable[..., Any], budget: Any, *args: Any, total_tokens: int,
                         max_new_tokens: int, **kwargs: Any) -> Any:
    """AROUND ``PrefillBudget.check_prefill(*, extend_input_len, total_tokens, max_new_tokens,
    ...)`` (a request that may stop early: SGLang's EOS path): its prompt must fit the device
    rows (SGLang's check on the row-bounded figure, ``available_rows_bound``), and its prompt
    plus ``max_new_tokens`` outputs the logical ids.

    SGLang checks ``prompt + max_new_tokens`` against one figure; against the device rows a
    request whose prompt and outputs together exceed them is never admitted (under real
    traffic the rig's queue hung with every row free), though its outputs take logical ids
    and at most B + 1 device rows."""
    allocator = getattr(budget, "allocator", None)
    if _coordinator(allocator) is None:
        return original(budget, *args, total_tokens=total_tokens, max_new_tokens=max_new_tokens, **kwargs)
    fits, limit = original(budget, *args, total_tokens=total_tokens - max_new_tokens,
                           max_new_tokens=max_new_tokens, **kwargs)
    if not fits:
        return fits, limit
    tree = budget.tree_cache
    logical = allocator.core.logical.available_size() + (int(tree.evictable_size()) if _sharing(tree) else 0)
    return (True, limit) if total_tokens < logical - budget.total_offset else (False, None)


def admit_ignore_eos_on_both_spaces(original: Callable[..., Any], adder: Any, req: Any, *args: Any,
                                    **kwargs: Any) -> Any:
    """AROUND ``PrefillAdder.add_one_req_ignore_eos(req)`` (``ignore_eos`` without the radix
    cache: SGLang's strictest path, which simulates every running request decoding to its end
    against the budget): the prompt's pages must fit the device rows (the row-bounded figure,
    ``available_rows_bound``), and SGLang's own checks then run on the logical ids alone.

    On the row-bounded figure a request whose prompt and ``max_new_tokens`` together exceed
    the device rows was never admitted (``long_output_past_device_rows``: queued for good on
    an idle server), though its outputs take logical ids and at most B + 1 rows."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    budget = getattr(adder, "memory_budget", None)
    if _coordinator(getattr(budget, "allocator", None)) is None:
        return original(adder, req, *args, **kwargs)
    paged = (adder.ceil_paged_tokens(len(req.full_untruncated_fill_ids) - req.prefix_len)
             + adder.per_req_token_overhead + adder._request_slot_reserve_for_req(req))
    if paged > min(budget.remaining_current, budget.remaining_total):
        return AddReqResult.NO_TOKEN
    budget._hisparse_logical_only = True
    try:
        return original(adder, req, *args, **kwargs)
    finally:
        budget._hisparse_logical_only = False
