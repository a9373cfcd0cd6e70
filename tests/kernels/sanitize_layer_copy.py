"""The all-layer row copy under compute-sanitizer memcheck (device -> pinned host, host ->
device, out-of-range pairs, 61 and 78 layers, both row sizes):

    compute-sanitizer --tool memcheck --error-exitcode 9 python tests/kernels/sanitize_layer_copy.py

Exits 1 on a mismatch against the reference; the sanitizer reports memory errors itself.
"""

from __future__ import annotations

import sys

import torch
from test_layer_copy_gpu import make_side, rows_pair, snapshot

from sglang_hisparse.kernels.layer_copy import LayerTable, copy_rows, reference_copy_rows


def main() -> int:
    failed = 0
    for num_layers, item, n in ((61, 656, 64), (78, 1152, 16), (3, 656, 1)):
        dev, _d = make_side(num_layers, 128, item, host=False, seed=n)
        host, _h = make_side(num_layers, 160, item, host=True, seed=n + 1, pad=16)
        for name, src, dst in (("to_host", dev, host), ("to_device", host, dev)):
            s_rows, d_rows = rows_pair(n, src[0].shape[0], dst[0].shape[0], seed=item + n)
            # one pair out of range on each side: skipped, never dereferenced
            s_rows = torch.cat([s_rows, torch.tensor([-1, src[0].shape[0]], device="cuda")])
            d_rows = torch.cat([d_rows, torch.tensor([0, -5], device="cuda")])
            st, dt = LayerTable.build(src), LayerTable.build(dst)
            keep = snapshot(dst)
            reference_copy_rows(src=st, dst=dt, src_rows=s_rows[:n], dst_rows=d_rows[:n])
            want = snapshot(dst)
            for t, k in zip(dst, keep, strict=True):
                t.copy_(k)
            copy_rows(src=st, dst=dt, src_rows=s_rows, dst_rows=d_rows)
            torch.cuda.synchronize()
            bad = [li for li in range(num_layers) if not torch.equal(dst[li], want[li])]
            if bad:
                failed += 1
                print(f"MISMATCH {name} L={num_layers} item={item} n={n}: layers {bad[:8]}")
    print(f"layer_copy sanitize sweep: {'FAILED ' + str(failed) if failed else 'all equal'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
