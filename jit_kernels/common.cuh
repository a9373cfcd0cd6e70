// Shared pieces of the resolve/replay kernels: error macros, a block scan valid for every block
// size, the 16-byte row copier, and the host-side tensor checks (torch-free, tvm-ffi views).
#pragma once

#include <cuda_runtime.h>
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <sstream>

#define HS_CHECK(cond, msg)                                                               \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::ostringstream hs_os_;                                                          \
      hs_os_ << __FILE__ << ":" << __LINE__ << ": " << msg;                               \
      TVM_FFI_THROW(ValueError) << hs_os_.str();                                          \
    }                                                                                     \
  } while (0)

#define HS_CUDA(call)                                                                     \
  do {                                                                                    \
    cudaError_t hs_e_ = (call);                                                           \
    if (hs_e_ != cudaSuccess) {                                                           \
      TVM_FFI_THROW(RuntimeError) << __FILE__ << ":" << __LINE__ << ": " << #call << ": " \
                                  << cudaGetErrorString(hs_e_);                           \
    }                                                                                     \
  } while (0)

namespace hisparse {

constexpr unsigned kFull = 0xffffffffu;
// CUDA's limit on gridDim.y: the most batch rows one launch takes.
constexpr int64_t kMaxGridRows = 65535;
constexpr int kUnroll = 4;  // 16-byte loads each thread keeps in flight

__host__ __device__ constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }
__host__ __device__ constexpr int log2i(int x) { return x <= 1 ? 0 : 1 + log2i(x / 2); }

// Entry i of an int32 or int64 index tensor (req_index, seq_lens) on the device.
__device__ __forceinline__ int64_t load_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

// Bit mask of the lanes below this one (for ranks within a ballot).
__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Inclusive prefix sum of one int per lane over the (full) warp.
__device__ __forceinline__ int warp_inclusive_scan(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// Replacement policy ids and slru's level caps in sixteenths of B (sglang_hisparse/
// kernel_policy.py is the spec; resolve.cuh runs all three policies, resolve_verify.cuh lru and
// slru).
constexpr int kPolicyLru = 0, kPolicyFra = 1, kPolicySlru = 2;
constexpr int kSlruCap1 = 3, kSlruCap2 = 10;

// slru's writer (both kernels; kernel_policy.py is the spec). `order` holds the evictables
// (levels 0, 1, 2, in old order) then the hits (level 0, then 1-2), the victims being
// order[0, m); n0 / n1 are the evictables of levels 0 / 1, b1 the old level-0 boundary. The new
// LRU: level-0 evictables left | misses | level-1 evictables left | level-0 hits | level-2
// evictables left | level-1/2 hits; thread 0 stores the new boundaries, capped, into *word.
__device__ __forceinline__ void slru_write(const int16_t* order, int16_t* lru, int B, int n_evict,
                                           int m, int n0, int n1, int b1, int tid, int T,
                                           int32_t* word) {
  const int h0 = b1 - n0;  // positions < b1 hold evictables or hits
  const int e1 = max(n0, m), e2 = max(m, n0 + n1), a0 = e1 - m;
  for (int j = tid; j < B; j += T) {
    const int at = j < a0 ? m + j : j < e1 ? j - a0 : j < e2 ? j
                 : j < e2 + h0 ? n_evict + (j - e2) : j < n_evict + h0 ? j - h0 : j;
    lru[j] = order[at];
  }
  if (tid == 0) {
    const int nb2 = max(e2 + h0, B - kSlruCap2 * B / 16);
    const int nb1 = max(e1, nb2 - kSlruCap1 * B / 16);
    *word = (B - nb1) | ((B - nb2) << 16);
  }
}

// Scan scratch at the end of both kernels' shared-memory layouts, in ints: block_exclusive_scan
// uses 33 (a total per warp and the block's), resolve.cuh's exchanges 32.
// NOTE: 40, not 33: the 28 spare bytes are in every figure sglang_hisparse/kernel_limits.py
// mirrors (the startup limits of config.py and the planner, and their tests); shrinking them
// changes those figures and nothing a shared-memory budget notices.
constexpr int kScanScratchInts = 40;

// Block-wide exclusive prefix sum of one int per thread, for any blockDim.x that is a multiple
// of 32 (1..32 warps). `scratch` holds 33 ints. NOTE: every warp's total is written before the
// first barrier and read only after it, and warp 0 publishes the offsets before the second
// barrier, so no warp ever reads a stale entry (the failure mode of scans that assume a fixed
// warp count); the third barrier makes `scratch` reusable at once.
__device__ __forceinline__ int block_exclusive_scan(int v, int* scratch, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int incl = warp_inclusive_scan(v);
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int t = lane < nwarps ? scratch[lane] : 0;
    const int ti = warp_inclusive_scan(t);
    if (lane < nwarps) scratch[lane] = ti - t;
    if (lane == 31) scratch[32] = ti;
  }
  __syncthreads();
  const int res = scratch[warp] + incl - v;
  total = scratch[32];
  __syncthreads();
  return res;
}

// Block-wide: write the old LRU lru[0..B) (slot ids, oldest first) into `order` as the
// evictable slots (hit[s] == 0) in their old order followed by the hit slots in their old
// order; returns the number of evictables. Each thread owns one contiguous chunk of the LRU, so
// one scan places both groups. Ends with a barrier: `order` is readable on return.
__device__ __forceinline__ int split_lru(const int16_t* lru, const uint8_t* hit, int16_t* order,
                                         int B, int* scratch) {
  const int T = blockDim.x, tid = threadIdx.x;
  const int per_b = (B + T - 1) / T, j0 = min(B, tid * per_b), j1 = min(B, j0 + per_b);
  int n_ev = 0;
  for (int j = j0; j < j1; ++j) n_ev += !hit[lru[j]];
  int n_evict;
  int e = block_exclusive_scan(n_ev, scratch, n_evict);
  int hh = n_evict + (j0 - e);
  for (int j = j0; j < j1; ++j) {
    const int16_t s = lru[j];
    if (hit[s]) order[hh++] = s; else order[e++] = s;
  }
  __syncthreads();
  return n_evict;
}

// ---- asynchronous global -> shared staging (cp.async, sm_80+) ---------------------------------
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most N committed groups are still in flight (the caller then syncs the block).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// stage_to_smem's fallback with plain loads (int16 rows at an odd 2-byte offset; before sm_80
// every source). Out of line: kept out of the instruction stream of the kernels' prologues.
static __device__ __noinline__ void stage_plain(void* dst, const void* src, int bytes, int tid, int T) {
  if ((reinterpret_cast<uintptr_t>(src) & 3) == 0 && bytes % 4 == 0) {
    for (int x = tid; x < bytes / 4; x += T)
      static_cast<int32_t*>(dst)[x] = static_cast<const int32_t*>(src)[x];
    return;
  }
  for (int x = tid; x < bytes / 2; x += T)
    static_cast<int16_t*>(dst)[x] = static_cast<const int16_t*>(src)[x];
}

// Block-wide copy of `bytes` (a multiple of 2) from global `src` into 16-byte aligned shared
// `dst`, issued as cp.async in the widest granule both addresses allow (16 or 4 bytes), so
// every thread has all its loads in flight at once and no registers hold them; sources that are
// only 2-byte aligned (odd-length int16 rows) fall back to plain loads. Complete after
// cp_async_wait + __syncthreads. `tid`/`T` are the thread's index and the block size.
// NOTE: the loops here and in fill_smem run a few times per thread and stay rolled: nvcc's
// 16-fold unrolling with remainder loops puts ~3 KB of code per call site in the kernels'
// prologues, whose instructions every launch fetches cold (resolve.cuh: the NOTE on the
// bookkeeping as the `if` body).
__device__ __forceinline__ void stage_to_smem(void* dst, const void* src, int bytes, int tid,
                                              int T) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(src);
#if __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if ((a & 15) == 0 && bytes % 16 == 0) {
#pragma unroll 1
    for (int x = tid; x < bytes / 16; x += T)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s + 16 * x),
                   "l"(static_cast<const char*>(src) + 16 * x) : "memory");
    return;
  }
  if ((a & 3) == 0 && bytes % 4 == 0) {
#pragma unroll 1
    for (int x = tid; x < bytes / 4; x += T)
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s + 4 * x),
                   "l"(static_cast<const char*>(src) + 4 * x) : "memory");
    return;
  }
#endif
  stage_plain(dst, src, bytes, tid, T);
}

// One 16-byte cp.async from global or mapped pinned host memory into shared memory.
// NOTE: .ca (through L1), not .cg: from pinned host memory with 656-byte rows, .cg moved the
// same rows at half the rate of plain loads (H200: 59.8 vs 34.3 us for 1638 rows); .ca and
// plain loads match for both 656 and 1152 bytes.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n"
               ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(src) : "memory");
#else
  *static_cast<int4*>(dst) = *static_cast<const int4*>(src);
#endif
}

// Block-wide fill of `n16` 16-byte pieces of shared memory with `v`.
__device__ __forceinline__ void fill_smem(void* dst, int n16, int4 v, int tid, int T) {
#pragma unroll 1
  for (int x = tid; x < n16; x += T) static_cast<int4*>(dst)[x] = v;
}

// Called by thread 0 of every CTA of batch row b once it has finished reading the request's
// mutable state: true in the CTA that arrives last, which alone writes the new state. The last
// arrival resets the counter, so the zeroed workspace serves the next launch (and graph replay).
// Split in two so that a caller can issue the arrival early and use its ticket late (the
// atomic's round trip then overlaps other work): arrive_last = arrive_decide(arrive_issue()).
// `fence` = false skips the __threadfence, for a CTA whose other warps have host reads in
// flight: the fence waits for those (resolve's fetch warps). The atomic then still follows the
// block barrier after which the arriving CTA's reads of the state have landed in shared memory,
// so no write the arrival permits can reach them.
__device__ __forceinline__ int arrive_issue(int32_t* arrivals, int b, int ctas, bool fence = true) {
  if (ctas <= 1) return 0;
  if (fence) __threadfence();
  return atomicAdd(&arrivals[b], 1);
}

__device__ __forceinline__ bool arrive_decide(int ticket, int32_t* arrivals, int b, int ctas) {
  if (ctas <= 1) return true;
  const bool last = ticket == ctas - 1;
  // The reset needs no fence: the next launch is ordered after this kernel anyway, and a fence
  // here would put one more round trip on the writer CTA, the one that ends the kernel.
  if (last) atomicExch(&arrivals[b], 0);
  return last;
}

__device__ __forceinline__ bool arrive_last(int32_t* arrivals, int b, int ctas) {
  return arrive_decide(arrive_issue(arrivals, b, ctas), arrivals, b, ctas);
}

// Row layouts (template ROWL; sglang_hisparse/kernels/row_layout.py is the spec). 0: token
// rows, row r at dev + r * dstride. 1: DeepSeek-V4's C4 entries as FlashMLA pages them, dstride
// = one page (64 entries): entry r's 576 data bytes at page r/64 + (r%64)*576, its 8 tail bytes
// (scales) at page + 36864 + (r%64)*8, the page padded to 37440 B; host rows are 592 B, whose
// last 8 bytes are not stored. 2: the same pages on both sides (host_cache [pages, 37440]: what
// SGLang's PD transfer writes into the decode host pool); a row is still read and stored as the
// 37 16-byte pieces of the 592-byte row, the last one's low 8 bytes being the tail. 3: token rows
// on the device, the host side split in halves (MiniMax-M3's K and V as SGLang's PD transfer
// writes them): host_cache [2H, ITEM/2], row h's first half at h, its second at H + h (hvoff =
// H * hstride bytes further).
constexpr int kC4Entries = 64, kC4Data = 576, kC4Tail = 8, kC4Page = 37440;

// Store piece `piece` (16 bytes of the host row) of device row `row`.
template <int ROWL, int ITEM>
__device__ __forceinline__ void store_piece(uint8_t* dev, int64_t dstride, int32_t row, int piece,
                                            const int4& v) {
  if constexpr (ROWL == 0 || ROWL == 3) {
    reinterpret_cast<int4*>(dev + static_cast<int64_t>(row) * dstride)[piece] = v;
  } else {
    static_assert((ROWL == 1 || ROWL == 2) && ITEM == kC4Data + 16, "the C4 layout takes 592-byte rows");
    uint8_t* page = dev + static_cast<int64_t>(row / kC4Entries) * dstride;
    const int e = row % kC4Entries;
    if (piece < kC4Data / 16)
      reinterpret_cast<int4*>(page + e * kC4Data)[piece] = v;
    else
      *reinterpret_cast<int2*>(page + kC4Entries * kC4Data + e * kC4Tail) = make_int2(v.x, v.y);
  }
}

// Load piece `piece` of row `row` (the host row's bytes; a C4 entry's tail piece is its 8 tail
// bytes and 8 zero bytes, as the host row holds them).
template <int ROWL, int ITEM>
__device__ __forceinline__ int4 load_piece(const uint8_t* base, int64_t stride, int64_t row, int piece) {
  if constexpr (ROWL == 0 || ROWL == 3) {
    return __ldg(reinterpret_cast<const int4*>(base + row * stride) + piece);
  } else {
    static_assert((ROWL == 1 || ROWL == 2) && ITEM == kC4Data + 16, "the C4 layout takes 592-byte rows");
    const uint8_t* page = base + (row / kC4Entries) * stride;
    const int e = static_cast<int>(row % kC4Entries);
    if (piece < kC4Data / 16) return __ldg(reinterpret_cast<const int4*>(page + e * kC4Data) + piece);
    const int2 t = __ldg(reinterpret_cast<const int2*>(page + kC4Entries * kC4Data + e * kC4Tail));
    return make_int4(t.x, t.y, 0, 0);
  }
}

// Bytes of one row of a device buffer of this layout (one KV row, or one page of C4 entries).
template <int ROWL, int ITEM>
constexpr int64_t device_row_bytes() { return ROWL == 0 || ROWL == 3 ? ITEM : kC4Page; }

// Bytes of one row of the host buffer: the row itself, one page of C4 entries (ROWL 2), or a
// half row (3).
template <int ROWL, int ITEM>
constexpr int64_t host_row_bytes() { return ROWL == 2 ? kC4Page : ROWL == 3 ? ITEM / 2 : ITEM; }

// Load piece `piece` of host row `row`: flat rows (ROWL 0, 1), an entry of a C4 page (2), or
// a half of the split rows, the second `hvoff` bytes after the first's array (3).
template <int ROWL, int ITEM>
__device__ __forceinline__ int4 load_host_piece(const uint8_t* host, int64_t hstride, int64_t row, int piece,
                                                int64_t hvoff = 0) {
  if constexpr (ROWL == 2) {
    return load_piece<1, ITEM>(host, hstride, row, piece);
  } else if constexpr (ROWL == 3) {
    static_assert(ITEM % 32 == 0, "a split row's halves are whole 16-byte pieces");
    constexpr int kHalf = ITEM / 32;
    const uint8_t* half = piece < kHalf ? host : host + hvoff;
    return __ldg(reinterpret_cast<const int4*>(half + row * hstride) + (piece < kHalf ? piece : piece - kHalf));
  } else {
    return __ldg(reinterpret_cast<const int4*>(host + row * hstride) + piece);
  }
}

// Store piece `piece` of host row `row` of split rows (the inverse of load_host_piece<3>).
template <int ITEM>
__device__ __forceinline__ void store_split_piece(uint8_t* host, int64_t hstride, int64_t row, int piece,
                                                  int64_t hvoff, const int4& v) {
  constexpr int kHalf = ITEM / 32;
  uint8_t* half = piece < kHalf ? host : host + hvoff;
  reinterpret_cast<int4*>(half + row * hstride)[piece < kHalf ? piece : piece - kHalf] = v;
}

// Copy rows [q0, q1) of (src, dst) with 16-byte loads straight from pinned host memory (with
// `list`, rows list[q0..q1) instead). The rows are flattened into 16-byte pieces spread over all
// threads, so lanes stay busy whatever the row size (656 B = 41 pieces is not a multiple of a
// warp's 32). `tid`/`T`: this thread's index among the T copying threads (-1: the whole CTA);
// UNROLL: loads each thread keeps in flight.
template <int ITEM, int UNROLL = kUnroll, int ROWL = 0>
__device__ __forceinline__ void copy_rows(const int64_t* src, const int32_t* dst, int q0, int q1,
                                          const uint8_t* host, int64_t hstride, uint8_t* dev,
                                          int64_t dstride, const int32_t* list = nullptr,
                                          int tid = -1, int T = 0, int64_t hvoff = 0) {
  constexpr int kPieces = ITEM / 16;
  if (tid < 0) {
    tid = threadIdx.x;
    T = blockDim.x;
  }
  const int total = (q1 - q0) * kPieces;
  for (int base = tid; base < total; base += T * UNROLL) {
    int4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int x = base + u * T;
      if (x < total) {
        const int q = list ? list[q0 + x / kPieces] : q0 + x / kPieces, piece = x % kPieces;
        v[u] = load_host_piece<ROWL, ITEM>(host, hstride, src[q], piece, hvoff);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int x = base + u * T;
      if (x < total) {
        const int q = list ? list[q0 + x / kPieces] : q0 + x / kPieces, piece = x % kPieces;
        store_piece<ROWL, ITEM>(dev, dstride, dst[q], piece, v[u]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host launchers: argument checks (file:line in every message), then one launch on the
// caller's current stream. Nothing here synchronizes or allocates, so both are capturable.

using tvm::ffi::TensorView;

inline void check_tensor(const TensorView& t, const char* name, int ndim, int code, int bits) {
  HS_CHECK(t.ndim() == ndim, name << " must have " << ndim << " dims, got " << t.ndim());
  HS_CHECK(t.dtype().code == code && t.dtype().bits == bits && t.dtype().lanes == 1,
           name << " has the wrong dtype (code " << int(t.dtype().code) << ", " << int(t.dtype().bits)
                << " bits); expected code " << code << ", " << bits << " bits");
  HS_CHECK(ndim < 2 || t.stride(ndim - 1) == 1 || t.size(ndim - 1) <= 1,
           name << " must be contiguous in its last dimension");
}

inline void check_cuda(const TensorView& t, const char* name, int dev) {
  HS_CHECK(t.device().device_type == kDLCUDA && t.device().device_id == dev,
           name << " must be on cuda:" << dev << " (got device type " << t.device().device_type
                << ", id " << t.device().device_id << ")");
}

inline void check_host(const TensorView& t, const char* name) {
  HS_CHECK(t.device().device_type == kDLCPU || t.device().device_type == kDLCUDAHost,
           name << " must be a pinned host tensor (got device type " << t.device().device_type << ")");
}

template <typename T>
inline T* ptr(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

// Per-batch-row index tensors (req_index, seq_lens): int32 or int64 [bs], contiguous; returns
// whether they are int64.
inline int check_index(const TensorView& t, const char* name, int64_t bs, int dev) {
  HS_CHECK(t.ndim() == 1 && t.size(0) == bs, name << " must have shape [" << bs << "]");
  HS_CHECK(t.dtype().code == kDLInt && (t.dtype().bits == 32 || t.dtype().bits == 64),
           name << " must be int32 or int64");
  HS_CHECK(t.ndim() == 1 && (bs <= 1 || t.stride(0) == 1), name << " must be contiguous");
  check_cuda(t, name, dev);
  return t.dtype().bits == 64;
}

// The launch shape both resolve launchers accept: any multiple of 32 threads up to 1024,
// 1..1024 CTAs per request (gridDim.x), one grid row per batch row (gridDim.y <= 65535).
inline void check_launch_shape(int64_t block, int64_t ctas, int64_t bs) {
  HS_CHECK(block >= 32 && block <= 1024 && block % 32 == 0,
           "block size " << block << " must be a multiple of 32 in [32, 1024]");
  HS_CHECK(ctas >= 1 && ctas <= 1024, "ctas per request " << ctas << " must be in [1, 1024]");
  HS_CHECK(bs <= kMaxGridRows, "batch " << bs << " exceeds the grid limit " << kMaxGridRows);
}

// The miss plan both resolve launchers record: src int64 [bs, >= cols], dst int32 like src
// (same strides), count int32 [bs], contiguous (`cols_name` spells "k" or "W*k").
inline void check_plan(const TensorView& src, const TensorView& dst, const TensorView& count,
                       int64_t bs, int64_t cols, const char* cols_name, int dev) {
  check_tensor(src, "plan.src", 2, kDLInt, 64);
  check_tensor(dst, "plan.dst", 2, kDLInt, 32);
  check_tensor(count, "plan.count", 1, kDLInt, 32);
  for (auto* t : {&src, &dst, &count}) check_cuda(*t, "plan tensor", dev);
  HS_CHECK(src.size(0) == bs && src.size(1) >= cols && dst.size(0) == bs &&
               dst.size(1) == src.size(1) && count.size(0) == bs &&
               dst.stride(0) == src.stride(0) && (bs <= 1 || count.stride(0) == 1),
           "plan must be src [bs, >=" << cols_name << "] int64, dst like src (same strides), "
           "count [bs]");
}

// The per-row arrival counters a multi-CTA launch needs (int32, at least bs entries).
inline void check_arrivals(const TensorView& arrivals, int64_t bs, int64_t ctas, int dev) {
  if (ctas <= 1) return;
  check_tensor(arrivals, "arrivals", 1, kDLInt, 32);
  check_cuda(arrivals, "arrivals", dev);
  HS_CHECK(arrivals.size(0) >= bs, "arrivals workspace has " << arrivals.size(0) << " < bs entries");
}

// The checks both resolve launchers make of the hot-buffer state and the host/device caches:
// dtypes, devices, and the [R, B + extra] slot shapes (`extra_name` spells "B+1" or "B+W" in
// the message). Returns R, the request slots.
inline int64_t check_hot_state(const TensorView& num_real, const TensorView& slot_tokens,
                               const TensorView& slot_rows, const TensorView& lru,
                               const TensorView& host_rows, const TensorView& host_cache,
                               const TensorView& device_cache, const TensorView& out_rows,
                               int out_ndim, int B, int extra, const char* extra_name, int dev) {
  check_tensor(num_real, "num_real_reqs", 1, kDLInt, 32);
  check_cuda(num_real, "num_real_reqs", dev);
  check_tensor(slot_tokens, "slot_tokens", 2, kDLInt, 32);
  check_tensor(slot_rows, "slot_rows", 2, kDLInt, 32);
  check_tensor(lru, "lru", 2, kDLInt, 16);
  check_tensor(host_rows, "host_rows", 2, kDLInt, 64);
  check_tensor(host_cache, "host_cache", 2, kDLUInt, 8);
  check_tensor(device_cache, "device_cache", 2, kDLUInt, 8);
  check_tensor(out_rows, "out_rows", out_ndim, kDLInt, 32);
  for (auto* t : {&slot_tokens, &slot_rows, &lru, &host_rows, &device_cache, &out_rows})
    check_cuda(*t, "a state/output tensor", dev);
  check_host(host_cache, "host_cache");
  const int64_t R = lru.size(0);
  HS_CHECK(lru.size(1) == B, "lru has " << lru.size(1) << " slots; this build is for B=" << B);
  HS_CHECK(slot_tokens.size(0) == R && slot_tokens.size(1) == B + extra,
           "slot_tokens must be [R, " << extra_name << "]");
  HS_CHECK(slot_rows.size(0) == R && slot_rows.size(1) == B + extra,
           "slot_rows must be [R, " << extra_name << "]");
  return R;
}

// Shared-memory limits of device `dev`: per block with the opt-in attribute, and per SM. Read
// once per device (a host query, so launchers may call it while a graph is being captured).
struct SmemLimits {
  int optin = 0, per_sm = 0;
};
// Shared memory the CUDA runtime keeps back for each resident CTA (sm_80 and later): two CTAs
// fit on one SM while each takes at most per_sm / 2 - kSmemReservedPerCta.
constexpr int kSmemReservedPerCta = 1024;
inline SmemLimits smem_limits(int dev) {
  static SmemLimits known[64];
  SmemLimits l = dev >= 0 && dev < 64 ? known[dev] : SmemLimits{};
  if (l.optin == 0) {
    HS_CUDA(cudaDeviceGetAttribute(&l.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    HS_CUDA(cudaDeviceGetAttribute(&l.per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
    if (dev >= 0 && dev < 64) known[dev] = l;
  }
  return l;
}

template <typename Kernel>
inline void set_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    HS_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(bytes)));
  }
}

// set_smem at most once per kernel, device and size: raises `kernel`'s limit on device `dev`
// to `bytes` unless an earlier call already allowed as much.
// NOTE: keyed by the kernel's address, not a plain function-local static flag: such a static in
// a template function is one object across every shared library that instantiates it (a GNU
// unique symbol), so a second build of the same kernel in the process (probes/probe_resolve.py's
// profiling build next to the op's) would skip its own attribute and fail to launch
// (test_a_second_build_of_the_same_kernels_launches). The table is shared the same way.
template <typename Kernel>
inline void ensure_smem(Kernel kernel, int dev, size_t bytes) {
  struct Allowed {
    const void* fn;
    int dev;
    size_t bytes;
  };
  static Allowed table[256];
  static int used = 0;
  static std::mutex mu;
  const void* fn = reinterpret_cast<const void*>(kernel);
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < used; ++i) {
    if (table[i].fn == fn && table[i].dev == dev) {
      if (table[i].bytes < bytes) {
        set_smem(kernel, bytes);
        table[i].bytes = bytes;
      }
      return;
    }
  }
  set_smem(kernel, bytes);
  if (used < 256) table[used++] = Allowed{fn, dev, bytes};
}

}  // namespace hisparse
