// Fused resolve (swap-in) kernel: bookkeeping + host->device copy of the misses, one launch.
//
// Semantics: sglang_hisparse/kernels/reference.py, bit for bit; design: docs/kernels.md.
// Compile-time K (top-k), B (hot slots), ITEM (row bytes); runtime batch, block size (any
// multiple of 32 up to 1024), CTAs per request, plan/copy flags.
#pragma once

#include "common.cuh"

namespace hisparse {

struct ResolveArgs {
  const int32_t* top_k; int64_t topk_stride;
  const void* req_index; bool req64;
  const void* seq_lens; bool len64;
  const int32_t* num_real;
  int32_t* slot_tokens; int64_t st_stride;
  const int32_t* slot_rows; int64_t sr_stride;
  int16_t* lru; int64_t lru_stride;
  const int64_t* host_rows; int64_t hr_stride;
  const uint8_t* host_cache; int64_t hc_stride;
  uint8_t* device_cache; int64_t dc_stride;
  int32_t* out_rows; int64_t out_stride;
  int64_t* plan_src; int32_t* plan_dst; int32_t* plan_count; int64_t plan_stride;
  int32_t* arrivals;  // [bs] zeros; the last CTA of a request to arrive resets its entry
  int ctas;           // CTAs per request (gridDim.x)
  bool write_plan, copy;
};

template <int K, int B>
struct Layout {
  static constexpr int H = pow2_ceil(2 * K) < 64 ? 64 : pow2_ceil(2 * K);  // load factor <= 1/2
  static constexpr int kLogH = log2i(H);
  static constexpr size_t hkey = 0, hval = hkey + 4 * H, src = hval + 4 * H, dst = src + 8 * K;
  static constexpr size_t pos = dst + 4 * K, tk = pos + 4 * K, order = tk + 4 * K;
  static constexpr size_t lru = order + 2 * B, hit = lru + 2 * B, filt = (hit + B + 15) / 16 * 16;
  static constexpr size_t scan = filt + H, bytes = scan + 4 * 40;  // filter: 8*H bits
};

// Independent global loads each thread keeps in flight in the bookkeeping loops.
// NOTE: a plain strided loop issues one load per iteration and waits on it before the next
// (its smem side effects keep the compiler from hoisting); at ~0.5-1 us per L2/DRAM round trip
// that made bookkeeping cost ~20 us. Loading kBatch values first, then using them, pays one
// round trip per batch instead.
constexpr int kBatch = 8;

// Phase clocks for the bookkeeping study (benchmarks/probe_resolve.py builds with
// HS_PHASE_PROFILE): thread 0 of each of the first kPhaseCtas CTAs records clock64() at each
// phase boundary. Compiled out otherwise.
#ifdef HS_PHASE_PROFILE
constexpr int kPhaseCtas = 4096, kPhases = 12;
__device__ long long hs_phase_clock[kPhaseCtas][kPhases];
#define HS_PHASE(i)                                                                     \
  do {                                                                                  \
    const int cta_ = blockIdx.y * gridDim.x + blockIdx.x;                               \
    if (threadIdx.x == 0 && cta_ < kPhaseCtas) hs_phase_clock[cta_][i] = clock64();     \
  } while (0)
#else
#define HS_PHASE(i) do {} while (0)
#endif

__device__ __forceinline__ int64_t load_index(const void* p, bool is64, int b) {
  return is64 ? static_cast<const int64_t*>(p)[b] : static_cast<const int32_t*>(p)[b];
}

__device__ __forceinline__ unsigned hash_slot(int p, int log_h) {
  return (static_cast<unsigned>(p) * 2654435761u) >> (32 - log_h);
}

// Second, independent hash for the membership filter of the selected positions.
__device__ __forceinline__ unsigned filter_bit(int p, int log_bits) {
  return (static_cast<unsigned>(p) * 0x85ebca77u) >> (32 - log_bits);
}

// Codes stored per top-k entry once it is hashed (tks[i] is overwritten with them).
constexpr int kPadEntry = -1, kNewestEntry = -2;

// Short request (n <= B): token p lives in slot p; out = slot_rows[p], nothing moves.
template <int K>
__device__ __forceinline__ void resolve_short(const int32_t* tk, const int32_t* rows, int64_t n,
                                              int32_t* out) {
  for (int i0 = threadIdx.x; i0 < K; i0 += blockDim.x * kBatch) {
    int v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u * blockDim.x;
      v[u] = i < K ? tk[i] : -1;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) v[u] = (v[u] >= 0 && v[u] < n) ? rows[v[u]] : -1;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u * blockDim.x;
      if (i < K) out[i] = v[u];
    }
  }
}

// One grid row (blockIdx.y) per batch row, gridDim.x CTAs per request. Every CTA of a request
// does the (cheap, smem-only) bookkeeping; each copies its share of the misses; the CTA that
// arrives last after all have read the old state writes the new state, out_rows and the plan.
// NOTE: the rejected alternative was one bookkeeping CTA handing misses to copy CTAs through
// global flags: that needs spin-waits (co-residency assumptions) or a second launch.
template <int K, int B, int ITEM>
__global__ void __launch_bounds__(1024) resolve_kernel(ResolveArgs a) {
  using L = Layout<K, B>;
  static_assert(K <= 32767 && B <= 32767, "slot ids and top-k indices are packed in 16 bits");
  static_assert(ITEM % 16 == 0, "rows are copied in 16-byte pieces");
  extern __shared__ __align__(16) uint8_t smem[];
  int32_t* hkey = reinterpret_cast<int32_t*>(smem + L::hkey);
  int32_t* hval = reinterpret_cast<int32_t*>(smem + L::hval);  // (first index << 16) | slot
  int64_t* msrc = reinterpret_cast<int64_t*>(smem + L::src);
  int32_t* mdst = reinterpret_cast<int32_t*>(smem + L::dst);
  int32_t* mpos = reinterpret_cast<int32_t*>(smem + L::pos);  // table index of each miss
  int32_t* tks = reinterpret_cast<int32_t*>(smem + L::tk);  // positions, then table codes
  int16_t* order = reinterpret_cast<int16_t*>(smem + L::order);  // evictables, then hits
  int16_t* lrus = reinterpret_cast<int16_t*>(smem + L::lru);
  uint8_t* hit = smem + L::hit;
  uint32_t* filt = reinterpret_cast<uint32_t*>(smem + L::filt);
  int* scratch = reinterpret_cast<int*>(smem + L::scan);
  __shared__ int s_writer;

  const int b = blockIdx.y, c = blockIdx.x, tid = threadIdx.x, T = blockDim.x;
  HS_PHASE(0);
  const int32_t* tk = a.top_k + b * a.topk_stride;
  int32_t* out = a.out_rows + b * a.out_stride;
  // Issued together (one round trip): every batch row's index entries are readable.
  const int n_real = *a.num_real;
  const int64_t r = load_index(a.req_index, a.req64, b);
  const int64_t n = load_index(a.seq_lens, a.len64, b);
  if (b >= n_real) {  // padding row: inert
    if (c == 0) {
      for (int i = tid; i < K; i += T) out[i] = -1;
      if (a.write_plan && tid == 0) a.plan_count[b] = 0;
    }
    return;
  }
  const int32_t* rows = a.slot_rows + r * a.sr_stride;
  if (n <= B) {
    if (c == 0) {
      resolve_short<K>(tk, rows, n, out);
      if (a.write_plan && tid == 0) a.plan_count[b] = 0;
    }
    return;
  }
  int32_t* stok = a.slot_tokens + r * a.st_stride;
  int16_t* lru = a.lru + r * a.lru_stride;
  const int newest = static_cast<int>(n - 1);
  HS_PHASE(1);

  // 0. Stage top-k and the LRU in shared memory (batched, coalesced); clear the tables.
  for (int i0 = tid; i0 < K; i0 += T * kBatch) {
    int v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) v[u] = i0 + u * T < K ? tk[i0 + u * T] : 0;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) if (i0 + u * T < K) tks[i0 + u * T] = v[u];
  }
  for (int j0 = tid; j0 < B; j0 += T * kBatch) {
    int16_t v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) v[u] = j0 + u * T < B ? lru[j0 + u * T] : 0;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) if (j0 + u * T < B) lrus[j0 + u * T] = v[u];
  }
  for (int h = tid; h < L::H; h += T) { hkey[h] = -1; hval[h] = 0x7fffffff; }
  for (int s = tid; s < B; s += T) hit[s] = 0;
  for (int w = tid; w < L::H / 4; w += T) filt[w] = 0;
  __syncthreads();
  HS_PHASE(2);
  // 1. Hash set of the selected positions (newest excluded), with the first top-k index of each;
  //    each entry's table index replaces its position in tks, so later passes never probe.
  for (int i = tid; i < K; i += T) {
    const int p = tks[i];
    int code = p == newest ? kNewestEntry : kPadEntry;  // padding or out of range (caller bug)
    if (p >= 0 && p < newest) {
      unsigned h = hash_slot(p, L::kLogH);
      while (true) {
        const int old = atomicCAS(&hkey[h], -1, p);
        if (old == -1 || old == p) break;
        h = (h + 1) & (L::H - 1);
      }
      atomicMin(&hval[h], (i << 16) | 0xffff);
      const unsigned f = filter_bit(p, L::kLogH + 3);
      atomicOr(&filt[f >> 5], 1u << (f & 31));
      code = static_cast<int>(h);
    }
    tks[i] = code;
  }
  __syncthreads();
  HS_PHASE(3);
  auto find = [&](int p) -> int {
    unsigned h = hash_slot(p, L::kLogH);
    while (true) {
      const int key = hkey[h];
      if (key == p) return static_cast<int>(h);
      if (key == -1) return -1;
      h = (h + 1) & (L::H - 1);
    }
  };
  // 2. Hits: resident slots whose token is selected (slot tokens loaded kBatch at a time).
  //    NOTE: a warp's probe loop runs as long as its longest lane's, and most slots are not
  //    selected (unsuccessful probes are the long ones), so a bit filter rejects those first.
  for (int s0 = tid; s0 < B; s0 += T * kBatch) {
    int tok[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) tok[u] = s0 + u * T < B ? stok[s0 + u * T] : -1;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (tok[u] < 0 || tok[u] >= newest) continue;
      const unsigned f = filter_bit(tok[u], L::kLogH + 3);
      if (!((filt[f >> 5] >> (f & 31)) & 1u)) continue;
      const int h = find(tok[u]);
      if (h >= 0) { hval[h] = (hval[h] & ~0xffff) | (s0 + u * T); hit[s0 + u * T] = 1; }
    }
  }
  __syncthreads();
  HS_PHASE(4);
  // 3. Split the old LRU into evictables (old order) and hits (old order); one scan, each thread
  //    owning a contiguous chunk.
  const int n_evict = split_lru(lrus, hit, order, B, scratch);
  HS_PHASE(5);
  // All reads of the mutable state (slot_tokens, lru) are done: arrive; the last CTA writes.
  if (tid == 0) s_writer = arrive_last(a.arrivals, b, a.ctas);
  // 4. Misses in top-k order (first occurrences of unresolved positions) take order[0..m).
  const int per_k = (K + T - 1) / T, i0 = min(K, tid * per_k), i1 = min(K, i0 + per_k);
  int n_miss = 0;
  for (int i = i0; i < i1; ++i) {
    const int h = tks[i];
    if (h < 0) continue;
    const int v = hval[h];
    n_miss += (v & 0xffff) == 0xffff && (v >> 16) == i;
  }
  int m;
  int q = block_exclusive_scan(n_miss, scratch, m);  // barriers also publish s_writer
  const bool writer = s_writer;
  for (int i = i0; i < i1 && n_miss; ++i) {
    const int h = tks[i];
    if (h < 0) continue;
    const int v = hval[h];
    if ((v & 0xffff) == 0xffff && (v >> 16) == i) mpos[q++] = h;  // q < n_evict as B >= K
  }
  __syncthreads();
  HS_PHASE(6);
  // 5. Per miss: claim its victim in the table (only read before the barrier above), fetch its
  //    host and device rows (kBatch loads in flight), record the new slot token.
  for (int x0 = tid; x0 < m; x0 += T * kBatch) {
    int64_t src[kBatch];
    int32_t dst[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int x = x0 + u * T;
      if (x < m) {
        src[u] = a.host_rows[r * a.hr_stride + hkey[mpos[x]]];
        dst[u] = rows[order[x]];
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int x = x0 + u * T;
      if (x >= m) continue;
      const int h = mpos[x], p = hkey[h], victim = order[x];
      hval[h] = (hval[h] & ~0xffff) | victim;
      msrc[x] = src[u];
      mdst[x] = dst[u];
      if (writer) stok[victim] = p;
    }
  }
  __syncthreads();
  HS_PHASE(7);
  if (writer) {
    for (int i0 = tid; i0 < K; i0 += T * kBatch) {
      int row[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = i0 + u * T;
        const int code = i < K ? tks[i] : kPadEntry;
        row[u] = -1;
        if (code == kNewestEntry) row[u] = rows[B];
        else if (code >= 0) row[u] = rows[hval[code] & 0xffff];
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) if (i0 + u * T < K) out[i0 + u * T] = row[u];
    }
    // New LRU = order rotated left by m over the evictables, then the hits.
    for (int j = tid; j < B; j += T) {
      const int at = j >= n_evict ? j : (j + m < n_evict ? j + m : j + m - n_evict);
      lru[j] = order[at];
    }
    if (a.write_plan) {
      for (int x = tid; x < m; x += T) {
        a.plan_src[b * a.plan_stride + x] = msrc[x];
        a.plan_dst[b * a.plan_stride + x] = mdst[x];
      }
      if (tid == 0) a.plan_count[b] = m;
    }
  }
  HS_PHASE(8);
  if (a.copy) {
    const int q0 = static_cast<int>(static_cast<int64_t>(m) * c / a.ctas);
    const int q1 = static_cast<int>(static_cast<int64_t>(m) * (c + 1) / a.ctas);
    copy_rows<ITEM>(msrc, mdst, q0, q1, a.host_cache, a.hc_stride, a.device_cache, a.dc_stride);
  }
  HS_PHASE(9);
}

using tvm::ffi::TensorView;

template <int K, int B, int ITEM>
void resolve_launch(TensorView top_k, TensorView req_index, TensorView seq_lens,
                    TensorView num_real, TensorView slot_tokens, TensorView slot_rows,
                    TensorView lru, TensorView host_rows, TensorView host_cache,
                    TensorView device_cache, TensorView out_rows, TensorView plan_src,
                    TensorView plan_dst, TensorView plan_count, TensorView arrivals,
                    int64_t ctas, int64_t block, int64_t write_plan, int64_t copy) {
  check_tensor(top_k, "top_k", 2, kDLInt, 32);
  const int dev = top_k.device().device_id;
  check_cuda(top_k, "top_k", dev);
  const int64_t bs = top_k.size(0);
  HS_CHECK(top_k.size(1) == K, "top_k has " << top_k.size(1) << " columns; this build is for k=" << K);
  const int req64 = check_index(req_index, "req_index", bs, dev);
  const int len64 = check_index(seq_lens, "seq_lens", bs, dev);
  const int64_t R = check_hot_state(num_real, slot_tokens, slot_rows, lru, host_rows, host_cache,
                                    device_cache, out_rows, 2, B, 1, "B+1", dev);
  HS_CHECK(host_rows.size(0) == R, "host_rows must have R=" << R << " rows");
  HS_CHECK(host_cache.size(1) == ITEM && device_cache.size(1) == ITEM,
           "host_cache/device_cache rows must be " << ITEM << " bytes for this build");
  HS_CHECK(out_rows.size(0) == bs && out_rows.size(1) == K, "out_rows must be [bs, k]");
  HS_CHECK(block >= 32 && block <= 1024 && block % 32 == 0,
           "block size " << block << " must be a multiple of 32 in [32, 1024]");
  HS_CHECK(ctas >= 1 && ctas <= 1024, "ctas per request " << ctas << " must be in [1, 1024]");
  HS_CHECK(bs <= 65535, "batch " << bs << " exceeds the grid limit 65535");
  if (write_plan) {
    check_tensor(plan_src, "plan.src", 2, kDLInt, 64);
    check_tensor(plan_dst, "plan.dst", 2, kDLInt, 32);
    check_tensor(plan_count, "plan.count", 1, kDLInt, 32);
    for (auto* t : {&plan_src, &plan_dst, &plan_count}) check_cuda(*t, "plan tensor", dev);
    HS_CHECK(plan_src.size(0) == bs && plan_src.size(1) >= K && plan_dst.size(0) == bs &&
                 plan_dst.size(1) == plan_src.size(1) && plan_count.size(0) == bs &&
                 plan_dst.stride(0) == plan_src.stride(0) && (bs <= 1 || plan_count.stride(0) == 1),
             "plan must be src [bs, >=k] int64, dst like src (same strides), count [bs]");
  }
  if (ctas > 1) {
    check_tensor(arrivals, "arrivals", 1, kDLInt, 32);
    check_cuda(arrivals, "arrivals", dev);
    HS_CHECK(arrivals.size(0) >= bs, "arrivals workspace has " << arrivals.size(0) << " < bs entries");
  }
  if (bs == 0) return;

  ResolveArgs a;
  a.top_k = ptr<const int32_t>(top_k); a.topk_stride = top_k.stride(0);
  a.req_index = ptr<const void>(req_index); a.req64 = req64;
  a.seq_lens = ptr<const void>(seq_lens); a.len64 = len64;
  a.num_real = ptr<const int32_t>(num_real);
  a.slot_tokens = ptr<int32_t>(slot_tokens); a.st_stride = slot_tokens.stride(0);
  a.slot_rows = ptr<const int32_t>(slot_rows); a.sr_stride = slot_rows.stride(0);
  a.lru = ptr<int16_t>(lru); a.lru_stride = lru.stride(0);
  a.host_rows = ptr<const int64_t>(host_rows); a.hr_stride = host_rows.stride(0);
  // Pinned memory is mapped at the same address on the device (UVA, 64-bit Linux).
  a.host_cache = ptr<const uint8_t>(host_cache); a.hc_stride = host_cache.stride(0);
  a.device_cache = ptr<uint8_t>(device_cache); a.dc_stride = device_cache.stride(0);
  a.out_rows = ptr<int32_t>(out_rows); a.out_stride = out_rows.stride(0);
  a.write_plan = write_plan != 0;
  a.plan_src = write_plan ? ptr<int64_t>(plan_src) : nullptr;
  a.plan_dst = write_plan ? ptr<int32_t>(plan_dst) : nullptr;
  a.plan_count = write_plan ? ptr<int32_t>(plan_count) : nullptr;
  a.plan_stride = write_plan ? plan_src.stride(0) : 0;
  a.arrivals = ctas > 1 ? ptr<int32_t>(arrivals) : nullptr;
  a.ctas = static_cast<int>(ctas);
  a.copy = copy != 0;

  using L = Layout<K, B>;
  auto kernel = resolve_kernel<K, B, ITEM>;
  static bool smem_set = false;  // once per instantiation, before any capture normally
  if (!smem_set) { set_smem(kernel, L::bytes); smem_set = true; }
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev));
  kernel<<<dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(bs)),
           static_cast<unsigned>(block), L::bytes, stream>>>(a);
  HS_CUDA(cudaGetLastError());
}

}  // namespace hisparse
