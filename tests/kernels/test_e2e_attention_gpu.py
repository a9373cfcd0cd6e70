"""benchmarks/e2e_attention.py's Triton sparse MLA decode kernels == the float32 torch reference,
eager and under CUDA-graph capture + replay (GPU only).

The kernel comparison uses a tolerance, not bit equality: the split-K kernel sums in a
different order than the reference (tiles of rows, then a log-sum-exp combine of the splits),
feeds p to the tensor cores as bf16 and rounds its output to bf16, so the two agree to bf16
precision only. Graph replay against eager is bit for bit: same kernels, same launch
configuration, no atomics. (The benchmark's exactness check is separate and bit-exact on the
toy model's outputs; it does not go through this kernel.)
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel vs reference comparison)"
)

N_ROWS = 20_000
TOL = {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture(scope="module")
def attn(import_benchmark):
    return import_benchmark("e2e_attention")


def make_inputs(bs, k, *, heads=16, seed, invalid=0.1, rows_dtype=torch.int32):
    """q bf16 [bs, H, 576] and a uint8 [N, 1152] pool viewed as bf16 [N, 576] (randn * 0.5),
    rows [bs, k] with a fraction ``invalid`` of -1 and, when bs > 1, the last request all -1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(bs, heads, 576, generator=g, device="cuda") * 0.5).bfloat16()
    pool = (torch.randn(N_ROWS, 576, generator=g, device="cuda") * 0.5).bfloat16().view(torch.uint8)
    kv = pool.view(torch.bfloat16)
    assert kv.shape == (N_ROWS, 576) and pool.shape == (N_ROWS, 1152)
    rows = torch.randint(0, N_ROWS, (bs, k), generator=g, device="cuda", dtype=rows_dtype)
    rows[torch.rand(bs, k, generator=g, device="cuda") < invalid] = -1
    if bs > 1:
        rows[-1] = -1
    return q, kv, rows


@pytest.mark.parametrize("k", [64, 2048])
@pytest.mark.parametrize("bs", [1, 5, 38])
def test_kernel_matches_reference(attn, bs, k):
    m = attn.SparseMLADecode(max_batch=64, heads=16, top_k=2048, device="cuda")
    q, kv, rows = make_inputs(bs, k, seed=bs * 7 + k)
    out = m(q, kv, rows)
    ref = attn.sparse_mla_reference(q, kv, rows)
    assert out.shape == (bs, 16, 512) and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, **TOL)
    if bs > 1:
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.parametrize("variant", [
    {"block_n": 32}, {"block_n": 32, "num_stages": 3}, {"num_warps": 8}, {"target_ctas": 1}, {"heads": 4}, {"heads": 20},
    {"rows_dtype": torch.int64},
])
def test_kernel_variants_match_reference(attn, variant):
    heads = variant.get("heads", 16)
    rows_dtype = variant.get("rows_dtype", torch.int32)
    opts = {key: v for key, v in variant.items() if key not in ("heads", "rows_dtype")}
    m = attn.SparseMLADecode(max_batch=8, heads=heads, top_k=1000, device="cuda", **opts)
    q, kv, rows = make_inputs(6, 1000, heads=heads, seed=3, rows_dtype=rows_dtype)
    out = m(q, kv, rows)
    torch.testing.assert_close(out.float(), attn.sparse_mla_reference(q, kv, rows), **TOL)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_graph_replay_equals_eager(attn):
    m = attn.SparseMLADecode(max_batch=64, heads=16, top_k=2048, device="cuda")
    q, kv, rows = make_inputs(38, 2048, seed=5)
    eager = m(q, kv, rows).clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(q, kv, rows)
    m.out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # new selections copied into the captured tensor are what the replay reads
    _, _, rows2 = make_inputs(38, 2048, seed=6)
    rows.copy_(rows2)
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    assert torch.equal(replayed, m(q, kv, rows))
    assert not torch.equal(replayed, eager)


def test_time_attention_reports_microseconds(attn):
    m = attn.SparseMLADecode(max_batch=64, heads=16, top_k=2048, device="cuda")
    q, kv, rows = make_inputs(38, 2048, seed=7, invalid=0.0)
    us = attn.time_attention(m, q, kv, rows, reps=10)
    assert us is not None and 0 < us < 10_000
