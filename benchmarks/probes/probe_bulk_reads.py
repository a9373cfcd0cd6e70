"""Bulk (TMA) host reads, and how far host reads in flight reach (GPU, JSON out).

Two studies on a 4 GiB pinned pool, rows drawn uniformly (the targets' worst case), each
written to the JSON as records of its own ``kind``:

* ``gather``: the same random rows (batch x 5 % of k = 2048) copied host -> device by the plain
  gather (one warp per row, full grid: the same-run ceiling) and by a bulk gather: CTAs of 128
  threads, each fetching R rows with one ``cp.async.bulk`` (the Hopper TMA path) per row into
  shared memory on one mbarrier, then storing them. ``correct`` checks the bulk copy's bytes.
* ``stall``: one 1024-thread CTA per SM; warps 1.. issue R host rows per CTA by ``cp.async``
  (16 B per lane), ``bulk`` (one TMA copy per row) or ``ldg`` (register loads, then stored),
  while thread 0 times a dependent chain of loads, either from a 512 MB device array (misses
  L2: ``global``) or from shared memory (``smem``); ns per chained load, median over CTAs and
  5 launches. ``split``: only even CTAs issue rows (R each); the odd ones, on other SMs, only
  time their chain: whether a saturated link slows the loads of SMs that read nothing from host.

    python benchmarks/probes/probe_bulk_reads.py --out bulk_reads.json

NOTE: benchmark-only kernels (inline below, built through the package's cached tvm-ffi JIT);
the product kernels and their references live in jit_kernels/ and sglang_hisparse/kernels/.
Results: benchmarks/RESOLVE.md ("Bulk reads and where the stall reaches").
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_resolve
from bench_resolve import (  # noqa: E402
    DEV,
    Pool,
    plan_rows,
    printed,
    probe_args,
    random_plans,
    time_graph,
    write_probe,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sglang_hisparse.kernels import _jit  # noqa: E402

MODES = ("none", "cp.async", "bulk", "ldg")
CHASES = ("global", "smem")
#: (chase shared memory, only even CTAs read) of the stall study; the kernels built for them
STUDIES = ((False, False), (True, False), (False, True))

_SOURCE = r'''
#include "common.cuh"
namespace probe {
using namespace hisparse;
using tvm::ffi::TensorView;
__device__ __forceinline__ uint32_t sa(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mb_init(uint64_t* m) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(m)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mb_expect(uint64_t* m, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(m)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_row(void* dst, const void* src, uint32_t bytes, uint64_t* m) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(sa(dst)), "l"(src), "r"(bytes), "r"(sa(m)) : "memory");
}
__device__ __forceinline__ void mb_wait(uint64_t* m) {
  asm volatile("{\n .reg .pred P1;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], 0;\n"
               " @P1 bra DONE;\n bra WAIT;\n DONE:\n }" :: "r"(sa(m)) : "memory");
}
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}

template <int ITEM>
__global__ void bulk_gather_kernel(const int64_t* src, const int32_t* dst, int rows, int R,
                                   const uint8_t* host, int64_t hs, uint8_t* dev, int64_t ds) {
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ __align__(8) uint64_t bar;
  const int r0 = blockIdx.x * R, n = min(R, rows - r0);
  if (n <= 0) return;
  if (threadIdx.x == 0) { mb_init(&bar); mb_expect(&bar, n * ITEM); }
  __syncthreads();
  for (int j = threadIdx.x; j < n; j += blockDim.x) bulk_row(sm + j * ITEM, host + src[r0 + j] * hs, ITEM, &bar);
  mb_wait(&bar);
  constexpr int kP = ITEM / 16;
  for (int x = threadIdx.x; x < n * kP; x += blockDim.x)
    reinterpret_cast<int4*>(dev + static_cast<int64_t>(dst[r0 + x / kP]) * ds)[x % kP] =
        reinterpret_cast<const int4*>(sm + (x / kP) * ITEM)[x % kP];
}

// MODE: 0 no host reads, 1 cp.async, 2 bulk, 3 register loads. SMEM: chase shared memory.
// SPLIT: odd CTAs issue no rows.
template <int ITEM, int MODE, bool SMEM, bool SPLIT>
__global__ void stall_kernel(const int64_t* src, int R, const uint8_t* host, int64_t hs,
                             const int32_t* chase, int steps, long long* out) {
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ __align__(8) uint64_t bar;
  int* table = reinterpret_cast<int*>(sm + R * ITEM);
  if (threadIdx.x == 0) { mb_init(&bar); if (MODE == 2) mb_expect(&bar, R * ITEM); }
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) table[i] = (i * 389 + 7) & 1023;
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  constexpr int kP = ITEM / 16, kPerLane = (kP + 31) / 32;
  const bool reads = MODE != 0 && !(SPLIT && (blockIdx.x & 1));
  if (warp >= 1 && reads) {
    for (int j = warp - 1; j < R; j += nw - 1) {
      const uint8_t* row = host + src[static_cast<int64_t>(blockIdx.x) * R + j] * hs;
      if (MODE == 1)
        for (int pc = lane; pc < kP; pc += 32) cp_async16(sm + j * ITEM + 16 * pc, row + 16 * pc);
      if (MODE == 2 && lane == 0) bulk_row(sm + j * ITEM, row, ITEM, &bar);
      if (MODE == 3) {
        int4 v[kPerLane];
#pragma unroll
        for (int u = 0; u < kPerLane; ++u)
          if (lane + 32 * u < kP) v[u] = __ldg(reinterpret_cast<const int4*>(row) + lane + 32 * u);
#pragma unroll
        for (int u = 0; u < kPerLane; ++u)
          if (lane + 32 * u < kP) reinterpret_cast<int4*>(sm + j * ITEM)[lane + 32 * u] = v[u];
      }
    }
  }
  if (MODE == 1) cp_async_commit();
  if (threadIdx.x == 0) {
    const volatile int* vt = table;
    int x = (blockIdx.x * 7919) & (SMEM ? 1023 : 0xffff);
    const unsigned long long t0 = now_ns();
    for (int i = 0; i < steps; ++i) x = SMEM ? vt[x] : chase[x];
    out[2 * blockIdx.x] = static_cast<long long>(now_ns() - t0);
    out[2 * blockIdx.x + 1] = x;
  }
  if (MODE == 1) cp_async_wait<0>();
  if (MODE == 2 && reads) mb_wait(&bar);
  __syncthreads();
}

template <typename K>
cudaStream_t prepare(K kernel, int smem, const TensorView& t) {
  HS_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, t.device().device_id));
}

template <int ITEM>
void bulk_gather(TensorView src, TensorView dst, TensorView host, TensorView dev, int R) {
  const int rows = static_cast<int>(src.size(0));
  auto kernel = bulk_gather_kernel<ITEM>;
  auto stream = prepare(kernel, R * ITEM, dev);
  kernel<<<(rows + R - 1) / R, 128, R * ITEM, stream>>>(
      ptr<const int64_t>(src), ptr<const int32_t>(dst), rows, R, ptr<const uint8_t>(host),
      host.stride(0), ptr<uint8_t>(dev), dev.stride(0));
  HS_CUDA(cudaGetLastError());
}

template <int ITEM, int MODE, bool SMEM, bool SPLIT>
void stall(TensorView src, int R, TensorView host, TensorView chase, int steps, TensorView out) {
  auto kernel = stall_kernel<ITEM, MODE, SMEM, SPLIT>;
  const int smem = R * ITEM + 4096;
  auto stream = prepare(kernel, smem, chase);
  kernel<<<static_cast<unsigned>(out.size(0) / 2), 1024, smem, stream>>>(
      ptr<const int64_t>(src), R, ptr<const uint8_t>(host), host.stride(0),
      ptr<const int32_t>(chase), steps, ptr<long long>(out));
  HS_CUDA(cudaGetLastError());
}
}  // namespace probe
'''


def module(item: int):
    """The probe kernels for ``item``-byte rows: ``bulk_gather`` and ``stall_<mode>_<chase>[_split]``."""
    wrapper, names = _SOURCE + "using tvm::ffi::TensorView;\n", ["bulk_gather"]
    wrapper += ("void bulk_gather(TensorView s, TensorView d, TensorView h, TensorView v, int64_t R) "
                f"{{ probe::bulk_gather<{item}>(s, d, h, v, (int)R); }}\n")
    for m in range(len(MODES)):
        for smem, split in STUDIES:
            name = f"stall_{m}_{int(smem)}_{int(split)}"
            args = f"{item}, {m}, {str(smem).lower()}, {str(split).lower()}"
            wrapper += (f"void {name}(TensorView s, int64_t R, TensorView h, TensorView c, "
                        f"int64_t st, TensorView o) {{ probe::stall<{args}>"
                        "(s, (int)R, h, c, (int)st, o); }\n")
            names.append(name)
    return _jit._build(f"hisparse_probe_bulk_i{item}", wrapper, names)


def gather_records(host, item, mod, steps, reps):
    """The warp gather and the bulk gather on the same rows: one record per grid, as measured."""
    gather = _jit.gather_module(item).gather
    for bs in (16, 64):
        per_req = round(0.05 * 2048)
        rows = bs * per_req
        dev_cache = torch.zeros(2 * rows, item, dtype=torch.uint8, device=DEV)
        flat = [plan_rows(p) for p in random_plans(bs, per_req, host.shape[0], 2 * rows, steps, seed=bs)]
        s, d = flat[0]
        host[s.cpu()] = torch.randint(0, 255, (rows, item), dtype=torch.uint8)

        def correct(r, s=s, d=d, c=dev_cache):
            """The bulk gather with R = r copies step 0's rows byte for byte."""
            c.zero_()
            mod.bulk_gather(s, d, host, c, r)
            torch.cuda.synchronize()
            return torch.equal(c[d.long()].cpu(), host[s.cpu()])
        # the warp gather before and after the bulk grids (host-read speed drifts with order)
        for r in (None, 2, 4, 8, 13, 26, None):
            if r is None:
                fn = lambda t, f=flat, c=dev_cache: gather(f[t][0], f[t][1], host, c)  # noqa: E731
            else:
                fn = lambda t, f=flat, c=dev_cache, r=r: mod.bulk_gather(f[t][0], f[t][1], host, c, r)  # noqa: E731
            rec = dict(kind="gather", kernel="warp" if r is None else "bulk", item=item, bs=bs,
                       rows=rows, us=round(time_graph(fn, lambda: None, steps, reps), 2))
            if r is not None:
                rec.update(R=r, ctas=-(-rows // r), correct=correct(r))
            yield rec


def stall_records(host, item, mod, sms, chase, g):
    """ns per chained load by rows per SM, issue method, chase and split: records as measured."""
    out = torch.zeros(2 * sms, dtype=torch.int64, device=DEV)
    for r in (2, 6, 13, 26):
        for smem, split in STUDIES:
            steps = 64 if smem else 16
            for m in ((0, 1, 2, 3, 0) if not split else (0, 1, 3)):
                fn = getattr(mod, f"stall_{m}_{int(smem)}_{int(split)}")
                even, odd = [], []
                for _ in range(5):
                    src = torch.randint(0, host.shape[0], (sms * r,), generator=g, device=DEV)
                    fn(src, r, host, chase, steps, out)
                    torch.cuda.synchronize()
                    t = out[0::2].tolist()
                    even.append(statistics.median(t[0::2]) / steps)
                    odd.append(statistics.median(t[1::2]) / steps)
                yield dict(kind="stall", item=item, R=r, mode=MODES[m],
                           chase=CHASES[int(smem)], split=split,
                           ns_per_load=round(statistics.median(even + odd), 1),
                           readers_ns=round(statistics.median(even), 1),
                           others_ns=round(statistics.median(odd), 1))


def main(argv=None) -> int:
    args = probe_args(__doc__, "probe_bulk_reads.json", 7, argv)
    pool, sms = Pool(4.0), torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device=DEV).manual_seed(0)
    chase = torch.randperm(1 << 27, generator=g, device=DEV).int()  # 512 MB: misses L2
    recs = []
    for item in (656, 1152):
        host, mod = pool.rows(item), module(item)
        recs += printed(gather_records(host, item, mod, args.steps, args.reps))
        recs += printed(stall_records(host, item, mod, sms, chase, g))
    write_probe(args.out, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
