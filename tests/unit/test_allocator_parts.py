"""The parts ``DualSpaceAllocator`` composes, each built by hand and tested on its own (CPU).

Every case builds the two id spaces and only the parts it needs, asserts exact ids, rows
and counts, and runs the parts' ``check_integrity`` after each step. The last section
checks the facade's forwarding and the names other modules read.
"""

from __future__ import annotations

import pytest
import torch

from sglang_hisparse.memory.address_map import UNMAPPED, AddressMap
from sglang_hisparse.memory.allocator import DualSpaceAllocator
from sglang_hisparse.memory.handover import Handover
from sglang_hisparse.memory.hot import HotBuffers
from sglang_hisparse.memory.paged import PagedIdAllocator
from sglang_hisparse.memory.prefill_rows import PrefillRows
from sglang_hisparse.memory.prefix_share import PrefixShare


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


class Parts:
    """Both spaces (``rows`` device rows, ``ratio`` x as many logical ids) and every part."""

    def __init__(self, rows: int = 8, ratio: int = 2, page_size: int = 1) -> None:
        self.logical = PagedIdAllocator(rows * ratio, page_size, name="logical ids")
        self.rows = PagedIdAllocator(rows, page_size, name="device rows")
        self.map = AddressMap(self.logical)
        self.prefill = PrefillRows(self.logical, self.rows, self.map)
        self.hot = HotBuffers(self.rows, self.map.mapping)
        self.share = PrefixShare(self.logical, self.rows, self.prefill, self.map, self.hot)
        self.handover = Handover(self.rows, self.prefill, self.share, self.hot, self.map)
        #: page counts ``room`` was asked for
        self.asked: list[int] = []

    def room(self, pages: int) -> bool:
        """Makes no room: answers whether ``pages`` device pages are free already."""
        self.asked.append(pages)
        return pages <= self.rows.available_pages()

    def prefill_of(self, n: int) -> torch.Tensor:
        """A fresh request's ``n`` prompt ids, each with a prefill row."""
        ids = self.prefill.alloc_extend(t(0), t(n), t(-1), room=self.room)
        assert ids is not None
        return ids

    def check(self) -> None:
        for part in (self.logical, self.rows, self.map, self.prefill, self.handover, self.share, self.hot):
            part.check_integrity()


# ---- AddressMap -------------------------------------------------------------------------------
def test_address_map_translates_binds_and_unmaps():
    p = Parts()
    assert p.map.mapping.tolist() == [0] * 17 + [-1]  # 16 usable ids + page 0, then the sentinel
    ids = p.logical.alloc(3)  # 1, 2, 3
    p.map.bind(ids, t(5, 6, 7))
    assert p.map.translate(t(1, 2, 3, 4, -1)).tolist() == [5, 6, 7, UNMAPPED, -1]
    p.map.map_tokens(t(3), t(2))  # a hot slot's row replaces the entry
    p.map.unmap(t(1))
    assert p.map.translate(ids).tolist() == [UNMAPPED, 6, 2]
    p.map.check_integrity()
    p.map.clear()
    assert p.map.translate(ids).tolist() == [0, 0, 0] and int(p.map.mapping[-1]) == -1


def test_address_map_integrity_names_free_mapped_ids_and_the_sentinel():
    p = Parts()
    p.map.map_tokens(t(4), t(1))  # id 4 was never allocated
    with pytest.raises(ValueError, match=r"free logical ids still mapped: \[4\]"):
        p.map.check_integrity()
    p.map.unmap(t(4))
    p.map.mapping[-1] = 0
    with pytest.raises(ValueError, match="sentinel corrupted: last element is 0, expected -1"):
        p.map.check_integrity()


def test_address_map_methods_use_a_rebound_view():
    p = Parts()
    view = p.map.mapping[:]  # same storage, another tensor object (the sync guard's marking)
    p.map.mapping = view
    p.logical.alloc(1)
    p.map.map_tokens(t(1), t(3))
    assert p.map.translate(t(1)).tolist() == [3] and int(p.hot.mapping[1]) == 3


# ---- PrefillRows ------------------------------------------------------------------------------
def test_prefill_alloc_takes_both_spaces_and_maps():
    p = Parts(rows=8, ratio=2, page_size=2)  # logical pages 1..8, device pages 1..4
    ids = p.prefill.alloc(4, room=p.room)
    assert ids.tolist() == [2, 3, 4, 5] and p.asked == [2]
    assert p.prefill.rows_of(ids).tolist() == [2, 3, 4, 5]
    assert p.map.translate(ids).tolist() == [2, 3, 4, 5]
    assert p.prefill.owned_pages() == {1, 2} and p.prefill.pages_of(t(5, 2)).tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"alloc\(3\): n must be a non-negative multiple of page_size = 2"):
        p.prefill.alloc(3, room=p.room)
    p.check()


def test_prefill_alloc_asks_room_only_when_logical_ids_suffice():
    p = Parts(rows=4, ratio=1)  # 4 logical ids, 4 device rows
    p.prefill.alloc(3, room=p.room)
    assert p.prefill.alloc(2, room=p.room) is None  # logical short: room never asked
    assert p.asked == [3]
    assert p.prefill.alloc(1, room=lambda pages: False) is None  # room refuses: nothing changed
    assert p.logical.available_size() == 1 and p.rows.available_size() == 1
    p.check()


def test_prefill_chunk_continues_its_device_page_until_disowned():
    p = Parts(rows=16, ratio=2, page_size=4)
    first = p.prefill_of(6)  # logical 4..9 -> rows 4..9
    more = p.prefill.alloc_extend(t(6), t(9), first[-1:], room=p.room)
    assert more.tolist() == [10, 11, 12] and p.prefill.rows_of(more).tolist() == [10, 11, 12]
    p.check()
    p.prefill.disown(torch.cat([first, more]))  # as a handover does; the mapping stays
    assert p.map.translate(more).tolist() == [10, 11, 12] and p.prefill.owned_pages() == set()
    with pytest.raises(ValueError, match=r"prefix tokens \[12\] \(logical\) have no prefill device row"):
        p.prefill.alloc_extend(t(9), t(10), more[-1:], room=p.room)


def test_prefill_free_rows_returns_whole_pages_and_keeps_mappings():
    p = Parts(rows=8, ratio=2, page_size=2)
    ids = p.prefill_of(3)  # logical 2..4 -> rows 2..4 (device pages 1, 2)
    assert p.prefill.free_rows(ids[2:]).tolist() == [2]  # row 4's page; rows 5 was its spare
    assert p.rows.available_pages() == 3 and p.prefill.rows_of(ids).tolist() == [2, 3, 0]
    assert p.map.translate(ids).tolist() == [2, 3, 4]  # unmapping is the caller's
    p.prefill.check_integrity()
    with pytest.raises(ValueError, match="double free"):
        p.rows.free_pages(t(2))


def test_prefill_bind_extend_short_of_rows_changes_nothing():
    p = Parts(rows=4, ratio=4, page_size=2)
    assert not p.prefill.bind_extend(torch.arange(4, 10), t(0), t(6), room=p.room)  # 3 pages, 2 free
    assert p.asked == [3] and p.logical.available_size() == 16
    assert p.prefill.bind_extend(t(8, 9, 10), t(0), t(3), room=p.room)
    assert p.prefill.rows_of(t(8, 9, 10)).tolist() == [2, 3, 4]
    with pytest.raises(ValueError, match="2 ids for 3 extend positions"):
        p.prefill.bind_extend(t(12, 13), t(0), t(3), room=p.room)
    p.check()


def test_prefill_integrity_compares_the_mapping_with_the_cpu_copy():
    p = Parts()
    ids = p.prefill_of(2)
    p.map.map_tokens(ids[:1], t(7))
    with pytest.raises(ValueError, match="mapping disagrees with the CPU prefill-row ownership"):
        p.prefill.check_integrity()


# ---- PrefixShare ------------------------------------------------------------------------------
def test_share_holds_count_each_request_once_per_page():
    p = Parts(rows=8, ratio=2, page_size=2)
    ids = p.prefill_of(4)  # logical pages 1, 2
    assert p.share.hold(0, ids).tolist() == [1, 2]
    assert p.share.hold(0, ids[:1]).tolist() == []  # already held by slot 0
    assert p.share.hold(1, ids[2:]).tolist() == [2]
    assert p.share.readers(t(1, 2, 3)).tolist() == [1, 2, 0] and p.share.holds(1)
    p.check()
    assert p.share.unhold(0).tolist() == [1, 2] and not p.share.holds(0)
    assert p.share.readers(t(1, 2)).tolist() == [0, 1]
    p.check()


def test_share_computed_ids_wait_for_their_host_copy():
    p = Parts()
    ids = p.prefill_of(3)
    p.share.note_computed(2, ids)
    assert p.share.host_pending(ids[1:2]) and p.share.computed_ids(2).tolist() == [1, 2, 3]
    p.share.mark_landed(2)
    assert not p.share.host_pending(ids) and p.share.holds(2)
    p.share.forget_pages(t(3))  # SGLang freed id 3 (a checkpoint's duplicate)
    assert p.share.computed_ids(2).tolist() == [1, 2] and p.share.readers(t(3)).tolist() == [0]
    p.share.check_integrity()
    held = p.share.drop_holds(2)
    assert not p.share.holds(2) and p.share.computed_ids(2) is None
    p.share.restore_holds(2, held)
    assert p.share.readers(t(1, 2)).tolist() == [1, 1] and p.share.computed_ids(2).tolist() == [1, 2]
    p.share.check_integrity()


def test_share_drop_unread_frees_only_unheld_rows_and_keeps_the_ids():
    p = Parts()
    ids = p.prefill_of(3)  # logical 1..3 -> rows 1..3
    p.share.hold(0, ids[:1])
    assert p.share.drop_unread(t(1, 2, 3, 4)) == 2  # page 1 is held; page 4 has no row
    assert p.map.translate(ids).tolist() == [1, 0, 0] and p.prefill.rows_of(ids).tolist() == [1, 0, 0]
    assert p.logical.is_used(ids).all() and p.rows.available_size() == 7
    p.check()


def test_share_load_prefix_gives_missing_pages_fresh_rows():
    p = Parts(rows=8, ratio=2, page_size=2)
    ids = p.prefill_of(4)  # logical 2..5 -> rows 2..5
    p.share.drop_unread(t(2))  # page 2 (ids 4, 5) has lost its rows; its KV is on host
    p.asked.clear()
    new_ids, rows, src = p.share.load_prefix(ids, room=p.room)
    assert new_ids.tolist() == [4, 5] and rows.tolist() == [4, 5] and src.tolist() == [0, 0]
    assert p.asked == [1] and p.map.translate(ids).tolist() == [2, 3, 4, 5]
    empty = p.share.load_prefix(ids, room=p.room)  # nothing missing now
    assert [x.numel() for x in empty] == [0, 0, 0]
    p.check()
    p.share.drop_unread(t(1))
    assert p.share.load_prefix(ids[:2], room=lambda pages: False) is None
    assert p.prefill.rows_of(ids[:2]).tolist() == [0, 0]  # nothing changed
    with pytest.raises(ValueError, match=r"prefix ids \[6, 7\] are not allocated"):
        p.share.load_prefix(t(6), room=p.room)


def test_share_load_prefix_copies_from_a_resident_buffer():
    p = Parts(rows=8, ratio=2)
    ids = p.logical.alloc(2)  # PD admission: logical 1, 2 in a resident buffer's rows 1, 2
    p.hot.alloc_resident(0, 2)
    p.map.map_tokens(ids, p.hot.resident_rows(0))
    _, rows, src = p.share.load_prefix(ids, room=p.room)
    assert rows.tolist() == [3, 4] and src.tolist() == [1, 2]  # copy device to device


def test_share_cached_pages_evict_oldest_first_and_skip_protected():
    p = Parts(rows=8, ratio=2)
    a = p.logical.alloc(2)  # request 0: ids 1, 2, resident in rows 1, 2
    p.hot.alloc_resident(0, 2)
    p.map.map_tokens(a, p.hot.resident_rows(0))
    b = p.logical.alloc(2)  # request 1: ids 3, 4, resident in rows 3, 4
    p.hot.alloc_resident(1, 2)
    p.map.map_tokens(b, p.hot.resident_rows(1))
    assert p.share.cache_resident(0, a) == 2 and p.share.cache_resident(1, b) == 2
    assert list(p.share.cached_pages) == [1, 2, 3, 4] and p.share.cached_rows == 4
    assert p.prefill.rows_of(torch.cat([a, b])).tolist() == [1, 2, 3, 4] and not p.hot.has(0)
    p.check()
    assert p.share.protect_cached(t(1, 9)) == 1  # id 9 is no cached page
    assert p.share.evict_cached(2) == 2 and list(p.share.cached_pages) == [1, 4]  # 2, 3 went
    p.share.release_protected()
    assert p.share.evict_cached(1) == 1 and list(p.share.cached_pages) == [4]
    assert p.share.evicted_rows == 3 and p.map.translate(torch.cat([a, b])).tolist() == [0, 0, 0, 4]
    p.share.hold(5, b)  # a held page is no cache any more
    assert list(p.share.cached_pages) == [] and p.share.evict_cached(4) == 0
    p.check()


def test_share_integrity_checks_cached_pages_and_reader_counts():
    p = Parts()
    ids = p.prefill_of(2)
    p.share.hold(0, ids)
    p.share.reader_counts[2] += 1
    with pytest.raises(ValueError, match=r"reader counts \[2\] of logical pages \[2\] disagree .*\(\[1\]\)"):
        p.share.check_integrity()
    p.share.reader_counts[2] -= 1
    p.share.cached_pages[1] = None  # held, so no cache
    with pytest.raises(ValueError, match=r"cached prefix pages \[1\] are held or have no prefill rows"):
        p.share.check_integrity()


# ---- Handover ---------------------------------------------------------------------------------
def test_handover_shrink_keeps_first_b_and_newest():
    p = Parts(rows=16, ratio=2)
    ids = p.prefill_of(7)  # logical 1..7 -> rows 1..7
    assert p.handover.shrink_to_hot_buffer(0, ids, 3).tolist() == [1, 2, 3, 7]
    assert p.map.translate(ids).tolist() == [0, 0, 0, 0, 0, 0, 7]  # only the newest stays mapped
    assert p.prefill.owned_pages() == set() and p.hot.owned_pages() == {1, 2, 3, 7}
    p.check()
    with pytest.raises(ValueError, match="request slot 0 already has a hot buffer"):
        p.handover.shrink_to_hot_buffer(0, ids, 3)
    with pytest.raises(ValueError, match=r"request slot 1: logical ids \[1, 2\] have no prefill device row\. "
                       r"Only a prefilled request can shrink"):
        p.handover.shrink_to_hot_buffer(1, ids[:2], 3)


def test_handover_keep_resident_needs_positional_rows():
    p = Parts(rows=8, ratio=2, page_size=2)
    ids = p.prefill_of(3)  # logical 2..4 -> rows 2..4
    assert p.handover.keep_resident(0, ids) == [1, 2]
    assert p.map.translate(ids).tolist() == [2, 3, 4] and p.hot.is_resident(0)
    p.check()
    other = p.prefill_of(2)  # logical 6, 7 -> rows 6, 7
    p.prefill.bind(other, t(7, 6))  # not laid out by position
    with pytest.raises(ValueError, match="every logical id needs a prefill device row"):
        p.handover.keep_resident(1, torch.cat([other, t(9)]))
    assert p.handover.keep_resident(1, other) is None and p.prefill.owned_pages() == {3}


def test_handover_collect_copies_needed_positions_of_shared_pages():
    p = Parts(rows=8, ratio=2)
    ids = p.prefill_of(4)  # logical 1..4 -> rows 1..4
    p.share.hold(0, ids)  # request 0 computed them; request 1 reads the first two
    p.share.hold(1, ids[:2])
    p.asked.clear()
    # hot size 1: slot 0 = token 0 (shared, needed), slot B = token 3 (own); token 1 not needed
    rows, shared, src, dst = p.handover.take_staged_rows(0, ids, t(1, 0, 0, 1).bool(), room=p.room)
    assert shared.tolist() == [True, True, False, False] and p.asked == [1]
    assert src.tolist() == [1] and dst.tolist() == [5]  # the needed shared position gets a private row
    assert rows.tolist() == [5, 0, 3, 4] and not p.share.holds(0)
    assert p.handover.adopt_staged_hot(0, ids, rows, shared, 1).tolist() == [5, 4]  # row 3 freed
    assert p.map.translate(ids).tolist() == [1, 2, 0, 4]  # shared ids stay on the shared rows
    assert p.hot.owned_pages() == {4, 5} and p.prefill.owned_pages() == {1, 2}
    p.check()


def test_handover_collect_short_of_rows_restores_the_holds():
    p = Parts(rows=2, ratio=4)
    ids = p.prefill_of(2)
    p.share.note_computed(0, ids)
    p.share.hold(1, ids)
    assert p.handover.take_staged_rows(0, ids, t(1, 1).bool(), room=p.room) is None
    assert p.share.readers(t(1, 2)).tolist() == [2, 2] and p.share.computed_ids(0).tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"request slot 2: logical ids \[3\] have no prefill device row\. "
                       r"Only a prefilled request can be collected"):
        p.handover.take_staged_rows(2, t(1, 3), t(1, 1).bool(), room=p.room)
    p.check()


def test_handover_integrity_finds_pages_without_an_owner():
    p = Parts()
    p.prefill_of(2)
    p.rows.alloc_pages(1)  # page 3 used, owned by nobody
    with pytest.raises(ValueError, match=r"unowned used pages \[3\]"):
        p.handover.check_integrity()


# ---- the facade -------------------------------------------------------------------------------
def test_facade_forwards_to_the_current_parts():
    a = DualSpaceAllocator(8, host_to_device_ratio=2)
    assert DualSpaceAllocator.hold is PrefixShare.hold  # on the class: the part's function
    assert a.hold.__self__ is a.share and a.translate.__self__ is a.address_map
    before = a.share
    a.clear()
    assert a.share is not before and a.hold.__self__ is a.share and a.shrink_to_hot_buffer.__self__ is a.handover
    # the names the harness's idle checks read are the share's own objects
    assert a._readers is a.share.reader_counts and a._held is a.share.held_pages
    assert a._cached is a.share.cached_pages and a.cached_evicted_rows == a.share.evicted_rows == 0


def test_facade_mapping_assignment_rebinds_the_address_map():
    a = DualSpaceAllocator(8, host_to_device_ratio=2)
    view = a.mapping[:]
    a.mapping = view
    assert a.address_map.mapping is view
    ids = a.alloc(2)
    assert view[ids].tolist() == [1, 2] and a.translate(ids).tolist() == [1, 2]
    a.check_integrity()


def test_facade_room_evicts_cached_pages_before_asking_the_reclaimer():
    class Reclaimer:
        def __init__(self) -> None:
            self.asked: list[int] = []

        def reclaimable_rows(self) -> int:
            return 0

        def reclaim(self, rows: int) -> int:
            self.asked.append(rows)
            return 0

    a = DualSpaceAllocator(4, host_to_device_ratio=2)
    ids = a.alloc_logical_extend(t(0), t(2), t(-1))
    a.hot.alloc_resident(0, 2)
    a.map_tokens(ids, a.hot.resident_rows(0))
    a.cache_resident(0, ids)  # rows 1, 2 cached; rows 3, 4 free
    r = Reclaimer()
    a.set_reclaimer(r)
    assert a.alloc(3).tolist() == [3, 4, 5] and a.cached_rows == 1 and r.asked == []
    assert a.alloc(2) is None and r.asked == [1]  # one row evicted, one still missing
    assert a.cached_evicted_rows == 2
    a.check_integrity()
