"""benchmarks/e2e_attention.py on CPU: the float32 reference against a naive per-request loop,
its masking (negative rows, an all-invalid request -> zeros), the split plan, the byte / FLOP
formulas, the CPU fallback, and the Triton kernels themselves under TRITON_INTERPRET=1.

The interpreter is chosen when ``@triton.jit`` runs, so the kernel comparison runs in a fresh
interpreter with the variable set (one subprocess for every case) rather than in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def attn(import_benchmark):
    return import_benchmark("e2e_attention")


def make_inputs(bs, heads, k, n_rows, *, seed, dim=576, invalid=0.2, dead=None):
    """q bf16 [bs, H, dim], kv bf16 [n_rows, dim] (randn * 0.5), rows int32 [bs, k] with a
    fraction ``invalid`` of -1 and request ``dead`` (if any) all -1."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(bs, heads, dim, generator=g) * 0.5).bfloat16()
    kv = (torch.randn(n_rows, dim, generator=g) * 0.5).bfloat16()
    rows = torch.randint(0, n_rows, (bs, k), generator=g, dtype=torch.int32)
    rows[torch.rand(bs, k, generator=g) < invalid] = -1
    if dead is not None:
        rows[dead] = -1
    return q, kv, rows


def naive(q, kv, rows, v_dim=512):
    """One request and head at a time over the list of its valid rows (float64)."""
    bs, heads, dim = q.shape
    out = torch.zeros(bs, heads, v_dim, dtype=torch.float64)
    for b in range(bs):
        sel = [int(r) for r in rows[b] if r >= 0]
        if not sel:
            continue
        keys = kv[sel].double()
        for h in range(heads):
            p = torch.softmax(keys @ q[b, h].double() / dim ** 0.5, dim=0)
            out[b, h] = p @ keys[:, :v_dim]
    return out


def test_reference_matches_naive_loop(attn):
    q, kv, rows = make_inputs(4, 3, 40, 100, seed=1, dead=2)
    ref = attn.sparse_mla_reference(q, kv, rows)
    assert ref.dtype == torch.float32 and ref.shape == (4, 3, 512)
    torch.testing.assert_close(ref.double(), naive(q, kv, rows), atol=1e-5, rtol=1e-5)


def test_reference_masking(attn):
    q, kv, rows = make_inputs(3, 2, 24, 50, seed=2, invalid=0.0)
    rows[rows == 0] = 1
    kv[0] = float("nan")  # the row a clamped -1 reads: it must not leak in
    rows[0, ::2] = -1
    rows[1] = -1
    ref = attn.sparse_mla_reference(q, kv, rows)
    assert not ref.isnan().any()
    assert torch.equal(ref[1], torch.zeros_like(ref[1]))
    kept = rows[0, 1::2]  # dropping the -1 entries changes nothing
    torch.testing.assert_close(ref[0], attn.sparse_mla_reference(q[:1], kv, kept[None])[0])
    scaled = attn.sparse_mla_reference(q, kv, rows, scale=0.01)
    assert not torch.allclose(scaled[0], ref[0])


def test_plan_is_fixed_by_shape_and_covers_every_tile(attn):
    m = attn.SparseMLADecode(max_batch=64, heads=16, top_k=2048, device="cpu", target_ctas=264,
                             block_n=32)
    assert m.splits_for(1) == 64 and m.splits_for(38) == 7 and m.splits_for(64) == 5
    for bs in range(1, 65):
        for k in (1, 31, 32, 80, 2047, 2048):
            splits, per = m.plan(bs, k)
            tiles = -(-k // 32)
            assert per % 32 == 0 and splits * per >= k and (splits - 1) * per < k, (bs, k)
            assert splits <= max(1, tiles) and bs * splits <= m.slots and splits <= m.max_splits
            assert m.plan(bs, k) == (splits, per)
    assert m.partial.shape == (m.slots, 16, 512) and m.out.shape == (64, 16, 512)
    wide = attn.SparseMLADecode(max_batch=8, heads=40, top_k=256, device="cpu", target_ctas=264,
                                block_n=32)
    assert wide.head_blocks == 3 and wide.splits_for(8) == 8  # 8 * 8 * 3 programs


def test_bad_shapes_are_refused(attn):
    m = attn.SparseMLADecode(max_batch=2, heads=4, top_k=64, device="cpu")
    q, kv, rows = make_inputs(3, 4, 64, 10, seed=3)
    with pytest.raises(ValueError, match="max_batch"):
        m(q, kv, rows)
    with pytest.raises(ValueError, match="power of two"):
        attn.SparseMLADecode(max_batch=2, heads=4, top_k=64, dim=584, device="cpu")


def test_cpu_fallback_writes_the_reference_into_its_buffer(attn):
    if attn.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 in this process: CPU tensors take the Triton path")
    m = attn.SparseMLADecode(max_batch=4, heads=4, top_k=64, device="cpu")
    q, kv, rows = make_inputs(3, 4, 50, 80, seed=4, dead=1)
    out = m(q, kv, rows)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 4, 512)
    assert out.data_ptr() == m.out.data_ptr()
    assert torch.equal(out, attn.sparse_mla_reference(q, kv, rows).bfloat16())
    assert attn.time_attention(m, q, kv, rows) is None


def test_bytes_and_flops(attn):
    rows_once = 38 * 2048 * 576 * 2
    base = attn.attention_bytes(38, 2048)
    assert base == rows_once + 38 * 16 * (576 + 512) * 2 + 38 * 2048 * 4
    assert 85e6 < base < 95e6  # the ~90 MB a layer reads at bs 38, k 2048
    assert attn.attention_bytes(38, 2048, splits=7) == base + 2 * 38 * 7 * 16 * 513 * 4
    assert attn.attention_bytes(38, 2048, heads=32) > base + rows_once  # rows read per 16 heads
    assert attn.attention_flops(38, 16, 2048) == 2 * 38 * 16 * 2048 * (576 + 512)


INTERPRETER_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import e2e_attention as attn
sys.path.insert(0, sys.argv[2])
from test_e2e_attention import make_inputs

assert attn.INTERPRETED, "TRITON_INTERPRET=1 was not picked up"
cases = {
    # name: (bs, heads, k, target_ctas, block_n, rows dtype)
    "h16_k64": (3, 16, 64, None, 32, torch.int32),
    "h4_k80": (3, 4, 80, None, 32, torch.int32),
    "h16_k80_two_tiles_per_split": (3, 16, 80, 4, 32, torch.int32),
    "h20_k80_one_split_two_head_blocks": (3, 20, 80, 1, 32, torch.int32),
    "h16_k80_block64_int64_rows": (3, 16, 80, None, 64, torch.int64),
}
res = {}
for i, (name, (bs, heads, k, ctas, block_n, dt)) in enumerate(cases.items()):
    q, kv, rows = make_inputs(bs, heads, k, 200, seed=10 + i, dead=1)
    rows = rows.to(dt)
    m = attn.SparseMLADecode(max_batch=4, heads=heads, top_k=k, device="cpu",
                             target_ctas=ctas, block_n=block_n)
    out = m(q, kv, rows).float()
    ref = attn.sparse_mla_reference(q, kv, rows)
    res[name] = {
        "splits": m.splits_for(bs),
        "nan": bool(out.isnan().any()),
        "max_err": float((out - ref).abs().max()),
        "close": bool(torch.allclose(out, ref, atol=2e-2, rtol=2e-2)),
        "dead_zero": bool(torch.equal(out[1], torch.zeros_like(out[1]))),
        "view": out.shape == (bs, heads, 512) and m.out.data_ptr() == m(q, kv, rows).data_ptr(),
    }
print("RESULT " + json.dumps(res))
"""

CASES = ["h16_k64", "h4_k80", "h16_k80_two_tiles_per_split", "h20_k80_one_split_two_head_blocks",
         "h16_k80_block64_int64_rows"]


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton", reason="triton not installed: no interpreter to run the kernels")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT, str(BENCH),
                           str(Path(__file__).parent)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case", CASES)
def test_triton_kernels_under_interpreter(interpreted, case):
    r = interpreted[case]
    assert not r["nan"], r
    assert r["close"], r
    assert r["dead_zero"], r
    assert r["view"], r


def test_interpreter_cases_cover_split_paths(interpreted):
    splits = {name: r["splits"] for name, r in interpreted.items()}
    assert splits["h16_k80_two_tiles_per_split"] == 2  # 3 tiles -> splits of 2 and 1
    assert splits["h20_k80_one_split_two_head_blocks"] == 1  # direct store, no combine
    assert splits["h16_k64"] == 2 and splits["h4_k80"] == 3
