"""Host pool core: rows addressed by logical id, the per-position table, budget check before
allocation, integrity (CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_hisparse.memory.budget import (
    GIB,
    _cgroup_headroom,
    available_host_bytes,
    check_host_budget,
    ranks_per_host,
)
from sglang_hisparse.memory.host_pool import HostKVPool, host_pool_bytes


def pool(**kw) -> HostKVPool:
    args = dict(
        num_layers=2,
        item_bytes=32,
        capacity_tokens=16,
        page_size=4,
        max_requests=3,
        max_context=12,
        pin=False,
    )
    args.update(kw)
    return HostKVPool(**args)


def test_bind_writes_the_logical_ids_as_host_rows():
    p = pool()
    assert p.kv.shape == (2, 20, 32) and p.total_rows == 20  # 4 usable pages + the padding page
    p.bind(0, 0, torch.tensor([9, 10, 11]))
    assert p.host_rows[0].tolist() == [9, 10, 11] + [-1] * 9 and p.allocated_len(0) == 3
    p.bind(0, 3, torch.tensor([4]))  # continue in position order
    p.bind(1, 0, torch.tensor([9, 10]))  # a shared prefix: the same rows for two requests
    p.bind_positions([0, 1], [4, 2], torch.tensor([16, 17]))
    assert p.host_rows[0, :5].tolist() == [9, 10, 11, 4, 16] and p.host_rows[1, :3].tolist() == [9, 10, 17]
    p.bind(0, 1, torch.tensor([12]))  # rebinding a bound position (a rejected draft's) is fine
    assert p.allocated_len(0) == 5
    p.check_integrity()
    p.unbind(0)
    assert p.host_rows[0].eq(-1).all() and p.allocated_len(0) == 0
    p.unbind(0)  # idempotent
    p.check_integrity()


def test_write_read_roundtrip_per_layer_and_all_layers():
    p = pool()
    rows = torch.tensor([4, 5, 6, 7])
    data = torch.randint(0, 256, (2, 4, 32), dtype=torch.uint8)
    p.write(rows, data)
    assert torch.equal(p.read(rows), data)
    p.write(rows[:1], data[0, 1:2] + 1, layer_id=1)
    assert torch.equal(p.layer(1)[rows[0]], data[0, 1] + 1)
    assert p.layer(0)[:4].eq(0).all()  # padding page zeroed


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="item_bytes = 20 must be a positive multiple of 16"):
        pool(item_bytes=20)
    with pytest.raises(ValueError, match="capacity_tokens = 2 must hold at least one page"):
        pool(capacity_tokens=2)
    p = pool()
    with pytest.raises(ValueError, match="exceeds max_context = 12"):
        p.bind(0, 0, torch.arange(4, 17))
    with pytest.raises(ValueError, match="would leave a gap"):
        p.bind(0, 2, torch.tensor([4]))
    with pytest.raises(ValueError, match="would leave a gap"):
        p.bind_positions([1], [3], torch.tensor([4]))
    with pytest.raises(ValueError, match="req_slot = 3 outside 0..2"):
        p.bind(3, 0, torch.tensor([4]))
    p.bind(0, 0, torch.tensor([2]))  # row 2 is in the padding page
    with pytest.raises(ValueError, match="outside the usable rows 4..19"):
        p.check_integrity()


def test_budget_checked_before_allocating():
    need = host_pool_bytes(num_layers=2, item_bytes=32, capacity_tokens=16, page_size=4)
    assert need == 2 * 20 * 32
    with pytest.raises(
        ValueError,
        match=r"needs 0.00 GiB.*only 0.00 GiB.*host_to_device_ratio.*mem-fraction-static",
    ):
        pool(available_bytes=need - 1)
    pool(available_bytes=need)  # exactly fits


def test_budget_counts_every_rank_on_the_machine_and_gives_both_figures():
    with pytest.raises(
        ValueError,
        match=r"x needs 3.00 GiB .* per rank; 2 rank\(s\) on this machine need 6.00 GiB but only "
        r"5.00 GiB is available .*'host_to_device_ratio' in --hisparse-config \(at most 3 fits\)",
    ):
        check_host_budget(3 * GIB, what="x", available_bytes=5 * GIB, ranks_per_host=2, ratio=4)
    check_host_budget(GIB, what="x", available_bytes=2 * GIB, ranks_per_host=2)  # exactly fits
    with pytest.raises(ValueError, match="ranks_per_host = 0 must be >= 1"):
        check_host_budget(GIB, what="x", available_bytes=2 * GIB, ranks_per_host=0)


@pytest.mark.parametrize(
    ("tp", "pp", "nnodes", "dp", "want"),
    [
        (8, 1, 1, 1, 8),  # one node, TP 8 (DP attention, too: it splits tp_size)
        (16, 1, 2, 1, 8),  # TP across two nodes
        (8, 2, 2, 1, 8),  # one pipeline stage per node
        (4, 4, 2, 1, 8),  # two stages per node
        (8, 2, 4, 1, 4),  # each stage over two nodes
        (2, 1, 1, 4, 8),  # four replicas of TP 2 on one node
    ],
)
def test_ranks_per_host_follows_sglangs_launch_layout(tp, pp, nnodes, dp, want):
    assert ranks_per_host(tp_size=tp, pp_size=pp, nnodes=nnodes, dp_replicas=dp) == want


def test_available_host_bytes_honours_cgroup(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    root = tmp_path / "cg"
    (root / "memory" / "job").mkdir(parents=True)
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text("1000000\n")
    (root / "memory" / "job" / "memory.usage_in_bytes").write_text("999000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/job\n0::/\n")
    assert _cgroup_headroom(root, proc) == 1000
    assert available_host_bytes(meminfo=meminfo, cgroup_root=tmp_path / "none") == 2048 * 1024
    # the real machine: a positive figure, never above MemAvailable
    assert 0 < available_host_bytes() <= 2**60


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12), st.booleans()), max_size=30))
def test_random_bind_unbind_sequences(ops):
    p = pool(max_requests=4)
    for r, length, finish in ops:
        if finish:
            p.unbind(r)
        else:
            have = p.allocated_len(r)
            start = min(have, length)
            p.bind(r, start, torch.arange(4, 4 + max(length - start, 0)))
            assert p.allocated_len(r) == max(have, length)
        p.check_integrity()
    for r in range(4):
        p.unbind(r)
    p.check_integrity()
    assert p.host_rows.eq(-1).all() and int(p.allocated_lens.sum()) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_pinned_on_cuda_and_unregistered_on_destroy():
    p = pool(device="cuda", pin=True)
    assert p.pinned and p.kv.is_pinned()
    p.destroy()
    assert not p.pinned
    p.destroy()  # idempotent
