// All-layer row copy: dst_layer[l][dst_rows[j]] = src_layer[l][src_rows[j]] for every layer l
// and row j, in ONE launch (the per-step write-through backup, staging, verify commit and the
// PD preload). Layers are reached through address tables built once per coordinator, so the
// launch takes no per-layer argument. Either side may be device HBM or pinned host memory seen
// through its device-mapped address (unified addressing: the GPU loads and stores it directly).
#pragma once

#include "common.cuh"

namespace hisparse {

// One row of a layer table: base address, row stride in bytes, number of rows.
constexpr int kTableCols = 3;

struct LayerCopyArgs {
  const int64_t* src_table;  // [L, 3]
  const int64_t* dst_table;  // [L, 3]
  const int64_t* src_rows;   // [n]
  const int64_t* dst_rows;   // [n]
  int64_t n, layers;
};

// Every (layer, row, 16-byte piece) is one work item, pieces fastest, so the lanes of a warp
// store consecutive 16-byte pieces of one row (656 B = 41 pieces, 1152 B = 72). Each thread
// issues kUnroll loads before its stores, the habit of common.cuh's copy_rows. Rows whose index
// is outside [0, rows of that layer) are skipped in both directions: memory stays safe whatever
// the caller passes (the reference skips them too).
// SL / DL: the row layout of the source / destination layers (common.cuh store_piece: 0 token
// rows, 1 DeepSeek-V4's paged C4 entries; a table's "rows" then counts entries, its stride is
// one page; 3 rows split in halves, a table row's stride one half and its second halves `rows`
// x stride bytes after the first's). SL = DL = 0 compiles to token rows only (if constexpr).
template <int ITEM, int SL = 0, int DL = 0>
__global__ void layer_copy_kernel(LayerCopyArgs a) {
  constexpr int kPieces = ITEM / 16;
  const int64_t per_layer = a.n * kPieces;
  const int64_t total = per_layer * a.layers;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
       base += step * kUnroll) {
    int4 v[kUnroll];
    int4* dst[kUnroll];
    const int64_t* dtab[kUnroll];  // DL != 0: the destination layer's table row, row and piece
    int64_t drow[kUnroll];
    int dpiece[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      dst[u] = nullptr;
      dtab[u] = nullptr;
      const int64_t x = base + u * step;
      if (x >= total) continue;
      const int64_t l = x / per_layer, rem = x - l * per_layer;
      const int64_t j = rem / kPieces;
      const int piece = static_cast<int>(rem - j * kPieces);
      const int64_t* st = a.src_table + l * kTableCols;
      const int64_t* dt = a.dst_table + l * kTableCols;
      const int64_t s = a.src_rows[j], d = a.dst_rows[j];
      if (s < 0 || s >= st[2] || d < 0 || d >= dt[2]) continue;
      if constexpr (SL == 3)
        v[u] = load_host_piece<3, ITEM>(reinterpret_cast<const uint8_t*>(st[0]), st[1], s, piece, st[2] * st[1]);
      else
        v[u] = load_piece<SL, ITEM>(reinterpret_cast<const uint8_t*>(st[0]), st[1], s, piece);
      if constexpr (DL == 0) {
        dst[u] = reinterpret_cast<int4*>(reinterpret_cast<uint8_t*>(dt[0]) + d * dt[1]) + piece;
      } else {
        dtab[u] = dt;
        drow[u] = d;
        dpiece[u] = piece;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if constexpr (DL == 0) {
        if (dst[u] != nullptr) *dst[u] = v[u];
      } else if (dtab[u] != nullptr) {
        if constexpr (DL == 3)
          store_split_piece<ITEM>(reinterpret_cast<uint8_t*>(dtab[u][0]), dtab[u][1], drow[u], dpiece[u],
                                  dtab[u][2] * dtab[u][1], v[u]);
        else
          store_piece<DL, ITEM>(reinterpret_cast<uint8_t*>(dtab[u][0]), dtab[u][1],
                                static_cast<int32_t>(drow[u]), dpiece[u], v[u]);
      }
    }
  }
}

using tvm::ffi::TensorView;

// Most CTAs one copy launches: enough to keep every SM's loads in flight for the largest
// backup (64 rows x 78 layers x 72 pieces), few enough that a small copy is one short wave.
constexpr int64_t kLayerCopyMaxCtas = 1024;
constexpr int kLayerCopyBlock = 256;

template <int ITEM, int SL = 0, int DL = 0>
void layer_copy_launch(TensorView src_table, TensorView dst_table, TensorView src_rows,
                       TensorView dst_rows) {
  check_tensor(src_table, "src_table", 2, kDLInt, 64);
  check_tensor(dst_table, "dst_table", 2, kDLInt, 64);
  check_tensor(src_rows, "src_rows", 1, kDLInt, 64);
  check_tensor(dst_rows, "dst_rows", 1, kDLInt, 64);
  const int dev = src_rows.device().device_id;
  check_cuda(src_table, "src_table", dev);
  check_cuda(dst_table, "dst_table", dev);
  check_cuda(src_rows, "src_rows", dev);
  check_cuda(dst_rows, "dst_rows", dev);
  const int64_t layers = src_table.size(0), n = src_rows.size(0);
  HS_CHECK(src_table.size(1) == kTableCols && dst_table.size(1) == kTableCols,
           "layer tables must be int64 [L, 3] (address, row stride in bytes, rows)");
  HS_CHECK(dst_table.size(0) == layers,
           "src_table has " << layers << " layers, dst_table " << dst_table.size(0));
  HS_CHECK((layers <= 1 || (src_table.stride(0) == kTableCols && dst_table.stride(0) == kTableCols)),
           "layer tables must be contiguous");
  HS_CHECK(dst_rows.size(0) == n,
           "src_rows has " << n << " rows, dst_rows " << dst_rows.size(0) << "; need the same");
  HS_CHECK(n <= 1 || (src_rows.stride(0) == 1 && dst_rows.stride(0) == 1),
           "src_rows/dst_rows must be contiguous");
  if (n == 0 || layers == 0) return;
  LayerCopyArgs a;
  a.src_table = ptr<const int64_t>(src_table);
  a.dst_table = ptr<const int64_t>(dst_table);
  a.src_rows = ptr<const int64_t>(src_rows);
  a.dst_rows = ptr<const int64_t>(dst_rows);
  a.n = n;
  a.layers = layers;
  const int64_t items = n * layers * (ITEM / 16);
  const int64_t per_cta = static_cast<int64_t>(kLayerCopyBlock) * kUnroll;
  const int64_t ctas = std::min<int64_t>(kLayerCopyMaxCtas, (items + per_cta - 1) / per_cta);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev));
  layer_copy_kernel<ITEM, SL, DL><<<static_cast<unsigned>(ctas), kLayerCopyBlock, 0, stream>>>(a);
  HS_CUDA(cudaGetLastError());
}

}  // namespace hisparse
