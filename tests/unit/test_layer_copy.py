"""All-layer row copy (kernels.layer_copy) on CPU: the reference's semantics, the table's
checks, and the coordinator's transfer paths (fused and per-layer) giving the same bytes."""

import pytest
import torch

from sglang_hisparse.kernels.layer_copy import LayerTable, copy_rows, reference_copy_rows


def _layers(num_layers: int, rows: int, item: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (rows, item), dtype=torch.uint8, generator=g) for _ in range(num_layers)]


def test_every_layer_copies_the_same_row_pairs():
    src, dst = _layers(3, 8, 32, 0), _layers(3, 10, 32, 1)
    before = [d.clone() for d in dst]
    s, d = torch.tensor([5, 0, 7]), torch.tensor([9, 2, 3])
    copy_rows(src=LayerTable.build(src), dst=LayerTable.build(dst), src_rows=s, dst_rows=d)
    for li in range(3):
        assert torch.equal(dst[li][[9, 2, 3]], src[li][[5, 0, 7]])
        untouched = [i for i in range(10) if i not in (9, 2, 3)]
        assert torch.equal(dst[li][untouched], before[li][untouched])


def test_table_rows_are_address_stride_rows():
    base = torch.zeros(2, 6, 48, dtype=torch.uint8)
    t = LayerTable.build([base[0], base[1]])
    assert t.item == 48 and t.table.dtype == torch.int64 and t.table.shape == (2, 3)
    assert t.table.tolist() == [[base[0].data_ptr(), 48, 6], [base[1].data_ptr(), 48, 6]]


def test_empty_copy_is_a_no_op():
    src, dst = _layers(2, 4, 16, 0), _layers(2, 4, 16, 1)
    before = [d.clone() for d in dst]
    e = torch.empty(0, dtype=torch.int64)
    reference_copy_rows(src=LayerTable.build(src), dst=LayerTable.build(dst), src_rows=e, dst_rows=e)
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))


def test_table_refuses_what_the_kernel_cannot_copy():
    with pytest.raises(ValueError, match="one row width"):
        LayerTable.build([torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 32, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="uint8"):
        LayerTable.build([torch.zeros(4, 16, dtype=torch.int32)])
    with pytest.raises(ValueError, match="multiple of 16"):
        LayerTable.build([torch.zeros(4, 24, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="16-byte aligned"):
        LayerTable.build([torch.zeros(4 * 16 + 8, dtype=torch.uint8)[8:].view(4, 16)])
    with pytest.raises(ValueError, match="empty"):
        LayerTable.build([])


def test_copy_refuses_mismatched_sides_and_rows():
    a, b = LayerTable.build(_layers(2, 4, 16, 0)), LayerTable.build(_layers(3, 4, 16, 1))
    r = torch.tensor([1])
    with pytest.raises(ValueError, match="must match"):
        copy_rows(src=a, dst=b, src_rows=r, dst_rows=r)
    c = LayerTable.build(_layers(2, 4, 16, 2))
    with pytest.raises(ValueError, match="int64"):
        copy_rows(src=a, dst=c, src_rows=r.int(), dst_rows=r)
    with pytest.raises(ValueError, match="1 source rows but 2"):
        copy_rows(src=a, dst=c, src_rows=r, dst_rows=torch.tensor([1, 2]))


@pytest.mark.parametrize("per_layer", [False, True])
def test_transfer_paths_move_the_same_bytes(per_layer):
    """transfer.to_host / to_device through the layer tables (default) and per layer (the path
    of a CUDA coordinator whose host pool has no device-mapped view: ``layer_tables`` False)
    leave identical KV."""
    from types import SimpleNamespace

    from sglang_hisparse.coordinator import transfer
    from sglang_hisparse.kernels.row_layout import TOKEN

    dev, host = _layers(4, 8, 32, 3), _layers(4, 12, 32, 4)
    ref_dev, ref_host = [t.clone() for t in dev], [t.clone() for t in host]
    # not an SGLang object: the fields of our CoreContext that transfer reads
    ctx = SimpleNamespace(device=torch.device("cpu"), device_kv=dev, host_kv=host,
                          host_kv_cuda=None, layer_tables=False if per_layer else None,
                          row_layout=TOKEN)
    transfer.to_host(ctx, torch.tensor([1, 6]), torch.tensor([11, 0]))
    transfer.to_device(ctx, torch.tensor([3]), torch.tensor([2]))
    assert (ctx.layer_tables is False) == per_layer
    for li in range(4):
        ref_host[li][[11, 0]] = ref_dev[li][[1, 6]]
        ref_dev[li][2] = ref_host[li][3]
        assert torch.equal(host[li], ref_host[li]) and torch.equal(dev[li], ref_dev[li])
