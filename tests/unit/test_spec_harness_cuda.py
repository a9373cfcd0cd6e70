"""Speculative verify steps on CUDA: the verify kernel (JIT), pinned host pool, side streams,
and every layer's 3-D swap_in captured into a CUDA graph (padded batch, num_real_reqs on the
device), with prepare/commit sync-free around it.

Skipped without CUDA. Run on a GPU box with ``python -m pytest tests/unit/test_spec_harness_cuda.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (verify kernel, pinned host pool, streams)")

from hisparse_testing.engine import EngineSizes, Mismatch, ToyRequest, capture_inert  # noqa: E402
from hisparse_testing.scenario import ScenarioSpec, run_scenario  # noqa: E402
from hisparse_testing.spec_engine import SpecDecodeEngine  # noqa: E402
from hisparse_testing.toy_model import ToyModel  # noqa: E402

SMALL = (
    ToyModel(num_layers=4, top_k=8, item_bytes=64, shared=(False, True, True, False)),
    EngineSizes(num_reqs=6, buffer_size=32, device_rows=1024, max_ctx=128), 3,
)
# DSA-like rows (656 B fp8), k = 64, W = 4 (n = 3), B = (n + 2) * k, two shared layers
REALISTIC = (
    ToyModel(num_layers=3, top_k=64, item_bytes=656, shared=(False, True, True)),
    EngineSizes(num_reqs=8, buffer_size=320, device_rows=16384, max_ctx=1024), 4,
)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
@pytest.mark.parametrize("which", ["small", "realistic"])
def test_random_spec_lifecycles_on_cuda_are_exact(which: str, prefetch: bool) -> None:
    model, sizes, W = SMALL if which == "small" else REALISTIC
    spec = (
        ScenarioSpec(max_prompt=60, max_new=40)
        if which == "small"
        else ScenarioSpec(num_requests=5, max_prompt=600, max_new=40)
    )
    misses = 0
    for seed in range(3):
        engine = SpecDecodeEngine(model, sizes, num_draft_tokens=W, device="cuda", prefetch=prefetch,
                                  skip_io=False, decode_alloc_rows=seed == 1, accept_seed=seed)
        try:
            stats = run_scenario(engine, random.Random(seed), spec)
            torch.cuda.synchronize()
            assert stats.checked_outputs > 0 and engine.verified < engine.accepted
            misses += engine.core.telemetry.snapshot().misses
        finally:
            engine.close()
    assert misses > 0


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
def test_verify_swap_in_replays_from_a_cuda_graph(prefetch: bool) -> None:
    model, sizes, W = SMALL
    engine = SpecDecodeEngine(model, sizes, num_draft_tokens=W, device="cuda", prefetch=prefetch, skip_io=False)
    try:
        _graph_rounds(engine, model, W)
    finally:
        engine.close()


def _graph_rounds(engine: SpecDecodeEngine, model: ToyModel, W: int) -> None:
    core, dev, bs_pad, L, k = engine.core, torch.device("cuda"), 4, model.num_layers, model.top_k
    reqs = [ToyRequest(rid=i, seed=11 + i, prompt_len=n, max_new=200) for i, n in enumerate((40, 5, 70))]
    for q in reqs:
        engine.prefill(q)
    torch.cuda.synchronize()
    engine.collect()
    engine.step(pad_to=bs_pad)  # one eager round first

    req_s = torch.zeros(bs_pad, dtype=torch.int64, device=dev)
    lens_s = torch.ones(bs_pad * W, dtype=torch.int32, device=dev)
    topk_s = torch.full((L, bs_pad, W, k), -1, dtype=torch.int32, device=dev)
    out_s = torch.full((L, bs_pad, W, k), -1, dtype=torch.int32, device=dev)

    def layers() -> None:
        for layer in range(L):  # dsa_backend views the result [bs*W, k]
            out_s[layer].copy_(core.swap_in(req_s, lens_s, topk_s[model.anchor_of(layer)], layer))

    graph = capture_inert(core, layers)

    rng, checked = random.Random(5), 0
    for rnd in range(10):
        batch, salt = list(engine.running), 1000 + rnd
        n = len(batch)
        s_cpu = [q.seq_len for q in batch]
        r_cpu = [q.req_pool_idx for q in batch]
        ids = engine.allocator.alloc_logical_extend(
            torch.tensor(s_cpu), torch.tensor(s_cpu) + W, engine.req_to_token[r_cpu, [s - 1 for s in s_cpu]])
        ids_cpu = ids.cpu()
        for b, (r, s) in enumerate(zip(r_cpu, s_cpu, strict=True)):
            engine.req_to_token[r, s:s + W] = ids[b * W:(b + 1) * W]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # prepare must not sync the host
        try:
            core.prepare_spec(req_index=torch.tensor(r_cpu).to(dev, non_blocking=True), req_index_cpu=r_cpu,
                              seq_lens_cpu=s_cpu, out_cache_loc=ids, out_cache_loc_cpu=ids_cpu)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        req_s.zero_()
        req_s[:n] = torch.tensor(r_cpu, device=dev)
        lens_s.copy_((torch.tensor(s_cpu + [0] * (bs_pad - n), device=dev)[:, None] + 1
                      + torch.arange(W, device=dev)).reshape(-1))
        topk_s.fill_(-1)
        for layer in range(L):
            for b, q in enumerate(batch):
                pos = torch.arange(q.seq_len, q.seq_len + W, device=dev)
                mine = ids[b * W:(b + 1) * W]
                engine.pool.write(layer, mine, model.kv_salted(q.seed, pos, torch.full((W,), salt), layer))
                if not model.shared[layer]:
                    engine.pool.write_index(layer, mine, model.index_keys(q.seed, pos, layer).view(torch.uint8))
                    for j in range(W):
                        keys = engine.pool.read_index(layer, engine.req_to_token[q.req_pool_idx, :q.seq_len + 1 + j])
                        topk_s[layer, b, j] = model.select(keys.view(torch.float32), q.seed, layer)
        core.num_real_reqs.fill_(n)
        graph.replay()
        for layer in range(L):
            rows, tk = out_s[layer], topk_s[model.anchor_of(layer)]
            assert (rows[n:] == -1).all()
            valid = tk[:n] >= 0
            got = model.attend(engine.pool.layer(layer)[rows[:n].clamp(min=0).long()].reshape(n * W, k, -1),
                               valid.reshape(n * W, k))
            want = []
            for b, q in enumerate(batch):
                pos = tk[b].clamp(min=0).long().reshape(-1)
                salts = torch.tensor(engine.salts[q.rid] + [salt] * W)[pos.cpu()]
                want.append(model.kv_salted(q.seed, pos, salts, layer))
            if not torch.equal(got, model.attend(torch.cat(want).reshape(n * W, k, -1), valid.reshape(n * W, k))):
                raise Mismatch(f"graph replay round {rnd}: layer {layer} differs")
            checked += n * W
        accept = [rng.randrange(W) for _ in batch]
        acc = torch.full((n, W), -1, dtype=torch.int32)
        for b, a in enumerate(accept):
            acc[b, :a + 1] = torch.arange(b * W, b * W + a + 1, dtype=torch.int32)
        acc = acc.to(dev)
        torch.cuda.set_sync_debug_mode("error")  # commit must not sync the host either
        try:
            core.commit_spec(acc, validate=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for b, (q, a) in enumerate(zip(batch, accept, strict=True)):
            engine.allocator.free(ids[b * W + a + 1:(b + 1) * W])
            engine.req_to_token[q.req_pool_idx, q.seq_len + a + 1:q.seq_len + W] = 0
            engine.salts[q.rid] += [salt] * (a + 1)
            q.seq_len += a + 1
            q.generated += a + 1
    torch.cuda.synchronize()
    assert checked == 10 * 3 * L * W
    snap = core.telemetry.snapshot()
    assert snap.misses > 0 and snap.selected > snap.misses
    for q in list(engine.running):
        engine.release(q, "finish")
    engine.check_no_leaks()
