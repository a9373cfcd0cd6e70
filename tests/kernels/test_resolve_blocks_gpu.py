"""The resolve kernel's block build (MiniMax-M3's block top-k, expanded in the kernel) == the
pure-torch reference on the expanded positions, bit for bit (GPU only); and == the token
build on the same positions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import (
    block_selection,
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

from hisparse_testing.engine import warm_and_capture
from sglang_hisparse.kernels import ops

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (kernel vs reference comparison)"
)

# (k, B, item, block, bs): M3's 16 blocks of 128 (k 2048) and 32 of 64, small builds too; M3.1's
# 16 top-k blocks plus its forced local block (k 2176) over its K-then-V rows (one head of 128:
# 512 B bf16, 256 B fp8)
GRID = [(64, 128, 1152, 8, 3), (64, 64, 656, 16, 64), (2048, 4096, 1152, 128, 3),
        (2048, 4096, 1152, 64, 64), (2048, 4096, 1152, 128, 1), (2176, 4352, 512, 128, 16),
        (2176, 4352, 256, 128, 64)]


@pytest.mark.parametrize("k,B,item,block,bs", GRID)
@pytest.mark.parametrize("hint", [None, "noise"])
def test_block_build_matches_reference_over_two_steps(k, B, item, block, bs, hint):
    sc, blocks = block_selection(scenario(k, B, item, bs, seed=k + bs + block, hint=hint), block, seed=block)
    want = reference_result(sc)
    for kw in ({}, dict(block_size=1024, ctas_per_request=1), dict(block_size=256, ctas_per_request=5),
               dict(block_size=32, ctas_per_request=2)):
        got = kernel_result(sc, top_k=blocks, selection_block=block, **kw)
        assert mismatches(want, got) == [], kw
        # the token build on the expanded positions agrees too
        assert mismatches(want, kernel_result(sc, **kw)) == [], kw
    sc2, blocks2 = block_selection(next_selection(sc, want[0], seed=block + 1), block, seed=block + 1)
    assert mismatches(reference_result(sc2), kernel_result(sc2, top_k=blocks2, selection_block=block)) == []


@pytest.mark.parametrize("page", [16, 64])
def test_block_build_resident_first_level(page):
    k, B, item, block, bs = 2048, 4096, 1152, 128, 16
    sc, blocks = block_selection(scenario(k, B, item, bs, seed=3), block, seed=4)
    rr = resident_rows(sc, page_size=page, seed=5)
    want = reference_result(sc, resident_rows=rr)
    got = kernel_result(sc, top_k=blocks, selection_block=block, resident_rows=rr_to(rr, "cuda"))
    assert mismatches(want, got) == []


def test_block_build_cuda_graph_capture_and_replay():
    k, B, item, bs, block = 2048, 4096, 1152, 3, 128
    sc, blocks = block_selection(scenario(k, B, item, bs, seed=31, hint="exact"), block, seed=31)
    init, st = to_cuda(sc.state), to_cuda(sc.state)
    plan = empty_plan(bs, k, "cuda")
    static_blocks = blocks.cuda()
    req, lens = sc.req_index.cuda(), sc.seq_lens.cuda()
    nr = torch.tensor([sc.num_real], dtype=torch.int32, device="cuda")
    out = torch.empty(bs, k, dtype=torch.int32, device="cuda")

    def step():
        ops.resolve(top_k=static_blocks, req_index=req, seq_lens=lens, num_real_reqs=nr,
                    slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru,
                    host_rows=st.host_rows, host_cache=st.host_cache, device_cache=st.device_cache,
                    out_rows=out, plan=plan, ctas_per_request=4, resident=st.resident,
                    selection_block=block, validate=False)

    g = warm_and_capture(step)
    for seed, n_real in ((32, bs - 1), (33, bs)):
        sc2, blocks2 = block_selection(next_selection(sc, sc.state, seed=seed, num_real=n_real), block, seed=seed)
        for name in ("slot_tokens", "lru", "device_cache", "resident"):
            getattr(st, name).copy_(getattr(init, name))
        static_blocks.copy_(blocks2)
        nr.fill_(n_real)
        g.replay()
        torch.cuda.synchronize()
        assert mismatches(reference_result(sc2), (st, out, plan)) == []


def test_a_block_selection_of_the_wrong_width_is_refused():
    sc, blocks = block_selection(scenario(64, 128, 1152, 3, seed=1), 8, seed=1)
    with pytest.raises(ValueError, match="block ids"):
        kernel_result(sc, top_k=blocks[:, :-1], selection_block=8)


def _split_host(sc):
    """``sc`` with its host rows' halves in separate arrays (``KV_SPLIT_HOST``: uint8 [2H, I/2],
    pinned), the bytes unchanged."""
    host = sc.state.host_cache
    H, item = host.shape
    split = torch.cat([host[:, : item // 2], host[:, item // 2 :]]).contiguous().pin_memory()
    return dataclasses.replace(sc, state=dataclasses.replace(sc.state, host_cache=split))


@pytest.mark.parametrize("k,B,item,block,bs", [(2176, 4352, 512, 128, 16), (2176, 4352, 256, 128, 64),
                                               (64, 128, 1152, 8, 3)])
def test_block_build_over_split_host_rows_matches_reference(k, B, item, block, bs):
    """MiniMax-M3 served PD: the host pool's K and V in separate arrays (ROWL 3, the arrays
    SGLang's transfer writes); the block build and the replay read each row's two halves into
    the one device row, bit-equal to the reference and to the build over whole host rows."""
    from sglang_hisparse.kernels.row_layout import KV_SPLIT_HOST

    sc, blocks = block_selection(scenario(k, B, item, bs, seed=k + bs + 3, hint="noise"), block, seed=block + 3)
    ss = _split_host(sc)
    want = reference_result(sc)
    assert mismatches(want, reference_result(ss, row_layout=KV_SPLIT_HOST)) == []
    for kw in ({}, dict(block_size=256, ctas_per_request=5)):
        assert mismatches(want, kernel_result(ss, top_k=blocks, selection_block=block, row_layout=KV_SPLIT_HOST,
                                              **kw)) == [], kw
    _, _, plan = want
    nr = torch.tensor([sc.num_real], dtype=torch.int32)
    layer = torch.randint(0, 256, sc.state.device_cache.shape, dtype=torch.uint8)
    from sglang_hisparse.kernels import reference as ref

    expect = layer.clone()
    ref.replay(plan=plan, num_real_reqs=nr, host_cache=sc.state.host_cache, device_cache=expect)
    got = layer.cuda()
    cplan = dataclasses.replace(plan, src=plan.src.cuda(), dst=plan.dst.cuda(), count=plan.count.cuda())
    ops.replay(plan=cplan, num_real_reqs=nr.cuda(), host_cache=ss.state.host_cache, device_cache=got,
               row_layout=KV_SPLIT_HOST, validate=True)
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), expect)
