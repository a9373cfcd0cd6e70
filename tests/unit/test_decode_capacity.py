"""SGLang's decode memory check counts hot-buffer growth, so pressure retracts instead of raising.

SGLang 0.5.23's ``ScheduleBatch.check_decode_mem`` asks the allocator's
``check_decode_capacity(num_tokens=..., requests=...)`` and ``retract_decode`` retracts until it
says yes. The base check compares ``available_size()`` with the new tokens only; a HiSparse
decode step also takes a fresh device page for every short request whose hot buffer has no
spare row (and, at page size 1, the temporary rows ``alloc()`` maps to the new ids). These
states are hand-built with 4-row pages: exact page counts asserted. The requests are SGLang's
own ``Req`` objects: 0.5.23 keeps the request slot at ``req.kv.req_pool_idx``, and a stand-in
with a top-level ``req_pool_idx`` once hid that the check read a field ``Req`` no longer has
(every slot list came out empty, so growth was never counted and real servers died in
``map_last_loc`` instead of retracting).
"""

from __future__ import annotations

from array import array

import pytest
import torch

from sglang_hisparse.memory.allocator import DualSpaceAllocator
from sglang_hisparse.sglang_adapter.memory import HiSparseTokenAllocator

B = 8  # hot slots; a full buffer holds B + 1 = 9 rows = 3 pages of 4


class _Pool:
    def register_mapping(self, mapping: torch.Tensor) -> None:
        self.mapping = mapping


def _alloc(device_rows: int, page: int) -> HiSparseTokenAllocator:
    a = HiSparseTokenAllocator(device_rows, page_size=page, dtype=torch.uint8, device="cpu", kvcache=_Pool(),
                               need_sort=False, host_to_device_ratio=4)
    a.configure_hot_buffer(B)
    return a


def _reqs(*slots: int) -> list:
    """Real SGLang requests holding request slots ``slots`` (as the scheduler leaves them
    after ``alloc_for_extend``)."""
    schedule_batch = pytest.importorskip("sglang.srt.managers.schedule_batch")
    from sglang.srt.sampling.sampling_params import SamplingParams

    out = []
    for r in slots:
        req = schedule_batch.Req(f"req{r}", "", array("q", [1, 2, 3]), SamplingParams(max_new_tokens=4))
        req.kv.req_pool_idx = r
        out.append(req)
    return out


def test_growth_pages_are_counted_exactly() -> None:
    dual: DualSpaceAllocator = _alloc(64, 4).core
    assert dual.hot.alloc(0, 4, B) is not None  # 4 rows = 1 full page, no spare: grows
    assert dual.hot.alloc(1, 3, B) is not None  # 3 rows in a page of 4: one spare, no growth
    assert dual.hot.alloc(2, 20, B) is not None  # long: B + 1 = 9 rows, 3 pages, full size
    assert dual.hot.rows_to_grow([0], B) == 4
    assert dual.hot.rows_to_grow([1], B) == 0
    assert dual.hot.rows_to_grow([2], B) == 0
    assert dual.hot.rows_to_grow([0, 1, 2, 3], B) == 4  # slot 3 has no buffer (staging): none
    dual.check_integrity()


def test_check_refuses_a_step_whose_growth_does_not_fit() -> None:
    a = _alloc(16, 4)  # 16 device rows: pages 1..3 usable (page 0 is the padding page)
    dual = a.core
    free_pages = dual.rows.available_size() // 4
    for r in range(free_pages):
        assert dual.hot.alloc(r, 4, B) is not None  # each fills its page exactly
    assert dual.rows.available_size() == 0 and dual.logical.available_size() > 0
    # the base check (available_size() >= num_tokens) would also refuse here, since
    # available_size is min(logical, rows) = 0; the growth is what refuses the next case
    assert not a.check_decode_capacity(num_tokens=4, tree_cache=None, requests=_reqs(0))
    dual.hot.release(free_pages - 1)  # one page free again
    assert a.available_size() == 4
    # num_tokens 4 (one new logical page) fits the base check, but two requests need 2 pages
    assert not a.check_decode_capacity(num_tokens=4, tree_cache=None, requests=_reqs(0, 1))
    assert a.check_decode_capacity(num_tokens=4, tree_cache=None, requests=_reqs(0))
    dual.check_integrity()


def test_page_size_one_counts_the_temporary_alloc_rows() -> None:
    a = _alloc(16, 1)
    dual = a.core
    assert dual.hot.alloc(0, 3, B) is not None  # 3 rows, grows by 1 row a step
    free = dual.rows.available_size()
    # two requests' decode: alloc(2) maps 2 fresh rows, then request 0 grows by one
    for q in range(free - 2):
        assert dual.hot.alloc(1 + q, 1, B) is not None
    assert dual.rows.available_size() == 2
    reqs = _reqs(0, 1)
    assert not a.check_decode_capacity(num_tokens=2, tree_cache=None, requests=reqs)  # 2 + 2 growth > 2
    assert a.check_decode_capacity(num_tokens=2, tree_cache=None, requests=[])  # nothing grows: 2 rows, 2 free
