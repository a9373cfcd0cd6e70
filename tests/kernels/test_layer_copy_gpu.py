"""CUDA all-layer row copy (jit_kernels/layer_copy.cuh) == the pure-torch reference, bit for
bit, device -> pinned host and back, eager and under CUDA-graph capture + replay (GPU only)."""

from __future__ import annotations

import pytest
import torch

from sglang_hisparse.coordinator.transfer import cuda_alias
from sglang_hisparse.kernels import _jit
from sglang_hisparse.kernels.layer_copy import LayerTable, copy_rows, reference_copy_rows

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (kernel vs reference comparison)"
)


def make_side(num_layers: int, rows: int, item: int, *, host: bool, seed: int, pad: int = 0):
    """Per-layer uint8 [rows, item] tensors: views of one CUDA array, or of one pinned host
    array seen through its device-mapped alias (``pad`` extra bytes per row: a strided layout
    like SGLang's [rows, 1, kv_dim] buffers with a wider row)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, 256, (num_layers, rows, item + pad), dtype=torch.uint8, generator=g)
    if host:
        full = full.pin_memory()
        view = cuda_alias(full, torch.device("cuda"))
        assert view is not None, "pinned host memory has no device-mapped view"
    else:
        view = full.cuda()
    return [view[li, :, :item] for li in range(num_layers)], full


def rows_pair(n: int, src_rows: int, dst_rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, src_rows, (n,), generator=g)
    dst = torch.randperm(dst_rows, generator=g)[:n]  # distinct destinations
    return src.cuda(), dst.cuda()


def snapshot(layers):
    return [t.clone() for t in layers]


def restore(layers, saved):
    for t, s in zip(layers, saved, strict=True):
        t.copy_(s)


@pytest.mark.parametrize("item", [656, 1152])
@pytest.mark.parametrize("num_layers,n", [(1, 1), (61, 16), (78, 64), (61, 300), (3, 0)])
@pytest.mark.parametrize("direction", ["to_host", "to_device"])
def test_kernel_matches_reference(item, num_layers, n, direction):
    dev, _d = make_side(num_layers, 512, item, host=False, seed=1)
    host, _h = make_side(num_layers, 700, item, host=True, seed=2, pad=32)
    src, dst = (dev, host) if direction == "to_host" else (host, dev)
    s_rows, d_rows = rows_pair(n, src[0].shape[0], dst[0].shape[0], seed=n + num_layers)
    assert_kernel_equals_reference(LayerTable.build(src), LayerTable.build(dst), dst, s_rows, d_rows)


def assert_kernel_equals_reference(st, dt, dst, s_rows, d_rows) -> None:
    """The kernel's copy leaves ``dst`` (the layers of ``dt``) as the reference's does."""
    before = snapshot(dst)
    reference_copy_rows(src=st, dst=dt, src_rows=s_rows, dst_rows=d_rows)
    want = snapshot(dst)
    restore(dst, before)
    copy_rows(src=st, dst=dt, src_rows=s_rows, dst_rows=d_rows)
    torch.cuda.synchronize()
    for li, (got, exp) in enumerate(zip(dst, want, strict=True)):
        assert torch.equal(got, exp), f"layer {li} differs"


@pytest.mark.parametrize("num_layers,n", [(1, 1), (43, 64), (43, 300), (3, 0)])
@pytest.mark.parametrize("direction", ["to_host", "to_device", "device_to_device"])
def test_c4_pages_copy_like_the_reference(num_layers, n, direction):
    """DeepSeek-V4's paged C4 entries (``row_layout.C4_PAGED``: device layers uint8 [pages,
    37440]) to and from 592-byte host rows, and within the device table: the kernel's ROWL
    builds leave every byte as the reference does (pages' padding and tails included)."""
    from sglang_hisparse.kernels.row_layout import C4_PAGED

    g = torch.Generator().manual_seed(num_layers + n)
    pages = torch.randint(0, 256, (num_layers, 9, C4_PAGED.page_bytes), dtype=torch.uint8, generator=g).cuda()
    dev = [pages[li] for li in range(num_layers)]
    host, _h = make_side(num_layers, 700, C4_PAGED.host_item(), host=True, seed=3)
    dtab, htab = LayerTable.build(dev, "dev", layout=C4_PAGED), LayerTable.build(host)
    entries = 9 * 64
    if direction == "to_host":
        s_rows, d_rows = rows_pair(n, entries, 700, seed=n)
        assert_kernel_equals_reference(dtab, htab, host, s_rows, d_rows)
    elif direction == "to_device":
        s_rows, d_rows = rows_pair(n, 700, entries, seed=n)
        assert_kernel_equals_reference(htab, dtab, dev, s_rows, d_rows)
    else:
        perm = torch.randperm(entries, generator=g)
        m = min(n, entries // 2)
        assert_kernel_equals_reference(dtab, dtab, dev, perm[:m].cuda(), perm[m : 2 * m].cuda())


@pytest.mark.parametrize("num_layers,n", [(1, 1), (43, 300)])
@pytest.mark.parametrize("direction", ["to_host", "to_device"])
def test_c4_pages_on_both_sides_copy_like_the_reference(num_layers, n, direction):
    """``C4_PAGED_HOST``: the host layers in the same C4 pages (pinned uint8 [pages, 37440],
    the host rows SGLang's PD transfer writes); staging, backup and PD preload copy page to page
    (ROWL 1 on both sides), every byte as the reference leaves it."""
    from sglang_hisparse.kernels.row_layout import C4_PAGED

    g = torch.Generator().manual_seed(num_layers + n + 1)
    pages = torch.randint(0, 256, (num_layers, 9, C4_PAGED.page_bytes), dtype=torch.uint8, generator=g).cuda()
    dev = [pages[li] for li in range(num_layers)]
    hpages = torch.randint(0, 256, (num_layers, 12, C4_PAGED.page_bytes), dtype=torch.uint8, generator=g).pin_memory()
    host = [cuda_alias(hpages[li], torch.device("cuda")) for li in range(num_layers)]
    dtab, htab = LayerTable.build(dev, "dev", layout=C4_PAGED), LayerTable.build(host, "host", layout=C4_PAGED)
    if direction == "to_host":
        s_rows, d_rows = rows_pair(n, 9 * 64, 12 * 64, seed=n)
        assert_kernel_equals_reference(dtab, htab, host, s_rows, d_rows)
    else:
        s_rows, d_rows = rows_pair(n, 12 * 64, 9 * 64, seed=n)
        assert_kernel_equals_reference(htab, dtab, dev, s_rows, d_rows)


@pytest.mark.parametrize("item", [256, 512])
@pytest.mark.parametrize("direction", ["to_host", "to_device"])
def test_split_host_rows_copy_like_the_reference(item, direction):
    """``KV_SPLIT_HOST`` (MiniMax-M3 served PD): host layers uint8 [2H, I/2], a row's K half at
    row h and its V half at H + h; staging, backup and PD preload move both halves of every row
    (ROWL 3 on the host side), every byte as the reference leaves it."""
    from sglang_hisparse.kernels.row_layout import KV_SPLIT_HOST

    num_layers, n = 7, 300
    dev, _d = make_side(num_layers, 512, item, host=False, seed=11)
    host, _h = make_side(num_layers, 2 * 700, item // 2, host=True, seed=12)
    dtab, htab = LayerTable.build(dev), LayerTable.build(host, "host", layout=KV_SPLIT_HOST.host_side)
    assert htab.item == item
    if direction == "to_host":
        s_rows, d_rows = rows_pair(n, 512, 700, seed=n)
        assert_kernel_equals_reference(dtab, htab, host, s_rows, d_rows)
    else:
        s_rows, d_rows = rows_pair(n, 700, 512, seed=n)
        assert_kernel_equals_reference(htab, dtab, dev, s_rows, d_rows)


@pytest.mark.parametrize("num_layers,n", [(1, 1), (61, 64), (78, 300)])
def test_device_to_device_within_one_table_matches_reference(num_layers, n):
    """A collect's private copies of rows another request holds (transfer.device_to_device):
    source and destination are one device table, the row sets disjoint."""
    dev, _d = make_side(num_layers, 1024, 656, host=False, seed=5)
    g = torch.Generator().manual_seed(n)
    perm = torch.randperm(1024, generator=g)
    s_rows, d_rows = perm[:n].cuda(), perm[n : 2 * n].cuda()
    table = LayerTable.build(dev)
    assert_kernel_equals_reference(table, table, dev, s_rows, d_rows)


def test_out_of_range_pairs_are_skipped():
    dev, _d = make_side(4, 64, 656, host=False, seed=3)
    host, _h = make_side(4, 32, 656, host=True, seed=4)
    before = snapshot(host)
    src = torch.tensor([1, -1, 5, 64, 7], device="cuda")
    dst = torch.tensor([2, 3, -1, 4, 32], device="cuda")
    copy_rows(src=LayerTable.build(dev), dst=LayerTable.build(host), src_rows=src, dst_rows=dst)
    torch.cuda.synchronize()
    for li in range(4):
        assert torch.equal(host[li][2], dev[li][1])
        assert torch.equal(host[li][3:], before[li][3:]) and torch.equal(host[li][:2], before[li][:2])


def test_capture_and_replay_with_new_rows():
    """One launch captured in a graph; replays with new row indices and new source bytes copy
    what the reference copies."""
    dev, _d = make_side(61, 256, 1152, host=False, seed=5)
    host, _h = make_side(61, 300, 1152, host=True, seed=6)
    st, dt = LayerTable.build(dev), LayerTable.build(host)
    s_rows, d_rows = rows_pair(16, 256, 300, seed=7)
    copy_rows(src=st, dst=dt, src_rows=s_rows, dst_rows=d_rows)  # build + warm up eagerly
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        copy_rows(src=st, dst=dt, src_rows=s_rows, dst_rows=d_rows)
    for step in range(3):
        new_s, new_d = rows_pair(16, 256, 300, seed=100 + step)
        s_rows.copy_(new_s)
        d_rows.copy_(new_d)
        for t in dev:
            t[new_s] += 1
        before = snapshot(host)
        reference_copy_rows(src=st, dst=dt, src_rows=s_rows, dst_rows=d_rows)
        want = snapshot(host)
        restore(host, before)
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        for li in range(61):
            assert torch.equal(host[li], want[li]), f"replay {step}: layer {li} differs"


def test_launcher_checks_report_the_source_line():
    mod = _jit.layer_copy_module(656)
    dev, _d = make_side(2, 8, 656, host=False, seed=8)
    t = LayerTable.build(dev)
    rows = torch.zeros(3, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match=r"layer_copy\.cuh:\d+: .*dst_rows 2"):
        mod.layer_copy(t.table, t.table, rows, rows[:2])
    with pytest.raises(ValueError, match=r"common\.cuh:\d+: src_rows has the wrong dtype"):
        mod.layer_copy(t.table, t.table, rows.int(), rows)
