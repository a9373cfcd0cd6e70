"""MiniMax-M3's HiSparse main pool (``sglang_adapter.memory_m3.HiSparseMHAPool``) inside SGLang
0.5.23's own ``MiniMaxSparseKVPool``, built on CPU with the arguments
``kv_cache_configurator._build_minimax_sparse_kv_pool`` passes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.memory_pool")

from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool  # noqa: E402

from sglang_hisparse.sglang_adapter.families import M3Family, detect_family  # noqa: E402
from sglang_hisparse.sglang_adapter.memory import HiSparseTokenAllocator  # noqa: E402
from sglang_hisparse.sglang_adapter.memory_m3 import HiSparseMHAPool  # noqa: E402

DEVICE_ROWS, PAGE, RATIO, HEAD_DIM = 128, 16, 2, 64


class _Layer:
    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


@pytest.fixture
def m3(monkeypatch):
    # MiniMaxSparseKVPool imports HiSparseMHAMainPool at call time; the plugin rebinds it
    import sglang.srt.mem_cache.hisparse_memory_pool as hmp

    monkeypatch.setattr(hmp, "HiSparseMHAMainPool", HiSparseMHAPool)
    pool = MiniMaxSparseKVPool(
        size=DEVICE_ROWS, page_size=PAGE, dtype=torch.bfloat16, index_dtype=torch.bfloat16, head_num=1,
        head_dim=HEAD_DIM, idx_head_dim=32, dense_layer_ids=[0], sparse_layer_ids=[1, 2], device="cpu",
        enable_memory_saver=False, start_layer=0, end_layer=3, enable_hisparse=True,
        host_to_device_ratio=RATIO,
    )
    alloc = HiSparseTokenAllocator(DEVICE_ROWS, page_size=PAGE, dtype=torch.bfloat16, device="cpu",
                                   kvcache=pool, need_sort=False, host_to_device_ratio=RATIO)
    return pool, alloc


def test_the_sparse_layers_hold_k_then_v_in_one_row_per_device_row(m3):
    pool, alloc = m3
    family = detect_family(alloc)
    main = family.pool
    assert isinstance(family, M3Family)
    assert isinstance(main, HiSparseMHAPool) and main.full_to_hisparse_device_index_mapping is alloc.core.mapping
    assert (main.start_layer, main.layer_num, main.row_bytes) == (1, 2, 2 * HEAD_DIM * 2)
    # the dense pool and the index pool stay at logical size on the device
    assert pool.dense_pool.size == DEVICE_ROWS * RATIO and pool.index_kv_pool.size == DEVICE_ROWS * RATIO
    rows, start = family.device_layers()
    assert start == 1 and [tuple(r.shape) for r in rows] == [(DEVICE_ROWS + PAGE, main.row_bytes)] * 2
    k, v = pool.get_key_buffer(2), pool.get_value_buffer(2)
    assert k.stride(0) == v.stride(0) == 2 * HEAD_DIM and v.data_ptr() - k.data_ptr() == HEAD_DIM * 2


def test_writes_land_at_the_translated_rows_and_padding_is_skipped(m3):
    pool, alloc = m3
    logical = alloc.alloc(PAGE)
    assert logical is not None
    loc = torch.cat([logical[:3], torch.tensor([-1])])
    cache_k = torch.randn(4, 1, HEAD_DIM).to(torch.bfloat16)
    cache_v = torch.randn(4, 1, HEAD_DIM).to(torch.bfloat16)
    before = [r.clone() for r in detect_family(alloc).device_layers()[0]]
    pool.set_kv_buffer(_Layer(2), loc, cache_k, cache_v)
    dev = pool.main_pool.translate_loc_to_hisparse_device(logical[:3])
    rows = detect_family(alloc).device_layers()[0]
    want = torch.cat([cache_k[:3].reshape(3, -1), cache_v[:3].reshape(3, -1)], 1).view(torch.uint8)
    assert torch.equal(rows[1][dev], want)
    changed = (rows[1] != before[1]).any(1).nonzero()[:, 0]
    assert sorted(changed.tolist()) == sorted(dev.tolist())  # nothing else, the -1 not at all
    assert torch.equal(rows[0], before[0])  # the other sparse layer untouched
    # a dense layer's write goes to the logical-size dense pool at the logical ids
    pool.set_kv_buffer(_Layer(0), logical[:3], cache_k[:3], cache_v[:3])
    assert torch.equal(pool.get_key_buffer(0)[logical[:3]], cache_k[:3])


def test_the_host_pool_holds_one_row_per_logical_id_and_sparse_layer(m3):
    """Every logical id has a host row per sparse layer: K then V co-located; as a PD decode
    server its K and V halves in separate arrays (``KV_SPLIT_HOST``), what PD decode registers,
    every layer's K, then every layer's V, one item per page of tokens (as SGLang's prefill
    pairs its sparse K/V buffers)."""
    pool, alloc = m3
    family = detect_family(alloc)
    kw = dict(ratio=RATIO, page_size=PAGE, max_requests=4, max_context=256, device="cpu", pin_memory=False,
              ranks_per_host=1)
    rows, half = DEVICE_ROWS * RATIO + PAGE, pool.main_pool.row_bytes // 2
    assert tuple(family.host_pool(**kw).kv.shape) == (2, rows, 2 * half)
    host = family.host_pool(**kw, pd_decode=True)
    assert tuple(host.kv.shape) == (2, 2 * rows, half)
    ptrs, lens, items = host.get_contiguous_buf_infos()
    base = [host.kv[li].data_ptr() for li in range(2)]
    assert ptrs == base + [b + rows * half for b in base]
    assert lens == [rows * half] * 4 and items == [half * PAGE] * 4 and host.layer_num == 2
    data = torch.randint(0, 256, (3, 2 * half), dtype=torch.uint8)
    host.write(torch.tensor([5, 9, 70]), data, 1)
    assert torch.equal(host.kv[1, torch.tensor([5, 9, 70])], data[:, :half])
    assert torch.equal(host.kv[1, rows + torch.tensor([5, 9, 70])], data[:, half:])


def test_what_the_pool_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="K and V of one head_dim"):
        HiSparseMHAPool(size=64, page_size=16, dtype=torch.bfloat16, head_num=1, head_dim=64, layer_num=1,
                        device="cpu", enable_memory_saver=False, v_head_dim=32)
    pool = HiSparseMHAPool(size=64, page_size=16, dtype=torch.bfloat16, head_num=1, head_dim=64, layer_num=1,
                           device="cpu", enable_memory_saver=False)
    with pytest.raises(ValueError, match="no mapping registered"):
        pool.translate_loc_to_hisparse_device(torch.tensor([1]))
    with pytest.raises(NotImplementedError, match="speculative decoding is not supported for MiniMax-M3"):
        pool.move_kv_cache(torch.tensor([1]), torch.tensor([2]))
