"""Device pool core: KV writes/reads translate logical ids; indexer keys stay logical (CPU)."""

from __future__ import annotations

import pytest
import torch

from hisparse_testing.device_pool import DeviceKVPool
from sglang_hisparse.memory.allocator import DualSpaceAllocator

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def t(*xs: int, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_writes_follow_mapping_and_unmapped_hits_padding_row(device):
    a = DualSpaceAllocator(8, host_to_device_ratio=2, device=device)
    p = DeviceKVPool(num_layers=2, item_bytes=16, allocator=a, index_item_bytes=4)
    assert p.kv.shape == (2, 9, 16) and p.index_k.shape == (2, 17, 4)
    ids = a.alloc_extend(t(0), t(3), t(-1))  # logical 1..3 -> rows 1..3
    data = torch.arange(48, dtype=torch.uint8, device=device).reshape(3, 16)
    p.write(1, ids, data)
    assert torch.equal(p.read(1, ids), data)
    assert torch.equal(p.read_rows(1, t(1, 2, 3, device=device)), data)
    assert p.kv[0].eq(0).all()  # other layer untouched
    # an unmapped logical id writes into padding row 0, never into a live row
    p.write(1, t(9, device=device), data[:1] + 100)
    assert torch.equal(p.kv[1, 0], data[0] + 100)
    assert torch.equal(p.read(1, ids), data)
    p.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_shrink_redirects_newest_token_and_index_keys_stay_logical(device):
    a = DualSpaceAllocator(8, host_to_device_ratio=2, device=device)
    p = DeviceKVPool(num_layers=1, item_bytes=16, allocator=a, index_item_bytes=8)
    ids = a.alloc_extend(t(0), t(4), t(-1))
    keys = torch.randint(0, 255, (4, 8), dtype=torch.uint8, device=device)
    p.write_index(0, ids, keys)
    slot_rows = a.shrink_to_hot_buffer(0, ids, hot_size=2)
    assert slot_rows.tolist() == [1, 2, 4]  # newest token keeps row 4 as slot B
    new = a.alloc_decode(t(5), ids[-1:])
    a.map_tokens(new, slot_rows[-1:])
    a.unmap(ids[-1:])
    row = torch.full((1, 16), 7, dtype=torch.uint8, device=device)
    p.write(0, new, row)
    assert torch.equal(p.kv[0, 4], row[0])
    assert torch.equal(p.read_index(0, ids), keys)  # indexer keys need no translation
    p.check_integrity()


def test_bad_construction_and_missing_index_cache():
    a = DualSpaceAllocator(4, host_to_device_ratio=1)
    with pytest.raises(ValueError, match="item_bytes = 24 must be a positive multiple of 16"):
        DeviceKVPool(num_layers=1, item_bytes=24, allocator=a)
    p = DeviceKVPool(num_layers=1, item_bytes=16, allocator=a)
    with pytest.raises(ValueError, match="no indexer key cache"):
        p.read_index(0, t(1))


def test_device_bytes_counts_padding_pages():
    # 2 layers x (9 rows x 656 B + 17 logical x 132 B)
    assert DeviceKVPool.device_bytes(
        num_layers=2,
        item_bytes=656,
        device_rows=8,
        host_to_device_ratio=2,
        page_size=1,
        index_item_bytes=132,
    ) == 2 * (9 * 656 + 17 * 132)
