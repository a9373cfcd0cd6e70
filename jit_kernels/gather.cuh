// Plain scattered gather of rows from pinned host memory: the benchmark's same-run ceiling.
// One warp per row, every lane issuing all its 16-byte loads before its stores, full grid.
// LOOKUP: the row's host row is first looked up in a device table (`src` holds keys into
// `table`, e.g. r * P + position into host_rows): one more dependent load before the host read,
// the least any kernel given top-k positions (not host rows) must pay (bench_resolve.py's
// `lookup_ceiling_us`).
#pragma once

#include "common.cuh"

namespace hisparse {

template <int ITEM, bool LOOKUP>
__global__ void gather_kernel(const int64_t* src, const int64_t* table, const int32_t* dst, int64_t rows,
                             const uint8_t* host, int64_t hstride, uint8_t* dev, int64_t dstride) {
  constexpr int kPieces = ITEM / 16, kPerLane = (kPieces + 31) / 32;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int64_t h = LOOKUP ? table[src[row]] : src[row];
  const int4* s = reinterpret_cast<const int4*>(host + h * hstride);
  int4* d = reinterpret_cast<int4*>(dev + static_cast<int64_t>(dst[row]) * dstride);
  int4 v[kPerLane];
#pragma unroll
  for (int u = 0; u < kPerLane; ++u)
    if (lane + 32 * u < kPieces) v[u] = __ldg(s + lane + 32 * u);
#pragma unroll
  for (int u = 0; u < kPerLane; ++u)
    if (lane + 32 * u < kPieces) d[lane + 32 * u] = v[u];
}

using tvm::ffi::TensorView;

// table: null for the plain gather, else a contiguous 1-D int64 tensor that `src` indexes.
template <int ITEM>
void gather_launch(TensorView src, TensorView dst, TensorView host_cache, TensorView device_cache,
                   const TensorView* table = nullptr) {
  check_tensor(src, "src", 1, kDLInt, 64);
  check_tensor(dst, "dst", 1, kDLInt, 32);
  check_tensor(host_cache, "host_cache", 2, kDLUInt, 8);
  check_tensor(device_cache, "device_cache", 2, kDLUInt, 8);
  const int dev = device_cache.device().device_id;
  check_cuda(src, "src", dev);
  check_cuda(dst, "dst", dev);
  check_cuda(device_cache, "device_cache", dev);
  check_host(host_cache, "host_cache");
  HS_CHECK(src.size(0) == dst.size(0), "src and dst must have the same length");
  HS_CHECK(host_cache.size(1) == ITEM && device_cache.size(1) == ITEM, "rows must be " << ITEM << " B");
  if (table) {
    check_tensor(*table, "table", 1, kDLInt, 64);
    HS_CHECK(table->stride(0) == 1 || table->size(0) <= 1, "table must be contiguous");
    check_cuda(*table, "table", dev);
  }
  const int64_t rows = src.size(0);
  if (rows == 0) return;
  const unsigned grid = static_cast<unsigned>((rows * 32 + 255) / 256);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev));
  auto kernel = table ? gather_kernel<ITEM, true> : gather_kernel<ITEM, false>;
  kernel<<<grid, 256, 0, stream>>>(
      ptr<const int64_t>(src), table ? ptr<const int64_t>(*table) : nullptr, ptr<const int32_t>(dst),
      rows, ptr<const uint8_t>(host_cache), host_cache.stride(0), ptr<uint8_t>(device_cache),
      device_cache.stride(0));
  HS_CUDA(cudaGetLastError());
}

}  // namespace hisparse
