"""The exactness harness on CUDA: JIT kernels, pinned host pool, real side streams, and the
per-layer swap-in captured into a CUDA graph (padded batch, ``num_real_reqs`` on device).

Skipped without CUDA. Run on a GPU box with ``python -m pytest tests/unit/test_harness_cuda.py``.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (kernels, pinned host pool, streams)")

from hisparse_testing.engine import (  # noqa: E402
    DecodeEngine,
    EngineSizes,
    Mismatch,
    ToyRequest,
    capture_inert,
)
from hisparse_testing.scenario import ScenarioSpec, run_scenario  # noqa: E402
from hisparse_testing.toy_model import ToyModel  # noqa: E402

SMALL = (
    ToyModel(num_layers=4, top_k=8, item_bytes=64, shared=(False, True, True, False)),
    EngineSizes(num_reqs=6, buffer_size=16, device_rows=512, max_ctx=96, page_size=1),
)
# DSA-like rows (656 B fp8), k = 64, B = 128, two shared layers per anchor, 64-token pages
REALISTIC = (
    ToyModel(num_layers=3, top_k=64, item_bytes=656, shared=(False, True, True)),
    EngineSizes(num_reqs=8, buffer_size=128, device_rows=8192, max_ctx=1024, page_size=64),
)


def _sizes(which: str, residency: str) -> tuple[ToyModel, EngineSizes]:
    """The model and sizes; under "pressure" a pool too small to keep every request resident."""
    model, sizes = SMALL if which == "small" else REALISTIC
    if residency == "pressure":
        sizes = dataclasses.replace(sizes, device_rows=160 if which == "small" else 1024)
    return model, sizes


@pytest.mark.parametrize("residency", ["always_hot", "pressure"])
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
@pytest.mark.parametrize("which", ["small", "realistic"])
def test_random_lifecycles_on_cuda_are_exact(which: str, prefetch: bool, residency: str) -> None:
    model, sizes = _sizes(which, residency)
    spec = (
        ScenarioSpec(max_prompt=48, max_new=24)
        if which == "small"
        else ScenarioSpec(num_requests=5, max_prompt=600, max_new=24)
    )
    misses = shrinks = 0
    for seed in range(3):
        engine = DecodeEngine(model, sizes, device="cuda", prefetch=prefetch, skip_io=False,
                              decode_alloc_rows=seed == 1, residency=residency,
                              watermark_rows=2 * sizes.page_size)
        try:
            stats = run_scenario(engine, random.Random(seed), spec)
            torch.cuda.synchronize()
            assert stats.checked_outputs > 0
            misses += engine.core.telemetry.snapshot().misses
            shrinks += engine.core.residency_counts()["shrinks"]
        finally:
            engine.close()
    if residency == "pressure":
        # a shrunk request's hot buffer starts with its recent selections: the toy model's
        # selections are stable enough that it may never miss at all
        assert shrinks > 0
    else:
        assert misses > 0


@pytest.mark.parametrize("residency", ["always_hot", "pressure"])
@pytest.mark.parametrize("host_paged", [False, True], ids=["host_flat", "host_paged"])
def test_a_toy_v4_in_c4_pages_on_cuda_is_exact(residency: str, host_paged: bool) -> None:
    """DeepSeek-V4's shape on the GPU: compress ratio 4, device rows in FlashMLA's C4 pages
    (``kernels.row_layout.C4_PAGED``: the resolve, replay and all-layer copy kernels' ROWL 1
    builds), 592-byte host rows or (``C4_PAGED_HOST``, ROWL 2) host rows in the same pages, a
    shared layer; exact through random lifecycles."""
    from sglang_hisparse.kernels.row_layout import C4_PAGED, C4_PAGED_HOST

    layout = C4_PAGED_HOST if host_paged else C4_PAGED
    model = ToyModel(num_layers=3, top_k=32, item_bytes=592, shared=(False, True, False))
    sizes = EngineSizes(num_reqs=6, buffer_size=64, device_rows=2048 if residency == "always_hot" else 640,
                        max_ctx=512, page_size=64)
    misses = shrinks = 0
    for seed in range(2):
        engine = DecodeEngine(model, sizes, device="cuda", prefetch=True, skip_io=False, compress_ratio=4,
                              residency=residency, watermark_rows=2 * sizes.page_size, row_layout=layout)
        try:
            stats = run_scenario(engine, random.Random(seed), ScenarioSpec(max_prompt=300, max_new=96))
            torch.cuda.synchronize()
            assert stats.checked_outputs > 0
            misses += engine.core.telemetry.snapshot().misses
            shrinks += engine.core.residency_counts()["shrinks"]
        finally:
            engine.close()
    assert (shrinks > 0) if residency == "pressure" else (misses > 0)


@pytest.mark.parametrize("residency", ["always_hot", "pressure"])
def test_a_toy_m3_with_split_host_rows_on_cuda_is_exact(residency: str) -> None:
    """MiniMax-M3's shape served PD on the GPU: block top-k (blocks of 8) over K-then-V device
    rows, the host's K and V halves in separate arrays (``KV_SPLIT_HOST``: the resolve, replay
    and all-layer copy kernels' ROWL 3 builds); exact through random lifecycles."""
    from sglang_hisparse.kernels.row_layout import KV_SPLIT_HOST

    model = ToyModel(num_layers=3, top_k=32, item_bytes=512, shared=(False, True, False))
    sizes = EngineSizes(num_reqs=6, buffer_size=64, device_rows=2048 if residency == "always_hot" else 640,
                        max_ctx=512, page_size=64)
    misses = 0
    for seed in range(2):
        engine = DecodeEngine(model, sizes, device="cuda", prefetch=True, skip_io=False, block_size=8,
                              residency=residency, watermark_rows=2 * sizes.page_size, row_layout=KV_SPLIT_HOST)
        try:
            stats = run_scenario(engine, random.Random(seed), ScenarioSpec(max_prompt=300, max_new=96))
            torch.cuda.synchronize()
            assert stats.checked_outputs > 0
            misses += engine.core.telemetry.snapshot().misses
        finally:
            engine.close()
    assert misses > 0


@pytest.mark.parametrize("residency", ["always_hot", "pressure"])
@pytest.mark.parametrize("which", ["small", "realistic"])
def test_per_step_calls_do_not_sync_on_cuda(which: str, residency: str) -> None:
    """map_last_loc, wait_for_pending_backup and every layer's swap_in run under
    ``torch.cuda.set_sync_debug_mode("error")`` (``DecodeEngine(guard_device_reads=True)``):
    any device-to-host copy or synchronize in them raises. "small" takes decode ids with
    alloc(bs) (page_size 1, rows handed back by rebind), "realistic" with alloc_decode
    (64-token pages, as SGLang's DSA pool)."""
    model, sizes = _sizes(which, residency)
    spec = (ScenarioSpec(max_prompt=48, max_new=24) if which == "small"
            else ScenarioSpec(num_requests=4, max_prompt=300, max_new=16))
    engine = DecodeEngine(model, sizes, device="cuda", skip_io=False, decode_alloc_rows=True,
                          guard_device_reads=True, residency=residency,
                          watermark_rows=2 * sizes.page_size)
    try:
        stats = run_scenario(engine, random.Random(5), spec)
        assert stats.checked_outputs > 0 and stats.long_requests > 0
    finally:
        engine.close()


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
def test_swap_in_replays_from_a_cuda_graph(prefetch: bool) -> None:
    """Capture every layer's swap_in for a padded batch of 4, then per step: host-side
    protocol eagerly (map_last_loc, KV writes, indexer), graph replay, oracle check."""
    model, sizes = SMALL
    engine = DecodeEngine(model, sizes, device="cuda", prefetch=prefetch, skip_io=False)
    try:
        _graph_steps(engine, model)
    finally:
        engine.close()


def _graph_steps(engine: DecodeEngine, model: ToyModel) -> None:
    core, dev, bs_pad, L, k = engine.core, torch.device("cuda"), 4, model.num_layers, model.top_k
    reqs = [ToyRequest(rid=i, seed=11 + i, prompt_len=n, max_new=40) for i, n in enumerate((30, 5, 50))]
    for q in reqs:
        engine.prefill(q)
    torch.cuda.synchronize()
    engine.collect()
    for _ in range(2):
        engine.step(pad_to=bs_pad)

    req_s = torch.zeros(bs_pad, dtype=torch.int64, device=dev)
    seq_s = torch.ones(bs_pad, dtype=torch.int64, device=dev)
    topk_s = torch.full((L, bs_pad, k), -1, dtype=torch.int32, device=dev)
    out_s = torch.full((L, bs_pad, k), -1, dtype=torch.int32, device=dev)

    def layers() -> None:
        for layer in range(L):
            out_s[layer].copy_(core.swap_in(req_s, seq_s, topk_s[model.anchor_of(layer)], layer))

    graph = capture_inert(core, layers)

    checked = 0
    for _ in range(12):
        batch = list(engine.running)
        seq_cpu = torch.tensor([q.seq_len + 1 for q in batch])
        req_cpu = torch.tensor([q.req_pool_idx for q in batch])
        last = engine.req_to_token[req_cpu.to(dev), seq_cpu.to(dev) - 2]
        new_ids = engine.allocator.alloc_decode(seq_cpu, last)
        for q, nid in zip(batch, new_ids.tolist(), strict=True):
            q.seq_len += 1
            engine.req_to_token[q.req_pool_idx, q.seq_len - 1] = nid
        req_dev, seq_dev, new_cpu = req_cpu.to(dev), seq_cpu.to(dev), new_ids.cpu()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # the per-step protocol must not sync the host
        try:
            core.map_last_loc(req_index=req_dev, seq_lens=seq_dev, new_logical=new_ids,
                              req_index_cpu=req_cpu.tolist(), seq_lens_cpu=seq_cpu.tolist(),
                              new_logical_cpu=new_cpu)
            core.wait_for_pending_backup()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        n = len(batch)
        req_s.zero_()
        seq_s.fill_(1)
        req_s[:n] = req_cpu.to(dev)
        seq_s[:n] = seq_cpu.to(dev)
        topk_s.fill_(-1)
        new_pos = torch.tensor([q.seq_len - 1 for q in batch], device=dev)
        for layer in range(L):
            engine.pool.write(layer, new_ids, torch.cat([model.kv(q.seed, new_pos[b:b + 1], layer) for b, q in enumerate(batch)]))
            if not model.shared[layer]:
                for b, q in enumerate(batch):
                    engine.pool.write_index(layer, new_ids[b:b + 1], model.index_keys(q.seed, new_pos[b:b + 1], layer).view(torch.uint8))
                    keys = engine.pool.read_index(layer, engine.req_to_token[q.req_pool_idx, :q.seq_len]).view(torch.float32)
                    topk_s[layer, b] = model.select(keys, q.seed, layer)
        core.num_real_reqs.fill_(n)
        graph.replay()
        for layer in range(L):
            rows, tk = out_s[layer], topk_s[model.anchor_of(layer)]
            assert (rows[n:] == -1).all()
            valid = tk[:n] >= 0
            got = model.attend(engine.pool.layer(layer)[rows[:n].clamp(min=0).long()], valid)
            want = model.attend(torch.stack([model.kv(q.seed, tk[b].clamp(min=0), layer) for b, q in enumerate(batch)]), valid)
            if not torch.equal(got, want):
                raise Mismatch(f"graph replay: layer {layer} differs")
            checked += n
    torch.cuda.synchronize()
    assert checked == 12 * 3 * L
    snap = core.telemetry.snapshot()
    assert snap.misses > 0 and snap.selected > snap.misses
    for q in list(engine.running):
        engine.release(q, "finish")
    engine.check_no_leaks()


def test_cuda_alias_of_the_pinned_host_pool_reads_and_writes_host_rows() -> None:
    from sglang_hisparse.coordinator.transfer import cuda_alias
    from sglang_hisparse.memory.host_pool import HostKVPool

    dev = torch.device("cuda")
    pool = HostKVPool(num_layers=2, item_bytes=32, capacity_tokens=64, page_size=1,
                      max_requests=2, max_context=16, device=dev)  # cudaHostRegister'd
    try:
        alias = cuda_alias(pool.kv, dev)
        assert alias is not None and alias.is_cuda and alias.shape == pool.kv.shape
        rows = torch.tensor([5, 9], device=dev)
        alias[1].index_copy_(0, rows, torch.full((2, 32), 7, dtype=torch.uint8, device=dev))
        torch.cuda.synchronize()
        assert pool.kv[1, 5].tolist() == [7] * 32 and pool.kv[1, 9].tolist() == [7] * 32
        pool.kv[0, 3] = 42
        assert alias[0].index_select(0, torch.tensor([3], device=dev)).cpu().tolist() == [[42] * 32]
    finally:
        del alias
        pool.destroy()
    assert cuda_alias(torch.zeros(4, 16, dtype=torch.uint8), dev) is None  # pageable: no alias
    engine = DecodeEngine(*SMALL, device="cuda", skip_io=False)
    try:
        assert engine.core.ctx.host_kv_cuda is not None  # the harness runs the sync-free path
    finally:
        engine.close()
