"""What a kernel's launch shape, its dependent loads and a late start cost a host gather (GPU,
JSON out).

Resolve ends ~2.5 us after the same-run gather of the same rows at batch 16 @5 % (RESOLVE.md).
This splits that gap: the same random rows (batch x 5 % of k = 2048 from the 4 GiB pinned pool)
are copied one warp per row by one probe kernel in several shapes, each timed like the
benchmarks (a CUDA graph of ``--steps`` launches, median of ``--reps`` replays):

* ``grid``: ``gather`` = 256-thread CTAs of 8 rows (the ceiling's shape); ``resolve`` = one CTA
  per request share as resolve launches it at that batch (8 CTAs per request at batch 16: 128
  CTAs of 1024 threads, ~13 rows each), with ``smem_kb`` of dynamic shared memory reserved;
  ``sms:N`` = N CTAs of 1024 threads, one per SM (``--sm-sweep``: how the rate depends on how
  many SMs read);
* ``deps``: dependent global loads before each host read: 0 = the host row is given; 1 = looked
  up in ``host_rows`` (as the lookup ceiling); 2 = one more load first (resolve: top-k entry,
  then host row);
* ``delay_cycles``: warps from ``late_warp`` on spin that many SM cycles before their first
  load (0: every warp; a late start, or with 6 a second wave as v11 issues its direct rows).
* ``load``: ``registers`` (each lane loads its pieces and stores them, as the ceiling) or
  ``cp.async`` (``--load-sweep``: every row of a CTA into shared memory at once, then stored, as
  resolve's early rows and the split launch's readers fetch); ``registers, marked``: register
  loads with ``%globaltimer`` marks per row, so the record also has when the last launch's last
  warp started (``start_last_us``) and its rows were stored (median, last), from its first
  warp's start: the in-kernel span, against ``us`` per launch; ``registers, held``
  (``--handoff``): each warp loads its row at once but stores it no earlier than
  ``delay_cycles`` after its CTA started, as a reader that waits for the bookkeeping's
  destinations: what holding landed rows costs, without any cluster or flag.

* ``handoff`` (``--handoff``: only these): role separation in thread-block clusters
  (``cluster`` CTAs, one per SM, ``groups`` clusters per request): rank 0 reads nothing from
  host, waits ``delay_cycles`` (the bookkeeping), then writes each row's destination into its
  reader's shared memory and raises the reader's flag; ranks 1.. put all their rows in flight
  at once (2 dependent loads; ``load``: cp.async into shared memory, or one row per warp in
  registers), wait for the flag by polling shared memory, then store. The floor of a resolve
  whose reading SMs never wait on global memory before their rows land;
  ``max_active_clusters``: how many such clusters the GPU runs at once.

    python benchmarks/probes/probe_gather_shape.py --out gather_shape.json
    python benchmarks/probes/probe_gather_shape.py --load-sweep --reps 9 --out gather_loads.json
    python benchmarks/probes/probe_gather_shape.py --handoff --reps 9 --out handoff.json

NOTE: benchmark-only kernel (inline below, built through the package's cached tvm-ffi JIT).
Results: benchmarks/RESOLVE.md.
"""

from __future__ import annotations

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

_SOURCE = r'''
#include "common.cuh"
#include <cooperative_groups.h>
namespace probe {
using namespace hisparse;
using tvm::ffi::TensorView;

// --marks: lane 0 of the warp copying row r records %globaltimer when it starts the row and
// after it has stored it (the stores need the row's loads back). Register loads only.
constexpr int kMarkRows = 8192;
__device__ unsigned long long probe_marks[kMarkRows][2];
__device__ __forceinline__ unsigned long long probe_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Row r's host row: src[r] (deps 0), table[key[r]] (1), table[key2[perm[r]]] (2).
template <int ITEM>
__global__ void shaped_gather_kernel(const int64_t* src, const int64_t* table, const int32_t* key,
                                     const int32_t* perm, const int32_t* key2, const int32_t* dst,
                                     int rows, int per_cta, int deps, long long delay, int late_warp,
                                     int load, const uint8_t* host, int64_t hs, uint8_t* dev,
                                     int64_t ds) {
  extern __shared__ __align__(16) uint8_t sm[];
  constexpr int kP = ITEM / 16, kPerLane = (kP + 31) / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int r0 = blockIdx.x * per_cta, r1 = min(rows, r0 + per_cta);
  const long long t_start = clock64();
  const bool held = load == 3;  // the delay holds landed rows instead of starting late
  if (delay > 0 && warp >= late_warp && !held) {
    while (clock64() - t_start < delay) {}
  }
  const auto host_row = [&](int r) -> int64_t {
    return deps == 0 ? src[r] : deps == 1 ? table[key[r]] : table[key2[perm[r]]];
  };
  if (load == 1) {  // cp.async: every row of the CTA into shared memory at once, then stored
    for (int r = r0 + warp; r < r1; r += nw) {
      const int64_t h = host_row(r);
      for (int pc = lane; pc < kP; pc += 32)
        cp_async16(sm + (r - r0) * ITEM + 16 * pc, host + h * hs + 16 * pc);
    }
    cp_async_commit();
    cp_async_wait<0>();  // each lane stores the pieces it fetched: no barrier needed
    for (int r = r0 + warp; r < r1; r += nw)
      for (int pc = lane; pc < kP; pc += 32)
        reinterpret_cast<int4*>(dev + static_cast<int64_t>(dst[r]) * ds)[pc] =
            reinterpret_cast<const int4*>(sm + (r - r0) * ITEM)[pc];
    return;
  }
  const bool mark = load == 2;
  for (int r = r0 + warp; r < r1; r += nw) {
    const unsigned long long t0 = mark ? probe_now() : 0;
    const int64_t h = host_row(r);
    const int4* s = reinterpret_cast<const int4*>(host + h * hs);
    int4* d = reinterpret_cast<int4*>(dev + static_cast<int64_t>(dst[r]) * ds);
    int4 v[kPerLane];
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) if (lane + 32 * u < kP) v[u] = __ldg(s + lane + 32 * u);
    if (held) {  // the row stays in registers until `delay` cycles after the CTA started
      asm volatile("" ::: "memory");
      while (clock64() - t_start < delay) {}
    }
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) if (lane + 32 * u < kP) d[lane + 32 * u] = v[u];
    if (mark && lane == 0 && r < kMarkRows) {
      probe_marks[r][0] = t0;
      probe_marks[r][1] = probe_now();
    }
  }
}

template <int ITEM>
void shaped_gather(TensorView src, TensorView table, TensorView key, TensorView perm,
                   TensorView key2, TensorView dst, TensorView host, TensorView dev, int ctas,
                   int threads, int smem, int deps, int64_t delay, int late_warp, int load) {
  const int rows = static_cast<int>(src.size(0));
  HS_CHECK(load != 1 || static_cast<int64_t>((rows + ctas - 1) / ctas) * ITEM <= smem,
           "cp.async mode: a CTA's rows must fit its shared memory");
  auto kernel = shaped_gather_kernel<ITEM>;
  HS_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev.device().device_id));
  kernel<<<ctas, threads, smem, stream>>>(
      ptr<const int64_t>(src), ptr<const int64_t>(table), ptr<const int32_t>(key),
      ptr<const int32_t>(perm), ptr<const int32_t>(key2), ptr<const int32_t>(dst), rows,
      (rows + ctas - 1) / ctas, deps, delay, late_warp, load, ptr<const uint8_t>(host), host.stride(0),
      ptr<uint8_t>(dev), dev.stride(0));
  HS_CUDA(cudaGetLastError());
}

// Role separation within clusters of CL CTAs, G clusters per request (one CTA per SM: `smem`
// reserves enough shared memory). Rank 0 of each cluster, the "bookkeeper", reads nothing from
// host: it waits `delay` cycles (the bookkeeping's time), then writes each row's destination
// into its reader's shared memory (distributed shared memory) and raises the reader's flag. The
// request's G * (CL - 1) readers take its rows round robin (row j to reader j % readers; reader
// g * (CL - 1) + rank - 1 is rank `rank` of the request's cluster g), put them all in flight at
// once with 2 dependent loads each (into shared memory by cp.async, or with `regs` one row per
// warp into registers), wait for their flag (a shared-memory poll: nothing on the global path)
// and store the rows. The split cluster barrier orders the flags' reset before any remote write.
constexpr int kMaxRows = 64;
template <int ITEM>
__global__ void handoff_kernel(const int64_t* table, const int32_t* perm, const int32_t* key2,
                               const int32_t* dst, int per_req, int groups, int regs,
                               long long delay, const uint8_t* host, int64_t hs, uint8_t* dev,
                               int64_t ds) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int CL = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  const int q = blockIdx.x / CL, req = q / groups, g = q % groups;
  const int readers = groups * (CL - 1), base = req * per_req;
  extern __shared__ __align__(16) uint8_t sm[];
  __shared__ int sdst[kMaxRows];
  __shared__ volatile int flag;
  constexpr int kP = ITEM / 16, kPerLane = (kP + 31) / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  if (rank == 0) {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    if (threadIdx.x == 0 && delay > 0) {
      const long long t0 = clock64();
      while (clock64() - t0 < delay) {}
    }
    __syncthreads();
    for (int j = threadIdx.x; j < per_req; j += blockDim.x) {
      const int owner = j % readers;
      if (owner / (CL - 1) != g) continue;
      int* remote = cluster.map_shared_rank(sdst, 1 + owner % (CL - 1));
      remote[j / readers] = dst[base + j];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      asm volatile("fence.acq_rel.cluster;" ::: "memory");
      for (int k = 1; k < CL; ++k) *cluster.map_shared_rank(const_cast<int*>(&flag), k) = 1;
    }
    return;
  }
  if (threadIdx.x == 0) flag = 0;
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  const int me = g * (CL - 1) + rank - 1;
  const int mine = (per_req - me + readers - 1) / readers;  // rows j = me + t * readers
  const auto host_row = [&](int t) { return host + table[key2[perm[base + me + t * readers]]] * hs; };
  int4 v[kPerLane];
  if (regs) {  // row t by warp t, in registers until its destination is in
    if (warp < mine) {
      const int4* s = reinterpret_cast<const int4*>(host_row(warp));
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) if (lane + 32 * u < kP) v[u] = __ldg(s + lane + 32 * u);
    }
  } else {
    for (int t = warp; t < mine; t += nw) {
      const uint8_t* row = host_row(t);
      for (int pc = lane; pc < kP; pc += 32) cp_async16(sm + t * ITEM + 16 * pc, row + 16 * pc);
    }
    cp_async_commit();
    cp_async_wait<0>();
  }
  __syncthreads();
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (threadIdx.x == 0) {
    while (flag == 0) {}
    asm volatile("fence.acq_rel.cluster;" ::: "memory");
  }
  __syncthreads();
  if (regs) {
    if (warp < mine) {
      int4* d = reinterpret_cast<int4*>(dev + static_cast<int64_t>(sdst[warp]) * ds);
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) if (lane + 32 * u < kP) d[lane + 32 * u] = v[u];
    }
    return;
  }
  for (int x = threadIdx.x; x < mine * kP; x += blockDim.x)
    reinterpret_cast<int4*>(dev + static_cast<int64_t>(sdst[x / kP]) * ds)[x % kP] =
        reinterpret_cast<const int4*>(sm + (x / kP) * ITEM)[x % kP];
}

template <int ITEM>
cudaLaunchConfig_t handoff_config(int bs, int cl, int groups, int smem, cudaStream_t stream,
                                  cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(bs * groups * cl);
  cfg.blockDim = dim3(1024);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cl;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  HS_CUDA(cudaFuncSetAttribute(handoff_kernel<ITEM>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return cfg;
}

template <int ITEM>
void handoff(TensorView table, TensorView perm, TensorView key2, TensorView dst, TensorView host,
             TensorView dev, int bs, int cl, int groups, int regs, int smem, int64_t delay) {
  const int per_req = static_cast<int>(dst.size(0)) / bs;
  const int per_reader = (per_req + groups * (cl - 1) - 1) / (groups * (cl - 1));
  HS_CHECK(cl >= 2 && cl <= 8 && groups >= 1, "clusters of 2..8 CTAs, >= 1 per request");
  HS_CHECK(per_reader <= (regs ? 32 : kMaxRows), "too many rows per reader");
  cudaLaunchAttribute attr[1];
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev.device().device_id));
  cudaLaunchConfig_t cfg = handoff_config<ITEM>(bs, cl, groups, smem, stream, attr);
  HS_CUDA(cudaLaunchKernelEx(&cfg, handoff_kernel<ITEM>, ptr<const int64_t>(table),
                             ptr<const int32_t>(perm), ptr<const int32_t>(key2),
                             ptr<const int32_t>(dst), per_req, groups, regs, delay,
                             ptr<const uint8_t>(host), host.stride(0), ptr<uint8_t>(dev),
                             dev.stride(0)));
}

// How many clusters of `cl` handoff CTAs the GPU runs at once (cudaOccupancyMaxActiveClusters).
template <int ITEM>
int64_t handoff_max_clusters(int cl, int smem) {
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = handoff_config<ITEM>(1, cl, 1, smem, nullptr, attr);
  int n = 0;
  HS_CUDA(cudaOccupancyMaxActiveClusters(&n, handoff_kernel<ITEM>, &cfg));
  return n;
}
}  // namespace probe
using tvm::ffi::TensorView;
'''


def module(item: int):
    """The probe kernels for ``item``-byte rows: ``shaped_gather`` and ``handoff``."""
    wrapper = _SOURCE + (
        "void shaped_gather(TensorView s, TensorView t, TensorView k, TensorView p, TensorView k2, "
        "TensorView d, TensorView h, TensorView v, int64_t ctas, int64_t threads, int64_t smem, "
        f"int64_t deps, int64_t delay, int64_t late, int64_t load) {{ probe::shaped_gather<{item}>(s, t, k, p, "
        "k2, d, h, v, (int)ctas, (int)threads, (int)smem, (int)deps, delay, (int)late, (int)load); }\n")
    wrapper += (
        "void handoff(TensorView t, TensorView p, TensorView k2, TensorView d, TensorView h, "
        "TensorView v, int64_t bs, int64_t cl, int64_t groups, int64_t regs, int64_t smem, "
        f"int64_t delay) {{ probe::handoff<{item}>(t, p, k2, d, h, v, (int)bs, (int)cl, (int)groups, "
        "(int)regs, (int)smem, delay); }\n")
    wrapper += (
        "int64_t handoff_max_clusters(int64_t cl, int64_t smem) "
        f"{{ return probe::handoff_max_clusters<{item}>((int)cl, (int)smem); }}\n")
    wrapper += (
        "void read_marks(TensorView out) { HS_CUDA(cudaMemcpyFromSymbol(out.data_ptr(), "
        "probe::probe_marks, sizeof(probe::probe_marks), 0, cudaMemcpyDeviceToHost)); }\n")
    return _jit._build(f"hisparse_probe_shape_i{item}", wrapper,
                       ["shaped_gather", "handoff", "handoff_max_clusters", "read_marks"])


# (grid, smem KiB, deps, delay cycles, first delayed warp); the plain gather before and after.
# The last resolve shape is v11's schedule without its bookkeeping: 6 rows per CTA at once, the
# rest ~10 us later.
SHAPES = [("gather", 0, 0, 0, 0), ("gather", 0, 1, 0, 0), ("gather", 0, 2, 0, 0),
          ("gather", 0, 0, 2000, 0), ("gather", 0, 0, 4000, 0), ("resolve", 0, 0, 0, 0),
          ("resolve", 90, 0, 0, 0), ("resolve", 90, 2, 0, 0), ("resolve", 90, 2, 2000, 0),
          ("resolve", 90, 2, 20000, 6), ("gather", 0, 0, 0, 0)]


def shape_records(host, item, bs, steps, reps, shapes=SHAPES, handoffs=True):
    """The plain gather, each shape, each handoff, the plain gather again: records as measured."""
    mod, plain = module(item), _jit.gather_module(item).gather
    per_req = round(0.05 * 2048)
    rows = bs * per_req
    dev_cache = torch.empty(2 * rows, item, dtype=torch.uint8, device=DEV)
    # host_rows table of a few requests' worth of positions; each row's key is its entry
    table = torch.randint(0, host.shape[0], (max(bs * 32768, 2 * steps * rows),), device=DEV)
    keys = torch.randperm(table.numel(), device=DEV)[: steps * rows].int().view(steps, rows)
    ins = []
    plans = random_plans(bs, per_req, host.shape[0], 2 * rows, steps, seed=bs)
    for plan, key in zip(plans, keys, strict=True):
        src, dst = plan_rows(plan)
        table[key.long()] = src  # distinct keys per step: no step overwrites another's entries
        perm = torch.randperm(rows, device=DEV).int()
        key2 = torch.empty_like(key)
        key2[perm.long()] = key
        ins.append((src, key, perm, key2, dst))
    for src, key, perm, key2, _ in ins:
        assert torch.equal(table[key.long()], src)
        assert torch.equal(table[key2[perm.long()].long()], src)

    def run(grid, smem_kb, deps, delay, late, load=0):
        ctas, threads = (-(-rows // 8), 256) if grid == "gather" else (128, 1024)
        if grid.startswith("sms:"):
            ctas = int(grid[4:])
        fn = lambda t: mod.shaped_gather(  # noqa: E731
            ins[t][0], table, ins[t][1], ins[t][2], ins[t][3], ins[t][4], host, dev_cache,
            ctas, threads, smem_kb * 1024, deps, delay, late, load)
        return time_graph(fn, lambda: None, steps, reps)

    def plain_record():
        us = time_graph(lambda t: plain(ins[t][0], ins[t][4], host, dev_cache), lambda: None,
                        steps, reps)
        return dict(kind="plain_gather", item=item, bs=bs, rows=rows, us=round(us, 2))

    def handoff_correct(cl, groups, regs):
        """The handoff in this shape copies step 0's rows byte for byte."""
        src, _, perm, key2, dst = ins[0]
        host[src.cpu()] = torch.randint(0, 255, (rows, item), dtype=torch.uint8)
        dev_cache.zero_()
        mod.handoff(table, perm, key2, dst, host, dev_cache, bs, cl, groups, regs, 120 * 1024, 0)
        torch.cuda.synchronize()
        return torch.equal(dev_cache[dst.long()].cpu(), host[src.cpu()])

    yield plain_record()
    marks = torch.zeros(8192, 2, dtype=torch.int64)
    for grid, smem_kb, deps, delay, late, *load in shapes:
        mode = load[0] if load else 0
        rec = dict(kind="shaped", item=item, bs=bs, rows=rows, grid=grid, smem_kb=smem_kb,
                   deps=deps, delay_cycles=delay, late_warp=late, load=LOADS[mode],
                   us=round(run(grid, smem_kb, deps, delay, late, mode), 2))
        if mode == 2:  # the last launch's rows: µs since its first warp started
            mod.read_marks(marks)
            m = (marks[:rows].double() - marks[:rows, 0].min()) / 1e3
            rec.update(start_last_us=round(float(m[:, 0].max()), 2),
                       stored_median_us=round(float(m[:, 1].median()), 2),
                       stored_last_us=round(float(m[:, 1].max()), 2))
        yield rec
    for cl, groups, delay, regs in HANDOFFS if handoffs else ():
        fn = lambda t, c=cl, g=groups, d=delay, x=regs: mod.handoff(  # noqa: E731
            table, ins[t][2], ins[t][3], ins[t][4], host, dev_cache, bs, c, g, x, 120 * 1024, d)
        yield dict(kind="handoff", item=item, bs=bs, rows=rows, cluster=cl, groups=groups,
                   readers=bs * groups * (cl - 1), load="registers" if regs else "cp.async",
                   delay_cycles=delay, max_active_clusters=mod.handoff_max_clusters(cl, 120 * 1024),
                   us=round(time_graph(fn, lambda: None, steps, reps), 2),
                   correct=handoff_correct(cl, groups, regs))
    yield plain_record()


def sm_sweep_shapes() -> list[tuple]:
    """The SM sweep: rows on every SM, on all but 8 / 16 / 32, on half, then on all again."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return [(f"sms:{n}", 120, 2, 0, 0) for n in (sms, sms - 8, sms - 16, sms - 32, sms // 2, sms)]


LOADS = ("registers", "cp.async", "registers, marked", "registers, held")


def held_shapes() -> list[tuple]:
    """Rows held in registers after they land (``registers, held``: each warp of the resolve grid
    loads its row at once, then stores it no earlier than ``delay_cycles`` after its CTA started,
    as a reader waiting for the bookkeeping's destinations would): 0 to ~10 us, then 0 again."""
    return [("resolve", 90, 2, d, 0, 3) for d in (0, 4000, 8000, 12000, 16000, 20000, 0)]


# Handoff shapes (cluster size, clusters per request, bookkeeper delay in cycles, register
# loads): 128 CTAs at batch 16 in clusters of 2 / 4 / 8 (64 / 96 / 112 readers), without and with
# a wait of ~5 / ~10 us (the bookkeeping's time).
HANDOFFS = [(2, 4, 0, 1), (2, 4, 10000, 1), (2, 4, 20000, 1), (4, 2, 0, 1), (4, 2, 20000, 1),
            (4, 2, 20000, 0), (8, 1, 20000, 1)]


def load_sweep_shapes() -> list[tuple]:
    """Register loads against cp.async into shared memory (resolve's early rows and the split
    readers fetch by cp.async), in the ceiling's grid and one CTA per SM on all / all but 16 SMs,
    each pair back to back, register loads again at the end."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pairs = [("gather", 16, 0), ("gather", 16, 2), (f"sms:{sms}", 120, 2), (f"sms:{sms - 16}", 120, 2)]
    marked = [("gather", 16, deps, 0, 0, 2) for deps in (0, 1, 2)]
    return [(g, kb, deps, 0, 0, load) for g, kb, deps in pairs for load in (0, 1)] + marked + [
        ("gather", 16, 0, 0, 0, 0)]


def main(argv=None) -> int:
    args = probe_args(__doc__, "probe_gather_shape.json", 7, argv,
                      flags={"--sm-sweep": "only the plain gather and the SM sweep (sms:N shapes)",
                             "--load-sweep": "only the plain gather and register loads against "
                                             "cp.async (load field)",
                             "--handoff": "only the plain gather, held rows and the cluster "
                                         "handoffs"})
    pool = Pool(4.0)
    kw = dict(shapes=sm_sweep_shapes(), handoffs=False) if args.sm_sweep else {}
    if args.load_sweep:
        kw = dict(shapes=load_sweep_shapes(), handoffs=False)
    if args.handoff:
        kw = dict(shapes=held_shapes())
    recs = printed(rec for item in (656, 1152)
                   for rec in shape_records(pool.rows(item), item, 16, args.steps, args.reps, **kw))
    write_probe(args.out, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
