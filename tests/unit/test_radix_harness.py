"""Radix cache in the CPU harness: shared prefixes, multi-turn, duplicates, releases (exact, leak-free).

The toy tree (``hisparse_testing/toy_radix.py``) plays SGLang's radix cache: matched prefixes
are held and loaded back from host rows (the host row of a logical id is the id), prefill rows
another request reads are copied at collect, a checkpoint's duplicates are freed and repointed,
and a finished request's prompt + output stay in the tree. Every decode step is compared with
the all-resident oracle; at the end the tree is evicted through the allocator and nothing may be
left.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse_testing.engine import DecodeEngine, EngineSizes, ReqStatus, ToyRequest
from hisparse_testing.scenario import ScenarioSpec, ci_seed, replay_note, run_scenario
from hisparse_testing.toy_model import ToyModel

BASE_SEED = ci_seed()

CONFIGS = {
    "L3-k4-B8-p1": (ToyModel(num_layers=3, top_k=4, item_bytes=16, shared=(False, True, False)),
                    EngineSizes(num_reqs=6, buffer_size=8, device_rows=192, max_ctx=64, page_size=1)),
    "L2-k4-B8-p2": (ToyModel(num_layers=2, top_k=4, item_bytes=16, shared=(False, True)),
                    EngineSizes(num_reqs=6, buffer_size=8, device_rows=192, max_ctx=64, page_size=2)),
    "L3-k8-B16-p4": (ToyModel(num_layers=3, top_k=8, item_bytes=32, shared=(False, True, True)),
                     EngineSizes(num_reqs=5, buffer_size=16, device_rows=256, max_ctx=96, page_size=4)),
}


def _engine(config: str, *, residency: str = "always_hot", **kw) -> DecodeEngine:
    model, sizes = CONFIGS[config]
    watermark = sizes.page_size * 2 if residency == "pressure" else 0
    return DecodeEngine(model, sizes, skip_io=False, radix=True, residency=residency,
                        watermark_rows=watermark, **kw)


def _run(engine: DecodeEngine, req: ToyRequest) -> ToyRequest:
    """Admit one request and decode it to its end, alone."""
    assert engine.can_admit(req)
    engine.prefill(req)
    while req.status is ReqStatus.STAGING:
        engine.collect()
    while req.generated < req.max_new:
        engine.step()
        engine.check_integrity()
    engine.release(req, "finish")
    return req


@pytest.mark.parametrize("residency", ["always_hot", "pressure"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_random_radix_lifecycles_are_exact_and_leak_free(config: str, residency: str) -> None:
    """Random lifecycles where most prompts share one of two prefixes: staging and PD
    admissions, aborts, retractions (a retracted request re-matches its own prompt), two
    prefills per batch (duplicates), memory pressure; exact at every step, nothing left."""
    totals = {"hit": 0, "load": 0, "copy": 0, "lifecycles": 0}
    for seed in range(3):
        engine = _engine(config, residency=residency, decode_alloc_rows=seed == 1,
                         new_token_ratio=(1.0, 0.6, 1.0)[seed])
        _, sizes = CONFIGS[config]
        spec = ScenarioSpec(num_requests=10, max_prompt=sizes.max_ctx // 2, max_new=sizes.buffer_size,
                            p_shared=0.8, p_direct=0.15)
        s = BASE_SEED + 31 * seed + len(config)
        try:
            stats = run_scenario(engine, random.Random(s), spec)
        except AssertionError as e:
            e.add_note(replay_note(BASE_SEED, f"tests/unit/test_radix_harness.py::test_random_radix_lifecycles_are_exact_and_leak_free[{config}-{residency}]"))
            raise
        snap = engine.core.telemetry.snapshot()
        totals["hit"] += snap.prefix_hit_tokens
        totals["load"] += snap.prefix_load_tokens
        totals["copy"] += snap.prefix_copy_rows
        totals["lifecycles"] += stats.lifecycles
    assert totals["hit"] > 0 and totals["lifecycles"] >= 30, totals


def test_a_finished_prefix_is_loaded_back_from_host_and_decodes_exactly() -> None:
    engine = _engine("L3-k4-B8-p1")
    first = _run(engine, ToyRequest(rid=0, seed=11, prompt_len=30, max_new=4, prefix_seed=7, shared_len=24))
    assert first.status is ReqStatus.DONE and engine.tree.size() == 34  # prompt + output (every harness token has KV)
    second = ToyRequest(rid=1, seed=12, prompt_len=28, max_new=6, prefix_seed=7, shared_len=24)
    _run(engine, second)
    snap = engine.core.telemetry.snapshot()
    assert second.matched == 24 and snap.prefix_hit_tokens == 24 and snap.prefix_load_tokens == 24
    engine.check_no_leaks()


def test_a_request_reads_a_staging_requests_rows_and_both_get_private_buffers() -> None:
    """B matches A's pages while A stages: B reads A's prefill rows (nothing loaded); at A's
    collect the pages B holds are copied into A's buffer, B later takes them over."""
    engine = _engine("L2-k4-B8-p2")
    a = ToyRequest(rid=0, seed=1, prompt_len=20, max_new=5, prefix_seed=9, shared_len=18)
    b = ToyRequest(rid=1, seed=2, prompt_len=22, max_new=5, prefix_seed=9, shared_len=18)
    engine.prefill(a)
    engine.prefill(b)  # A is still staging: its rows are on the device
    assert b.matched == 18
    engine.collect()
    for _ in range(5):
        engine.step()
        engine.check_integrity()
    snap = engine.core.telemetry.snapshot()
    assert snap.prefix_load_tokens == 0 and snap.prefix_copy_rows > 0
    for q in (a, b):
        engine.release(q, "finish")
    engine.check_no_leaks()


@pytest.mark.parametrize("residency", ["pressure", "always_hot"])
def test_a_match_on_a_running_request_copies_its_rows_device_to_device(residency: str) -> None:
    """B matches A's pages while A decodes: resident, A's buffer still maps every id, so B's
    prefill rows are copied from A's rows and nothing is loaded; hot, A maps only its newest
    token, so the prefix comes from host. Exact either way, and A keeps decoding."""
    engine = _engine("L2-k4-B8-p2", residency=residency)
    a = ToyRequest(rid=0, seed=1, prompt_len=20, max_new=6, prefix_seed=9, shared_len=18)
    engine.prefill(a)
    engine.collect()
    engine.step()
    b = ToyRequest(rid=1, seed=2, prompt_len=22, max_new=5, prefix_seed=9, shared_len=18)
    engine.prefill(b)
    assert b.matched == 18
    engine.collect()
    for _ in range(5):
        engine.step()
        engine.check_integrity()
    snap = engine.core.telemetry.snapshot()
    if residency == "pressure":
        assert snap.prefix_load_tokens == 0 and snap.prefix_copy_rows == 18, snap
    else:
        assert snap.prefix_load_tokens == 18 and snap.prefix_copy_rows == 0, snap
    for q in (a, b):
        engine.release(q, "finish")
    engine.check_no_leaks()


def test_a_hot_requests_stale_newest_mapping_is_not_a_copy_source() -> None:
    """A hot request's prompt fills whole pages, so its last token is in the tree; after a
    decode step that token's mapping still points at slot B (SGLang's overlap scheduler may
    read it), which now holds a later token. A request matching the whole prompt must load
    that page from host, not copy slot B's row."""
    engine = _engine("L2-k4-B8-p2", residency="always_hot")
    a = ToyRequest(rid=0, seed=1, prompt_len=20, max_new=6, prefix_seed=9, shared_len=20)
    engine.prefill(a)
    engine.collect()
    for _ in range(2):
        engine.step()
    b = ToyRequest(rid=1, seed=2, prompt_len=24, max_new=3, prefix_seed=9, shared_len=20)
    engine.prefill(b)
    assert b.matched == 20
    ids = engine.req_to_token[b.req_pool_idx, :20]
    pos = torch.arange(20)
    for layer in range(engine.model.num_layers):
        assert torch.equal(engine.pool.read(layer, ids), engine._kv(b, pos, layer)), layer
    engine.collect()
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    for q in (a, b):
        engine.release(q, "finish")
    engine.check_no_leaks()


def test_identical_prompts_in_one_batch_dedup_and_stage_only_their_own_ids() -> None:
    engine = _engine("L3-k8-B16-p4")
    reqs = [ToyRequest(rid=i, seed=100 + i, prompt_len=26, max_new=6, prefix_seed=5, shared_len=26) for i in range(3)]
    for q in reqs:
        assert engine.can_admit(q)
        engine.prefill(q, defer=True)  # one batch: nobody matched anybody yet
    assert all(q.matched == 0 for q in reqs)
    used = engine.allocator.logical.used_size()
    engine.flush_prefills()  # the 2nd and 3rd checkpoints find the 1st's 6 pages: freed, repointed
    assert engine.allocator.logical.used_size() == used - 2 * 24
    assert engine.core.telemetry.staged_tokens == 26 + 2 * 2  # duplicates are not staged again
    engine.collect()
    for _ in range(6):
        engine.step()
        engine.check_integrity()
    for q in reqs:
        engine.release(q, "finish")
    engine.check_no_leaks()


def test_a_request_finished_at_its_prefill_leaves_host_rows_the_next_match_can_read() -> None:
    """Released before staging (SGLang: finished at prefill, aborted between chunks): the tree
    keeps the pages it computed, so their KV goes to host first."""
    engine = _engine("L3-k4-B8-p1")
    a = ToyRequest(rid=0, seed=3, prompt_len=20, max_new=1, prefix_seed=4, shared_len=20)
    engine.prefill(a, defer=True)
    engine.release(a, "finish")
    assert engine.tree.size() == 20
    b = ToyRequest(rid=1, seed=6, prompt_len=25, max_new=6, prefix_seed=4, shared_len=20)
    _run(engine, b)
    assert b.matched == 20 and engine.core.telemetry.snapshot().prefix_load_tokens == 20
    engine.check_no_leaks()


@pytest.mark.parametrize("residency", ["always_hot", "pressure"])
def test_multi_turn_matches_prompt_and_output_of_the_previous_turn(residency: str) -> None:
    """Turn t+1 is turn t's prompt + output + new tokens: the output tokens' host rows (the
    last one written through at finish) are read back."""
    engine = _engine("L3-k4-B8-p1", residency=residency)  # page 1: the newest token stays in the tree
    n = 12
    for turn in range(5):
        q = _run(engine, ToyRequest(rid=turn, seed=77, prompt_len=n, max_new=5))
        if turn:
            assert q.matched >= (n - 1) // 2 * 2 - 2, (turn, q.matched, n)
        n = q.seq_len + 3
    engine.check_no_leaks()


def test_an_abort_while_staging_keeps_the_tree_pages_readable() -> None:
    engine = _engine("L3-k4-B8-p1")
    a = ToyRequest(rid=0, seed=8, prompt_len=18, max_new=3, prefix_seed=2, shared_len=18)
    engine.prefill(a)
    engine.release(a, "abort")  # staging: the copy lands; its prefill's checkpoint keeps the prompt
    assert engine.tree.size() == 18
    b = ToyRequest(rid=1, seed=9, prompt_len=20, max_new=4, prefix_seed=2, shared_len=18)
    _run(engine, b)
    assert b.matched == 18
    engine.check_no_leaks()


def test_pages_wait_for_their_host_copy_until_their_request_is_staged() -> None:
    """A computed page is host-pending until its request's staging lands (or its ids are
    freed): a collect that would read it from host waits (Lifecycle._take_rows)."""
    engine = _engine("L2-k4-B8-p2")
    a = engine.allocator
    ids = a.alloc_extend(torch.tensor([0]), torch.tensor([6]), torch.tensor([-1]))
    a.note_computed(3, ids)
    assert a.host_pending(ids) and a.host_pending(ids[:2]) and a.holds(3)
    a.mark_landed(3)
    assert not a.host_pending(ids)
    a.note_computed(3, ids[:2])
    a.free(ids)  # a checkpoint's duplicates: freed, no longer pending, no longer held
    assert not a.host_pending(ids) and not a.holds(3) and a.computed_ids(3).numel() == 0
    a.unhold(3)
    a.check_integrity()


def test_a_finished_resident_request_leaves_its_rows_as_a_device_cache() -> None:
    """Radix cache with pressure residency: a finished resident request's pages stay as cached
    prefix rows, so the next turn on its prompt loads nothing; allocations take them back
    first, and the tree's eviction frees them with their ids."""
    engine = _engine("L3-k4-B8-p1", residency="pressure")
    a = engine.allocator
    first = _run(engine, ToyRequest(rid=0, seed=31, prompt_len=30, max_new=4))
    assert a.cached_rows == first.seq_len and engine.core.residency_counts()["cached_rows"] == first.seq_len
    second = _run(engine, ToyRequest(rid=1, seed=31, prompt_len=first.seq_len + 3, max_new=4))
    snap = engine.core.telemetry.snapshot()
    assert second.matched == first.seq_len and snap.prefix_hit_tokens == first.seq_len
    assert snap.prefix_load_tokens == 0  # on the device already
    before = a.rows.available_size()
    assert a.evict_cached(1) == 1 and a.rows.available_size() == before + 1
    engine.check_no_leaks()


def test_protected_cached_pages_outlive_an_allocation_that_evicts() -> None:
    """``protect_cached``: an extend that matched cached pages allocates its new ids first
    (SGLang's ``alloc_for_extend``), and an allocation short of rows evicts cached pages,
    oldest first; the matched (protected) ones are skipped, the others go, and after
    ``release_protected`` they are evictable again."""
    engine = _engine("L3-k4-B8-p1", residency="pressure")
    a = engine.allocator
    first = _run(engine, ToyRequest(rid=0, seed=41, prompt_len=20, max_new=4))
    second = _run(engine, ToyRequest(rid=1, seed=42, prompt_len=20, max_new=4))
    n1, n2 = first.seq_len, second.seq_len
    assert a.cached_rows == n1 + n2
    # pages of one id (p1), cached in release order: the first request's are the oldest
    ids1 = torch.tensor(list(a._cached)[:n1], dtype=torch.int64)
    # the oldest cached pages (the first request's) are what a later turn on it matched
    assert a.protect_cached(ids1) == n1
    taken = a.alloc(a.rows.available_size() + 3)  # 3 rows more than are free
    assert taken is not None
    assert a.cached_rows == n1 + n2 - 3 and bool((a.translate(ids1) > 0).all())
    a.release_protected()
    assert a.evict_cached(1) == 1 and a.cached_rows == n1 + n2 - 4
    a.free(taken)
    a.check_integrity()
