"""Where the resolve kernel's time goes, and what bounds host reads (GPU, JSON out).

Three studies, each written to the JSON as records of its own ``kind``:

* ``phases``: the resolve kernel built with ``HS_PHASE_PROFILE`` records ``clock64()`` at each
  phase boundary in thread 0 of every CTA; per phase the median cycles over CTAs and steps
  (converted with the SM clock), plus in the same run the CUDA-graph time per launch of the
  real kernel and of an empty kernel with the same grid and shared memory (the launch floor).
* ``timeline`` (``--timeline``): the same build's ``%globaltimer`` marks read GPU-wide: when
  each phase ends after the launch's first CTA started (median and last CTA), and how each CTA's
  end follows the misses it owns. Shows whether the copies or the bookkeeping set the time.
* ``host``: the same-run scattered-gather ceiling over pinned pools allocated four ways
  (``cudaHostAlloc``; ``malloc`` + ``cudaHostRegister`` as ``HostKVPool`` does; an ``mmap``
  with ``MADV_HUGEPAGE`` + ``cudaHostRegister``; ``MAP_HUGETLB`` when the kernel has huge pages)
  and over pool slices of several sizes: if rows per second, not bytes, bound the gather, and
  the bound moves with the host page size, GPU address translation is the limit.

    python benchmarks/probes/probe_resolve.py --out probe.json [--skip-host] [--skip-phases]
    python benchmarks/probes/probe_resolve.py --skip-host --skip-phases --timeline --out timeline.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_resolve
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_resolve import (  # noqa: E402
    DEV,
    batch_inputs,
    make_trace,
    sm_clock_mhz,
    time_graph,
    write_probe,
)

from sglang_hisparse.kernel_limits import resolve_smem_bytes  # noqa: E402
from sglang_hisparse.kernels import _jit, ops  # noqa: E402

# Phase boundaries HS_PHASE(0..11) in resolve.cuh, in order ("stage" includes the early fetch's
# issue; "staged_wait" is the wait for the early-fetched rows, "copy" the direct copies).
PHASES = ["indices", "stage", "mark", "prefix", "ids_hits", "exchange", "miss_fetch", "outputs",
          "staged_wait", "staged_store", "copy"]
_ARGS = _jit._RESOLVE_ARGS
_CALL = _jit._RESOLVE_CALL


def phase_module(k, B, item):
    wrapper = (
        "#define HS_PHASE_PROFILE 1\n#include \"resolve.cuh\"\nusing tvm::ffi::TensorView;\n"
        f"void resolve({_ARGS}) {{\n  hisparse::resolve_launch<{k}, {B}, {item}>({_CALL});\n}}\n"
        "void read_phases(TensorView out, TensorView ns) {\n"
        "  HS_CUDA(cudaMemcpyFromSymbol(out.data_ptr(), hisparse::hs_phase_clock,"
        " sizeof(hisparse::hs_phase_clock), 0, cudaMemcpyDeviceToHost));\n"
        "  HS_CUDA(cudaMemcpyFromSymbol(ns.data_ptr(), hisparse::hs_phase_ns,"
        " sizeof(hisparse::hs_phase_ns), 0, cudaMemcpyDeviceToHost));\n}\n"
        "__global__ void empty_kernel() { extern __shared__ int s[]; if (threadIdx.x == 1 << 20) s[0] = 0; }\n"
        "void empty(int64_t ctas, int64_t bs, int64_t block, int64_t smem) {\n"
        "  hisparse::set_smem(empty_kernel, smem);\n"
        "  auto st = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, 0));\n"
        "  empty_kernel<<<dim3(ctas, bs), block, smem, st>>>();\n"
        "  HS_CUDA(cudaGetLastError());\n}\n"
    )
    return _jit._build(f"probe_resolve_k{k}_b{B}_i{item}", wrapper,
                       ["resolve", "read_phases", "empty"])


def sm_hz() -> float:
    """The SM clock in Hz (NVML), or the H200's 1.98 GHz boost clock without NVML."""
    return (sm_clock_mhz() or 1980) * 1e6


def phase_inputs(mod, host, *, bs, ctas, churn, block, k, B, item, ctx, steps, hint=True):
    """A synthetic trace for the phase-profiled build and ``call(t, copy)``, which resolves its
    step t eagerly (no plan; ``hint``: with the resident hint, i.e. the early fetch, as the
    coordinator runs it)."""
    tr = make_trace(bs=bs, k=k, B=B, ctx=ctx, churns=[churn] * bs, steps=steps,
                    host_rows_total=host.shape[0], seed=0)
    io = batch_inputs(tr, bs=bs, k=k, B=B, item=item, ctx=ctx)
    arrivals = torch.zeros(bs, dtype=torch.int32, device=DEV)
    e64 = torch.empty(0, 0, dtype=torch.int64, device=DEV)
    e32 = torch.empty(0, 0, dtype=torch.int32, device=DEV)
    c32 = torch.empty(0, dtype=torch.int32, device=DEV)

    def call(t, copy):
        mod.resolve(tr["top_k"][t], io["req"], io["lens"], io["nr"], tr["slot_tokens"],
                    tr["slot_rows"], tr["lru"], tr["host_rows"], host, io["dev_cache"], io["out"],
                    e64, e32, c32, arrivals, tr["resident"] if hint else arrivals, ctas, block,
                    0, copy, ops.FETCH_EARLY_ROWS if hint else -1)

    return tr, io["restore"], call


def phase_config(add, mod, host, *, bs, ctas, churn, block, k, B, item, ctx, steps=8, hint=True):
    """Phase clocks and graph time of one config, eager NO_IO then COPY (``hint``: with the
    resident hint, i.e. the early fetch, as the coordinator runs it)."""
    _, restore, resolve = phase_inputs(mod, host, bs=bs, ctas=ctas, churn=churn, block=block,
                                       k=k, B=B, item=item, ctx=ctx, steps=steps, hint=hint)
    buf = torch.zeros(4096, 12, dtype=torch.int64)
    nsbuf = torch.zeros(4096, 12, dtype=torch.int64)
    smem_bytes = resolve_smem_bytes(k, B, ctx)

    def empty(_t):
        mod.empty(ctas, bs, block, smem_bytes)

    for copy in (0, 1):
        def call(t, copy=copy):
            resolve(t, copy)

        restore()
        deltas = {p: [] for p in PHASES}
        total, span, start_skew = [], [], []
        last = len(PHASES)
        for t in range(1, steps + 1):
            call(t)
            torch.cuda.synchronize()
            mod.read_phases(buf, nsbuf)
            ph = buf[: bs * ctas, : last + 1].double()
            for i, p in enumerate(PHASES):
                deltas[p] += (ph[:, i + 1] - ph[:, i]).tolist()
            total += (ph[:, last] - ph[:, 0]).tolist()
            # GPU-wide timer: first CTA start to last CTA end, and the spread of the starts.
            ns = nsbuf[: bs * ctas, : last + 1]
            span.append(float(ns[:, last].max() - ns[:, 0].min()) / 1e3)
            start_skew.append(float(ns[:, 0].max() - ns[:, 0].min()) / 1e3)
        hz = sm_hz()
        us = time_graph(lambda t, call=call: call(t + 1), restore, steps, 5)
        floor = time_graph(empty, lambda: None, steps, 5)
        rec = dict(kind="phases", bs=bs, ctas=ctas, churn=churn, block=block, copy=copy, hint=hint,
                   k=k, B=B, item=item, graph_us=round(us, 2), empty_graph_us=round(floor, 2),
                   sm_mhz=round(hz / 1e6),
                   cta_total_us=round(statistics.median(total) / hz * 1e6, 2),
                   cta_max_us=round(max(total) / hz * 1e6, 2),
                   span_us=round(statistics.median(span), 2),
                   start_skew_us=round(statistics.median(start_skew), 2))
        for p in PHASES:
            rec[p + "_us"] = round(statistics.median(deltas[p]) / hz * 1e6, 3)
        add(rec)


CONFIGS = ((1, 32, 0.15, 1024), (16, 8, 0.05, 1024), (64, 2, 0.0, 1024), (64, 2, 0.15, 1024),
           (64, 2, 0.15, 512), (128, 1, 0.15, 512))


def owned_misses(top_k, slot_tokens, *, B, ctas, newest):
    """[bs, ctas]: the misses each CTA owns (first occurrences of positions no history slot
    holds; owner of entry i = i mod ctas), from the state before the call."""
    bs = top_k.shape[0]
    cnt = torch.zeros(bs, ctas)
    for b in range(bs):
        held, seen = set(slot_tokens[b, :B].tolist()), set()
        for i, p in enumerate(top_k[b].tolist()):
            if p != newest and p not in held and p not in seen:
                cnt[b, i % ctas] += 1
            seen.add(p)
    return cnt


def study_timeline(add, *, gib=4.0, k=2048, B=4096, ctx=32768, steps=8):
    """GPU-wide timeline of COPY launches (hint on): per phase boundary, the time since the
    first CTA of the launch started (``%globaltimer`` of thread 0 of every CTA), median and
    last over the CTAs, median over steps 2..steps (eager, so absolute figures run higher than
    in a graph; compare kernels with each other). Plus, per step, how each CTA's end time
    follows the misses it owns (``rows_vs_end``)."""
    pool = torch.empty(int(gib * 2**30), dtype=torch.uint8, pin_memory=True)
    buf = torch.zeros(4096, 12, dtype=torch.int64)
    nsbuf = torch.zeros(4096, 12, dtype=torch.int64)
    names = ["start"] + PHASES
    for item, bs, ctas, churn in TIMELINE_CONFIGS:
        mod = phase_module(k, B, item)
        host = pool[: (pool.numel() // item) * item].view(-1, item)
        tr, restore, call = phase_inputs(mod, host, bs=bs, ctas=ctas, churn=churn, block=1024,
                                         k=k, B=B, item=item, ctx=ctx, steps=steps)
        restore()
        rel_steps, rows_vs_end = [], []
        for t in range(1, steps + 1):
            before = tr["slot_tokens"].clone()
            call(t, 1)
            torch.cuda.synchronize()
            mod.read_phases(buf, nsbuf)
            ns = nsbuf[: bs * ctas].double()
            rel = (ns - ns[:, 0].min()) / 1e3
            if t == 1:  # the first launch also pays for cold caches
                continue
            rel_steps.append(rel)
            rows = owned_misses(tr["top_k"][t], before, B=B, ctas=ctas, newest=ctx - 1).flatten()
            end = rel[:, len(PHASES)]
            rows_vs_end.append(dict(
                r=round(float(torch.corrcoef(torch.stack([rows, end]))[0, 1]), 3),
                rows_min=int(rows.min()), rows_max=int(rows.max()),
                end_of_max_rows=round(float(end[rows.argmax()]), 2),
                end_max=round(float(end.max()), 2), end_median=round(float(end.median()), 2)))
        rel = torch.stack(rel_steps)  # [steps - 1, CTAs, boundaries]
        med = rel.median(dim=1).values.median(dim=0).values
        last = rel.max(dim=1).values.median(dim=0).values
        add(dict(kind="timeline", bs=bs, ctas=ctas, churn=churn, k=k, B=B, item=item, block=1024,
                 early_rows=ops.FETCH_EARLY_ROWS,
                 median_cta_us={n: round(float(v), 2) for n, v in zip(names, med, strict=True)},
                 last_cta_us={n: round(float(v), 2) for n, v in zip(names, last, strict=True)},
                 rows_vs_end=rows_vs_end))
    del pool


TIMELINE_CONFIGS = ((1152, 16, 8, 0.05), (656, 16, 8, 0.05), (1152, 1, 32, 0.15))


def study_phases(add, *, k=2048, B=4096, item=1152, ctx=32768):
    mod = phase_module(k, B, item)
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    host = host[: (host.numel() // item) * item].view(-1, item)
    for bs, ctas, churn, block in CONFIGS:
        for hint in (True, False):
            phase_config(add, mod, host, bs=bs, ctas=ctas, churn=churn, block=block, k=k, B=B,
                         item=item, ctx=ctx, hint=hint)


# ---- host-pool allocation study ---------------------------------------------------------------
MADV_HUGEPAGE = 14
MAP_HUGETLB = 0x40000


def _meminfo(key):
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return line.split()[1] + " kB"
    return None


def _register(t: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0x1 | 0x2)
    assert int(err) == 0, f"cudaHostRegister failed: {err}"


def alloc_pool(how: str, nbytes: int):
    keep = None
    if how == "cudaHostAlloc":
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    elif how == "malloc_register":
        t = torch.empty(nbytes, dtype=torch.uint8)
        t.zero_()
        _register(t)
    elif how in ("mmap_thp", "mmap_hugetlb"):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if how == "mmap_hugetlb":
            flags |= MAP_HUGETLB
        m = mmap.mmap(-1, nbytes, flags=flags)
        if how == "mmap_thp":
            m.madvise(MADV_HUGEPAGE)
        t = torch.frombuffer(m, dtype=torch.uint8)
        t.zero_()
        _register(t)
        keep = m
    else:
        raise ValueError(how)
    return t, keep


def gather_us(gather, srcs, dst, host, dev_cache, steps):
    return time_graph(lambda t: gather(srcs[t], dst, host, dev_cache), lambda: None, steps, 5)


def study_host(add, *, gib=4.0, rows=16384, steps=8,
               ways=("cudaHostAlloc", "malloc_register", "mmap_thp", "mmap_hugetlb"),
               slices=(0.0625, 0.5, None)):
    info = dict(kind="host_info")
    for f in ("/sys/kernel/mm/transparent_hugepage/enabled",
              "/sys/kernel/mm/transparent_hugepage/defrag", "/proc/sys/vm/nr_hugepages"):
        try:
            info[f] = open(f).read().strip()
        except OSError as e:
            info[f] = repr(e)
    info["AnonHugePages_before"] = _meminfo("AnonHugePages")
    add(info)
    nbytes = int(gib * 2**30)
    for how in ways:
        t0 = time.time()
        try:
            flat, keep = alloc_pool(how, nbytes)
        except Exception as e:  # noqa: BLE001
            add(dict(kind="host_pool", how=how, error=repr(e)[:300]))
            continue
        alloc_s = round(time.time() - t0, 2)
        anon = _meminfo("AnonHugePages")
        for item in (656, 1152):
            gather = _jit.gather_module(item).gather
            for slice_gib in [gib if x is None else x for x in slices]:
                n = int(slice_gib * 2**30) // item
                host = flat[: n * item].view(n, item)
                g = torch.Generator(device=DEV).manual_seed(3)
                srcs = [torch.randint(0, n, (rows,), generator=g, device=DEV) for _ in range(steps)]
                dst = torch.randperm(rows * 2, generator=g, device=DEV)[:rows].int()
                dev_cache = torch.empty(rows * 2, item, dtype=torch.uint8, device=DEV)
                us = gather_us(gather, srcs, dst, host, dev_cache, steps)
                add(dict(kind="host_pool", how=how, alloc_s=alloc_s, anon_huge=anon, item=item,
                         slice_gib=slice_gib, rows=rows, us=round(us, 2),
                         gbps=round(rows * item / (us * 1e-6) / 1e9, 2),
                         mrows_per_s=round(rows / us, 2)))
        if how != "cudaHostAlloc":
            torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
        del flat, keep
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="probe_resolve.json")
    ap.add_argument("--skip-host", action="store_true")
    ap.add_argument("--skip-phases", action="store_true")
    ap.add_argument("--timeline", action="store_true",
                    help="also the GPU-wide phase timeline of COPY launches (kind 'timeline')")
    ap.add_argument("--early-rows", type=int, default=None,
                    help="rows per CTA the early fetch may stage (default: the op's)")
    ap.add_argument("--gib", type=float, default=4.0, help="pool size for the host study")
    ap.add_argument("--ways", default="cudaHostAlloc,malloc_register,mmap_thp,mmap_hugetlb",
                    help="host allocations to compare (comma-separated)")
    ap.add_argument("--slices", default="0.0625,0.5",
                    help="pool slices (GiB) gathered from, besides the whole pool")
    args = ap.parse_args(argv)
    if args.early_rows is not None:
        ops.FETCH_EARLY_ROWS = args.early_rows
    recs = []

    def add(rec):
        recs.append(rec)
        print(json.dumps(rec), flush=True)

    if not args.skip_phases:
        study_phases(add)
    if args.timeline:
        study_timeline(add, gib=args.gib)
    if not args.skip_host:
        study_host(add, gib=args.gib, ways=tuple(args.ways.split(",")),
                   slices=tuple(float(x) for x in args.slices.split(",")) + (None,))
    write_probe(args.out, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
