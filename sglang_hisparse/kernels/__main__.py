"""``python -m sglang_hisparse.kernels``: precompile every kernel specialization a setup needs.

Builds the resolve module for each ``(top_k, B, item)`` and the replay and all-layer copy modules for each item
size into the JIT cache (see ``_jit.py``), in parallel, so that the first decode step does not
pay for nvcc. Examples::

    python -m sglang_hisparse.kernels                                  # defaults: k 2048, B 4096
    python -m sglang_hisparse.kernels --top-k 2048 --buffer 4096 8192 --items 656
    python -m sglang_hisparse.kernels --grid tests --jobs 8           # GPU tests + benchmarks
    python -m sglang_hisparse.kernels --buffer 10240 --draft-tokens 4 # + speculative verify (W = 4)
    python -m sglang_hisparse.kernels --policy fra                     # the fra resolve builds

``--draft-tokens W`` (= ``--speculative-num-draft-tokens``) also builds the verify-step module
for each ``(k, B, W, item)`` with ``B >= W*k`` (speculative decoding, ``verify_ops``).

A build that fails on a host missing part of the toolchain (a CUDA home without
``lib64/libcudart.so``, no ``ninja``, ...) ends in one line naming what is missing and the fix,
from doctor's ``kernel build`` check (``kernels/toolchain.py``), and exit status 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from ..kernel_policy import POLICIES, policy_id
from . import _jit, toolchain

#: (k, B, item) specializations the GPU tests and benchmarks use: every k in {64, 512, 2048},
#: B in {k, 2k, 4k} for some item, both item sizes for each k, plus the benchmark shapes.
TEST_GRID: tuple[tuple[int, int, int], ...] = (
    (64, 64, 656), (64, 128, 1152), (64, 256, 656),
    (512, 512, 1152), (512, 1024, 656), (512, 2048, 1152),
    (2048, 2048, 656), (2048, 2048, 1152), (2048, 4096, 656), (2048, 4096, 1152),
    (2048, 8192, 656),
)
ITEMS = (656, 1152)
#: DeepSeek-V4's C4 builds of the test grid ((k, B) at 592-byte rows, row layouts 1 and 2:
#: tests/kernels/test_resolve_c4_gpu.py, the CUDA harness's toy V4, bench_resolve_c4.py)
C4_GRID = ((512, 1024), (512, 2048), (64, 128), (32, 64))
C4_ITEM = 592
#: MiniMax-M3's block builds over split host rows (ROWL 3): (k, B, item, block) of
#: test_resolve_blocks_gpu.py's split test and the CUDA harness's toy M3
M3_SPLIT_GRID = ((2176, 4352, 512, 128), (2176, 4352, 256, 128), (64, 128, 1152, 8), (32, 64, 512, 8))


def precompile(resolve_specs, items, jobs: int = 4, gather: bool = False, log=print,
               verify_specs=(), policy: str = "lru") -> None:
    """Build the given resolve ``(k, B, item)`` specs (for ``policy``, its builds instead of
    lru's when it is not lru), replay and all-layer copy ``items``, verify ``(k, B, W, item)``
    specs (and the benchmark's gather ceiling when ``gather``) with ``jobs`` parallel builds."""
    pid = policy_id(policy)
    tasks = [("resolve_policy", (*s, pid)) if pid else ("resolve", s) for s in resolve_specs]
    tasks += [("replay", (i,)) for i in items]
    tasks += [("verify", s) for s in verify_specs] + [("layer_copy", (i,)) for i in items]
    tasks += [("gather", (i,)) for i in items] if gather else []
    if gather:  # the test grid: DeepSeek-V4's C4 builds too
        tasks += [("resolve_c4", (k, b, C4_ITEM, r)) for k, b in C4_GRID for r in (0, 1, 2)]
        tasks += [("replay", (C4_ITEM, r)) for r in (0, 1, 2)] + [("gather", (C4_ITEM,))]
        tasks += [("layer_copy", (C4_ITEM, sl, dl)) for sl, dl in ((0, 0), (1, 0), (0, 1), (1, 1))]
        tasks += [("resolve_m3", spec) for spec in M3_SPLIT_GRID]
        items3 = sorted({i for _, _, i, _ in M3_SPLIT_GRID})
        tasks += [("replay", (i, 3)) for i in items3]
        tasks += [("layer_copy", (i, sl, dl)) for i in items3 for sl, dl in ((0, 3), (3, 0))]
    getters = {"resolve": _jit.resolve_module, "replay": _jit.replay_module,
               "gather": _jit.gather_module, "verify": _jit.verify_module,
               "layer_copy": _jit.layer_copy_module,
               "resolve_policy": lambda k, b, i, p: _jit.resolve_module(k, b, i, policy=p),
               "resolve_c4": lambda k, b, i, r: _jit.resolve_module(k, b, i, rowl=r),
               "resolve_m3": lambda k, b, i, blk: _jit.resolve_module(k, b, i, blocks=blk, rowl=3)}

    def one(task):
        kind, args = task
        t0 = time.perf_counter()
        getters[kind](*args)
        return f"{kind}{args}: {time.perf_counter() - t0:.1f} s"

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for line in pool.map(one, tasks):
            log(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_hisparse.kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top-k", type=int, nargs="+", default=[2048], help="top-k values (k)")
    ap.add_argument("--buffer", type=int, nargs="+", default=[4096],
                    help="device_buffer_size values (B >= k)")
    ap.add_argument("--items", type=int, nargs="+", default=list(ITEMS),
                    help="KV row sizes in bytes (656 fp8 DSA, 1152 bf16 MLA)")
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[], metavar="W",
                    help="also build speculative verify modules for W = --speculative-num-draft-"
                         "tokens (needs B >= W*k)")
    ap.add_argument("--policy", choices=POLICIES, default="lru",
                    help="replacement policy of the resolve builds (--hisparse-config \"policy\")")
    ap.add_argument("--grid", choices=["tests"], help="build the GPU test/benchmark grid instead")
    ap.add_argument("--jobs", type=int, default=4, help="parallel builds")
    args = ap.parse_args(argv)
    if args.grid == "tests":
        specs, items = list(TEST_GRID), list(ITEMS)
    else:
        specs = [(k, b, i) for k in args.top_k for b in args.buffer for i in args.items if b >= k]
        items = args.items
        if not specs:
            print("no (top_k, buffer) pair with buffer >= top_k; nothing to build", file=sys.stderr)
            return 2
    verify = [(k, b, w, i) for (k, b, i) in specs for w in args.draft_tokens if w >= 1 and b >= w * k]
    if args.draft_tokens and not verify:
        w, k = max(args.draft_tokens), min(args.top_k)
        print(f"--draft-tokens {args.draft_tokens}: no --buffer value holds W*k; a verify step "
              f"needs B >= W*top_k, e.g. --buffer {max(2, w + 1) * k}", file=sys.stderr)
        return 2
    print(f"JIT cache: {_jit.cache_dir()}  target: sm {_jit.cuda_arch()}")
    try:
        precompile(specs, items, jobs=args.jobs, gather=args.grid == "tests", verify_specs=verify,
                   policy=args.policy)
    except (RuntimeError, OSError):  # tvm-ffi's: ninja's output, or a tool it could not start
        problem = toolchain_problem()
        if problem is None:
            raise  # the host has what the build needs: a compile error or a bug, shown in full
        print(f"error: the kernel build failed: {problem}", file=sys.stderr)
        return 1
    return 0


def toolchain_problem() -> str | None:
    """What this host lacks for the build and the fix, in one line (doctor's ``kernel build``
    check, ``kernels/toolchain.inspect``), or None when it lacks nothing."""
    import torch

    readiness = toolchain.inspect(torch_cuda=torch.version.cuda)
    return None if readiness.ok else readiness.summary()


if __name__ == "__main__":
    sys.exit(main())
