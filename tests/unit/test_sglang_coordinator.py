"""``SGLangHiSparseCoordinator`` against SGLang 0.5.23's real classes on CPU.

Built with the kwargs ``ModelRunner.maybe_init_hisparse_coordinator`` passes
(model_runner.py:1042-1058) over our SGLang-facing allocator/pool (built as
``kv_cache_configurator`` builds them) and SGLang's own ``ReqToTokenPool`` and ``Req``, then
driven through the calls the scheduler, ``prepare_for_decode``, the DSA backend and the PD
decode path make (``schedule_batch.py``, ``batch_result_processor.py``, ``dsa_backend.py``,
``disaggregation/decode.py`` in SGLang 0.5.23).
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

pytest.importorskip("sglang.srt.managers.hisparse_coordinator")

from sglang.srt.managers.hisparse_coordinator import (  # noqa: E402
    HiSparseCoordinator,
    HiSparseTokenStats,
)
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from hisparse_testing.sync_guard import (  # noqa: E402
    device_side,
    forbid_device_reads,
    mark_device_state,
)
from sglang_hisparse.coordinator.state import Phase  # noqa: E402
from sglang_hisparse.sglang_adapter.coordinator import SGLangHiSparseCoordinator  # noqa: E402
from sglang_hisparse.sglang_adapter.memory import HiSparseDSAPool, HiSparseTokenAllocator  # noqa: E402

DEVICE_ROWS, PAGE, RATIO, LAYERS = 1024, 64, 2, 2  # DSA pools use 64-token pages
TOP_K, B, R, MAX_CTX = 16, 64, 4, 512


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def _kv(p: int, layer: int) -> int:
    return (3 * p + 40 * layer) % 251


class Server:
    """The pieces SGLang would build, plus the coordinator under test."""

    def __init__(self, shared: list[bool] | None = None, num_draft_tokens: int = 0,
                 residency: str = "always_hot") -> None:
        self.pool = HiSparseDSAPool(
            DEVICE_ROWS, page_size=PAGE, dtype=torch.float8_e4m3fn, kv_lora_rank=512,
            qk_rope_head_dim=64, layer_num=LAYERS, device="cpu", kv_cache_dim=656,
            enable_memory_saver=False, start_layer=0, end_layer=LAYERS, index_head_dim=128,
            index_kpool=1, index_kpool_compress=False, tail_extra_slots=0,
            max_running_requests=R, host_to_device_ratio=RATIO,
        )
        self.alloc = HiSparseTokenAllocator(
            DEVICE_ROWS, page_size=PAGE, dtype=torch.float8_e4m3fn, device="cpu",
            kvcache=self.pool, need_sort=False, host_to_device_ratio=RATIO,
        )
        self.req_to_token_pool = ReqToTokenPool(
            size=R, max_context_len=MAX_CTX, device="cpu", enable_memory_saver=False
        )
        # model_runner.py:1042-1058
        self.coord = SGLangHiSparseCoordinator(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.alloc,
            top_k=TOP_K,
            device_buffer_size=B,
            device="cpu",
            tp_group=None,
            host_to_device_ratio=RATIO,
            swap_in_block_size=512,
            shared_index_layers=shared,
            num_draft_tokens=num_draft_tokens,
            # the hot-buffer path, step by step; "pressure" (the server default) has its own test
            residency=residency,
        )
        self.layers = self.coord.core.ctx.device_kv

    def new_req(self, r: int, n: int) -> Req:
        req = Req(f"rid{r}", "", list(range(n)), SamplingParams(max_new_tokens=8))
        req.kv.req_pool_idx = r
        return req

    def prefill(self, r: int, n: int) -> Req:
        req = self.new_req(r, n)
        ids = self.alloc.alloc_extend(t(0), t(0), t(n), t(n), t(-1), n)
        self.req_to_token_pool.req_to_token[r, :n] = ids.to(torch.int32)
        rows = self.pool.translate_loc_to_hisparse_device(ids)
        for layer in range(LAYERS):
            for p in range(n):
                self.layers[layer][rows[p]] = _kv(p, layer)
        req.extend_end = n
        req.kv.kv_allocated_len = n
        req.output_ids.append(7)  # the token sampled by the prefill forward
        return req

    def decode_step(self, reqs: list[Req], *, guard: bool = False) -> None:
        """prepare_for_decode (alloc_for_decode, seq_lens += 1, map_last_loc_to_buffer) and
        the new token's KV write through the pool's translation. ``guard``: the tensors SGLang
        passes on the device are marked device-side and the coordinator's calls may not read
        them (``hisparse_testing.sync_guard``)."""
        rs = [q.kv.req_pool_idx for q in reqs]
        lens = [q.kv.kv_allocated_len + 1 for q in reqs]
        last = t(*[int(self.req_to_token_pool.req_to_token[r, n - 2]) for r, n in zip(rs, lens, strict=True)])
        loc = self.alloc.alloc_decode(t(*lens), t(*lens), last)
        for q, r, n, x in zip(reqs, rs, lens, loc.tolist(), strict=True):
            self.req_to_token_pool.req_to_token[r, n - 1] = x
            q.kv.kv_allocated_len = n
        dev = device_side if guard else (lambda x: x)
        with forbid_device_reads() if guard else contextlib.nullcontext():
            self.coord.map_last_loc_to_buffer(dev(t(*lens)), dev(loc), dev(t(*rs)), t(*lens), t(*rs))
            self.coord.wait_for_pending_backup()
        self.coord.num_real_reqs.fill_(len(reqs))
        rows = self.pool.translate_loc_to_hisparse_device(loc)
        for layer in range(LAYERS):
            for row, n in zip(rows.tolist(), lens, strict=True):
                self.layers[layer][row] = _kv(n - 1, layer)

    def release(self, req: Req) -> None:
        """request_finished, then release_kv_cache's allocator.free of the logical ids."""
        r, n = req.kv.req_pool_idx, req.kv.kv_allocated_len
        self.coord.request_finished(req)
        self.alloc.free(self.req_to_token_pool.req_to_token[r, :n].to(torch.int64))

    def assert_empty(self) -> None:
        self.alloc.core.check_integrity()
        self.coord.host_pool.check_integrity()
        assert self.alloc.core.logical.used_size() == 0 and self.alloc.core.rows.used_size() == 0
        assert int(self.coord.host_pool.allocated_lens.sum()) == 0
        assert all(p is Phase.FREE for p in self.coord.core.state.phase)


def test_constructor_takes_the_native_keyword_arguments() -> None:
    """Every argument SGLang passes, and ours only as optional extras (SGLang never passes
    them; a server reads them from the validated --hisparse-config)."""
    native = set(inspect.signature(HiSparseCoordinator.__init__).parameters)
    params = inspect.signature(SGLangHiSparseCoordinator.__init__).parameters
    assert native <= set(params)
    # (after the plugin's REPLACE hook ran, SGLang's name is our class: no extras then)
    extras = set(params) - native
    assert extras <= {"residency", "residency_watermark"}
    assert all(params[name].default is None for name in {"residency", "residency_watermark"})


def test_pressure_residency_through_sglang_calls() -> None:
    """The server default: a staged long request keeps all its rows, resolves without misses
    (decode steps read nothing back from the device), and shrinks to its hot buffer when a
    prefill allocation finds the device short; outputs stay the request's own KV."""
    srv = Server(shared=[False, True], residency="pressure")
    coord = srv.coord
    req = srv.prefill(1, 300)  # 5 pages; a hot buffer keeps 2
    coord.admit_request_into_staging(req)
    assert coord.collect_ready_reqs() == [req]
    c = coord.core.residency_counts()
    assert c["resident"] == 1 and c["hot"] == 0
    srv.decode_step([req], guard=True)
    top_k = torch.tensor([[300, 3, 180, 299] + [-1] * (TOP_K - 4)], dtype=torch.int32)
    for layer in range(LAYERS):
        rows = coord.swap_in_selected_pages(t(1), t(301), top_k, layer)
        assert [int(srv.layers[layer][row, 0]) for row in rows[0, :4].tolist()] == [
            _kv(p, layer) for p in (300, 3, 180, 299)]
    assert coord.telemetry()["misses"] == 0
    srv.alloc.core.check_integrity()
    # a prefill bigger than the free rows: the allocator asks the coordinator, which shrinks
    filler = srv.prefill(0, 448)  # 7 of the 11 free pages
    assert srv.alloc.core.rows.available_size() == 4 * PAGE
    other = srv.prefill(2, 300)  # 5 pages: one shrink frees 3
    c = coord.core.residency_counts()
    assert c["shrinks"] == 1 and c["resident"] == 0 and c["hot"] == 1
    for layer in range(LAYERS):
        rows = coord.swap_in_selected_pages(t(1), t(301), top_k, layer)
        assert [int(srv.layers[layer][row, 0]) for row in rows[0, :4].tolist()] == [
            _kv(p, layer) for p in (300, 3, 180, 299)]
    srv.alloc.core.check_integrity()
    for q in (filler, other):
        coord.admit_request_into_staging(q)
    coord.collect_ready_reqs()
    for q in (req, filler, other):
        srv.release(q)
    srv.assert_empty()


def test_staging_decode_swap_in_and_finish_through_sglang_calls() -> None:
    srv = Server(shared=[False, True])
    coord = srv.coord
    assert coord.core.prefetch_enabled and coord.padded_buffer_size == 2 * PAGE
    req = srv.prefill(1, 100)  # long: 100 > B
    coord.admit_request_into_staging(req)
    assert req.hisparse_staging and coord.has_ongoing_staging()
    assert coord.ack_staging_queue[0].req is req
    assert coord.collect_ready_reqs() == [req]
    assert not req.hisparse_staging and not coord.has_ongoing_staging()
    st = coord.core.state
    assert st.slot_tokens[0, 1, B].item() == 99 and st.rows_held(1) == B + 1

    srv.decode_step([req])  # seq_len 101: token 100 -> slot B
    assert int(srv.pool.translate_loc_to_hisparse_device(
        srv.req_to_token_pool.req_to_token[1, 100:101].to(torch.int64))[0]) == int(st.slot_rows[1, B])
    top_k = torch.tensor([[100, 3, 80, 99] + [-1] * (TOP_K - 4)], dtype=torch.int32)
    for layer in range(LAYERS):  # layer 1 shares layer 0's index: replayed, same rows
        rows = coord.swap_in_selected_pages(t(1), t(101), top_k, layer)
        got = [int(srv.layers[layer][row, 0]) for row in rows[0, :4].tolist()]
        assert got == [_kv(p, layer) for p in (100, 3, 80, 99)]
        assert rows[0, 4:].tolist() == [-1] * (TOP_K - 4)

    stats = coord.get_token_stats()
    assert isinstance(stats, HiSparseTokenStats)
    assert stats.device_tokens == srv.alloc.core.rows.used_size() > 0
    assert stats.host_tokens >= 100 and 0.0 < stats.host_token_usage < 1.0
    counters = coord.telemetry()
    assert counters["misses"] == 2 and counters["staged_requests"] == 1

    srv.release(req)
    srv.assert_empty()


def test_short_request_grows_and_pd_direct_admission_preloads() -> None:
    srv = Server()
    coord = srv.coord
    short = srv.prefill(0, 10)
    coord.admit_request_into_staging(short)
    coord.collect_ready_reqs()
    # PD: logical ids only, host rows from the transfer path, then direct admission
    pd = srv.new_req(2, 30)
    ids = srv.alloc.alloc_logical_only(t(0), t(0), t(30), t(30), t(-1), 30)
    srv.req_to_token_pool.req_to_token[2, :30] = ids.to(torch.int32)
    host_rows = coord.mem_pool_host.alloc_paged_token_slots(
        coord.req_to_host_pool, coord.req_to_host_pool_allocated_len, 2, 0, coord.host_token_len(30)
    )
    for layer in range(LAYERS):
        coord.host_pool.kv[layer, host_rows] = torch.tensor([_kv(p, layer) for p in range(30)], dtype=torch.uint8)[:, None]
    pd.kv.kv_allocated_len = 30
    pd.output_ids.append(7)
    coord.admit_request_direct(pd)
    assert not pd.hisparse_staging and coord.core.state.rows_held(2) == 30

    for _ in range(3):
        srv.decode_step([short, pd])
    coord.num_real_reqs.fill_(2)
    top_k = torch.full((2, TOP_K), -1, dtype=torch.int32)
    top_k[0, :3] = torch.tensor([12, 0, 9])
    top_k[1, :3] = torch.tensor([32, 1, 29])
    rows = coord.swap_in_selected_pages(t(0, 2), t(13, 33), top_k, 1)
    got = [[int(srv.layers[1][row, 0]) for row in rows[b, :3].tolist()] for b in range(2)]
    assert got == [[_kv(p, 1) for p in (12, 0, 9)], [_kv(p, 1) for p in (32, 1, 29)]]
    for req in (short, pd):
        srv.release(req)
    srv.assert_empty()


def test_retract_while_staging_and_finish_before_staging_release_everything() -> None:
    srv = Server()
    staged = srv.prefill(0, 70)
    srv.coord.admit_request_into_staging(staged)
    srv.coord.retract_req(staged)  # schedule_batch.release_req -> retract_req
    assert not staged.hisparse_staging and not srv.coord.has_ongoing_staging()
    srv.release(staged)
    finished_in_prefill = srv.prefill(1, 5)
    srv.release(finished_in_prefill)  # batch_result_processor: finished prefill
    srv.assert_empty()


def test_unsupported_paths_say_so() -> None:
    srv = Server()
    with pytest.raises(ValueError, match=r"'device_buffer_size' = 64 must be >= speculative_num_draft_tokens \* top_k = 5 \* 16 = 80.*at least 80"):
        SGLangHiSparseCoordinator(
            req_to_token_pool=srv.req_to_token_pool, token_to_kv_pool_allocator=srv.alloc,
            top_k=TOP_K, device_buffer_size=B, device="cpu", tp_group=None, num_draft_tokens=5,
        )
    with pytest.raises(ValueError, match="DualSpaceAllocator.*not sglang-hisparse's HiSparseTokenAllocator"):
        SGLangHiSparseCoordinator(  # SGLang's own allocator would land here without the plugin
            req_to_token_pool=srv.req_to_token_pool, token_to_kv_pool_allocator=srv.alloc.core,
            top_k=TOP_K, device_buffer_size=B, device="cpu", tp_group=None,
        )
    with pytest.raises(ValueError, match="swap_in_selected_blocks is MiniMax-M3's call.*DSA backends call swap_in_selected_pages"):
        srv.coord.swap_in_selected_blocks(torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
                                          torch.zeros(1, 1, dtype=torch.int32), 0, 16)
    srv.coord.allocate_spec_scratch([0, 1])  # called for every new batch: a no-op without spec
    with pytest.raises(ValueError, match="num_draft_tokens = 0"):
        srv.coord.prepare_spec_verify(ScheduleBatch(reqs=[], req_to_token_pool=srv.req_to_token_pool, device="cpu"))
    srv.coord.destroy()


W = 3


def _verify_batch(srv: Server, reqs: list[Req], seq: list[int]) -> ScheduleBatch:
    """alloc_for_spec_decode (page_size 64: alloc_logical_only for positions not yet
    allocated) + eagle_prepare_for_verify's out_cache_loc; SGLang's no-verify-sync mode
    leaves seq_lens_cpu None. SGLang's own dataclass, built with the fields init_new sets
    (init_new itself reads the published 'spec' namespace through Req.is_prefill_only)."""
    r2t = srv.req_to_token_pool.req_to_token
    for q, s in zip(reqs, seq, strict=True):
        r, have = q.kv.req_pool_idx, q.kv.kv_allocated_len
        if have < s + W:
            last = t(int(r2t[r, have - 1]))
            ids = srv.alloc.alloc_logical_only(t(have), t(have), t(s + W), t(s + W), last, s + W - have)
            r2t[r, have : s + W] = ids.to(torch.int32)
            q.kv.kv_allocated_len = s + W
    rs = [q.kv.req_pool_idx for q in reqs]
    loc = torch.cat([r2t[r, s : s + W].to(torch.int64) for r, s in zip(rs, seq, strict=True)])
    return ScheduleBatch(reqs=reqs, req_to_token_pool=srv.req_to_token_pool, token_to_kv_pool_allocator=srv.alloc,
                         device="cpu", req_pool_indices=t(*rs), req_pool_indices_cpu=t(*rs), seq_lens=t(*seq),
                         seq_lens_cpu=None, out_cache_loc=loc)


def test_speculative_verify_rounds_through_sglang_calls() -> None:
    """allocate_spec_scratch -> staging/collect -> prepare_spec_verify -> target-verify
    swap_in_selected_pages (3-D top-k, dsa_seqlens_expanded) -> commit_spec_accept_tokens,
    twice; accepted drafts come back from host in the next round; finish leaks nothing."""
    srv = Server(shared=[False, True], num_draft_tokens=W)
    coord = srv.coord
    assert coord.spec_swap.scratch_capacity == PAGE and srv.alloc.request_slot_reserve(
        has_req_pool_slot=False, prefill_tokens=100) == PAGE
    coord.allocate_spec_scratch([1])  # alloc_for_extend
    req = srv.prefill(1, 100)
    coord.admit_request_into_staging(req)
    assert coord.collect_ready_reqs() == [req]
    for rnd, (s, picks, accept) in enumerate([
        (100, [[100, 3, 80], [101, 3, 50], [102, 100, 7]], [0, 1, -1]),  # accept 100, 101
        (102, [[101, 100, 3], [103, 101, 2], [104, 102, 101]], [0, -1, -1]),  # 101 missed back
    ]):
        batch = _verify_batch(srv, [req], [s])
        coord.prepare_spec_verify(batch)
        rows_w = srv.pool.translate_loc_to_hisparse_device(batch.out_cache_loc)
        for layer in range(LAYERS):  # the verify forward's KV writes, salted by round
            for j, row in enumerate(rows_w.tolist()):
                srv.layers[layer][row] = (_kv(s + j, layer) + 50 * (rnd + 1)) % 256
        coord.num_real_reqs.fill_(1)
        top_k = torch.full((1, W, TOP_K), -1, dtype=torch.int32)
        top_k[0, :, :3] = torch.tensor(picks)
        expanded = torch.tensor([s + 1 + j for j in range(W)], dtype=torch.int32)
        for layer in range(LAYERS):  # dsa_backend forward_extend (target verify)
            out = coord.swap_in_selected_pages(t(1), expanded, top_k, layer).view(W, -1)
            got = [[int(srv.layers[layer][x, 0]) for x in out[j, :3].tolist()] for j in range(W)]
            # window: this round's salt; 100, 101: accepted in round 0 (salt 50); prompt: 0
            want = [[(_kv(p, layer) + (50 * (rnd + 1) if p >= s else 50 if p >= 100 else 0)) % 256
                     for p in row] for row in picks]
            assert got == want, (rnd, layer)
        coord.commit_spec_accept_tokens(batch=batch, accept_indices=torch.tensor([accept], dtype=torch.int32))
        coord.core.spec.check_integrity()
    coord.commit_spec_accept_tokens(batch=None, accept_indices=torch.empty(0, dtype=torch.int32))  # idle
    srv.release(req)
    srv.assert_empty()


# -- PD decode: host rows taken before admission (disaggregation/decode.py) ----------------------


def _pd_prealloc(srv: Server, r: int, n: int) -> tuple[Req, torch.Tensor]:
    """``_pre_alloc`` under HiSparse (decode.py:2321-2344): logical ids only, then host rows
    for the RDMA destination; the request slot stays FREE until ``admit_request_direct``."""
    coord = srv.coord
    req = srv.new_req(r, n)
    ids = srv.alloc.alloc_logical_only(t(0), t(0), t(n), t(n), t(-1), n)
    srv.req_to_token_pool.req_to_token[r, :n] = ids.to(torch.int32)
    req.kv.kv_allocated_len = n
    host_rows = coord.mem_pool_host.alloc_paged_token_slots(
        coord.req_to_host_pool, coord.req_to_host_pool_allocated_len, r, 0, coord.host_token_len(n)
    )
    return req, host_rows


def test_pd_requests_released_before_admission_give_their_host_rows_back() -> None:
    """Transfer failure / abort / timeout: ``_release_request`` (decode.py:2812) calls
    request_finished on a request that was never admitted, then release_kv_cache."""
    srv = Server()
    pool, ids = srv.coord.host_pool, srv.coord.dual.logical
    full = ids.available_size()
    for n in (130, 70, 200):  # a burst of failed transfers, every slot reused
        for r in range(R):
            req, _ = _pd_prealloc(srv, r, n)
            assert ids.available_size() == full - -(-n // PAGE) * PAGE and pool.allocated_len(r) == n
            srv.release(req)
            srv.coord.request_finished(req)  # a second release (abort after the failure) is a no-op
            assert ids.available_size() == full and pool.allocated_len(r) == 0, (n, r)
            pool.check_integrity()
    srv.assert_empty()

    # the slot admits the next request normally
    req, host_rows = _pd_prealloc(srv, 1, 30)
    for layer in range(LAYERS):
        pool.kv[layer, host_rows] = torch.tensor([_kv(p, layer) for p in range(30)], dtype=torch.uint8)[:, None]
    req.output_ids.append(7)
    srv.coord.admit_request_direct(req)
    srv.decode_step([req])
    srv.coord.num_real_reqs.fill_(1)
    top_k = torch.full((1, TOP_K), -1, dtype=torch.int32)
    top_k[0, :2] = torch.tensor([30, 4])
    rows = srv.coord.swap_in_selected_pages(t(1), t(31), top_k, 0)
    assert [int(srv.layers[0][x, 0]) for x in rows[0, :2].tolist()] == [_kv(30, 0), _kv(4, 0)]
    srv.release(req)
    srv.assert_empty()


def test_host_rows_taken_twice_for_one_slot_are_one_set() -> None:
    srv = Server()
    coord, ids = srv.coord, srv.coord.dual.logical
    full = ids.available_size()
    req, first = _pd_prealloc(srv, 0, 100)
    again = coord.mem_pool_host.alloc_paged_token_slots(
        coord.req_to_host_pool, coord.req_to_host_pool_allocated_len, 0, 0, 100
    )
    # the host rows are the logical ids, so asking twice binds the same ones
    assert torch.equal(first, again) and ids.available_size() == full - 2 * PAGE
    assert first.tolist() == srv.req_to_token_pool.req_to_token[0, :100].tolist()
    srv.release(req)
    assert ids.available_size() == full
    srv.assert_empty()


def test_every_release_path_is_idempotent_and_leaves_nothing() -> None:
    """Retracting a directly admitted PD request (then the abort SGLang sends when the
    retraction has no backup), and aborting a staging request twice."""
    srv = Server()
    pd, _ = _pd_prealloc(srv, 2, 90)
    pd.output_ids.append(7)
    srv.coord.admit_request_direct(pd)
    srv.decode_step([pd])
    srv.coord.retract_req(pd)  # schedule_batch.release_req, before backup_kv_cache
    srv.coord.request_finished(pd)
    srv.release(pd)
    staged = srv.prefill(0, 70)
    srv.coord.admit_request_into_staging(staged)
    srv.coord.abort_staging_request(staged)
    srv.coord.abort_staging_request(staged)
    srv.release(staged)
    srv.assert_empty()
    assert int(srv.coord.host_pool.allocated_lens.sum()) == 0


def test_host_allocated_lengths_are_one_maintained_tensor() -> None:
    """decode.py passes req_to_host_pool_allocated_len to alloc_paged_token_slots: one int64
    [R] tensor kept up to date, not a list rebuilt per access."""
    srv = Server()
    coord = srv.coord
    lens = coord.req_to_host_pool_allocated_len
    assert coord.req_to_host_pool_allocated_len is lens
    slots = coord.host_pool.max_requests  # ReqToTokenPool(size=R) has R + 1 rows
    assert lens.dtype == torch.int64 and lens.tolist() == [0] * slots
    pd, _ = _pd_prealloc(srv, 2, 70)
    staged = srv.prefill(0, 10)
    coord.admit_request_into_staging(staged)
    assert lens.tolist() == [10, 0, 70] + [0] * (slots - 3)
    srv.release(pd)
    assert lens.tolist() == [10] + [0] * (slots - 1)
    coord.collect_ready_reqs()
    srv.release(staged)
    assert lens.tolist() == [0] * slots
    srv.assert_empty()


def _startup_lines() -> list[str]:
    """The ``sglang_hisparse`` log lines of one ``Server()`` construction."""
    from hisparse_testing.logs import captured_logs

    with captured_logs() as logs:
        Server()
    return [m for m in logs if m.startswith("HiSparse coordinator state")]


def test_startup_logs_the_state_bytes_and_whether_the_kv_budget_reserved_them(monkeypatch) -> None:
    from dataclasses import replace

    from sglang_hisparse.sglang_adapter import budget

    # R = 4 requests + req_to_token's padding row = 5 slots. Per slot: 2 layers x (slot_tokens
    # 65*4 + lru 64*2 + resident hint 16*4: 512 columns) + slot_rows 65*4 + host_rows 512*8 = 5260,
    # the default slru policy's word per layer 2*4, and one resolver row: out_rows + plan 16*16 +
    # batch id and count 8 (CPU: no counters) = 264
    state = 5 * (5260 + 8 + 264)
    monkeypatch.setattr(budget, "_last", None)  # pool sized without our budget hook
    (line,) = _startup_lines()
    assert f"({state} B) on the GPU for 5 request slots, NOT reserved out of the KV budget" in line
    shape = budget.StateShape(num_layers=LAYERS, buffer_size=B, max_context=MAX_CTX, top_k=TOP_K,
                              num_draft_tokens=0, extra_rows=1, cuda=False, policy="slru")
    taken = budget.Reservation(budget_bytes=2**30, reserved_bytes=shape.bytes_for(5),
                               max_running_requests=R, request_slots=5, shape=shape)
    monkeypatch.setattr(budget, "_last", taken)
    (line,) = _startup_lines()
    assert taken.reserved_bytes == state
    assert line == (f"HiSparse coordinator state: 0.0 MiB ({state} B) on the GPU for 5 request slots, "
                    f"reserved out of the KV budget (0.0 MiB reserved for 5 slots).")
    monkeypatch.setattr(budget, "_last", replace(taken, reserved_bytes=state - 1))
    (line,) = _startup_lines()
    assert "more than the 0.0 MiB (5 slots) reserved out of the KV budget" in line


def test_the_server_config_is_resolved_once_for_the_models_top_k(sglang_with_plugin, tmp_path) -> None:
    """parse_hisparse_config (SGLang's pool sizing), the coordinator and the KV budget read one
    object, arg_hook.server_config: the published --hisparse-config resolved for the served
    model's selection width (its index_topk here), so a default device_buffer_size is the
    model's (2 * 16, not 2 * 2048) everywhere. The 'memory' and 'spec' namespaces are SGLang's
    own, projected from the real argument pipeline into a model-owned context (create_context)
    active only inside each ``with``."""
    import sglang.srt.runtime_context as rc
    from conftest import DSA_CONFIG, write_model
    from sglang.srt.server_args import prepare_server_args

    from sglang_hisparse.sglang_adapter.arg_hook import parse_hisparse_config, server_config

    model = write_model(tmp_path / "dsa16", dict(DSA_CONFIG, index_topk=TOP_K))

    def published(*flags: str) -> contextlib.AbstractContextManager:
        args = prepare_server_args(["--model-path", str(model), "--skip-tokenizer-init", "--device", "cpu",
                                    "--enable-hisparse", "--disable-radix-cache", *flags])
        args.resolve_once()
        return rc.use_context(rc.create_context(args, role="scheduler"))

    assert server_config() is None  # no server published: tests build pieces directly
    with published():
        assert rc.get_memory().hisparse_config is None and rc.get_spec().speculative_algorithm is None
        cfg = parse_hisparse_config()
        assert cfg is server_config()  # one object, not a parse per reader
        assert (cfg.top_k, cfg.device_buffer_size) == (TOP_K, 2 * TOP_K)
        srv = Server()
        coord = SGLangHiSparseCoordinator(
            req_to_token_pool=srv.req_to_token_pool, token_to_kv_pool_allocator=srv.alloc,
            top_k=TOP_K, device_buffer_size=cfg.device_buffer_size, device="cpu", tp_group=None,
        )
        assert coord.device_buffer_size == coord.core.buffer_size == 2 * TOP_K
    with published("--hisparse-config", f'{{"device_buffer_size": {B}}}'):  # an explicit size is kept
        assert parse_hisparse_config().device_buffer_size == B


# -- no host sync per step (issue 35 item 7) ---------------------------------------------------


def test_decode_and_verify_steps_read_nothing_back_from_the_device() -> None:
    """Every device tensor SGLang passes, and the coordinator's device state, marked
    device-side (``hisparse_testing.sync_guard``): map_last_loc_to_buffer / wait_for_pending_backup
    (short and long requests, growth, write-through backup) and prepare_spec_verify /
    commit_spec_accept_tokens read none of them. SGLang's DSA pool takes 64-token pages on
    CUDA (DSATokenToKVPool asserts it), so decode ids come from alloc_decode, computed on the
    device; the page_size-1 alloc() path is the harness's (tests/unit/test_sync_guard.py)."""
    srv = Server()
    mark_device_state(srv.coord.core)
    long_req, short = srv.prefill(1, 100), srv.prefill(2, 10)
    for req in (long_req, short):
        srv.coord.admit_request_into_staging(req)
    assert srv.coord.collect_ready_reqs() == [long_req, short]
    for _ in range(4):
        srv.decode_step([long_req, short], guard=True)
    srv.alloc.core.check_integrity()
    for req in (long_req, short):
        srv.release(req)
    srv.assert_empty()

    srv = Server(num_draft_tokens=W)
    mark_device_state(srv.coord.core)
    srv.coord.allocate_spec_scratch([1])
    req = srv.prefill(1, 100)
    srv.coord.admit_request_into_staging(req)
    srv.coord.collect_ready_reqs()
    for s in (100, 102):
        batch = _verify_batch(srv, [req], [s])
        batch.seq_lens_cpu = t(s)  # spec v1 passes it; v2's read-back is the adapter's NOTE
        batch.out_cache_loc = device_side(batch.out_cache_loc)
        batch.req_pool_indices = device_side(batch.req_pool_indices)
        with forbid_device_reads():
            srv.coord.prepare_spec_verify(batch)
            srv.coord.commit_spec_accept_tokens(batch, device_side(torch.tensor([[0, 1, -1]], dtype=torch.int32)))
    srv.release(req)
    srv.assert_empty()
