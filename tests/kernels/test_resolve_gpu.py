"""CUDA resolve/replay kernels == the pure-torch reference, bit for bit (GPU only)."""

from __future__ import annotations

import pytest
import torch
from harness import (
    call,
    empty_plan,
    kernel_result,
    mismatches,
    next_selection,
    reference_result,
    resident_rows,
    rr_to,
    scenario,
    to_cuda,
)

from sglang_hisparse.kernels import _jit, ops
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.contract import ResolveMode

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (kernel vs reference comparison)"
)

# Deliberate grid (each (k, B, item) is one JIT build): k in {64, 512, 2048}, B in {k, 2k, 4k},
# both item sizes, batch 1 / 3 / 64 with a padding row, long + short requests, mixed churn.
GRID = [
    (64, 64, 656, 64), (64, 128, 1152, 3), (64, 256, 656, 1),
    (512, 512, 1152, 3), (512, 1024, 656, 64), (512, 2048, 1152, 1),
    (2048, 2048, 656, 3), (2048, 2048, 1152, 64), (2048, 4096, 656, 64),
    (2048, 4096, 1152, 1), (2048, 4096, 1152, 3), (2048, 8192, 656, 3),
]
BLOCKS = [32, 64, 96, 128, 256, 480, 512, 960, 1024]


@pytest.mark.parametrize("k,B,item,bs", GRID)
def test_kernel_matches_reference_over_two_steps(k, B, item, bs):
    idx = torch.int32 if bs == 3 else torch.int64
    sc = scenario(k, B, item, bs, seed=k + B + bs, idx_dtype=idx)
    want = reference_result(sc)
    got = kernel_result(sc)
    assert mismatches(want, got) == []
    # Second step from the updated state: exercises LRU order produced by the kernel itself.
    sc2 = next_selection(sc, want[0], seed=k + B + bs + 1)
    assert mismatches(reference_result(sc2), kernel_result(sc2)) == []


def test_a_second_build_of_the_same_kernels_launches(monkeypatch):
    """Two builds of one resolve template in one process (probe_resolve.py's profiling build next
    to the op's) each raise their own kernel's shared-memory limit. The launcher once kept that
    in a function-local static, which is one object across the two libraries: the second build
    skipped its attribute and could not launch a CTA needing more than 48 KiB."""
    k, B, item = 2048, 4096, 656  # ~90 KiB of shared memory per CTA
    sc = scenario(k, B, item, 3, seed=5)
    want = reference_result(sc)
    assert mismatches(want, kernel_result(sc)) == []
    second = _jit.resolve_module(k, B, item, build="second")
    monkeypatch.setattr(ops, "resolve_module", lambda *_, **__: second)
    assert mismatches(want, kernel_result(sc)) == []


@pytest.mark.parametrize("k,B,item", [(64, 128, 1152), (2048, 4096, 656)])
@pytest.mark.parametrize("hint", [None, "noise"])
def test_every_block_size_and_cta_split(k, B, item, hint):
    """Every accepted block size; with a hint, those of >= 64 threads run the early fetch."""
    sc = scenario(k, B, item, 3, seed=11, hint=hint)
    want = reference_result(sc)
    for block in BLOCKS:
        for ctas in (1, 2, 5, 32):
            got = kernel_result(sc, block_size=block, ctas_per_request=ctas)
            assert mismatches(want, got) == [], f"block {block}, ctas {ctas}"


@pytest.mark.parametrize("k,B,item,bs", [(64, 128, 1152, 3), (512, 1024, 656, 64),
                                         (2048, 4096, 656, 64), (2048, 4096, 1152, 3)])
def test_resident_hint_changes_no_result_and_is_kept_like_the_reference(k, B, item, bs):
    """Exact, random and empty hints (the early fetch stages right, wrong and all guesses):
    outputs, state, plan and the updated hint match the reference over two steps, for block
    sizes with and without the early fetch (< 64 threads: none; 96, 256 and 288: the
    run-time-sized build), CTA splits and staging caps down to one row (the rest copied directly) and
    zero (hint kept, nothing staged)."""
    for hint in ("exact", "noise", "empty"):
        sc = scenario(k, B, item, bs, seed=k + bs, hint=hint)
        want = reference_result(sc)
        for kw in ({}, dict(block_size=1024, ctas_per_request=1),
                   dict(block_size=512, ctas_per_request=5, early_rows=3),
                   dict(block_size=32, ctas_per_request=2), dict(block_size=96, ctas_per_request=32,
                                                                 early_rows=1),
                   dict(block_size=288, ctas_per_request=32, early_rows=1),
                   dict(block_size=256, ctas_per_request=3),
                   dict(block_size=1024, ctas_per_request=8, early_rows=0)):
            assert mismatches(want, kernel_result(sc, **kw)) == [], f"{hint} {kw}"
        sc2 = next_selection(sc, want[0], seed=k + bs + 1)
        assert mismatches(reference_result(sc2), kernel_result(sc2)) == [], hint


def test_back_to_back_steps():
    """Steps launched back to back on the same state, no host sync or copy between them: each
    launch reads the state the previous one wrote; every step must match the reference chain."""
    k, B, item, bs = 2048, 4096, 1152, 64
    sc = scenario(k, B, item, bs, seed=31)
    steps, wants = [], []
    for t in range(4):
        want = reference_result(sc)
        steps.append(sc)
        wants.append(want)
        sc = next_selection(sc, want[0], seed=32 + t)
    top_ks = [s.top_k.cuda() for s in steps]
    outs = [torch.empty(bs, k, dtype=torch.int32, device="cuda") for _ in steps]
    plans = [empty_plan(bs, k, "cuda") for _ in steps]
    req, lens = steps[0].req_index.cuda(), steps[0].seq_lens.cuda()
    nr = torch.tensor([steps[0].num_real], dtype=torch.int32, device="cuda")
    for _ in range(2):  # the first round builds and reserves; the second runs back to back
        st = to_cuda(steps[0].state)
        torch.cuda.synchronize()
        for tk, out, plan in zip(top_ks, outs, plans, strict=True):
            ops.resolve(top_k=tk, req_index=req, seq_lens=lens, num_real_reqs=nr,
                        slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru,
                        host_rows=st.host_rows, host_cache=st.host_cache,
                        device_cache=st.device_cache, out_rows=out, plan=plan, validate=False,
                        ctas_per_request=2)
        torch.cuda.synchronize()
    for t, (want, out, plan) in enumerate(zip(wants, outs, plans, strict=True)):
        assert torch.equal(want[1], out.cpu()), f"step {t}: out_rows"
        assert torch.equal(want[2].count, plan.count.cpu()), f"step {t}: plan count"
    final = wants[-1][0]
    assert torch.equal(final.slot_tokens, st.slot_tokens.cpu())
    assert torch.equal(final.lru, st.lru.cpu())
    assert torch.equal(final.device_cache, st.device_cache.cpu())


def test_no_io_does_bookkeeping_only():
    sc = scenario(512, 1024, 656, 3, seed=5)
    want = reference_result(sc, mode=ResolveMode.NO_IO)
    got = kernel_result(sc, mode=ResolveMode.NO_IO)
    assert mismatches(want, got) == []
    assert torch.equal(got[0].device_cache.cpu(), sc.state.device_cache)


@pytest.mark.parametrize("item", [656, 1152])
def test_replay_matches_reference(item):
    sc = scenario(512, 1024 if item == 656 else 2048, item, 64, seed=7)
    _, _, plan = kernel_result(sc)
    host2 = torch.randint(0, 256, sc.state.host_cache.shape, dtype=torch.uint8).pin_memory()
    dev0 = torch.randint(0, 256, sc.state.device_cache.shape, dtype=torch.uint8)
    nr = torch.tensor([sc.num_real], dtype=torch.int32)
    want = dev0.clone()
    cpu_plan = type(plan)(plan.src.cpu(), plan.dst.cpu(), plan.count.cpu())
    ref.replay(plan=cpu_plan, num_real_reqs=nr, host_cache=host2, device_cache=want)
    for ctas in (1, 8, 100):
        for block in (32, 512, 1024):
            got = dev0.cuda()
            ops.replay(plan=plan, num_real_reqs=nr.cuda(), host_cache=host2, device_cache=got,
                       ctas=ctas, block_size=block)
            assert torch.equal(got.cpu(), want), f"ctas {ctas}, block {block}"


def test_cuda_graph_capture_and_replay():
    k, B, item, bs = 512, 512, 1152, 3
    sc = scenario(k, B, item, bs, seed=21, hint="exact")  # the coordinator's call: early fetch on
    init = to_cuda(sc.state)
    st = to_cuda(sc.state)
    plan = empty_plan(bs, k, "cuda")
    static_tk = sc.top_k.cuda()
    req, lens = sc.req_index.cuda(), sc.seq_lens.cuda()
    nr = torch.tensor([sc.num_real], dtype=torch.int32, device="cuda")
    out = torch.empty(bs, k, dtype=torch.int32, device="cuda")
    dev2 = torch.zeros_like(st.device_cache)

    def step():
        ops.resolve(top_k=static_tk, req_index=req, seq_lens=lens, num_real_reqs=nr,
                    slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru,
                    host_rows=st.host_rows, host_cache=st.host_cache, device_cache=st.device_cache,
                    out_rows=out, plan=plan, ctas_per_request=4, resident=st.resident)
        ops.replay(plan=plan, num_real_reqs=nr, host_cache=st.host_cache, device_cache=dev2)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: builds the modules and reserves the workspace outside capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed, n_real in ((21, bs - 1), (22, bs)):
        sc2 = next_selection(sc, sc.state, seed=seed, num_real=n_real)
        for name in ("slot_tokens", "lru", "device_cache", "resident"):
            getattr(st, name).copy_(getattr(init, name))
        static_tk.copy_(sc2.top_k)
        nr.fill_(n_real)
        g.replay()
        torch.cuda.synchronize()
        want = reference_result(sc2)
        assert mismatches(want, (st, out, plan)) == []


def test_empty_batch_and_validation():
    sc = scenario(64, 128, 1152, 3, seed=3)
    st = to_cuda(sc.state)
    empty = sc.top_k[:0]
    ops.resolve(top_k=empty.cuda(), req_index=sc.req_index[:0].cuda(),
                seq_lens=sc.seq_lens[:0].cuda(), num_real_reqs=torch.zeros(1, dtype=torch.int32,
                                                                          device="cuda"),
                slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru,
                host_rows=st.host_rows, host_cache=st.host_cache, device_cache=st.device_cache,
                out_rows=torch.empty(0, 64, dtype=torch.int32, device="cuda"), validate=True)
    bad = sc.top_k.clone()
    bad[0, 0] = int(sc.seq_lens[0])
    with pytest.raises(ValueError, match="outside"):
        call(ops.resolve, st, sc, bad, plan=None, validate=True)
    st.host_cache = torch.zeros(sc.state.host_cache.shape, dtype=torch.uint8)  # pageable
    with pytest.raises(ValueError, match="pinned"):
        call(ops.resolve, st, sc, sc.top_k, plan=None, validate=True)


def test_context_beyond_shared_memory_is_a_clear_error():
    """The position bitmap spans host_rows' columns: a pool too long for shared memory fails at
    launch with the figures, not with a launch failure."""
    sc = scenario(64, 128, 1152, 3, seed=4)
    st = to_cuda(sc.state)
    R = st.host_rows.shape[0]
    st.host_rows = torch.zeros(R, 12 << 20, dtype=torch.int64, device="cuda")  # 12M positions
    with pytest.raises(ValueError, match=r"host_rows of 12582912 positions needs \d+ B of shared memory"):
        call(ops.resolve, st, sc, sc.top_k, plan=None, validate=False)


@pytest.mark.parametrize("k,B,item", [(64, 128, 1152), (2048, 4096, 656), (2048, 8192, 656)])
def test_kernel_limits_mirror_the_kernels_shared_memory(k, B, item):
    """kernel_limits.resolve_smem_bytes (what startup checks use) == the kernel's own Layout."""
    from sglang_hisparse.kernel_limits import resolve_smem_bytes
    from sglang_hisparse.kernels import _jit

    mod = _jit.resolve_module(k, B, item)
    for ctx in (0, 1, 264, 32768, 131072, 163840, 200000):
        assert mod.smem_bytes((ctx + 31) // 32) == resolve_smem_bytes(k, B, ctx), ctx


# First level (residency "pressure"): fully resident requests resolve through their page table
# in the same launch as hot ones; page sizes 1 and 64, both record blocks, with and without the
# resident hint, one and several CTAs per request.
RESIDENT_GRID = [(64, 128, 656, 3, 1), (512, 1024, 1152, 16, 64), (2048, 4096, 656, 64, 64),
                 (2048, 4096, 1152, 1, 1)]


@pytest.mark.parametrize("k,B,item,bs,page", RESIDENT_GRID)
@pytest.mark.parametrize("hint", [None, "exact"])
def test_resident_first_level_matches_reference(k, B, item, bs, page, hint):
    sc = scenario(k, B, item, bs, seed=k + bs + page, hint=hint)
    for ring in (0, B // k - 1):
        rr = resident_rows(sc, page_size=page, seed=bs, ring=ring)
        want = reference_result(sc, resident_rows=rr)
        for ctas in (1, 4):
            got = kernel_result(sc, resident_rows=rr_to(rr, "cuda"), ctas_per_request=ctas)
            assert mismatches(want, got) == [], f"ring {ring}, ctas {ctas}"
        flagged = [b for b, r in enumerate(sc.req_index.tolist()) if rr.flag[r] and b < sc.num_real]
        assert flagged and all(int(want[2].count[b]) == 0 for b in flagged)


def test_resident_flag_flips_between_graph_replays():
    """The flag is read on the device: one captured launch serves a request resident, then
    (after a shrink flipped its flag outside the graph) hot."""
    k, B, item, bs = 512, 1024, 656, 3
    sc = scenario(k, B, item, bs, seed=31, hint="exact")
    rr_cpu = resident_rows(sc, page_size=64, seed=3)
    rr = rr_to(rr_cpu, "cuda")
    init = to_cuda(sc.state)
    st = to_cuda(sc.state)
    plan = empty_plan(bs, k, "cuda")
    tk, req, lens = sc.top_k.cuda(), sc.req_index.cuda(), sc.seq_lens.cuda()
    nr = torch.tensor([sc.num_real], dtype=torch.int32, device="cuda")
    out = torch.empty(bs, k, dtype=torch.int32, device="cuda")

    def step():
        ops.resolve(top_k=tk, req_index=req, seq_lens=lens, num_real_reqs=nr,
                    slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru,
                    host_rows=st.host_rows, host_cache=st.host_cache, device_cache=st.device_cache,
                    out_rows=out, plan=plan, ctas_per_request=2, resident=st.resident,
                    resident_rows=rr)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for flip in (False, True):
        if flip:
            rr.flag.zero_()
            rr_cpu.flag.zero_()
        for name in ("slot_tokens", "lru", "device_cache", "resident"):
            getattr(st, name).copy_(getattr(init, name))
        g.replay()
        torch.cuda.synchronize()
        assert mismatches(reference_result(sc, resident_rows=rr_cpu), (st, out, plan)) == []
