"""DeepSeek-V4's C4 pool under HiSparse (``sglang_adapter.memory_v4.HiSparseC4Pool``), built by
SGLang 0.5.23's own ``DeepSeekV4TokenToKVPool`` on CPU inside a published runtime context (the
V4 config of conftest, fp8_e4m3 KV), as ``_init_compressed_pools`` builds it with the name
``HiSparseC4DevicePool`` rebound. Not yet served: the V4 allocator and coordinator are not
built (docs/v4-m3.md D6)."""

from __future__ import annotations

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


def _entry(c: int, layer: int) -> torch.Tensor:
    """The toy C4 entry of compressed position ``c`` in C4 layer ``layer``: 584 bytes + 8 zero."""
    g = torch.Generator().manual_seed(c * 7 + layer)
    row = torch.randint(0, 256, (592,), generator=g, dtype=torch.uint8)
    row[584:] = 0
    return row


@pytest.mark.parametrize("residency", ["always_hot", "pressure"])
def test_the_coordinator_serves_v4_entries_exactly_through_decode(v4_pool, residency):
    """The V4 branch of SGLangHiSparseCoordinator driven with SGLang's own V4 pool and SWA
    allocator: a 300-token prompt's 75 C4 entries staged to host, then 60 decode steps with the
    core growing only on 4-aligned lengths (``map_last_loc_to_buffer``), the compressor's write
    of each new entry through ``_translate_loc_to_hisparse_device``, and every step's selection
    (raw_indices_buffer, random compressed positions, old ones included) resolved by
    ``swap_in_selected_pages`` to device rows holding exactly the entry bytes; leak-free."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_hisparse.sglang_adapter.coordinator import SGLangHiSparseCoordinator
    from sglang_hisparse.sglang_adapter.memory_v4 import HiSparseV4Allocator

    swa = SWATokenToKVPoolAllocator(2048, 1024, page_size=256, dtype=torch.float8_e4m3fn, device="cpu",
                                    kvcache=v4_pool, need_sort=False)
    alloc = HiSparseV4Allocator(swa)
    c4 = v4_pool.c4_kv_pool
    r2t = ReqToTokenPool(size=3, max_context_len=1024, device="cpu", enable_memory_saver=False)
    coord = SGLangHiSparseCoordinator(req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, top_k=16,
                                      device_buffer_size=64, device="cpu", tp_group=None, host_to_device_ratio=2,
                                      residency=residency)
    assert coord.family.name == "v4" and coord.raw_indices_buffer.shape == (4, 16)
    layers = c4.device_rows()

    def write(compressed: torch.Tensor) -> None:  # the compressor, through the private translation
        rows = c4._translate_loc_to_hisparse_device(compressed)
        for li, buf in enumerate(layers):
            C4_PAGED.write(buf, rows, torch.stack([_entry(int(c), li) for c in compressed]))

    r, n = 1, 300
    req = Req("v4", "", list(range(n)), SamplingParams(max_new_tokens=8))
    req.kv.req_pool_idx = r
    locs = alloc.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([n]), torch.tensor([n]),
                              torch.tensor([-1]), n)
    r2t.req_to_token[r, :n] = locs.to(torch.int32)
    first = c4.translate_loc_from_full_to_compressed(locs)
    write(first)
    base = int(first[0])
    req.extend_end = n
    coord.admit_request_into_staging(req)
    assert coord.collect_ready_reqs() == [req]
    g = torch.Generator().manual_seed(5)
    resolved = 0
    for step in range(60):
        length = n + step + 1
        last = r2t.req_to_token[r, length - 2 : length - 1].to(torch.int64)
        loc = alloc.alloc_decode(torch.tensor([length]), torch.tensor([length]), last)
        r2t.req_to_token[r, length - 1] = int(loc[0])
        coord.map_last_loc_to_buffer(torch.tensor([length]), loc, torch.tensor([r]), torch.tensor([length]),
                                     torch.tensor([r]))
        if length % 4 == 0:
            write((loc.to(torch.int64) - 3) // 4)
        coord.wait_for_pending_backup()
        coord.num_real_reqs.fill_(1)
        clen = length // 4
        sel = torch.randperm(clen, generator=g)[:16].to(torch.int32)
        coord.raw_indices_buffer[0, :] = -1
        coord.raw_indices_buffer[0, : sel.numel()] = sel
        for li, buf in enumerate(layers):
            rows = coord.swap_in_selected_pages(torch.tensor([r]), torch.tensor([clen]), coord.raw_indices_buffer[:1], li)
            got = C4_PAGED.read(buf, rows[0, : sel.numel()].to(torch.int64))
            want = torch.stack([_entry(base + int(c), li) for c in sel])
            assert torch.equal(got, want), f"step {step} layer {li}"
            resolved += sel.numel()
    assert resolved == 60 * 2 * 16
    if residency == "always_hot":  # 75-90 entries over 64 hot slots: misses loaded from host rows
        assert coord.core.telemetry.snapshot().misses > 0
    length = n + 60
    coord.request_finished(req)
    alloc.free(r2t.req_to_token[r, :length].to(torch.int64))
    alloc.check_integrity()
    assert alloc.core.rows.used_size() == 0 and alloc.core.logical.used_size() == 0
    assert int(coord.host_pool.allocated_lens.sum()) == 0
    coord.destroy()
