"""The resolve and replay kernels' C4 row layouts (DeepSeek-V4's compressed KV as FlashMLA pages
it, ``kernels.row_layout.C4_PAGED`` with flat 592-byte host rows and ``C4_PAGED_HOST`` with the
host rows in the same pages) == the pure-torch reference over the same paged buffers, bit for
bit, padding and untouched bytes included (GPU only): every CTA split and block size, the
early-fetch path (a resident hint), CUDA-graph capture, and the replay into another layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import (
    empty_plan,
    kernel_result,
    mismatches,
    next_selection,
    reference_result,
    scenario,
    to_cuda,
)

from hisparse_testing.engine import warm_and_capture
from sglang_hisparse.kernels import ops
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.row_layout import C4_PAGED, C4_PAGED_HOST

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (kernel vs reference comparison)"
)

ITEM = C4_PAGED.host_item()  # 592
# (k, B, bs): DeepSeek-V4's 512 compressed entries per C4 layer (B 1024 and 2048), small builds
GRID = [(512, 1024, 16), (512, 1024, 64), (512, 2048, 3), (64, 128, 5)]


LAYOUTS = [C4_PAGED, C4_PAGED_HOST]


def _paged(rows: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    paged = torch.randint(0, 256, (-(-rows.shape[0] // 64), C4_PAGED.page_bytes), generator=g, dtype=torch.uint8)
    C4_PAGED.write(paged, torch.arange(rows.shape[0]), rows)
    return paged


def c4(sc, seed: int, layout=C4_PAGED):
    """``sc`` with its device rows moved into a paged C4 buffer of random bytes (and, for
    ``C4_PAGED_HOST``, its host rows into pinned pages of random bytes too)."""
    g = torch.Generator().manual_seed(seed)
    state = dataclasses.replace(sc.state, device_cache=_paged(sc.state.device_cache, g))
    if layout.host_paged:
        state = dataclasses.replace(state, host_cache=_paged(sc.state.host_cache, g).pin_memory())
    return dataclasses.replace(sc, state=state)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
@pytest.mark.parametrize("k,B,bs", GRID)
@pytest.mark.parametrize("hint", [None, "noise"])
def test_c4_build_matches_reference_over_two_steps(k, B, bs, hint, layout):
    sc = c4(scenario(k, B, ITEM, bs, seed=k + bs, hint=hint), seed=bs, layout=layout)
    want = reference_result(sc, row_layout=layout)
    for kw in ({}, dict(block_size=1024, ctas_per_request=1), dict(block_size=256, ctas_per_request=5),
               dict(block_size=32, ctas_per_request=2)):
        assert mismatches(want, kernel_result(sc, row_layout=layout, **kw)) == [], kw
    sc2 = next_selection(sc, want[0], seed=bs + 1)
    assert mismatches(reference_result(sc2, row_layout=layout), kernel_result(sc2, row_layout=layout)) == []


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_c4_replay_into_another_layer_matches_reference(layout):
    sc = c4(scenario(512, 1024, ITEM, 16, seed=7), seed=7, layout=layout)
    _, _, plan = reference_result(sc, row_layout=layout)
    assert int(plan.count.sum()) > 0
    nr = torch.tensor([sc.num_real], dtype=torch.int32)
    layer = torch.randint(0, 256, sc.state.device_cache.shape, dtype=torch.uint8)
    want = layer.clone()
    ref.replay(plan=plan, num_real_reqs=nr, host_cache=sc.state.host_cache, device_cache=want, row_layout=layout)
    got = layer.cuda()
    cplan = dataclasses.replace(plan, src=plan.src.cuda(), dst=plan.dst.cuda(), count=plan.count.cuda())
    for ctas in (1, 8):
        ops.replay(plan=cplan, num_real_reqs=nr.cuda(), host_cache=sc.state.host_cache, device_cache=got,
                   ctas=ctas, row_layout=layout, validate=True)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want), ctas


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_c4_build_cuda_graph_capture_and_replay(layout):
    k, B, bs = 512, 1024, 5
    sc = c4(scenario(k, B, ITEM, bs, seed=31, hint="exact"), seed=31, layout=layout)
    init, st = to_cuda(sc.state), to_cuda(sc.state)
    plan = empty_plan(bs, k, "cuda")
    static_topk = sc.top_k.cuda()
    req, lens = sc.req_index.cuda(), sc.seq_lens.cuda()
    nr = torch.tensor([sc.num_real], dtype=torch.int32, device="cuda")
    out = torch.empty(bs, k, dtype=torch.int32, device="cuda")

    def step():
        ops.resolve(top_k=static_topk, req_index=req, seq_lens=lens, num_real_reqs=nr,
                    slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru,
                    host_rows=st.host_rows, host_cache=st.host_cache, device_cache=st.device_cache,
                    out_rows=out, plan=plan, ctas_per_request=4, resident=st.resident,
                    row_layout=layout, validate=False)

    g = warm_and_capture(step)
    for seed, n_real in ((32, bs - 1), (33, bs)):
        sc2 = next_selection(sc, sc.state, seed=seed, num_real=n_real)
        for name in ("slot_tokens", "lru", "device_cache", "resident"):
            getattr(st, name).copy_(getattr(init, name))
        static_topk.copy_(sc2.top_k)
        nr.fill_(n_real)
        g.replay()
        torch.cuda.synchronize()
        assert mismatches(reference_result(sc2, row_layout=layout), (st, out, plan)) == []


def test_a_token_buffer_is_refused_by_the_c4_build():
    sc = scenario(64, 128, ITEM, 3, seed=1)
    with pytest.raises(ValueError, match="not the c4_paged layout"):
        kernel_result(sc, row_layout=C4_PAGED)


def test_flat_host_rows_are_refused_by_the_paged_host_build():
    sc = c4(scenario(64, 128, ITEM, 3, seed=1), seed=1)
    with pytest.raises(ValueError, match="not the c4_paged layout"):
        kernel_result(sc, row_layout=C4_PAGED_HOST)
