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
    return original(req, tree_cache, *args, **kwargs)


def available_rows_bound(original: Callable[..., int], budget: Any, *args: Any, **kwargs: Any) -> int:
    """AROUND ``PrefillBudget._available_and_evictable``: SGLang's ``available + evictable``,
    at most the device rows a prefill could get (free plus what resident requests give up)."""
    total = original(budget, *args, **kwargs)
    allocator = getattr(budget, "allocator", None)
    if _coordinator(allocator) is None:
        return total
    return min(total, allocator.core.available_rows())


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
