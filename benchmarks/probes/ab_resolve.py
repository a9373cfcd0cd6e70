"""A/B of two resolve kernels: a baseline ``resolve.cuh`` (e.g. an older commit's) against the
current one, on the same traces (GPU, JSON out).

For each config it first checks, in one process, that both kernels produce identical out_rows,
slot tokens and LRU over three steps (``same``). Then it times NO_IO and COPY graphs of 12
steps with each kernel **in its own process**, four processes in the order base, new, new,
base, and keeps the faster of the two repeats per kernel and config.

    git show a475369:jit_kernels/resolve.cuh > /tmp/resolve_base.cuh
    python benchmarks/probes/ab_resolve.py --baseline /tmp/resolve_base.cuh --out ab.json
    python benchmarks/probes/ab_resolve.py --baseline /tmp/resolve_base.cuh --new-flags=-DHS_HASH_SLACK=4
    python benchmarks/probes/ab_resolve.py --baseline jit_kernels/resolve.cuh   # control: same code

Both kernels are compiled the same way, each in its own namespace (``-Dhisparse=hisparse_base``
/ ``hisparse_new``), next to the ``common.cuh`` beside the given ``resolve.cuh`` if there is one,
else the current one. So a whole older tree compares as it was:

    git archive 5ebabd5 jit_kernels | tar -x -C /tmp/base
    python benchmarks/probes/ab_resolve.py --baseline /tmp/base/jit_kernels/resolve.cuh --out ab.json

NOTE (H200, 2026-11-30): with both modules loaded in one process, control runs (identical code
on both sides) showed the module loaded second 1-2.6 us slower in NO_IO whatever the timing
order (results/resolve_ab_control.json). That is why each side is now timed in a process of
its own; run the control anyway when a NO_IO difference below ~1 us matters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from bench_resolve import (  # noqa: E402
    DEV,
    batch_inputs,
    clock_reasons,
    make_trace,
    sm_clock_mhz,
    time_graph,
)

from sglang_hisparse.kernels import _jit, ops  # noqa: E402

CONFIGS = [  # (bs, ctas, churn, block)
    (1, 32, 0.15, 1024), (16, 8, 0.05, 1024), (16, 8, 0.15, 1024), (64, 2, 0.0, 1024),
    (64, 2, 0.05, 1024), (64, 2, 0.15, 1024), (64, 2, 0.15, 512), (128, 1, 0.15, 512),
    (100, 1, 0.05, 1024),
]
K, B, CTX, STEPS = 2048, 4096, 32768, 12
#: pass the trace's resident hint to both kernels (--hint): the early fetch, as the coordinator
HINT = False
#: early rows per side (--base-early-rows / --new-early-rows; None: ops.FETCH_EARLY_ROWS)
BASE_EARLY: int | None = None
NEW_EARLY: int | None = None


def build_variant(path: Path, tag: str, item: int, flags: list[str]):
    """Compile ``path`` (a resolve.cuh) in namespace ``hisparse_<tag>`` with extra nvcc
    ``flags``, next to the ``common.cuh`` in its directory if there is one, else the current
    one (every resolve build inlines common.cuh's staging loops, so an older resolve.cuh is
    measured with the common.cuh it was written against)."""
    import tvm_ffi.cpp

    common = path.parent / "common.cuh"
    if not common.is_file():
        common = _jit.source_dir() / "common.cuh"
    text = path.read_text() + "\0" + common.read_text()
    digest = hashlib.sha256((text + "\0".join(flags)).encode()).hexdigest()[:12]
    inc = Path(tempfile.gettempdir()) / f"ab_resolve_{tag}_{digest}"
    inc.mkdir(exist_ok=True)
    shutil.copy(path, inc / f"resolve_{tag}.cuh")
    shutil.copy(common, inc / "common.cuh")  # found first: the including file's directory
    wrapper = (
        f'#include "resolve_{tag}.cuh"\nusing tvm::ffi::TensorView;\n'
        f"void resolve({_jit._RESOLVE_ARGS}) {{\n"
        f"  hisparse::resolve_launch<{K}, {B}, {item}>({_jit._RESOLVE_CALL});\n}}\n"
    )
    os.environ.setdefault("TVM_FFI_CUDA_ARCH_LIST", _jit.cuda_arch())
    rename = f"-Dhisparse=hisparse_{tag}"
    return tvm_ffi.cpp.load_inline(
        f"ab_{tag}_k{K}_b{B}_i{item}", cuda_sources=wrapper, functions=["resolve"],
        extra_cuda_cflags=[*_jit._CFLAGS, rename, *flags], extra_cflags=[rename],
        extra_include_paths=[str(inc), str(_jit.source_dir())], build_directory=str(inc / f"build{item}"))


class Case:
    """One config's trace and tensors, and a call(mod, step, copy) of either kernel."""

    def __init__(self, host, *, item, bs, ctas, churn, block):
        self.item, self.bs, self.ctas, self.churn, self.block = item, bs, ctas, churn, block
        self.tr = make_trace(bs=bs, k=K, B=B, ctx=CTX, churns=[churn] * bs, steps=STEPS,
                             host_rows_total=host.shape[0], seed=1)
        self.io = batch_inputs(self.tr, bs=bs, k=K, B=B, item=item, ctx=CTX)
        self.host = host
        self.arrivals = torch.zeros(bs, dtype=torch.int32, device=DEV)
        self.e64 = torch.empty(0, 0, dtype=torch.int64, device=DEV)
        self.e32 = torch.empty(0, 0, dtype=torch.int32, device=DEV)
        self.c32 = torch.empty(0, dtype=torch.int32, device=DEV)

    def call(self, mod, t, copy, early=None):
        tr, io = self.tr, self.io
        mod.resolve(tr["top_k"][t], io["req"], io["lens"], io["nr"], tr["slot_tokens"],
                    tr["slot_rows"], tr["lru"], tr["host_rows"], self.host, io["dev_cache"],
                    io["out"], self.e64, self.e32, self.c32, self.arrivals,
                    tr["resident"] if HINT else self.arrivals, self.ctas, self.block, 0, copy,
                    (ops.FETCH_EARLY_ROWS if early is None else early) if HINT else -1)

    def key(self):
        return f"{self.item}/{self.bs}/{self.ctas}/{self.churn}/{self.block}"


def host_pool():
    return torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)


def cases(pool, items):
    for item in items:
        host = pool[: (pool.numel() // item) * item].view(-1, item)
        for bs, ctas, churn, block in CONFIGS:
            if item != 1152 and bs not in (1, 16, 64):
                continue
            yield Case(host, item=item, bs=bs, ctas=ctas, churn=churn, block=block)


def check_same(args, items) -> dict[str, bool]:
    """Both kernels' outputs and state over three steps, per config (one process)."""
    pool, same = host_pool(), {}
    mods = {}
    for case in cases(pool, items):
        if case.item not in mods:
            mods[case.item] = {
                "base": build_variant(args.baseline, "base", case.item, shlex.split(args.base_flags)),
                "new": build_variant(args.new, "new", case.item, shlex.split(args.new_flags))}
        got = {}
        for name, mod in mods[case.item].items():
            case.io["restore"]()
            outs = []
            for t in range(1, 4):
                case.call(mod, t, 0)
                outs.append(case.io["out"].clone())
            got[name] = [*outs, case.tr["slot_tokens"].clone(), case.tr["lru"].clone()]
        same[case.key()] = all(
            torch.equal(x, y) for x, y in zip(got["base"], got["new"], strict=True))
    return same


def worker(side: str, path: Path, flags: str, items) -> None:
    """Time one kernel on every config; one JSON line per config on stdout."""
    pool = host_pool()
    mods = {}
    for case in cases(pool, items):
        if case.item not in mods:
            mods[case.item] = build_variant(path, side, case.item, shlex.split(flags))
        mod = mods[case.item]
        rec = dict(key=case.key(), sm_mhz=sm_clock_mhz())
        for copy in (0, 1):
            early = BASE_EARLY if side == "base" else NEW_EARLY
            us = time_graph(lambda t, c=copy, case=case, mod=mod, e=early: case.call(mod, t + 1, c, e),
                            case.io["restore"], STEPS, 5)
            rec[f"{side}_{'copy' if copy else 'noio'}_us"] = round(us, 2)
        rec["clock_reasons"] = clock_reasons()
        print("AB " + json.dumps(rec), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, type=Path, help="the other resolve.cuh")
    ap.add_argument("--new", type=Path, default=_jit.source_dir() / "resolve.cuh",
                    help="the resolve.cuh to compare (default: the current one)")
    ap.add_argument("--base-flags", default="", help="extra nvcc flags for the baseline")
    ap.add_argument("--new-flags", default="", help="extra nvcc flags for the new kernel")
    ap.add_argument("--out", default="ab_resolve.json")
    ap.add_argument("--items", default="1152,656")
    ap.add_argument("--hint", action="store_true",
                    help="give both kernels the resident hint (early fetch on, as in serving)")
    ap.add_argument("--base-early-rows", type=int, default=None,
                    help="early rows per CTA for the baseline (default: ops.FETCH_EARLY_ROWS, "
                         "as for the new kernel)")
    ap.add_argument("--new-early-rows", type=int, default=None,
                    help="early rows per CTA for the new kernel (default: ops.FETCH_EARLY_ROWS)")
    ap.add_argument("--worker", choices=("base", "new"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global HINT, BASE_EARLY, NEW_EARLY
    HINT, BASE_EARLY, NEW_EARLY = args.hint, args.base_early_rows, args.new_early_rows
    items = [int(x) for x in args.items.split(",")]
    if args.worker:
        path, flags = (args.baseline, args.base_flags) if args.worker == "base" else (args.new, args.new_flags)
        worker(args.worker, path, flags, items)
        return 0

    t0 = time.time()
    same = check_same(args, items)
    print(f"[ab] outputs compared on {len(same)} configs ({sum(same.values())} identical), "
          f"{time.time() - t0:.0f} s", flush=True)
    recs = {key: dict(same=ok) for key, ok in same.items()}
    base_cmd = [sys.executable, __file__, "--baseline", str(args.baseline), "--new", str(args.new),
                f"--base-flags={args.base_flags}", f"--new-flags={args.new_flags}",
                "--items", args.items, *(["--hint"] if args.hint else []),
                *([f"--base-early-rows={args.base_early_rows}"] if args.base_early_rows is not None else []),
                *([f"--new-early-rows={args.new_early_rows}"] if args.new_early_rows is not None else [])]
    for i, side in enumerate(("base", "new", "new", "base")):  # each side once first, once last
        proc = subprocess.run([*base_cmd, "--worker", side], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"[ab] worker {side} failed with exit code {proc.returncode}")
        for line in proc.stdout.splitlines():
            if not line.startswith("AB "):
                continue
            rec = json.loads(line[3:])
            dst = recs[rec.pop("key")]
            dst.setdefault("sm_mhz", []).append(rec.pop("sm_mhz"))
            dst.setdefault("clock_reasons", []).append(rec.pop("clock_reasons"))
            for k, v in rec.items():
                dst[k] = min(dst.get(k, float("inf")), v)
        print(f"[ab] timing process {i + 1}/4 ({side}) done, {time.time() - t0:.0f} s", flush=True)
    out = []
    for key, rec in recs.items():
        item, bs, ctas, churn, block = key.split("/")
        out.append(dict(item=int(item), bs=int(bs), ctas=int(ctas), churn=float(churn),
                        block=int(block), k=K, B=B, ctx=CTX, **rec))
        print(json.dumps(out[-1]), flush=True)
    Path(args.out).write_text(json.dumps(dict(
        baseline=str(args.baseline), new=str(args.new), base_flags=args.base_flags,
        new_flags=args.new_flags, records=out), indent=1))
    return 0 if all(r["same"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
