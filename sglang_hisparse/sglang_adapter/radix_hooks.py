"""Hooks that let SGLang's radix cache share prefixes with HiSparse (co-located).

SGLang 0.5.23's tree holds ``req_to_token`` values, i.e. our logical ids, and a logical id's
host row is the id (``memory/host_pool.py``), so the tree needs no change; four call paths
need our side of the protocol (docs/prefix-cache.md):

| hook | type | what ours adds |
|---|---|---|
| ``mem_cache.allocation.alloc_for_extend`` | AROUND | after SGLang wrote each request's prefix and new ids into ``req_to_token``: ``prepare_prefix`` holds the tree part of the row (loading from host what no device row holds) and the ids this extend computed |
| ``mem_cache.common.release_kv_cache`` | AROUND | a request released before staging without ``request_finished`` (aborted between chunks) gets it first: its computed ids go to host, its holds are dropped |
| ``mem_cache.prefill_budget.PrefillBudget._available_and_evictable`` | AROUND | the tree's evictable ids free logical ids, not device rows: the budget is at most the rows |
| ``managers.schedule_policy.PrefillAdder._request_slot_reserve_for_req`` | AROUND | a new request's matched prefix may be loaded back into device rows: its page-rounded length is reserved |
| ``disaggregation.decode.DecodePreallocQueue._pre_alloc`` | AROUND | PD decode with its radix cache: SGLang's HiSparse branch asserts no prefix; ours runs it for the whole fill, then gives the matched positions back to the tree's ids (their host rows are the tree's) and returns only the suffix's host rows as the transfer destination |
| ``arg_groups.pd_disaggregation_hook.handle_pd_disaggregation`` | AROUND | its decode-radix branch refuses HiSparse inline: ours runs it with HiSparse hidden, after applying the HiSparse rules that hiding would skip |

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
    """AROUND ``alloc_for_extend(batch)`` -> ``(out_cache_loc, req_pool_indices, *_cpu)``."""
    out = original(batch, *args, **kwargs)
    tree = getattr(batch, "tree_cache", None)
    coord = _coordinator(getattr(tree, "token_to_kv_pool_allocator", None))
    if coord is None or not _sharing(tree):
        return out
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
    """AROUND ``PrefillBudget._available_and_evictable``: SGLang's ``available + evictable``,
    at most the device rows a prefill could get (free plus what resident requests give up)."""
    total = original(budget, *args, **kwargs)
    allocator = getattr(budget, "allocator", None)
    if _coordinator(allocator) is None:
        return total
    return min(total, allocator.core.available_rows())


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
