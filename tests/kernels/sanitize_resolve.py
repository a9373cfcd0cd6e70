"""Small kernel-vs-reference sweep to run under compute-sanitizer (memcheck, racecheck).

    compute-sanitizer --tool memcheck  python tests/kernels/sanitize_resolve.py
    compute-sanitizer --tool racecheck python tests/kernels/sanitize_resolve.py --quick

Exits 1 on any mismatch; the sanitizer's own summary reports memory errors and hazards.
"""

from __future__ import annotations

import sys

import torch
from harness import kernel_result, mismatches, reference_result, scenario

from sglang_hisparse.kernels import ops


def main() -> int:
    quick = "--quick" in sys.argv
    cases = [(64, 128, 1152, 3), (512, 1024, 656, 3)] + ([] if quick else [(64, 64, 656, 5)])
    blocks = (32, 96, 288, 512) if quick else (32, 64, 96, 256, 480, 512, 1024)
    # with a resident hint (and >= 64 threads) COPY launches also run the early fetch: fetch
    # warps (rows in registers, named barriers) at every CTA split
    hints = (None, "noise") if quick else (None, "exact", "noise")
    failed = 0
    for (k, B, item, bs), hint in ((c, h) for c in cases for h in hints):
        sc = scenario(k, B, item, bs, seed=k + bs, hint=hint)
        want = reference_result(sc)
        for block in blocks:
            for ctas in (1, 3, 16):
                got = kernel_result(sc, block_size=block, ctas_per_request=ctas)
                bad = mismatches(want, got)
                if bad:
                    failed += 1
                    print(f"MISMATCH k={k} B={B} item={item} hint={hint} block={block} "
                          f"ctas={ctas}: {bad}")
                else:
                    ops.replay(plan=got[2], num_real_reqs=torch.tensor(
                        [sc.num_real], dtype=torch.int32, device="cuda"),
                        host_cache=sc.state.host_cache, device_cache=got[0].device_cache,
                        ctas=3, block_size=block)
        torch.cuda.synchronize()
    print(f"sanitize sweep: {'FAILED ' + str(failed) if failed else 'all cases match'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
