"""Hand-built allocator cases with exact ids (CPU)."""

from __future__ import annotations

import pytest
import torch

from sglang_hisparse.memory.allocator import UNMAPPED, DualSpaceAllocator, PagedIdAllocator


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# ---- PagedIdAllocator -------------------------------------------------------------------------
def test_paged_free_list_order_page1():
    a = PagedIdAllocator(8, 1)
    assert a.alloc(3).tolist() == [1, 2, 3]  # id 0 is the padding slot, never handed out
    assert a.alloc(2).tolist() == [4, 5]
    a.free(t(4, 2))
    # freed ids go to the front, ascending: most recently freed reused first
    assert a.alloc(3).tolist() == [2, 4, 6]
    assert a.available_size() == 2 and a.used_size() == 6
    a.check_integrity()


def test_paged_pages_of_four():
    a = PagedIdAllocator(12, 4)  # pages 1..3 -> ids 4..15
    assert a.total_ids == 16
    assert a.alloc(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert a.alloc(8) is None  # one page left: query, then mutate
    assert a.available_size() == 4
    a.free(t(5))  # any id of a page frees the whole page
    assert a.available_size() == 8
    assert a.alloc(4).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="multiple of page_size = 4"):
        a.alloc(3)
    a.check_integrity()


def test_paged_bad_frees_raise_with_numbers():
    a = PagedIdAllocator(4, 1)
    ids = a.alloc(2)
    a.free(ids)
    with pytest.raises(ValueError, match=r"double free of page\(s\) \[1, 2\].*4 of 4 ids free"):
        a.free(ids)
    with pytest.raises(ValueError, match=r"page\(s\) \[0\].*valid pages are 1..4"):
        a.free(t(0))
    with pytest.raises(ValueError, match=r"page\(s\) \[9\]"):
        a.free(t(9))
    a.check_integrity()  # nothing changed


def test_paged_extend_continues_mid_page_prefix():
    a = PagedIdAllocator(16, 4)
    first = a.alloc_extend(t(0, 0), t(6, 3), t(-1, -1))
    # request 0: 6 tokens -> pages 1, 2 (ids 4..9); request 1: page 3 (ids 12..14)
    assert first.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14]
    # request 0 continues from 6 to 11: 10, 11 in page 2, then page 4 for positions 8..10
    more = a.alloc_extend(t(6), t(11), t(9))
    assert more.tolist() == [10, 11, 16, 17, 18]
    assert a.alloc_extend(t(0), t(5), t(-1)) is None  # needs 2 pages, 0 left
    a.check_integrity()


def test_paged_decode_opens_pages_only_when_needed():
    a = PagedIdAllocator(16, 4)
    a.alloc_extend(t(0, 0), t(4, 2), t(-1, -1))  # r0: 4..7, r1: 8..9
    # r0's new token (position 4) opens a page; r1's (position 2) continues its page
    out = a.alloc_decode(t(5, 3), t(7, 9))
    assert out.tolist() == [12, 10]
    a.check_integrity()


def test_paged_check_integrity_reports_three_numbers():
    a = PagedIdAllocator(4, 1)
    a.alloc(2)
    a._num_used = 1  # simulate a lost page
    with pytest.raises(ValueError, match=r"free 2 \+ used 1 != capacity 4"):
        a.check_integrity()


# ---- DualSpaceAllocator -----------------------------------------------------------------------
def prefill(a: DualSpaceAllocator, *lens: int) -> list[torch.Tensor]:
    n = len(lens)
    ids = a.alloc_extend(torch.zeros(n, dtype=torch.int64), t(*lens), torch.full((n,), -1))
    return list(torch.split(ids, list(lens)))


def test_dual_prefill_maps_both_spaces_and_sentinel():
    a = DualSpaceAllocator(8, host_to_device_ratio=2)
    assert a.size_full == 16 and a.size_device == 8
    (r0,) = prefill(a, 5)
    assert r0.tolist() == [1, 2, 3, 4, 5]
    assert a.translate(r0).tolist() == [1, 2, 3, 4, 5]
    assert a.translate(t(6, -1)).tolist() == [UNMAPPED, -1]  # unmapped -> padding row; -1 stays -1
    assert a.available_size() == 3  # min(11 logical, 3 device)
    a.check_integrity()


def test_dual_prefill_is_query_then_mutate():
    a = DualSpaceAllocator(4, host_to_device_ratio=4)
    prefill(a, 3)
    assert a.alloc_extend(t(0), t(2), t(-1)) is None  # device short (1 row), logical has room
    assert a.logical.available_size() == 13 and a.rows.available_size() == 1
    a.check_integrity()


def test_dual_shrink_long_prompt_keeps_first_b_and_newest():
    a = DualSpaceAllocator(16, host_to_device_ratio=2)
    (r0,) = prefill(a, 7)  # logical 1..7 -> rows 1..7
    slot_rows = a.shrink_to_hot_buffer(0, r0, hot_size=3)
    # slots 0..2 = rows of tokens 0..2; slot B=3 = newest token (6) -> row 7
    assert slot_rows.tolist() == [1, 2, 3, 7]
    assert a.rows.available_size() == 16 - 4  # rows 4, 5, 6 returned
    # only the newest token stays mapped
    assert a.translate(r0).tolist() == [0, 0, 0, 0, 0, 0, 7]
    a.check_integrity()
    a.free(r0)  # logical ids freed; row 7 belongs to the hot buffer and stays
    assert a.rows.available_size() == 12
    a.hot.release(0)
    assert a.rows.available_size() == 16 and a.logical.available_size() == 32
    a.check_integrity()


def test_dual_shrink_short_prompt_then_grow():
    a = DualSpaceAllocator(16, host_to_device_ratio=2)
    (r0,) = prefill(a, 2)
    assert a.shrink_to_hot_buffer(3, r0, hot_size=4).tolist() == [1, 2, -1, -1, -1]
    assert a.hot.grow(3).tolist() == [3]  # fresh row for slot 2
    a.check_integrity()
    a.free_request(3, r0)
    assert a.rows.available_size() == 16 and a.logical.available_size() == 32
    a.check_integrity()


def test_dual_shrink_pages_keep_union_of_pages():
    a = DualSpaceAllocator(32, host_to_device_ratio=2, page_size=4)
    (r0,) = prefill(a, 11)  # logical 4..14 -> rows 4..14 (pages 1, 2, 3)
    slot_rows = a.shrink_to_hot_buffer(0, r0, hot_size=2)
    # slots 0,1 -> rows 4,5 (page 1); slot B -> newest token 10 -> row 14 (page 3); page 2 freed
    assert slot_rows.tolist() == [4, 5, 14]
    assert a.hot.pages(0) == [1, 3]
    assert a.hot.spare_rows(0) == [6, 7, 12, 13, 15]
    assert a.rows.available_size() == 32 - 8
    assert a.hot.grow(0, 2).tolist() == [6, 7]  # spare rows first
    a.check_integrity()


def test_dual_grow_allocates_page_when_no_spare():
    a = DualSpaceAllocator(8, host_to_device_ratio=2, page_size=2)
    (r0,) = prefill(a, 2)  # rows 2, 3 (page 1)
    assert a.shrink_to_hot_buffer(0, r0, hot_size=4).tolist() == [2, 3, -1, -1, -1]
    assert a.hot.grow(0).tolist() == [4]  # new page 2, row 5 kept spare
    assert a.hot.grow(0).tolist() == [5]
    assert a.hot.grow(0, 5) is None  # 3 pages needed, 2 free: nothing changes
    assert a.rows.available_size() == 4
    a.check_integrity()


def test_dual_direct_admission_release_then_free_unmaps_newest():
    a = DualSpaceAllocator(8, host_to_device_ratio=4)
    ids = a.alloc_logical_extend(t(0), t(10), t(-1))
    assert a.translate(ids).eq(UNMAPPED).all()
    slot_rows = a.hot.alloc(5, length=10, hot_size=4)
    assert slot_rows.tolist() == [1, 2, 3, 4, 5]  # 4 slots + slot B
    a.map_tokens(ids[-1:], slot_rows[-1:])  # coordinator points the newest token at slot B
    a.check_integrity()
    a.hot.release(5)  # proportional: returns the pages, leaves the mapping to the free
    assert a.translate(ids[-1:]).tolist() == [5]
    with pytest.raises(ValueError, match="mappings outside hot buffers"):
        a.check_integrity()  # the checker sees a stale entry left without the free
    a.free(ids)
    assert a.translate(ids).eq(UNMAPPED).all()  # no stale mapping survives the free
    assert a.available_size() == 8 and a.logical.available_size() == 32
    a.check_integrity()


def test_dual_decode_is_logical_only():
    a = DualSpaceAllocator(4, host_to_device_ratio=2)
    r0, r1 = prefill(a, 2, 2)
    out = a.alloc_decode(t(3, 3), t(int(r0[-1]), int(r1[-1])))
    assert out.tolist() == [5, 6]
    assert a.rows.available_size() == 0 and a.translate(out).tolist() == [0, 0]
    a.check_integrity()


def test_dual_chunked_prefill_continues_device_page():
    a = DualSpaceAllocator(16, host_to_device_ratio=2, page_size=4)
    (c0,) = prefill(a, 6)  # logical 4..9, rows 4..9
    c1 = a.alloc_extend(t(6), t(9), c0[-1:])
    assert c1.tolist() == [10, 11, 12] and a.translate(c1).tolist() == [10, 11, 12]
    a.shrink_to_hot_buffer(0, torch.cat([c0, c1]), hot_size=8)
    with pytest.raises(ValueError, match="no prefill device row"):
        a.alloc_extend(t(9), t(10), c1[-1:])  # after shrink the prefix rows are gone
    a.check_integrity()


def test_dual_bad_frees_change_nothing():
    a = DualSpaceAllocator(4, host_to_device_ratio=2)
    (r0,) = prefill(a, 2)
    a.free(r0)
    with pytest.raises(ValueError, match="double free"):
        a.free(r0)
    with pytest.raises(ValueError, match="outside 0..8"):
        a.free(t(9))
    with pytest.raises(ValueError, match="no hot buffer"):
        a.hot.release(0)
    assert a.available_size() == 4
    a.check_integrity()


def test_dual_page1_decode_alloc_then_rebind_frees_temporary_row():
    a = DualSpaceAllocator(8, host_to_device_ratio=2)
    (r0,) = prefill(a, 3)  # logical 1..3 -> rows 1..3
    slot_rows = a.shrink_to_hot_buffer(0, r0, hot_size=2)
    assert slot_rows.tolist() == [1, 2, 3]
    new = a.alloc(1)  # SGLang's page_size-1 decode: logical 4 + temporary row 4
    assert new.tolist() == [4] and a.translate(new).tolist() == [4]
    a.unmap(r0[-1:])
    a.rebind(new, slot_rows[-1:], logical_ids_cpu=a.last_alloc_cpu)
    assert a.translate(new).tolist() == [3]  # now writes into slot B's row
    assert a.rows.available_size() == 5  # rows 4..8 free: the temporary row came back
    a.check_integrity()
    a.free_request(0, torch.cat([r0, new]))
    assert a.available_size() == 8
    a.check_integrity()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: mapping and ids on the GPU")
def test_dual_on_cuda_paged_lifecycle():
    a = DualSpaceAllocator(32, host_to_device_ratio=2, page_size=4, device="cuda")
    ids = a.alloc_extend(t(0, 0), t(6, 4), t(-1, -1).cuda())
    assert ids.is_cuda and a.mapping.is_cuda
    assert a.translate(ids).tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14, 15]
    slot_rows = a.shrink_to_hot_buffer(0, ids[:6], hot_size=4)
    assert slot_rows.tolist() == [4, 5, 6, 7, 9]
    new = a.alloc_decode(t(7), ids[5:6])  # last_loc on the GPU: no host read
    assert new.is_cuda and new.tolist() == [10]
    a.map_tokens(new, slot_rows[-1:])
    a.check_integrity()
    a.free_request(0, torch.cat([ids[:6], new]))
    a.free(ids[6:])
    assert a.available_size() == 32
    a.check_integrity()


def test_bind_extend_maps_ids_decided_elsewhere_and_continues_mid_page_chunks():
    """DeepSeek-V4's compressed ids follow SGLang's full-token pages (docs/v4-m3.md D6): the
    allocator claims their pages instead of choosing them, gives the entries device rows in the
    usual page layout (a chunk continuing a mid-page prefix continues its row page), and frees
    them as its own."""
    a = DualSpaceAllocator(32, host_to_device_ratio=2, page_size=4)
    # request 0: entries 0..5 on logical pages 7 and 3; request 1: entries 0..1 on page 5
    ids = torch.tensor([28, 29, 30, 31, 12, 13, 20, 21])
    assert a.bind_extend(ids, torch.tensor([0, 0]), torch.tensor([6, 2]))
    rows = a.translate(ids)
    assert bool((rows > 0).all()) and rows[:4].tolist() == list(range(int(rows[0]), int(rows[0]) + 4))
    assert not bool(a.logical._used[torch.tensor([1, 2])].any())  # only the claimed pages are used
    # request 0's next chunk: entries 6..8 continue page 3 (rows continue its device page), then page 10
    more = torch.tensor([14, 15, 40])
    assert a.bind_extend(more, torch.tensor([6]), torch.tensor([9]))
    got = a.translate(torch.tensor([12, 13, 14, 15]))
    assert got.tolist() == list(range(int(got[0]), int(got[0]) + 4))  # one device page
    a.check_integrity()
    with pytest.raises(ValueError, match="already in use|new pages"):
        a.bind_extend(torch.tensor([28, 29]), torch.tensor([0]), torch.tensor([2]))
    with pytest.raises(ValueError, match="3 ids for 2 extend positions"):
        a.bind_extend(torch.tensor([44, 45, 46]), torch.tensor([0]), torch.tensor([2]))
    a.free(torch.cat([ids[:6], more]))
    a.free(ids[6:])
    a.check_integrity()
    assert a.rows.available_size() == a.rows.size and a.logical.available_size() == a.logical.size
    # device rows short: False, nothing changed
    big = DualSpaceAllocator(8, host_to_device_ratio=4, page_size=4)
    before = big.logical.available_size()
    assert not big.bind_extend(torch.arange(4, 16), torch.tensor([0]), torch.tensor([12]))
    assert big.logical.available_size() == before
    big.check_integrity()
