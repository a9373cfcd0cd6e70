// Copy-only replay of a resolve's miss plan for another layer's KV arrays.
#pragma once

#include "common.cuh"

namespace hisparse {

struct ReplayArgs {
  const int64_t* src; const int32_t* dst; const int32_t* count; int64_t stride;
  const int32_t* num_real; int bs, k;
  const uint8_t* host; int64_t hstride, hvoff;
  uint8_t* dev; int64_t dstride;
};

// Copy-only replay of a miss plan on a small fixed grid: all copies of the batch are flattened
// into 16-byte pieces and dealt out over every thread of the grid, so uneven per-request miss
// counts do not leave CTAs idle (one CTA per request would wait on the longest request).
template <int ITEM, int ROWL = 0>
__global__ void replay_kernel(ReplayArgs a) {
  constexpr int kPieces = ITEM / 16;
  extern __shared__ __align__(16) int rsmem[];
  int* scratch = rsmem;       // 33 ints (+pad)
  int* prefix = rsmem + 40;   // [nr + 1] exclusive prefix of the counts
  const int tid = threadIdx.x, T = blockDim.x;
  const int nr = max(0, min(*a.num_real, a.bs));
  const int per = (nr + T - 1) / T, j0 = min(nr, tid * per), j1 = min(nr, j0 + per);
  int local = 0;
  for (int j = j0; j < j1; ++j) local += min(max(a.count[j], 0), a.k);
  int total;
  int off = block_exclusive_scan(local, scratch, total);
  for (int j = j0; j < j1; ++j) { prefix[j] = off; off += min(max(a.count[j], 0), a.k); }
  __syncthreads();
  const int64_t pieces = static_cast<int64_t>(total) * kPieces;
  const int64_t step = static_cast<int64_t>(gridDim.x) * T;
  for (int64_t base = blockIdx.x * T + tid; base < pieces; base += step * kUnroll) {
    int4 v[kUnroll];
    int32_t dst_row[kUnroll];
    int dst_piece[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t x = base + u * step;
      if (x < pieces) {
        const int g = static_cast<int>(x / kPieces), piece = static_cast<int>(x % kPieces);
        int lo = 0, hi = nr - 1;  // last row whose prefix <= g (rows with no copies share it)
        while (lo < hi) {
          const int mid = (lo + hi + 1) >> 1;
          if (prefix[mid] <= g) lo = mid; else hi = mid - 1;
        }
        const int64_t e = lo * a.stride + (g - prefix[lo]);
        v[u] = load_host_piece<ROWL, ITEM>(a.host, a.hstride, a.src[e], piece, a.hvoff);
        dst_row[u] = a.dst[e];
        dst_piece[u] = piece;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * step < pieces) store_piece<ROWL, ITEM>(a.dev, a.dstride, dst_row[u], dst_piece[u], v[u]);
    }
  }
}

using tvm::ffi::TensorView;

template <int ITEM, int ROWL = 0>
void replay_launch(TensorView plan_src, TensorView plan_dst, TensorView plan_count,
                   TensorView num_real, TensorView host_cache, TensorView device_cache,
                   int64_t ctas, int64_t block) {
  check_tensor(plan_src, "plan.src", 2, kDLInt, 64);
  check_tensor(plan_dst, "plan.dst", 2, kDLInt, 32);
  check_tensor(plan_count, "plan.count", 1, kDLInt, 32);
  check_tensor(num_real, "num_real_reqs", 1, kDLInt, 32);
  check_tensor(host_cache, "host_cache", 2, kDLUInt, 8);
  check_tensor(device_cache, "device_cache", 2, kDLUInt, 8);
  const int dev = device_cache.device().device_id;
  for (auto* t : {&plan_src, &plan_dst, &plan_count, &num_real, &device_cache})
    check_cuda(*t, "plan/num_real_reqs/device_cache", dev);
  check_host(host_cache, "host_cache");
  const int64_t bs = plan_src.size(0);
  HS_CHECK(plan_dst.size(0) == bs && plan_dst.size(1) == plan_src.size(1) &&
               plan_count.size(0) == bs && plan_dst.stride(0) == plan_src.stride(0) &&
               (bs <= 1 || plan_count.stride(0) == 1),
           "plan must be src [bs, k] int64, dst like src (same strides), count [bs]");
  constexpr int64_t kDevRow = device_row_bytes<ROWL, ITEM>(), kHostRow = host_row_bytes<ROWL, ITEM>();
  HS_CHECK(host_cache.size(1) == kHostRow && device_cache.size(1) == kDevRow,
           "host_cache rows must be " << kHostRow << " bytes and device_cache rows "
           << kDevRow << " bytes for this build");
  HS_CHECK(block >= 32 && block <= 1024 && block % 32 == 0,
           "block size " << block << " must be a multiple of 32 in [32, 1024]");
  HS_CHECK(ctas >= 1 && ctas <= 65535, "replay grid " << ctas << " must be in [1, 65535]");
  if (bs == 0) return;
  ReplayArgs a;
  a.src = ptr<const int64_t>(plan_src); a.dst = ptr<const int32_t>(plan_dst);
  a.count = ptr<const int32_t>(plan_count); a.stride = plan_src.stride(0);
  a.num_real = ptr<const int32_t>(num_real);
  a.bs = static_cast<int>(bs); a.k = static_cast<int>(plan_src.size(1));
  a.host = ptr<const uint8_t>(host_cache); a.hstride = host_cache.stride(0);
  a.hvoff = ROWL == 3 ? host_cache.size(0) / 2 * host_cache.stride(0) : 0;
  a.dev = ptr<uint8_t>(device_cache); a.dstride = device_cache.stride(0);
  const size_t bytes = (40 + bs + 1) * sizeof(int);
  auto kernel = replay_kernel<ITEM, ROWL>;
  set_smem(kernel, bytes);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev));
  kernel<<<static_cast<unsigned>(ctas), static_cast<unsigned>(block), bytes, stream>>>(a);
  HS_CUDA(cudaGetLastError());
}

}  // namespace hisparse
