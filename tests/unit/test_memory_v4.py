"""DeepSeek-V4's C4 pool under HiSparse (``sglang_adapter.memory_v4.HiSparseC4Pool``), built by
SGLang 0.5.23's own ``DeepSeekV4TokenToKVPool`` on CPU inside a published runtime context (the
V4 config of conftest, fp8_e4m3 KV), as ``_init_compressed_pools`` builds it with the name
``HiSparseC4DevicePool`` rebound. Not yet served: the V4 allocator and coordinator are not
built (docs/v4-m3.md D6)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.deepseek_v4_memory_pool")

from sglang_hisparse.kernels.layer_copy import LayerTable  # noqa: E402
from sglang_hisparse.kernels.row_layout import C4_PAGED  # noqa: E402
from sglang_hisparse.memory.allocator import DualSpaceAllocator  # noqa: E402
from sglang_hisparse.sglang_adapter.memory_v4 import HiSparseC4Pool  # noqa: E402

C4_ROWS = 512


@pytest.fixture
def v4_pool(v4_model_dir, monkeypatch):
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as dsv4
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setattr(dsv4, "HiSparseC4DevicePool", HiSparseC4Pool)
    args = prepare_server_args(["--model-path", str(v4_model_dir), "--skip-tokenizer-init", "--device", "cpu",
                                "--disable-radix-cache", "--kv-cache-dtype", "fp8_e4m3"])
    args.resolve_once()
    ctx = rc.create_context(args, role="scheduler")
    ctx.parallel.override_permanently(world_group=SimpleNamespace(cpu_group=None))
    with rc.use_context(ctx):
        yield dsv4.DeepSeekV4TokenToKVPool(
            max_num_reqs=4, swa_size=1024, c4_size=C4_ROWS, c128_size=64, c4_state_pool_size=64,
            c128_state_pool_size=64, page_size=256, swa_page_size=256, dtype=torch.float8_e4m3fn,
            c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
            indexer_head_dim=128, layer_num=4, device="cpu", enable_memory_saver=False,
            compression_ratios=[4, 128, 4, 128], sliding_window=128, enable_hisparse=True, num_req_slots=5,
            full_size=2048)


def test_sglang_builds_our_c4_pool_in_flashmla_pages(v4_pool):
    c4 = v4_pool.c4_kv_pool
    assert isinstance(c4, HiSparseC4Pool) and c4.compress_ratio == 4
    # two C4 layers (compress ratio 4 at layers 0 and 2), (512 + 256) / 64 pages of 37440 B each
    assert [tuple(b.shape) for b in c4.device_rows()] == [(12, 37440)] * 2
    table = LayerTable.build(c4.device_rows(), "c4", layout=C4_PAGED)  # the core's C4_PAGED layers
    assert table.item == 592 and table.table[:, 2].tolist() == [768, 768]


def test_full_locations_translate_through_compressed_ids_to_device_rows(v4_pool):
    c4 = v4_pool.c4_kv_pool
    # the compressed space: one 64-entry page per 256-token full page (2048 full tokens -> 512 ids)
    alloc = DualSpaceAllocator(C4_ROWS, host_to_device_ratio=1, page_size=64, logical_capacity=C4_ROWS)
    c4.register_mapping(alloc.mapping)
    # a 10-token prompt on full page 3 (locations 768..777): entries of tokens 3 and 7
    full = torch.arange(768, 778)
    compressed = c4.translate_loc_from_full_to_compressed(full)
    assert compressed.tolist() == [192, 193]
    assert alloc.bind_extend(compressed, torch.tensor([0]), torch.tensor([2]))
    rows = c4.translate_loc_from_full_to_hisparse_device(full)
    assert rows.dtype == torch.int64 and bool((rows > 0).all()) and rows.tolist() == alloc.translate(compressed).tolist()
    assert c4.translate_loc_to_hisparse_device(compressed).dtype == torch.int32
    assert c4._translate_loc_to_hisparse_device(torch.tensor([-1])).tolist() == [-1]  # SGLang's -1 stays -1
    with pytest.raises(NotImplementedError, match="own host pool"):
        c4.get_cpu_copy(torch.tensor([1]))


def test_the_v4_allocator_binds_the_extends_c4_entries_and_frees_them_with_their_pages(v4_pool):
    """SGLang's SWA allocator hands out the token locations; ours binds device rows for the
    extend's new C4 entries by compressed id (a chunk continues its page), and a free of the
    full pages frees the compressed pages; capacity counts the C4 rows (x 4 tokens)."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    from sglang_hisparse.sglang_adapter.memory_v4 import HiSparseV4Allocator

    swa = SWATokenToKVPoolAllocator(2048, 1024, page_size=256, dtype=torch.float8_e4m3fn, device="cpu",
                                    kvcache=v4_pool, need_sort=False)
    alloc = HiSparseV4Allocator(swa)
    c4 = v4_pool.c4_kv_pool
    assert alloc.full_to_hisparse_device_index_mapping is c4.full_to_hisparse_device_index_mapping
    assert alloc.available_size() == min(swa.available_size(), C4_ROWS * 4)

    def extend(prefix, seq, last):
        p, s = torch.tensor(prefix), torch.tensor(seq)
        return alloc.alloc_extend(p, p, s, s, torch.tensor(last), int((s - p).sum()))

    locs = extend([0, 0], [10, 300], [-1, -1])
    assert locs is not None and locs.numel() == 310
    entries = c4.translate_loc_from_full_to_compressed(locs)
    assert entries.numel() == 10 // 4 + 300 // 4
    rows = c4.translate_loc_to_hisparse_device(entries)
    assert bool((rows > 0).all()) and torch.unique(rows).numel() == rows.numel()
    # request 1's next chunk: tokens 300..309 continue its second full page (entries 75..76)
    more = extend([300], [310], [int(locs[-1])])
    new = c4.translate_loc_from_full_to_compressed(more)
    assert new.numel() == 2 and bool((c4.translate_loc_to_hisparse_device(new) > 0).all())
    alloc.check_integrity()
    alloc.free(torch.cat([locs[:10]]))  # request 0 finishes: its page and its C4 page go
    alloc.free(torch.cat([locs[10:], more]))
    alloc.check_integrity()
    assert alloc.core.rows.available_size() == alloc.core.size_device
    assert swa.full_available_size() == swa.size_full
    with pytest.raises(NotImplementedError, match="alloc_extend / alloc_decode"):
        alloc.alloc(4)
