"""The resolve kernel's fra and slru policies == the pure-torch reference bit for bit, and == the
simulator miss for miss on recorded traces (GPU only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from harness import (
    call,
    empty_plan,
    mismatches,
    next_selection,
    scenario,
    to_cuda,
)

from sglang_hisparse import kernel_policy as kp
from sglang_hisparse.kernel_limits import resolve_smem_bytes
from sglang_hisparse.kernels import _jit, ops
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.contract import MissPlan, ResolveMode
from sglang_hisparse.traces.format import load_trace
from sglang_hisparse.traces.kernel_replay import kernel_misses
from sglang_hisparse.traces.simulator import prepare, simulate_stream

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (kernel vs reference comparison)"
)

BLOCKS = [32, 64, 96, 128, 256, 480, 512, 960, 1024]
DATA = Path(__file__).resolve().parents[1] / "data"


POLICIES = ["fra", "slru"]


def words_for(sc, seed: int, policy: str = "fra") -> torch.Tensor:
    """Random policy state (CPU int32). fra [R, B]: hits 0..255 (a third never selected),
    last <= n. slru [R, 1]: level boundaries within the caps (request 0: all level 0)."""
    g = torch.Generator().manual_seed(seed)
    R, B = sc.state.lru.shape
    if policy == "slru":
        cap1, cap2 = kp.slru_caps(B)
        b2 = B - torch.randint(0, cap2 + 1, (R,), generator=g)
        b1 = (b2 - torch.randint(0, cap1 + 1, (R,), generator=g)).clamp(min=0)
        b1[0] = b2[0] = B
        return torch.tensor([[kp.slru_pack(int(x), int(y), B)] for x, y in zip(b1, b2, strict=True)],
                            dtype=torch.int32)
    n = sc.state.seq_lens.view(R, 1).clamp(min=1)
    hits = torch.randint(0, 256, (R, B), generator=g)
    hits[torch.rand(R, B, generator=g) < 0.33] = 0
    last = (torch.rand(R, B, generator=g) * n).long()
    last[hits == 0] = 0
    return ((last << 8) | hits).to(torch.int32)


def run(fn, sc, words, *, mode=ResolveMode.COPY, cuda=False, policy="fra", **extra):
    st = to_cuda(sc.state) if cuda else sc.state.clone()
    w = words.cuda() if cuda else words.clone()
    bs, k = sc.top_k.shape
    plan = empty_plan(bs, k, "cuda" if cuda else "cpu")
    kw = dict(validate=False) if cuda else {}
    out = call(fn, st, sc, sc.top_k, plan=plan, mode=mode, policy=policy, policy_state=w, **kw, **extra)
    if cuda:
        torch.cuda.synchronize()
    return (st, out, plan), w


def compare(sc, words, policy="fra", **extra):
    (want, w_ref) = run(ref.resolve, sc, words, policy=policy)
    (got, w_ker) = run(ops.resolve, sc, words, cuda=True, policy=policy, **extra)
    bad = mismatches(want, got)
    if not torch.equal(w_ref, w_ker.cpu()):
        bad.append("policy_state")
    return bad, want, w_ref


@pytest.mark.parametrize("k,B,item,bs", [(64, 128, 1152, 3), (512, 1024, 656, 64),
                                         (2048, 4096, 656, 64), (2048, 4096, 1152, 1),
                                         (2048, 2048, 656, 3)])
@pytest.mark.parametrize("hint", [None, "exact"])
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_matches_reference_over_two_steps(k, B, item, bs, hint, policy):
    sc = scenario(k, B, item, bs, seed=k + B + bs, hint=hint)
    words = words_for(sc, seed=k + bs, policy=policy)
    bad, want, w = compare(sc, words, policy)
    assert bad == []
    # Second step from the updated state and words: the kernel's own LRU order and words.
    sc2 = next_selection(sc, want[0], seed=k + B + bs + 1)
    assert compare(sc2, w, policy)[0] == []


@pytest.mark.parametrize("k,B,item", [(64, 128, 1152), (2048, 4096, 656)])
@pytest.mark.parametrize("hint", [None, "noise"])
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_every_block_size_and_cta_split(k, B, item, hint, policy):
    sc = scenario(k, B, item, 3, seed=13, hint=hint)
    words = words_for(sc, seed=14, policy=policy)
    want, w_ref = run(ref.resolve, sc, words, policy=policy)
    for block in BLOCKS:
        for ctas in (1, 2, 5, 32):
            got, w = run(ops.resolve, sc, words, cuda=True, block_size=block, ctas_per_request=ctas,
                         policy=policy)
            assert mismatches(want, got) == [], f"block {block}, ctas {ctas}"
            assert torch.equal(w.cpu(), w_ref), f"block {block}, ctas {ctas}: policy_state"


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_no_io_and_replay_lockstep(policy):
    """NO_IO keeps the same bookkeeping; the plan of a policy's resolve replays into another
    layer's cache exactly as the reference replays it (the shared-index layers stay in lockstep)."""
    sc = scenario(512, 1024, 656, 16, seed=41)
    words = words_for(sc, seed=42, policy=policy)
    want, w_ref = run(ref.resolve, sc, words, mode=ResolveMode.NO_IO, policy=policy)
    got, w = run(ops.resolve, sc, words, cuda=True, mode=ResolveMode.NO_IO, policy=policy)
    assert mismatches((want[0], want[1], want[2]), got) == [] and torch.equal(w.cpu(), w_ref)
    (st, _, plan), _ = run(ops.resolve, sc, words, cuda=True, policy=policy)
    nr = torch.tensor([sc.num_real], dtype=torch.int32, device="cuda")
    other = torch.zeros_like(st.device_cache)
    ops.replay(plan=plan, num_real_reqs=nr, host_cache=st.host_cache, device_cache=other)
    other_ref = torch.zeros_like(other).cpu()
    ref.replay(plan=MissPlan(plan.src.cpu(), plan.dst.cpu(), plan.count.cpu()), num_real_reqs=nr.cpu(),
               host_cache=st.host_cache, device_cache=other_ref)
    torch.cuda.synchronize()
    assert torch.equal(other.cpu(), other_ref)
    assert int(plan.count.sum()) > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_cuda_graph_capture_and_replay(policy):
    k, B, item, bs = 512, 1024, 1152, 3
    sc = scenario(k, B, item, bs, seed=51, hint="exact")
    words = words_for(sc, seed=52, policy=policy)
    init = to_cuda(sc.state)
    st = to_cuda(sc.state)
    w = words.cuda()
    plan = empty_plan(bs, k, "cuda")
    static_tk = sc.top_k.cuda()
    req, lens = sc.req_index.cuda(), sc.seq_lens.cuda()
    nr = torch.tensor([sc.num_real], dtype=torch.int32, device="cuda")
    out = torch.empty(bs, k, dtype=torch.int32, device="cuda")

    def step():
        ops.resolve(top_k=static_tk, req_index=req, seq_lens=lens, num_real_reqs=nr,
                    slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru,
                    host_rows=st.host_rows, host_cache=st.host_cache, device_cache=st.device_cache,
                    out_rows=out, plan=plan, ctas_per_request=4, resident=st.resident,
                    policy=policy, policy_state=w)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture (build, workspace)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed, n_real in ((53, bs - 1), (54, bs)):
        sc2 = next_selection(sc, sc.state, seed=seed, num_real=n_real)
        for name in ("slot_tokens", "lru", "device_cache", "resident"):
            getattr(st, name).copy_(getattr(init, name))
        w.copy_(words)
        static_tk.copy_(sc2.top_k)
        nr.fill_(n_real)
        g.replay()
        torch.cuda.synchronize()
        want, w_ref = run(ref.resolve, sc2, words, policy=policy)
        assert mismatches(want, (st, out, plan)) == [] and torch.equal(w.cpu(), w_ref)


#: the tuning trace and a held-aside one (docs/traces.md)
TRACES = [p for p in (DATA / "smollm2_shakespeare.npz", DATA / "gemma3_lear_32k.npz") if p.exists()]


@pytest.mark.skipif(not TRACES, reason="no recorded traces under tests/data")
@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
@pytest.mark.parametrize("mult", [2, 4])
def test_simulate_and_kernel_agree_miss_for_miss_on_recorded_traces(path, mult):
    trace = load_trace(str(path))
    B = mult * int(trace.header["top_k"])
    prepared = {(s.stream, s.layer): s for s in prepare(trace)}
    for policy in ("fra", "slru", "lru"):
        got = kernel_misses(trace, B, policy, layers=2)
        total = 0
        for (stream, layer), counts in got.items():
            sim = simulate_stream(prepared[(stream, layer)], policy, B).misses_per_step
            np.testing.assert_array_equal(sim, counts, err_msg=f"{policy} stream {stream} layer {layer}")
            total += int(sim.sum())
        assert total > 0


@pytest.mark.parametrize("k,B,item", [(64, 128, 656), (2048, 4096, 1152)])
@pytest.mark.parametrize("policy", POLICIES)
def test_kernel_limits_mirror_the_policy_build(k, B, item, policy):
    mod = _jit.resolve_module(k, B, item, policy=kp.policy_id(policy))
    for ctx in (0, 4096, 131072):
        words = (ctx + 31) // 32
        assert mod.smem_bytes(words) == resolve_smem_bytes(k, B, ctx, policy)
