"""HiSparseCore on hand-built 4-slot states: exact slots, rows, LRU, host bytes and errors.

Sizes: L = 2 layers, R = 4 request slots, B = 4 hot slots, k = 2, I = 16 bytes, page 1.
KV bytes of token p at layer l are ``_kv(p, l)`` (every byte = 10*l + p), so a host or
device row can be checked by value.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

from hisparse_testing.device_pool import DeviceKVPool
from sglang_hisparse.coordinator.core import HiSparseCore
from sglang_hisparse.coordinator.resolver import build_prefetch_groups
from sglang_hisparse.coordinator.state import Phase
from sglang_hisparse.coordinator.streams import NullEvent
from sglang_hisparse.kernels import ResolveMode
from sglang_hisparse.memory.allocator import DualSpaceAllocator
from sglang_hisparse.memory.host_pool import HostKVPool

L, R, B, K, ITEM = 2, 4, 4, 2, 16


def _kv(p: int, layer: int) -> torch.Tensor:
    return torch.full((ITEM,), 10 * layer + p, dtype=torch.uint8)


class Rig:
    """Allocator + pools + core, and the little bit of scheduler the tests need."""

    def __init__(
        self, shared: list[bool] | None = None, prefetch: bool | None = True, skip_io: bool | None = False
    ) -> None:
        self.alloc = DualSpaceAllocator(32, host_to_device_ratio=2)
        self.pool = DeviceKVPool(num_layers=L, item_bytes=ITEM, allocator=self.alloc)
        self.host = HostKVPool(
            num_layers=L, item_bytes=ITEM, capacity_tokens=64, page_size=1,
            max_requests=R, max_context=32, pin=False,
        )
        self.core = HiSparseCore(
            top_k=K, buffer_size=B, num_reqs=R, allocator=self.alloc, host=self.host,
            device_kv=self.pool.kv, host_kv=self.host.kv, device="cpu",
            shared_index_layers=shared, max_batch=4, prefetch=prefetch, skip_io=skip_io,
            log_interval_s=0,
        )
        self.ids: dict[int, list[int]] = {}

    def prefill(self, r: int, n: int, *, stage: bool = True) -> torch.Tensor:
        ids = self.alloc.alloc_extend(torch.tensor([0]), torch.tensor([n]), torch.tensor([-1]))
        for layer in range(L):
            self.pool.write(layer, ids, torch.stack([_kv(p, layer) for p in range(n)]))
        self.ids[r] = ids.tolist()
        if stage:
            self.core.admit_staging(r, ids, req=f"req{r}")
        return ids

    def step(self, rs: list[int]) -> torch.Tensor:
        """One decode step: a logical id each, map_last_loc, the new tokens' KV written."""
        lens = [len(self.ids[r]) + 1 for r in rs]
        new = self.alloc.alloc_decode(torch.tensor(lens), torch.tensor([self.ids[r][-1] for r in rs]))
        for r, i in zip(rs, new.tolist(), strict=True):
            self.ids[r].append(i)
        self.core.map_last_loc(
            req_index=torch.tensor(rs), seq_lens=torch.tensor(lens), new_logical=new,
            req_index_cpu=rs, seq_lens_cpu=lens,
        )
        self.core.wait_for_pending_backup()
        for layer in range(L):
            self.pool.write(layer, new, torch.stack([_kv(n - 1, layer) for n in lens]))
        return new

    def swap(self, rs: list[int], top_k: list[list[int]], layer: int) -> torch.Tensor:
        self.core.num_real_reqs.fill_(len(rs))
        lens = torch.tensor([len(self.ids[r]) for r in rs])
        return self.core.swap_in(torch.tensor(rs), lens, torch.tensor(top_k, dtype=torch.int32), layer)

    def release(self, r: int) -> None:
        self.core.finish(r)
        self.alloc.free(torch.tensor(self.ids.pop(r)))

    def host_bytes(self, r: int, p: int, layer: int) -> int:
        return int(self.host.kv[layer, int(self.host.host_rows[r, p]), 0])

    def assert_empty(self) -> None:
        self.alloc.check_integrity()
        self.host.check_integrity()
        assert self.alloc.logical.used_size() == 0
        assert self.alloc.rows.used_size() == 0
        assert int(self.host.allocated_lens.sum()) == 0
        assert all(p is Phase.FREE for p in self.core.state.phase)


def test_staging_then_collect_shrinks_a_long_prompt_to_its_hot_buffer() -> None:
    rig = Rig()
    ids = rig.prefill(1, 7)
    prompt_rows = rig.alloc.translate(ids).tolist()
    assert rig.core.has_ongoing_staging() and rig.core.staging_queue[0].req == "req1"
    # every prompt token of every layer is on host
    assert [rig.host_bytes(1, p, 1) for p in range(7)] == [10 + p for p in range(7)]
    ready = rig.core.collect_ready()
    assert [e.req for e in ready] == ["req1"] and not rig.core.has_ongoing_staging()
    st = rig.core.state
    # slots 0..3 keep tokens 0..3, slot B holds the newest token (6)
    assert st.slot_tokens[:, 1].tolist() == [[0, 1, 2, 3, 6]] * L
    assert st.slot_rows[1].tolist() == prompt_rows[:4] + [prompt_rows[6]]
    assert st.lru[:, 1].tolist() == [[0, 1, 2, 3]] * L
    assert st.rows_held(1) == 5 and st.skip_backup[1] and st.phase[1] is Phase.DECODING
    assert rig.alloc.rows.used_size() == 5  # the other prompt rows went back


def test_first_step_after_staging_skips_the_backup_then_writes_through() -> None:
    rig = Rig()
    rig.prefill(0, 6)
    rig.core.collect_ready()
    new = rig.step([0])  # n = 7: token 5 is on host already
    st = rig.core.state
    assert rig.core.telemetry.backup_tokens == 0
    assert st.slot_tokens[:, 0, B].tolist() == [6, 6]
    assert int(rig.alloc.translate(new)[0]) == int(st.slot_rows[0, B])
    rig.step([0])  # n = 8: token 6 leaves slot B for the host
    assert rig.core.telemetry.backup_tokens == 1
    assert [rig.host_bytes(0, 6, layer) for layer in range(L)] == [6, 16]
    rig.release(0)
    rig.assert_empty()


def test_the_forward_waits_once_per_backup(monkeypatch) -> None:
    """wait_for_pending_backup orders the forward stream after the last backup once: the
    wait stays enqueued on that stream, so repeating it each step is a stale wait."""
    rig = Rig()
    rig.prefill(0, 6)
    rig.core.collect_ready()
    waits: list[object] = []
    streams = rig.core.streams  # pretend to be CUDA for the stream calls only
    monkeypatch.setattr(streams, "is_cuda", True)
    # not an SGLang object: a recorder in place of torch.cuda's current stream (no CUDA on CPU)
    monkeypatch.setattr(streams, "current", lambda: SimpleNamespace(wait_event=waits.append, wait_stream=lambda s: None))
    monkeypatch.setattr(streams, "on", lambda side: contextlib.nullcontext())
    rig.step([0])  # first step after staging: no backup, nothing to wait for
    assert waits == []
    rig.step([0])  # token 6 backed up: the forward waits on it
    assert len(waits) == 1
    rig.core.wait_for_pending_backup()  # e.g. a second forward before the next step's backup
    assert len(waits) == 1
    rig.step([0])
    assert len(waits) == 2


def test_a_short_request_grows_one_row_per_step_and_gets_slot_B_past_B() -> None:
    rig = Rig()
    rig.prefill(2, 2)
    rig.core.collect_ready()
    st = rig.core.state
    assert st.rows_held(2) == 2 and st.slot_tokens[0, 2].tolist() == [0, 1, -1, -1, -1]
    rig.step([2])  # n = 3: slot 2 gets a row; token 1 already on host (staged)
    rig.step([2])  # n = 4: slot 3; token 2 backed up from slot 2
    rig.step([2])  # n = 5: first growth past B: slot B; token 3 backed up from slot 3
    assert st.rows_held(2) == 5
    assert st.slot_tokens[1, 2].tolist() == [0, 1, 2, 3, 4]
    assert st.lru[1, 2].tolist() == [0, 1, 2, 3]
    assert len(set(st.slot_rows[2].tolist())) == 5 and min(st.slot_rows[2].tolist()) > 0
    assert rig.core.telemetry.backup_tokens == 2
    assert [rig.host_bytes(2, p, 1) for p in range(4)] == [10, 11, 12, 13]
    # short path: positions map straight to their slots' rows
    rows = rig.swap([2], [[4, 1]], 0)
    assert rows.tolist() == [[int(st.slot_rows[2, B]), int(st.slot_rows[2, 1])]]
    rig.release(2)
    rig.assert_empty()


def _direct(rig: Rig, r: int, n: int) -> None:
    ids = rig.alloc.alloc_logical_extend(torch.tensor([0]), torch.tensor([n]), torch.tensor([-1]))
    rig.ids[r] = ids.tolist()
    rig.host.bind(r, 0, ids)
    for layer in range(L):
        rig.host.write(rig.host.host_rows[r, :n], torch.stack([_kv(p, layer) for p in range(n)]), layer)
    rig.core.admit_direct(r, n)


def test_direct_admission_preloads_short_requests_and_starts_long_ones_empty() -> None:
    rig = Rig()
    _direct(rig, 0, 3)
    _direct(rig, 1, 9)
    st = rig.core.state
    assert st.slot_tokens[0, 0].tolist() == [0, 1, 2, -1, -1]
    assert [int(rig.pool.kv[1, int(st.slot_rows[0, p]), 0]) for p in range(3)] == [10, 11, 12]
    assert st.slot_tokens[0, 1].tolist() == [-1, -1, -1, -1, 8] and st.rows_held(1) == B + 1
    # slot B holds the long request's newest token, loaded (a compressed layout resolves first)
    assert int(rig.pool.kv[1, int(st.slot_rows[1, B]), 0]) == 18
    assert rig.core.telemetry.snapshot().preload_tokens == 3 + 1
    # the long request's first resolve misses what it selects and copies it from host
    rig.step([0, 1])
    rows = rig.swap([0, 1], [[3, 0], [2, 7]], 1)
    got = rig.pool.kv[1, rows.reshape(-1).long(), 0].reshape(2, 2).tolist()
    assert got == [[13, 10], [12, 17]]
    assert rig.core.state.lru[1, 1].tolist() == [2, 3, 0, 1]  # evictables | misses 2->s0, 7->s1
    for r in (0, 1):
        rig.release(r)
    rig.assert_empty()


def test_finish_in_every_phase_returns_everything() -> None:
    rig = Rig()
    rig.prefill(0, 9)  # aborted while staging
    rig.prefill(1, 3)  # finishes while decoding
    rig.prefill(3, 5, stage=False)  # finished during prefill (never staged)
    rig.release(0)
    assert [e.req_slot for e in rig.core.staging_queue] == [1]
    rig.core.collect_ready()
    rig.step([1])
    rig.release(1)
    rig.release(3)
    rig.assert_empty()
    assert not rig.core.has_ongoing_staging()


def test_shared_layer_reuses_the_anchor_rows_and_receives_replayed_bytes() -> None:
    rig = Rig(shared=[False, True], prefetch=True)
    assert rig.core.resolver.groups == {0: [1]}
    rig.prefill(0, 8)
    rig.core.collect_ready()
    rig.step([0])  # n = 9
    anchor = rig.swap([0], [[6, 1]], 0)  # 6 misses, 1 hits (slot 1)
    assert rig.core.telemetry.snapshot().misses == 1
    shared = rig.swap([0], [[6, 1]], 1)
    assert shared.data_ptr() == anchor.data_ptr() and shared.tolist() == anchor.tolist()
    assert rig.pool.kv[1, anchor[0].long(), 0].tolist() == [16, 11]
    assert rig.core.telemetry.snapshot().h2d_bytes == 2 * ITEM  # anchor copy + one replay


def test_sync_mode_resolves_every_layer_against_its_own_state() -> None:
    rig = Rig(shared=[False, True], prefetch=False)
    assert not rig.core.prefetch_enabled and rig.core.resolver.groups == {}
    rig.prefill(0, 8)
    rig.core.collect_ready()
    rig.step([0])
    for layer in range(L):
        rows = rig.swap([0], [[6, 1]], layer)
        assert rig.pool.kv[layer, rows[0].long(), 0].tolist() == [10 * layer + 6, 10 * layer + 1]
    assert rig.core.telemetry.snapshot().misses == 2


def test_padding_rows_resolve_to_minus_one_and_are_not_counted() -> None:
    rig = Rig()
    rig.prefill(0, 8)
    rig.core.collect_ready()
    rig.step([0])
    rig.core.num_real_reqs.fill_(1)
    rows = rig.core.swap_in(torch.tensor([0, 0]), torch.tensor([9, 1]), torch.tensor([[6, 1], [0, -1]], dtype=torch.int32), 0)
    assert rows[1].tolist() == [-1, -1]
    snap = rig.core.telemetry.snapshot()
    assert (snap.selected, snap.misses) == (2, 1)


def test_collect_agrees_on_the_minimum_ready_count_across_tp_ranks(monkeypatch) -> None:
    rig = Rig()
    rig.prefill(0, 3)
    rig.prefill(1, 3)
    calls = []

    def fake_all_reduce(t, op=None, group=None):
        calls.append(int(t))
        t.fill_(1)  # another rank has only one copy done

    rig.core.lifecycle.tp_world_size = 2
    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    assert [e.req_slot for e in rig.core.collect_ready()] == [0]
    assert calls == [2] and [e.req_slot for e in rig.core.staging_queue] == [1]


def test_build_prefetch_groups() -> None:
    assert build_prefetch_groups([False, True, True, False, True, False]) == {0: [1, 2], 3: [4]}
    assert build_prefetch_groups([False, False]) == {}
    with pytest.raises(ValueError, match=r"shared_index_layers\[0\]"):
        build_prefetch_groups([True, False])


def test_bad_calls_raise_value_errors_that_say_what_to_do() -> None:
    rig = Rig()
    with pytest.raises(ValueError, match="request slot 0 is free"):
        rig.core.map_last_loc(
            req_index=torch.tensor([0]), seq_lens=torch.tensor([3]), new_logical=torch.tensor([5]),
            req_index_cpu=[0], seq_lens_cpu=[3],
        )
    rig.prefill(0, 4)
    with pytest.raises(ValueError, match="request slot 0 is staging, expected free"):
        rig.core.admit_staging(0, torch.tensor([1, 2]))
    rig.core.collect_ready()
    with pytest.raises(ValueError, match="expected 5"):
        rig.core.map_last_loc(
            req_index=torch.tensor([0]), seq_lens=torch.tensor([7]), new_logical=torch.tensor([5]),
            req_index_cpu=[0], seq_lens_cpu=[7],
        )
    with pytest.raises(ValueError, match="'device_buffer_size' = 2 must be >= top_k = 4.*at least 4"):
        HiSparseCore(
            top_k=4, buffer_size=2, num_reqs=R, allocator=rig.alloc, host=rig.host,
            device_kv=rig.pool.kv, host_kv=rig.host.kv, device="cpu",
        )
    with pytest.raises(ValueError, match="speculative"):
        rig.core.swap_in(torch.tensor([0]), torch.tensor([5]), torch.zeros(1, 2, K, dtype=torch.int32), 0)


def test_legacy_env_names_switch_prefetch_and_io_and_are_logged(monkeypatch, caplog) -> None:
    monkeypatch.setenv("SGLANG_DISABLE_HISPARSE_PREFETCH", "1")
    monkeypatch.setenv("SGLANG_DEBUG_HISPARSE_SKIP_IO", "1")
    with caplog.at_level(logging.INFO, logger="sglang_hisparse"):
        rig = Rig(shared=[False, True], prefetch=None, skip_io=None)
    assert not rig.core.prefetch_enabled and rig.core.resolver.mode is ResolveMode.NO_IO
    text = caplog.text
    assert "SGLANG_DISABLE_HISPARSE_PREFETCH" in text
    assert "SGLANG_DEBUG_HISPARSE_SKIP_IO" in text and "INVALID" in text


def test_explicit_arguments_override_the_environment(monkeypatch, caplog) -> None:
    monkeypatch.setenv("SGLANG_HISPARSE_SKIP_IO", "1")
    with caplog.at_level(logging.INFO, logger="sglang_hisparse"):
        rig = Rig(shared=[False, True], prefetch=True, skip_io=False)
    assert rig.core.prefetch_enabled and rig.core.resolver.mode is ResolveMode.COPY
    assert "INVALID" not in caplog.text


def test_layers_past_the_sharing_pattern_compute_their_own_index() -> None:
    rig = Rig(shared=[False])  # the pool has 2 layers, the pattern names 1
    assert rig.core.resolver.groups == {} and rig.core.resolver.is_shared == [False, False]


class _RecordingStream:
    """Records what a side stream was ordered after (CUDA stand-in for a CPU test)."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _RecordingStream) -> None:
        self.log.append((self.name, other.name))

    def wait_event(self, event: object) -> None:
        return None

    def synchronize(self) -> None:
        return None


@pytest.mark.parametrize(("prompt_written", "waits"), [
    (False, [("staging", "current"), ("staging", "forward")]),
    # SGLang's result processor synced the prefill's copy_done: the forward stream, which may
    # already hold the next batch, must not delay the staging copy (issue #28, defect 6)
    (True, [("staging", "current")]),
])
def test_staging_waits_for_the_forward_stream_only_when_the_prompt_may_be_unwritten(
    monkeypatch, prompt_written: bool, waits: list[tuple[str, str]]
) -> None:
    rig = Rig()
    streams, log = rig.core.streams, []
    current = _RecordingStream("current", log)
    monkeypatch.setattr(streams, "is_cuda", True)
    monkeypatch.setattr(streams, "current", lambda: current)
    monkeypatch.setattr(streams, "staging", _RecordingStream("staging", log))
    monkeypatch.setattr(streams, "on", lambda side: contextlib.nullcontext())
    monkeypatch.setattr(streams, "new_event", NullEvent)
    streams.set_producer(_RecordingStream("forward", log))
    ids = rig.alloc.alloc_extend(torch.tensor([0]), torch.tensor([5]), torch.tensor([-1]))
    rig.core.admit_staging(1, ids, req="req1", prompt_written=prompt_written)
    assert log == waits
