"""The C4 row layout (DeepSeek-V4's compressed KV as FlashMLA pages it, ``kernels.row_layout``):
byte positions, and the reference resolve/replay over it equal to the token layout's."""

from __future__ import annotations

import pytest
import torch

from sglang_hisparse.kernels import ops
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.contract import MissPlan, ResolveMode
from sglang_hisparse.kernels.row_layout import C4_PAGED, TOKEN
from sglang_hisparse.kernels.synthetic import make_state, make_topk


def paged_like(token_cache: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A C4 device buffer for as many entries as ``token_cache`` has rows, random bytes, holding
    each token row's first 584 bytes at its entry."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-token_cache.shape[0] // 64)
    paged = torch.randint(0, 256, (pages, C4_PAGED.page_bytes), generator=g, dtype=torch.uint8)
    C4_PAGED.write(paged, torch.arange(token_cache.shape[0]), token_cache)
    return paged


def test_an_entry_is_576_data_bytes_and_8_tail_bytes_of_its_page():
    paged = torch.zeros((2, 37440), dtype=torch.uint8)
    row = torch.arange(592, dtype=torch.int64).remainder(251).add(1).to(torch.uint8)[None]
    C4_PAGED.write(paged, torch.tensor([64 + 5]), row)  # page 1, entry 5
    assert torch.equal(paged[1, 5 * 576 : 6 * 576], row[0, :576])
    assert torch.equal(paged[1, 36864 + 5 * 8 : 36864 + 6 * 8], row[0, 576:584])
    assert int(paged[0].count_nonzero()) == 0 and int(paged[1].count_nonzero()) == 584  # nothing else
    got = C4_PAGED.read(paged, torch.tensor([69]))
    assert torch.equal(got[0, :584], row[0, :584]) and int(got[0, 584:].count_nonzero()) == 0
    assert (C4_PAGED.host_item(), C4_PAGED.device_rows(paged), TOKEN.host_item(656)) == (592, 128, 656)


def test_a_buffer_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="not the c4_paged layout.*37440 contiguous bytes"):
        C4_PAGED.check_device(torch.zeros((4, 592), dtype=torch.uint8), 592)
    with pytest.raises(ValueError, match="host rows of the c4_paged layout are 592 B, got 576"):
        C4_PAGED.check_device(torch.zeros((4, 37440), dtype=torch.uint8), 576)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_resolve_and_replay_over_c4_entries_equal_the_token_layout(seed):
    k, B, bs = 32, 64, 6
    lens = [300, 65, 64, 20, 500, 129, 70, 33]
    st = make_state(seq_lens=lens, B=B, item=592, max_ctx=512, seed=seed)
    req = [0, 1, 2, 4, 5, 6]
    tk = make_topk(st, req, k=k, churn=[0.0, 0.1, 0.3, 0.5, 0.2, 0.05], dup_frac=0.05, seed=seed)
    req_t, lens_t = torch.tensor(req), st.seq_lens[req]
    nr = torch.tensor([bs], dtype=torch.int32)
    results = {}
    for layout in (TOKEN, C4_PAGED):
        s = st.clone()
        dc = s.device_cache if layout is TOKEN else paged_like(s.device_cache, seed)
        out = torch.empty(bs, k, dtype=torch.int32)
        plan = MissPlan.empty(bs, k, "cpu")
        ref.resolve(top_k=tk, req_index=req_t, seq_lens=lens_t, num_real_reqs=nr, slot_tokens=s.slot_tokens,
                    slot_rows=s.slot_rows, lru=s.lru, host_rows=s.host_rows, host_cache=s.host_cache,
                    device_cache=dc, out_rows=out, plan=plan, mode=ResolveMode.COPY, validate=True,
                    row_layout=layout)
        other = torch.zeros_like(dc)  # a second layer, filled by the replay of the plan
        ops.replay(plan=plan, num_real_reqs=nr, host_cache=s.host_cache, device_cache=other, row_layout=layout)
        rows = torch.arange(st.device_cache.shape[0])
        results[layout.name] = (out, s.slot_tokens, s.lru, plan.count, layout.read(dc, rows)[:, :584],
                                layout.read(other, rows)[:, :584])
    assert int(results["token"][3].sum()) > 0  # the scenario misses
    for a, b in zip(results["token"], results["c4_paged"], strict=True):
        assert torch.equal(a, b)
