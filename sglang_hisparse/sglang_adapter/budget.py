"""Reserve the coordinator's GPU state out of the KV budget SGLang sizes its pool from.

SGLang 0.5.23 sizes the KV pool before ``ModelRunner.maybe_init_hisparse_coordinator`` builds
our coordinator, so nothing in its budget knows about our per-request-slot state::

    KVCacheConfigurator._resolve_memory_pool_config(pre)
      _profile_available_bytes(pre)    free GPU memory - slack           -> budget   <- AROUND hook here
      config_from_budget(budget)       budget // bytes per device row    -> T rows
      resolve_max_num_reqs(T)          --max-running-requests, else a heuristic of T -> R
    _init_pools                        req_to_token [R+1 (+PD pre-alloc), context+extra], T KV rows
    maybe_init_hisparse_coordinator    SlotState + host_rows + resolver buffers for every
                                       req_to_token row: state_bytes.coordinator_state_bytes

That state grows with the context (the resident hint and ``host_rows``) and with R, which SGLang
derives from T when ``--max-running-requests`` is not given (DeepSeek-V3.2 at 128K: 3.6 MB a
slot, over 3000 slots on an H200: 11 GB nobody budgeted, found missing at CUDA-graph capture).

:func:`reserve_coordinator_state` returns the profiled budget less that state, so the pool gets
``reserved // bytes per row`` fewer device rows and everything after it is SGLang's unchanged
arithmetic. R depends on T and T on the reservation: with ``f(R)`` = the R SGLang derives from
the budget less R's state (non-increasing in R), the reservation is for the smallest
``R* >= f(R*)`` (a bisection over ``[0, f(0)]``), so the R SGLang then picks is ``<= R*``.

NOTE: the hook is AROUND ``_profile_available_bytes`` (one int in, one int out; SGLang already
subtracts its own reservations there: non-static slack, the multimodal reserve) rather than
around ``config_from_budget`` (also the post-capture resize path, which HiSparse does not take,
and a PP all-reduce per call) or ``_resolve_memory_pool_config`` (which would mean re-profiling
or re-implementing it). The probes call SGLang's own configurator and ``resolve_max_num_reqs``,
so the reservation follows its sizing rules instead of a copy of them.

The coordinator, once built, logs its own figure against :func:`last_reservation`
(:func:`log_coordinator_state`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sglang_hisparse.memory.budget import GIB
from sglang_hisparse.memory.state_bytes import coordinator_state_bytes

logger = logging.getLogger("sglang_hisparse")

MIB = 2**20


def _size(n: int) -> str:
    """GiB for the figures of a real server, MiB below one GiB (small test or edge budgets)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


@dataclass(frozen=True)
class StateShape:
    """What the coordinator's state is sized by, as SGLang will build it on this rank."""

    num_layers: int  # L: local layers of the DSA pool
    buffer_size: int  # B
    max_context: int  # P: req_to_token columns (context_len + SGLang's headroom)
    top_k: int
    num_draft_tokens: int  # W, 0 without speculative decoding
    extra_rows: int  # req_to_token rows beyond max_running_requests (padding row, PD pre-alloc)
    cuda: bool
    policy: str = "lru"  # the replacement policy (its per-slot words count)
    residency_page_size: int = 0  # page size when the resident page table exists ("pressure")

    def bytes_for(self, request_slots: int) -> int:
        return coordinator_state_bytes(
            request_slots=request_slots, num_layers=self.num_layers,
            buffer_size=self.buffer_size, max_context=self.max_context, top_k=self.top_k,
            num_draft_tokens=self.num_draft_tokens, cuda=self.cuda, policy=self.policy,
            residency_page_size=self.residency_page_size,
        )


@dataclass(frozen=True)
class Reservation:
    """The reservation taken out of one KV budget (bytes per TP rank)."""

    budget_bytes: int  # what SGLang profiled
    reserved_bytes: int  # coordinator state for ``request_slots``
    max_running_requests: int  # R* the reservation covers
    request_slots: int  # R* + shape.extra_rows: req_to_token rows
    shape: StateShape

    @property
    def per_slot_bytes(self) -> int:
        return self.shape.bytes_for(1)


_last: Reservation | None = None


def last_reservation() -> Reservation | None:
    """The reservation this process took (None: the pool was sized without the hook)."""
    return _last


def clear_reservation() -> None:
    global _last
    _last = None


def state_shape(kvc: Any) -> StateShape:
    """The coordinator's sizes from SGLang's ``KVCacheConfigurator`` and runtime config: the
    values ``ModelRunner.maybe_init_hisparse_coordinator`` and ``_build_req_to_token_pool``
    will use."""
    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len
    from sglang.srt.runtime_context import get_disagg, get_spec

    from sglang_hisparse.sglang_adapter.arg_hook import parse_hisparse_config

    cfg = parse_hisparse_config()
    disagg = get_disagg()
    extra_rows = 1  # ReqToTokenPool's padding row 0
    if disagg.disaggregation_mode == "decode" or disagg.enable_pd_role_switch:
        extra_rows += disagg.disaggregation_decode_extra_slots or 0
    spec_on = not kvc.spec_algorithm.is_none()
    from sglang.srt.runtime_context import get_schedule

    resident = cfg.residency == "pressure" and not spec_on
    W = int(get_spec().speculative_num_draft_tokens or 0) if spec_on else 0
    layers = int(kvc.layer_info.num_effective_layers)
    top_k = int(cfg.top_k)  # the served model's selection width (the resolved config's)
    from sglang.srt.configs.model_config import is_minimax_sparse

    hf_config = kvc.model_config.hf_config
    if is_minimax_sparse(hf_config):  # the sparse layers only, resolving the merged selection
        from sglang_hisparse.arg_scope import m3_sparse_layers

        lo, hi = kvc.layer_info.start_layer, kvc.layer_info.end_layer
        layers = sum(1 for layer in m3_sparse_layers(hf_config) if lo <= layer < hi)
    return StateShape(
        num_layers=layers,
        buffer_size=int(cfg.device_buffer_size),
        max_context=int(kvc.model_config.context_len) + int(get_req_to_token_extra_context_len()),
        top_k=top_k,
        num_draft_tokens=W,
        extra_rows=int(extra_rows),
        cuda=str(kvc.device).startswith("cuda"),
        policy=cfg.policy,
        residency_page_size=int(get_schedule().page_size or 1) if resident else 0,
    )


@contextmanager
def _silenced(name: str) -> Iterator[None]:
    """Mute logger ``name`` for the probes: ``resolve_max_num_reqs`` warns about the R it
    returns, and SGLang logs the final one itself right after."""
    lg = logging.getLogger(name)
    was, lg.disabled = lg.disabled, True
    try:
        yield
    finally:
        lg.disabled = was


def _probe(kvc: Any) -> Callable[[int], tuple[int, int]]:
    """budget bytes -> (device rows, max_running_requests) as SGLang derives them."""
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_schedule

    configurator = create_memory_pool_configurator(kvc)
    page, cap = get_schedule().page_size, get_schedule().max_total_tokens

    def probe(budget: int) -> tuple[int, int]:
        if budget <= 0:
            return 0, 0
        try:
            rows = configurator.calculate_pool_sizes(budget, page).max_total_num_tokens
        except RuntimeError:  # MemoryPoolConfig's "Not enough memory": no row fits
            return 0, 0
        rows = min(rows, cap) if cap else rows
        if rows <= 0:
            return 0, 0
        with _silenced(type(kvc).__module__):
            return rows, int(kvc.resolve_max_num_reqs(rows))

    return probe


def plan_reservation(kvc: Any, budget: int) -> Reservation:
    """The smallest reservation that covers the R SGLang will pick (module docstring)."""
    shape = state_shape(kvc)
    probe = _probe(kvc)

    def derived(r: int) -> int:
        return probe(budget - shape.bytes_for(r + shape.extra_rows))[1]

    lo, hi = 0, derived(0)
    while lo < hi:  # g(r) = r - derived(r) is increasing: first r with g(r) >= 0
        mid = (lo + hi) // 2
        if mid >= derived(mid):
            hi = mid
        else:
            lo = mid + 1
    slots = lo + shape.extra_rows
    reserved = shape.bytes_for(slots)
    if probe(budget - reserved)[0] <= 0:
        plural = "" if slots == 1 else "s"
        raise ValueError(
            f"--enable-hisparse: the coordinator's GPU state needs {_size(reserved)} "
            f"({slots} request slot{plural} x {shape.bytes_for(1) / MIB:.2f} MiB: {shape.num_layers} "
            f"layers, device_buffer_size {shape.buffer_size}, {shape.max_context}-token rows) "
            f"out of a KV budget of {_size(budget)}, leaving no room for one page of KV rows. "
            f"Lower --max-running-requests or --context-length, lower 'device_buffer_size' in "
            f"--hisparse-config, or raise --mem-fraction-static."
        )
    return Reservation(budget_bytes=budget, reserved_bytes=reserved, max_running_requests=lo,
                       request_slots=slots, shape=shape)


def reserve_coordinator_state(original: Callable[..., int], kvc: Any, *args: Any, **kwargs: Any) -> int:
    """AROUND hook of ``KVCacheConfigurator._profile_available_bytes``: the profiled KV budget
    less the coordinator's state (module docstring); unchanged without HiSparse or in a draft
    worker (it sizes nothing: it reuses the target's pool config)."""
    global _last
    budget = original(kvc, *args, **kwargs)
    from sglang.srt.runtime_context import get_memory, get_schedule

    if kvc.is_draft_worker or not get_memory().enable_hisparse:
        return budget
    res = plan_reservation(kvc, budget)
    _last = res
    s = res.shape
    logger.info(
        "sglang-hisparse: reserved %s of the %s KV budget for the coordinator's GPU state "
        "(%d request slots x %.2f MiB: %d layers, B=%d, %d-token rows, resolver buffers "
        "included); the KV pool is sized from the remaining %s.%s",
        _size(res.reserved_bytes), _size(budget), res.request_slots, res.per_slot_bytes / MIB,
        s.num_layers, s.buffer_size, s.max_context, _size(budget - res.reserved_bytes),
        "" if get_schedule().max_running_requests else (
            f" SGLang derives max_running_requests ({res.max_running_requests}) from the pool; "
            f"--max-running-requests at the concurrency you serve shrinks the reservation."),
    )
    return budget - res.reserved_bytes


def log_coordinator_state(*, state_bytes: int, request_slots: int) -> None:
    """Startup line of the built coordinator: its GPU state and whether the budget covered it."""
    res = _last
    what = (f"HiSparse coordinator state: {_size(state_bytes)} ({state_bytes} B) on the GPU "
            f"for {request_slots} request slots")
    if res is None:
        logger.warning(
            "%s, NOT reserved out of the KV budget (the pool was sized without sglang-hisparse's "
            "budget hook); GPU memory may run out at CUDA-graph capture.", what)
    elif state_bytes > res.reserved_bytes:
        logger.warning(
            "%s, more than the %s (%d slots) reserved out of the KV budget; GPU memory may run "
            "out at CUDA-graph capture.", what, _size(res.reserved_bytes), res.request_slots)
    else:
        logger.info("%s, reserved out of the KV budget (%s reserved for %d slots).",
                    what, _size(res.reserved_bytes), res.request_slots)
