"""SGLang-facing memory adapters, constructed on CPU against the installed SGLang 0.5.23.

SGLang's ``kv_cache_configurator`` needs a full ModelRunner (model config, parallel
groups, device memory profile) to run, so the classes are built directly with exactly the
arguments its call sites pass (quoted next to each construction).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.memory_pool")

from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool  # noqa: E402

import sglang_hisparse.sglang_adapter.memory_host as memory_host  # noqa: E402
from sglang_hisparse.memory.host_pool import host_pool_bytes  # noqa: E402
from sglang_hisparse.sglang_adapter.memory import (  # noqa: E402
    HiSparseDSAPool,
    HiSparseTokenAllocator,
    build_host_pool,
)

DEVICE_ROWS, PAGE, RATIO, LAYERS = 256, 64, 2, 2  # DSA requires 64-token pages


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


@pytest.fixture
def pool() -> HiSparseDSAPool:
    # kv_cache_configurator.py:2369-2393 (_build_dsa_kv_pool):
    #   token_to_kv_pool = PoolCls(max_total_num_tokens, page_size=self.pool_page_size,
    #       dtype=self.kv_cache_dtype, kv_lora_rank=..., qk_rope_head_dim=..., layer_num=...,
    #       device=self.device, kv_cache_dim=calculate_mla_kv_cache_dim(...),
    #       enable_memory_saver=..., start_layer=..., end_layer=..., index_head_dim=...,
    #       index_kpool=..., index_kpool_compress=..., tail_extra_slots=...,
    #       max_running_requests=max_running_requests, **pool_kwargs)
    # with pool_kwargs["host_to_device_ratio"] = parse_hisparse_config().host_to_device_ratio (:2350)
    return HiSparseDSAPool(
        DEVICE_ROWS,
        page_size=PAGE,
        dtype=torch.float8_e4m3fn,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        layer_num=LAYERS,
        device="cpu",
        kv_cache_dim=656,
        enable_memory_saver=False,
        start_layer=0,
        end_layer=LAYERS,
        index_head_dim=128,
        index_kpool=1,
        index_kpool_compress=False,
        tail_extra_slots=0,
        max_running_requests=4,
        host_to_device_ratio=RATIO,
    )


@pytest.fixture
def alloc(pool: HiSparseDSAPool) -> HiSparseTokenAllocator:
    # kv_cache_configurator.py:2892-2900 (_build_token_to_kv_pool_allocator):
    #   HiSparseTokenToKVPoolAllocator(sizes.max_total_num_tokens, page_size=get_schedule().page_size,
    #       dtype=self.kv_cache_dtype, device=self.device, kvcache=token_to_kv_pool,
    #       need_sort=need_sort, host_to_device_ratio=hisparse_cfg.host_to_device_ratio)
    return HiSparseTokenAllocator(
        DEVICE_ROWS,
        page_size=PAGE,
        dtype=torch.float8_e4m3fn,
        device="cpu",
        kvcache=pool,
        need_sort=False,
        host_to_device_ratio=RATIO,
    )


def test_pool_sizes_kv_in_device_rows_and_index_keys_in_logical_space(pool):
    assert isinstance(pool, DSATokenToKVPool)
    assert pool.size == DEVICE_ROWS
    assert pool.kv_buffer[0].shape == (DEVICE_ROWS + PAGE, 1, 656)
    # indexer keys: (512 logical + padding page) / 64 pages of 64 x (128 B key + 4 B scale)
    assert pool.index_k_with_scale_buffer[0].shape == (
        (DEVICE_ROWS * RATIO + PAGE) // PAGE,
        PAGE * 132,
    )


def test_allocator_reports_logical_capacity_and_registers_mapping(alloc, pool):
    assert isinstance(alloc, BaseTokenToKVPoolAllocator)  # scheduler budget hooks inherited
    assert alloc.size == alloc.size_full == DEVICE_ROWS * RATIO
    assert alloc.available_size() == DEVICE_ROWS  # min(logical, device)
    assert alloc.logical_attn_allocator.available_size() == 512
    assert alloc.hisparse_attn_allocator.available_size() == 256
    assert alloc.hisparse_page_size == PAGE
    assert pool.full_to_hisparse_device_index_mapping is alloc.full_to_hisparse_device_index_mapping
    alloc.check_integrity()


def test_prefill_decode_free_through_sglang_call_shapes(alloc, pool):
    # allocation.py alloc_paged_token_slots_extend: alloc_extend(prefix_lens, prefix_lens_cpu,
    # seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
    ids = alloc.alloc_extend(t(0), t(0), t(70), t(70), t(-1), 70)
    assert ids[:2].tolist() == [64, 65] and ids[-1].item() == 64 * 2 + 5  # pages 1 and 2
    assert (
        pool.translate_loc_to_hisparse_device(ids).tolist() == ids.tolist()
    )  # fresh pool: same ids
    assert pool.translate_loc_to_hisparse_device(t(-1, 400)).tolist() == [
        -1,
        0,
    ]  # padding / unmapped
    assert alloc.available_size() == 256 - 128
    # the coordinator shrinks once the prompt is on host: B=64 keeps page 1 + the newest's page 2
    slot_rows = alloc.core.shrink_to_hot_buffer(0, ids, hot_size=64)
    assert slot_rows[:64].tolist() == list(range(64, 128)) and slot_rows[64].item() == 133
    # allocation.py alloc_paged_token_slots_decode: alloc_decode(seq_lens, seq_lens_cpu, last_loc)
    new = alloc.alloc_decode(t(71), t(71), ids[-1:])
    assert new.tolist() == [134]  # continues the logical page; no device row
    assert alloc.hisparse_attn_allocator.available_size() == 128
    alloc.check_integrity()
    alloc.core.hot.release(0)
    alloc.free(torch.cat([ids, new]))
    assert alloc.available_size() == 256 and alloc.logical_attn_allocator.available_size() == 512
    alloc.check_integrity()
    with pytest.raises(ValueError, match="double free"):
        alloc.free(ids)


def test_logical_only_for_pd_and_spec(alloc):
    # decode.py alloc_for_decode_prealloc_hisparse -> allocator.alloc_logical_only(...)
    ids = alloc.alloc_logical_only(t(0), t(0), t(10), t(10), t(-1), 10)
    assert ids.tolist() == list(range(64, 74))
    assert alloc.full_to_hisparse_device_index_mapping[ids].eq(0).all()
    assert alloc.hisparse_attn_allocator.available_size() == 256
    alloc.free(ids)
    alloc.check_integrity()


def test_kv_writes_and_reads_are_translated(alloc, pool, monkeypatch):
    # The real MLA write/read kernels are Triton (GPU only); capture what reaches them.
    seen = {}
    monkeypatch.setattr(
        DSATokenToKVPool,
        "set_mla_kv_buffer",
        lambda self, layer, loc, *a: seen.setdefault("set", loc),
    )
    monkeypatch.setattr(
        DSATokenToKVPool,
        "get_mla_kv_buffer",
        lambda self, layer, loc, dt=None: seen.setdefault("get", loc),
    )
    ids = alloc.alloc_extend(t(0), t(0), t(3), t(3), t(-1), 3)
    slot_rows = alloc.core.shrink_to_hot_buffer(1, ids, hot_size=2)
    new = alloc.alloc_decode(t(4), t(4), ids[-1:])
    alloc.core.map_tokens(new, slot_rows[-1:])
    # deepseek_v2.py:2183 (DeepseekV2AttentionMLA.attn_mqa): the layer the MLA backend passes
    layer = RadixAttention(128, 512 + 64, 1.0, num_kv_heads=1, layer_id=0, v_head_dim=512)
    pool.set_mla_kv_buffer(layer, new, None, None)
    pool.get_mla_kv_buffer(layer, torch.cat([new, ids[:1]]))
    assert seen["set"].tolist() == [slot_rows[-1].item()]
    assert seen["get"].tolist() == [slot_rows[-1].item(), 0]  # token 0 is only in the hot slot now


def test_spec_reserve_and_validation(alloc):
    assert alloc.request_slot_reserve(has_req_pool_slot=False, prefill_tokens=10) == 0
    alloc.configure_spec_scratch(128, device_buffer_size=192)
    # prompt of 10 tokens covers one page: 192 - 64 extra buffer rows + 128 scratch
    assert alloc.request_slot_reserve(has_req_pool_slot=False, prefill_tokens=10) == 128 + 128
    assert alloc.request_slot_reserve(has_req_pool_slot=True, prefill_tokens=300) == 0
    with pytest.raises(
        ValueError, match="capacity = 10 must be a non-negative multiple of page_size = 64"
    ):
        alloc.configure_spec_scratch(10)


def test_host_pool_on_hicache_buffer(pool):
    # The coordinator's call (hisparse_coordinator.py:618-634) builds MLATokenToKVPoolHost from
    # device_pool.get_device_pool_infos()[0].buffer_info, layout="layer_first".
    host = build_host_pool(
        pool,
        ratio=RATIO,
        page_size=PAGE,
        max_requests=4,
        max_context=600,
        device="cpu",
        pin_memory=False,
    )
    assert host.kv.shape == (LAYERS, 512 + PAGE, 656) and host.layer_num == LAYERS
    assert host.kv.data_ptr() == host.hicache.kv_buffer.data_ptr()  # same storage, no copy
    _, lens, _ = host.get_contiguous_buf_infos()
    assert lens == [(512 + PAGE) * 656] * LAYERS
    # decode.py:2321-2344: alloc_paged_token_slots(req_to_host_pool, allocated_len, idx, 0, n)
    # the host rows are the logical ids the PD prealloc just took (logical_source)
    allocated = torch.zeros(4, dtype=torch.int64)
    latest = {"ids": torch.arange(192, 262)}
    host.logical_source = lambda: latest["ids"]
    rows = host.alloc_paged_token_slots(host.host_rows, allocated, 2, 0, 70)
    assert rows.tolist() == list(range(192, 262)) and allocated[2].item() == 70
    latest["ids"] = torch.arange(300, 310)
    assert host.alloc_paged_token_slots(host.host_rows, allocated, 2, 70, 10).tolist() == list(range(300, 310))
    host.check_integrity()
    with pytest.raises(RuntimeError, match="latest logical-only allocation holds 10 ids"):
        host.alloc_paged_token_slots(host.host_rows, allocated, 3, 0, 512)
    host.unbind(2)
    assert host.allocated_len(2) == 0 and bool((host.host_rows[2] == -1).all())
    host.destroy()


def test_host_pool_budget_counts_every_rank_on_the_machine(pool, monkeypatch):
    """8 TP ranks on one machine each build this pool: the check compares all 8 pools with the
    machine's free memory and refuses before HiCache allocates or pins anything. Before, each
    rank compared only its own pool, so a machine could pin 8x what it had."""
    from sglang.srt.runtime_context import get_parallel

    per_rank = host_pool_bytes(num_layers=LAYERS, item_bytes=656, capacity_tokens=DEVICE_ROWS * RATIO,
                               page_size=PAGE)
    monkeypatch.setattr(memory_host, "available_host_bytes", lambda: 4 * per_rank)  # room for 4 pools
    built = []

    class NoHiCache:  # stands in for MLATokenToKVPoolHost: constructing it allocates and pins
        def __init__(self, **kwargs):
            built.append(kwargs)
            raise AssertionError("the host buffer was allocated before the budget check refused")

    monkeypatch.setattr("sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost", NoHiCache)
    args = dict(ratio=RATIO, page_size=PAGE, max_requests=4, max_context=600, device="cpu", pin_memory=False)
    with get_parallel().override(tp_size=8, pp_size=1, nnodes=1, dp_size=1):
        assert memory_host.server_ranks_per_host() == 8
        with pytest.raises(ValueError, match=(
            r"HiSparse host KV pool \(2 layers x 512 rows x 656 B\) needs 0.00 GiB .* per rank; 8 "
            r"rank\(s\) on this machine need .* Lower 'host_to_device_ratio' in --hisparse-config "
            r"\(at most 1 fits\).*--max-total-tokens")):
            build_host_pool(pool, **args)
    assert built == []
    with get_parallel().override(tp_size=8, pp_size=1, nnodes=2, dp_size=1):  # 4 ranks a machine
        assert memory_host.server_ranks_per_host() == 4
        with pytest.raises(AssertionError, match="allocated before"):  # passes the check
            build_host_pool(pool, **args)


def test_ranks_check_figures_agreed_across_the_world_group(monkeypatch):
    """Every rank checks the largest pool and the least free memory any rank measured (one
    all_reduce MIN over [-pool, free] on SGLang's world group, before anyone allocates)."""
    import sglang.srt.distributed.parallel_state as sgl_dist

    dist = memory_host.dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    # NOTE: a stand-in for SGLang's GroupCoordinator: a real one needs torch.distributed's
    # process group (init_process_group, gloo groups), which is process-global; only cpu_group is read
    monkeypatch.setattr(sgl_dist, "get_world_group", lambda: SimpleNamespace(cpu_group="world-cpu"))
    monkeypatch.setattr(memory_host, "available_host_bytes", lambda: 900)
    seen = {}

    def all_reduce(t, op, group):  # the other rank: a 150-byte pool, 700 bytes free
        seen.update(op=op, group=group)
        t.copy_(torch.minimum(t, torch.tensor([-150, 700])))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert memory_host._agreed_budget(100) == (150, 700)
    assert seen == {"op": dist.ReduceOp.MIN, "group": "world-cpu"}
