"""``state_bytes.slot_state_bytes`` equals what the coordinator allocates per request slot (CPU).

Sizes: L = 3 layers, R = 5 request slots, B = 6 hot slots, P = 70 host_rows columns (3 hint
words, the last one partly used), so every term of the formula has an odd size of its own.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hisparse_testing.device_pool import DeviceKVPool
from sglang_hisparse.coordinator.core import HiSparseCore
from sglang_hisparse.coordinator.state import SlotState
from sglang_hisparse.memory.allocator import DualSpaceAllocator
from sglang_hisparse.memory.host_pool import HostKVPool
from sglang_hisparse.memory.state_bytes import (
    coordinator_state_bytes,
    hint_words,
    resolver_bytes,
    slot_state_bytes,
)

L, R, B, P = 3, 5, 6, 70


def _host(max_context: int = P, num_layers: int = L) -> HostKVPool:
    return HostKVPool(num_layers=num_layers, item_bytes=16, capacity_tokens=128, page_size=1,
                      max_requests=R, max_context=max_context, pin=False)


def _state_bytes(state: SlotState, buffer_size: int) -> int:
    """Bytes of every tensor ``state`` holds; a tensor added to SlotState is counted here too,
    so the helper has to learn about it. The [B] LRU template is shared, not per request."""
    tensors = {name: t for name, t in vars(state).items() if isinstance(t, torch.Tensor)}
    assert tensors.pop("_lru_init").shape == (buffer_size,)
    return sum(t.nbytes for t in tensors.values())


def test_hint_words():
    assert [hint_words(max_context=p, num_draft_tokens=0) for p in (0, 1, 32, 33, 70)] == [0, 1, 1, 2, 3]
    # the verify kernel reads no hint, whatever the window (W = 1 included)
    assert hint_words(max_context=70, num_draft_tokens=1) == 0
    assert hint_words(max_context=70, num_draft_tokens=2) == 0


@pytest.mark.parametrize(
    ("draft_tokens", "per_request"),
    [
        # L * (slot_tokens (B+1)*4 + lru B*2 + hint 3*4) + slot_rows (B+1)*4 + host_rows P*8
        (0, 3 * (7 * 4 + 6 * 2 + 3 * 4) + 7 * 4 + 70 * 8),
        # speculative decoding, W = 1: the same B+1 columns, no hint
        (1, 3 * (7 * 4 + 6 * 2) + 7 * 4 + 70 * 8),
        # speculative decoding, W = 3: B+3 columns, no hint
        (3, 3 * (9 * 4 + 6 * 2) + 9 * 4 + 70 * 8),
    ],
)
def test_helper_matches_the_tensors_slot_state_and_host_rows_allocate(draft_tokens, per_request):
    state = SlotState(num_layers=L, num_reqs=R, buffer_size=B, device="cpu",
                      num_draft_tokens=draft_tokens, hint_positions=P)
    assert (state.resident is not None) == (draft_tokens == 0)
    helper = slot_state_bytes(num_layers=L, buffer_size=B, max_context=P, num_draft_tokens=draft_tokens)
    assert helper == per_request
    assert _state_bytes(state, B) + _host().host_rows.nbytes == R * helper


def test_one_draft_token_allocates_no_resident_hint():
    """speculative_num_draft_tokens = 1 runs the verify kernel, which reads no hint: the core
    must not build one, and the budget must not charge it (61 layers, 256 slots, 128K: the
    hint alone is 61 * 256 * 4096 words = 244 MiB)."""
    alloc = DualSpaceAllocator(32, host_to_device_ratio=2)
    pool = DeviceKVPool(num_layers=L, item_bytes=16, allocator=alloc)
    host = _host()
    core = HiSparseCore(top_k=2, buffer_size=B, num_reqs=R, allocator=alloc, host=host,
                        device_kv=pool.kv, host_kv=host.kv, device="cpu", max_batch=R,
                        log_interval_s=0, num_draft_tokens=1)
    assert core.spec is not None and core.state.resident is None
    big = dict(request_slots=256, num_layers=61, buffer_size=4096, max_context=128 * 1024, top_k=2048)
    saved = coordinator_state_bytes(**big) - coordinator_state_bytes(**big, num_draft_tokens=1)
    assert saved == 61 * 256 * (128 * 1024 // 32) * 4  # the hint, and nothing else differs


@pytest.mark.parametrize("draft_tokens", [0, 1, 2])
def test_helper_matches_what_hisparse_core_builds(draft_tokens):
    # the core sizes the hint by its host pool's columns and drops it under speculative decoding
    k, b, max_context = 2, 4, 40
    alloc = DualSpaceAllocator(32, host_to_device_ratio=2)
    pool = DeviceKVPool(num_layers=2, item_bytes=16, allocator=alloc)
    host = _host(max_context=max_context, num_layers=2)
    core = HiSparseCore(top_k=k, buffer_size=b, num_reqs=R, allocator=alloc, host=host,
                        device_kv=pool.kv, host_kv=host.kv, device="cpu", max_batch=R,
                        log_interval_s=0, num_draft_tokens=draft_tokens)
    helper = slot_state_bytes(num_layers=2, buffer_size=b, max_context=max_context,
                              num_draft_tokens=draft_tokens)
    assert _state_bytes(core.state, b) + host.host_rows.nbytes == R * helper


@pytest.mark.parametrize("draft_tokens", [0, 1, 3])
def test_resolver_bytes_match_the_resolvers_buffers(draft_tokens):
    # out_rows, the miss plan and the batch ids per decode-batch row; with speculative decoding
    # (even W = 1) they are the verify kernel's, at W*k columns, and there are no decode ones
    # (CPU: no counters)
    k, b, max_batch = 4, 16, 3
    alloc = DualSpaceAllocator(64, host_to_device_ratio=2)
    pool = DeviceKVPool(num_layers=2, item_bytes=16, allocator=alloc)
    host = _host(max_context=40, num_layers=2)
    core = HiSparseCore(top_k=k, buffer_size=b, num_reqs=R, allocator=alloc, host=host,
                        device_kv=pool.kv, host_kv=host.kv, device="cpu", max_batch=max_batch,
                        log_interval_s=0, num_draft_tokens=draft_tokens)
    res = core.resolver
    held = [res.out_rows, res._batch_ids, res.plan.src, res.plan.dst, res.plan.count]
    tensors = [t for t in vars(res).values() if isinstance(t, torch.Tensor)]
    # out_rows, batch ids and num_real_reqs (the core's, not counted)
    assert len(tensors) == 3
    assert res.out_rows.shape[1:] == ((draft_tokens, k) if draft_tokens else (k,))
    assert sum(t.nbytes for t in held) == max_batch * resolver_bytes(
        top_k=k, num_draft_tokens=draft_tokens, cuda=False)
    # on CUDA the one kernel the resolver launches adds one int32 arrival counter per batch row
    assert resolver_bytes(top_k=k, num_draft_tokens=draft_tokens) - resolver_bytes(
        top_k=k, num_draft_tokens=draft_tokens, cuda=False) == 4


def test_the_planner_imports_the_helper_without_torch():
    code = "import sys, sglang_hisparse.planner; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
