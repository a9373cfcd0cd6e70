// Probe: does a warp's work stall while host reads are in flight on its SM (its own, or other
// warps')? What the resolve kernel's early fetch (jit_kernels/resolve.cuh) has to live with.
//
//   nvcc -arch=sm_90 -O3 -o probe_host_stall benchmarks/probes/probe_host_stall.cu
//   ./probe_host_stall > probe_host_stall.json
//
// 128 CTAs x 1024 threads (one per SM); R random 1152-byte rows per CTA from a 4 GiB pinned
// pool. The workers run a latency-bound dependent chain: shared-memory loads and atomics
// (modes 0-4) or L2-resident global loads (5-6). Modes: 0 no host reads; 1 warps 1..31 issue
// the rows (cp.async) and then work (v8's early fetch); 2 warps 28..31 (one per SM sub-
// partition) issue all rows, warps 0..27 work; 3 the rows from warps 3, 7, .., 31 (one sub-
// partition); 4 like 2 with register loads instead of cp.async; 5 no host reads, global-load
// work; 6 like 2 with global-load work. Reported per config (median over 6 launches): the
// workers' time (median and slowest CTA, and split by sub-partition) and when the last row
// landed, in us at 1980 MHz (clock64 cycles / 1980).
#include <cstdio>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do{cudaError_t e=(x); if(e!=cudaSuccess){printf("%s:%d %s\n",__FILE__,__LINE__,cudaGetErrorString(e)); return 1;}}while(0)
constexpr int ITEM = 1152, PIECES = ITEM / 16, WORK_WORDS = 4096;
__device__ __forceinline__ unsigned long long gtime(){unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;":"=l"(t)); return t;}
__device__ __forceinline__ void cpa(void* d, const void* s){asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n"::"r"((unsigned)__cvta_generic_to_shared(d)),"l"(s):"memory");}
__global__ void __launch_bounds__(1024) probe(const uint8_t* host, const int64_t* rows, int R, int mode, int iters,
    unsigned long long* work_ns, unsigned long long* fetch_ns, int* sink, const uint32_t* gwork) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint32_t* work = reinterpret_cast<uint32_t*>(smem);
  uint8_t* stage = smem + 4 * WORK_WORDS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, c = blockIdx.x;
  for (int i = tid; i < WORK_WORDS; i += 1024) work[i] = i * 2654435761u;
  __syncthreads();
  const int64_t* myrows = rows + (int64_t)c * R;
  bool fetcher; int fidx, nf;
  if (mode == 1) { fetcher = warp >= 1; fidx = warp - 1; nf = 31; }
  else if (mode == 2 || mode == 4 || mode == 6) { fetcher = warp >= 28; fidx = warp - 28; nf = 4; }
  else if (mode == 3) { fetcher = (warp & 3) == 3; fidx = warp >> 2; nf = 8; }
  else { fetcher = false; fidx = 0; nf = 1; }
  const bool worker = mode == 1 ? true : !fetcher;
  const long long t0 = clock64();
  if (fetcher && mode == 4) {
    for (int j0 = fidx; j0 < R; j0 += 4 * nf) {
      int4 v[4][3];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int q = 0; q < 3; ++q) {
          const int j = j0 + u * nf, pc = lane + 32 * q;
          if (j < R && pc < PIECES) v[u][q] = __ldg(reinterpret_cast<const int4*>(host + myrows[j] * ITEM) + pc);
        }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int q = 0; q < 3; ++q) {
          const int j = j0 + u * nf, pc = lane + 32 * q;
          if (j < R && pc < PIECES) reinterpret_cast<int4*>(stage + j * ITEM)[pc] = v[u][q];
        }
    }
  } else if (fetcher) {
    for (int j = fidx; j < R; j += nf) {
      const uint8_t* src = host + myrows[j] * ITEM;
      for (int pc = lane; pc < PIECES; pc += 32) cpa(stage + j * ITEM + 16 * pc, src + 16 * pc);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  }
  const long long tw0 = clock64(); long long tw1 = tw0;
  if (worker) {
    uint32_t x = tid;
    if (mode >= 5) {  // dependent chain of global (L2-resident) loads
      const uint32_t* g = gwork + (size_t)c * WORK_WORDS;
      for (int it = 0; it < iters / 8; ++it) x = __ldcg(&g[(x * 7 + it * 13 + lane) & (WORK_WORDS - 1)]);
    } else {
      for (int it = 0; it < iters; ++it) {  // dependent smem chain + an atomic: latency-bound like bookkeeping
        x = work[(x * 7 + it * 13 + lane) & (WORK_WORDS - 1)];
        atomicOr(&work[(x + tid) & (WORK_WORDS - 1)], 1u << (it & 31));
      }
    }
    if (x == 0xdeadbeef) sink[0] = x;
    tw1 = clock64();
  }
  if (fetcher) {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncwarp();
    if (lane == 0) atomicMax(&fetch_ns[c], (unsigned long long)(clock64() - t0));
  }
  if (worker && lane == 0) atomicMax(&work_ns[c * 32 + warp], (unsigned long long)(tw1 - tw0));
}
int main() {
  const size_t pool = 4ull << 30; const int64_t nrows = pool / ITEM;
  uint8_t* host; CK(cudaHostAlloc(&host, pool, cudaHostAllocMapped));
  for (size_t i = 0; i < pool; i += 4096) host[i] = 1;
  const int ctas = 128, Rmax = 120;
  std::mt19937_64 g(1);
  int64_t *rows; CK(cudaMalloc(&rows, 8ull * ctas * Rmax * 20));
  unsigned long long *wns, *fns; int* sink; uint32_t* gwork;
  CK(cudaMalloc(&gwork, 4ull * ctas * WORK_WORDS)); CK(cudaMemset(gwork, 0, 4ull * ctas * WORK_WORDS));
  CK(cudaMalloc(&wns, 8 * ctas * 32)); CK(cudaMalloc(&fns, 8 * ctas)); CK(cudaMalloc(&sink, 8));
  const int smem = 4 * WORK_WORDS + Rmax * ITEM;
  CK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<int64_t> h(ctas * Rmax * 20);
  for (auto& v : h) v = g() % nrows;
  CK(cudaMemcpy(rows, h.data(), 8 * h.size(), cudaMemcpyHostToDevice));
  printf("{\"records\": [\n");
  bool firstrec = true;
  for (int iters : {400}) for (int mode : {0, 1, 2, 3, 4, 5, 6}) for (int R : {0, 6, 24, 64, 120}) {
    if ((mode == 0 || mode == 5) != (R == 0)) continue;
    std::vector<double> wmed, wmax, fmax, wsp3, wsp012;
    for (int rep = 0; rep < 8; ++rep) {
      CK(cudaMemset(wns, 0, 8 * ctas * 32)); CK(cudaMemset(fns, 0, 8 * ctas));
      probe<<<ctas, 1024, smem>>>(host, rows + (int64_t)(rep % 20) * ctas * Rmax, R, mode, iters, wns, fns, sink, gwork);
      CK(cudaDeviceSynchronize());
      std::vector<unsigned long long> w(ctas * 32), f(ctas);
      CK(cudaMemcpy(w.data(), wns, 8 * w.size(), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(f.data(), fns, 8 * ctas, cudaMemcpyDeviceToHost));
      std::vector<double> per, sp3, sp012;
      for (int cc = 0; cc < ctas; ++cc) {
        double mx = 0, m3 = 0, m012 = 0;
        for (int wp = 0; wp < 32; ++wp) if (w[cc * 32 + wp]) {
          mx = std::max(mx, (double)w[cc * 32 + wp]);
          if ((wp & 3) == 3) m3 = std::max(m3, (double)w[cc * 32 + wp]); else m012 = std::max(m012, (double)w[cc * 32 + wp]);
        }
        per.push_back(mx); sp3.push_back(m3); sp012.push_back(m012);
      }
      std::sort(per.begin(), per.end()); std::sort(f.begin(), f.end());
      std::sort(sp3.begin(), sp3.end()); std::sort(sp012.begin(), sp012.end());
      if (rep >= 2) { wmed.push_back(per[ctas / 2]); wmax.push_back(per.back()); fmax.push_back(f.back()); wsp3.push_back(sp3[ctas/2]); wsp012.push_back(sp012[ctas/2]); }
    }
    auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2] / 1980.0; };
    printf("%s{\"mode\": %d, \"rows_per_cta\": %d, \"iters\": %d, \"work_us_med_cta\": %.2f, \"work_us_max_cta\": %.2f, \"fetch_done_us_max\": %.2f, \"work_us_smsp3\": %.2f, \"work_us_smsp012\": %.2f}",
           firstrec ? "" : ",\n", mode, R, iters, med(wmed), med(wmax), med(fmax), med(wsp3), med(wsp012));
    firstrec = false;
  }
  printf("\n]}\n");
  return 0;
}
