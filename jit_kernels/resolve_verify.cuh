// Verify-step resolve: one launch per layer resolves the union of a request's W = n+1 verify
// rows (speculative decoding) against its hot buffer and copies the union's misses once.
//
// Semantics: sglang_hisparse/kernels/reference.py:resolve_verify (the window W of the decode
// resolve's W = 1), bit for bit. Compile-time K (top-k per row), B (history slots), W (verify
// rows), ITEM (row bytes), PLAN (record the miss plan), COPY (false = no-IO timing oracle),
// POLICY (kPolicyLru, or kPolicySlru: the lru build is the code without it);
// runtime batch, block size (multiple of 32, <= 1024) and CTAs per request (chosen in Python:
// verify_ops.default_verify_ctas, from verify_ctas_per_sm below). Slots B..B+W-1 hold the
// verify window outside the LRU.
//
// NOTE: membership is an open-addressing hash table, not resolve.cuh's position bitmap and
// prefix counts (the NOTE there has the decode kernel's figures). The bitmap is not carried
// over because it has not been measured here: its shared memory grows with the pool's
// context (3 B per 16 positions, 24 KiB at 128K) on top of a layout that already takes
// 211 KB of the 227 KiB at W = 4, k = 2048, B = 10240 (kernel_limits.verify_smem_bytes), and
// a verify step runs once per W tokens, so its cost weighs less per token. The same holds for
// resolve.cuh's cp.async staging, fetch warps and batched loops. Port them with an A/B
// (bench_verify.py) when a verify step's resolve shows up in a profile.
#pragma once

#include "common.cuh"

namespace hisparse {

struct VerifyArgs {
  const int32_t* top_k; int64_t topk_stride;  // [bs, W, K], a request's W*K entries contiguous
  const void* req_index; bool req64;
  const void* seq_lens; bool len64; int64_t len_stride;  // [bs, W]; column 0 (= n0) is read
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
  int ctas;
  // slru's level boundaries, one int32 per request ([R, 1], resolve.cuh's word); slru builds
  int32_t* pstate; int64_t ps_stride;
};

// Shared memory. The hash (keys + values) is dead once out_rows is written, so the copy phase
// reuses it for the wide (src, dst) row lists: 8*WK <= 4*H bytes since H >= 2*WK.
// NOTE: keeping src int64 / dst int32 lists from the start (as the single-row kernel does)
// would need 12*WK more bytes: 96 KiB at W=4, K=2048, past the 227 KiB limit with B = 5K.
template <int K, int B, int W>
struct VerifyLayout {
  static constexpr int WK = W * K;
  static constexpr int H = pow2_ceil(2 * WK) < 64 ? 64 : pow2_ceil(2 * WK);  // load <= 1/2
  static constexpr int kLogH = log2i(H);
  static constexpr size_t hkey = 0, hval = hkey + 4 * H, mpos = hval + 4 * H;
  static constexpr size_t mvic = mpos + 4 * WK, order = mvic + 2 * WK, hit = order + 2 * B;
  static constexpr size_t scan = (hit + B + 15) / 16 * 16, bytes = scan + 4 * kScanScratchInts;
};

// Multiplicative hash (Knuth: 2^32 / golden ratio) of a position, to a table of 2^log_h
// entries: the top log_h bits of the product.
constexpr unsigned kHashMul = 2654435761u;
__device__ __forceinline__ unsigned hash_slot(int p, int log_h) {
  return (static_cast<unsigned>(p) * kHashMul) >> (32 - log_h);
}
// hval packs (first flat index << 16) | slot; kNoSlot: no slot holds the position yet.
constexpr int kNoSlot = 0xffff;

// Grid: (ctas, bs). Every CTA of a request repeats the smem-only bookkeeping over the union and
// copies its 1/ctas share of the misses; the CTA that arrives last, after all have read the old
// slot_tokens/lru, writes the new state, out_rows and the plan (same scheme as resolve.cuh).
template <int K, int B, int W, int ITEM, bool PLAN, bool COPY, int POLICY = kPolicyLru>
__global__ void resolve_verify_kernel(VerifyArgs a) {
  static_assert(POLICY == kPolicyLru || POLICY == kPolicySlru, "the verify kernel runs lru and slru");
  using L = VerifyLayout<K, B, W>;
  constexpr int WK = L::WK;
  static_assert(WK <= 32767 && B <= 32767, "entry indices and slot ids are packed in 16 bits");
  static_assert(B >= WK, "the union of W rows of K entries must fit in B history slots");
  static_assert(ITEM % 16 == 0, "rows are copied in 16-byte pieces");
  extern __shared__ __align__(16) uint8_t smem[];
  int32_t* hkey = reinterpret_cast<int32_t*>(smem + L::hkey);
  int32_t* hval = reinterpret_cast<int32_t*>(smem + L::hval);  // (first flat index << 16) | slot
  int32_t* mpos = reinterpret_cast<int32_t*>(smem + L::mpos);  // miss q: its position
  int16_t* mvic = reinterpret_cast<int16_t*>(smem + L::mvic);  // miss q: its victim slot
  int16_t* order = reinterpret_cast<int16_t*>(smem + L::order);  // evictables, then hits
  uint8_t* hit = smem + L::hit;
  int* scratch = reinterpret_cast<int*>(smem + L::scan);
  __shared__ int s_writer;

  const int b = blockIdx.y, c = blockIdx.x, tid = threadIdx.x, T = blockDim.x;
  const int32_t* tk = a.top_k + b * a.topk_stride;
  int32_t* out = a.out_rows + b * a.out_stride;
  if (b >= *a.num_real) {  // padding row: inert
    if (c == 0) {
      for (int i = tid; i < WK; i += T) out[i] = -1;
      if (PLAN && tid == 0) a.plan_count[b] = 0;
    }
    return;
  }
  const int64_t r = load_index(a.req_index, a.req64, b);
  const int64_t n0 = load_index(a.seq_lens, a.len64, b * a.len_stride);
  const int64_t N = n0 + W - 1;  // length of the last verify row
  const int32_t* rows = a.slot_rows + r * a.sr_stride;
  if (N <= B) {  // short request: token p in slot p (window too), nothing moves
    if (c == 0) {
      for (int i = tid; i < WK; i += T) {
        const int p = tk[i];
        out[i] = (p >= 0 && p < N) ? rows[p] : -1;
      }
      if (PLAN && tid == 0) a.plan_count[b] = 0;
    }
    return;
  }
  int32_t* stok = a.slot_tokens + r * a.st_stride;
  int16_t* lru = a.lru + r * a.lru_stride;
  const int base = static_cast<int>(n0 - 1);  // first window position; history is [0, base)
  // slru: levels 0 | 1 | 2 of the LRU array cut at b1, b2 (kernel_policy.py), read before this
  // CTA arrives; the writer rewrites them after the last.
  constexpr bool slru = POLICY == kPolicySlru;
  int b1 = B, b2 = B;
  if constexpr (slru) {
    const int32_t w = a.pstate[r * a.ps_stride];
    b1 = B - (w & 0xffff);
    b2 = B - ((w >> 16) & 0xffff);
  }

  // 1. Hash set of the union's history positions, with the first flat index of each.
  for (int h = tid; h < L::H; h += T) { hkey[h] = -1; hval[h] = 0x7fffffff; }
  for (int s = tid; s < B; s += T) hit[s] = 0;
  __syncthreads();
  for (int i = tid; i < WK; i += T) {
    const int p = tk[i];
    if (p < 0 || p >= base) continue;  // padding, window, or out of range (caller bug)
    unsigned h = hash_slot(p, L::kLogH);
    while (true) {
      const int old = atomicCAS(&hkey[h], -1, p);
      if (old == -1 || old == p) break;
      h = (h + 1) & (L::H - 1);
    }
    atomicMin(&hval[h], (i << 16) | kNoSlot);
  }
  __syncthreads();
  auto find = [&](int p) -> int {
    unsigned h = hash_slot(p, L::kLogH);
    while (true) {
      const int key = hkey[h];
      if (key == p) return static_cast<int>(h);
      if (key == -1) return -1;
      h = (h + 1) & (L::H - 1);
    }
  };
  // 2. Hits: history slots whose token is in the union (stale window content never hits).
  for (int s = tid; s < B; s += T) {
    const int tok = stok[s];
    if (tok < 0 || tok >= base) continue;
    const int h = find(tok);
    if (h >= 0) { hval[h] = (hval[h] & ~kNoSlot) | s; hit[s] = 1; }
  }
  __syncthreads();
  // 3. Old LRU -> evictables (old order) then hits (old order); each thread owns one chunk.
  const int n_evict = split_lru(lru, hit, order, B, scratch);
  // slru: the evictables of levels 0 and 1 (by old LRU position), packed, one block scan; its
  // barriers end every read of the old LRU before the arrival below.
  int ev0 = 0, ev1 = 0;
  if constexpr (slru) {
    const int per_b = (B + T - 1) / T, j0 = min(B, tid * per_b), j1 = min(B, j0 + per_b);
    int mine = 0;
    for (int j = j0; j < j1; ++j) {
      if (hit[lru[j]]) continue;
      mine += j < b1 ? 1 : j < b2 ? (1 << 16) : 0;
    }
    int both;
    block_exclusive_scan(mine, scratch, both);  // each total <= B < 2**15: no carry
    ev0 = both & 0xffff;
    ev1 = both >> 16;
  }
  // All reads of the mutable state are done: arrive; the last CTA of the request writes.
  if (tid == 0) s_writer = arrive_last(a.arrivals, b, a.ctas);
  // 4. Misses in flat order (row 0's top-k, then row 1's, ...) take order[0..m).
  const int per_k = (WK + T - 1) / T, i0 = min(WK, tid * per_k), i1 = min(WK, i0 + per_k);
  int n_miss = 0;
  for (int i = i0; i < i1; ++i) {
    const int p = tk[i];
    if (p < 0 || p >= base) continue;
    const int v = hval[find(p)];
    n_miss += (v & kNoSlot) == kNoSlot && (v >> 16) == i;
  }
  int m;
  int q = block_exclusive_scan(n_miss, scratch, m);  // its barriers also publish s_writer
  const bool writer = s_writer;
  for (int i = i0; i < i1 && n_miss; ++i) {
    const int p = tk[i];
    if (p < 0 || p >= base) continue;
    const int h = find(p);
    const int v = hval[h];
    if ((v & kNoSlot) != kNoSlot || (v >> 16) != i) continue;
    const int victim = order[q];  // q < n_evict: |union| <= W*K <= B
    hval[h] = (v & ~kNoSlot) | victim;
    mpos[q] = p;
    mvic[q] = static_cast<int16_t>(victim);
    if (writer) stok[victim] = p;
    ++q;
  }
  __syncthreads();
  if (writer) {
    for (int i = tid; i < WK; i += T) {
      const int p = tk[i];
      int row = -1;
      if (p >= base && p < N) row = rows[B + (p - base)];
      else if (p >= 0 && p < base) row = rows[hval[find(p)] & kNoSlot];
      out[i] = row;
    }
    if constexpr (slru) {
      slru_write(order, lru, B, n_evict, m, ev0, ev1, b1, tid, T, a.pstate + r * a.ps_stride);
    } else {
      // New LRU = evictables rotated left by m (rest, then the misses), then the hits.
      for (int j = tid; j < B; j += T) {
        const int at = j >= n_evict ? j : (j + m < n_evict ? j + m : j + m - n_evict);
        lru[j] = order[at];
      }
    }
    if (PLAN) {
      for (int x = tid; x < m; x += T) {
        a.plan_src[b * a.plan_stride + x] = a.host_rows[r * a.hr_stride + mpos[x]];
        a.plan_dst[b * a.plan_stride + x] = rows[mvic[x]];
      }
      if (tid == 0) a.plan_count[b] = m;
    }
  }
  if (COPY) {
    __syncthreads();  // the hash is dead: reuse it for this CTA's (src, dst) row lists
    int64_t* msrc = reinterpret_cast<int64_t*>(smem + L::hkey);
    int32_t* mdst = reinterpret_cast<int32_t*>(smem + L::hval);
    const int q0 = static_cast<int>(static_cast<int64_t>(m) * c / a.ctas);
    const int q1 = static_cast<int>(static_cast<int64_t>(m) * (c + 1) / a.ctas);
    for (int x = q0 + tid; x < q1; x += T) {
      msrc[x] = a.host_rows[r * a.hr_stride + mpos[x]];
      mdst[x] = rows[mvic[x]];
    }
    __syncthreads();
    copy_rows<ITEM>(msrc, mdst, q0, q1, a.host_cache, a.hc_stride, a.device_cache, a.dc_stride);
  }
}

template <int K, int B, int W, int ITEM, bool PLAN, bool COPY, int POLICY>
void launch_verify(const VerifyArgs& a, int dev, int64_t bs, int64_t block, cudaStream_t stream) {
  auto kernel = resolve_verify_kernel<K, B, W, ITEM, PLAN, COPY, POLICY>;
  constexpr size_t bytes = VerifyLayout<K, B, W>::bytes;
  const int optin = smem_limits(dev).optin;  // host queries only: capture-safe
  HS_CHECK(bytes <= static_cast<size_t>(optin),
           "resolve_verify needs " << bytes << " B of shared memory per CTA for k=" << K
           << " B=" << B << " W=" << W << " (about 8*pow2(2*W*k) + 6*W*k + 3*B), but this "
           << "GPU allows " << optin << " B; lower device_buffer_size or the draft count");
  ensure_smem(kernel, dev, bytes);
  kernel<<<dim3(static_cast<unsigned>(a.ctas), static_cast<unsigned>(bs)),
           static_cast<unsigned>(block), bytes, stream>>>(a);
  HS_CUDA(cudaGetLastError());
}

// How many CTAs of `block` threads of this kernel one SM of the current device holds (its
// shared memory, registers and threads), for verify_ops.default_verify_ctas. Host queries only,
// so a graph capture may call it.
template <int K, int B, int W, int ITEM, int POLICY = kPolicyLru>
int64_t verify_ctas_per_sm(int64_t block) {
  constexpr size_t bytes = VerifyLayout<K, B, W>::bytes;
  auto kernel = resolve_verify_kernel<K, B, W, ITEM, true, true, POLICY>;
  set_smem(kernel, bytes);
  int per_sm = 0;
  HS_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, static_cast<int>(block),
                                                        bytes));
  HS_CHECK(per_sm >= 1, "resolve_verify needs " << bytes << " B of shared memory per CTA (k="
                        << K << " B=" << B << " W=" << W << ") at block " << block
                        << ": more than this GPU offers; lower device_buffer_size or top_k");
  return per_sm;
}

template <int K, int B, int W, int ITEM, int POLICY = kPolicyLru>
void resolve_verify_launch(TensorView top_k, TensorView req_index, TensorView seq_lens,
                           TensorView num_real, TensorView slot_tokens, TensorView slot_rows,
                           TensorView lru, TensorView host_rows, TensorView host_cache,
                           TensorView device_cache, TensorView out_rows, TensorView plan_src,
                           TensorView plan_dst, TensorView plan_count, TensorView arrivals,
                           int64_t ctas, int64_t block, int64_t write_plan, int64_t copy,
                           TensorView policy_state) {
  check_tensor(top_k, "top_k", 3, kDLInt, 32);
  const int dev = top_k.device().device_id;
  check_cuda(top_k, "top_k", dev);
  const int64_t bs = top_k.size(0);
  HS_CHECK(top_k.size(1) == W && top_k.size(2) == K,
           "top_k is [" << bs << ", " << top_k.size(1) << ", " << top_k.size(2)
                        << "]; this build is for W=" << W << ", k=" << K);
  HS_CHECK(top_k.stride(1) == K, "top_k's W rows of one request must be contiguous");
  const int req64 = check_index(req_index, "req_index", bs, dev);
  check_cuda(seq_lens, "seq_lens", dev);
  HS_CHECK(seq_lens.ndim() == 2 && seq_lens.size(0) == bs && seq_lens.size(1) == W,
           "seq_lens must be [bs, W] = [" << bs << ", " << W << "] (dsa_seqlens_expanded.view)");
  HS_CHECK(seq_lens.dtype().code == kDLInt && (seq_lens.dtype().bits == 32 || seq_lens.dtype().bits == 64),
           "seq_lens must be int32 or int64");
  const int64_t R = check_hot_state(num_real, slot_tokens, slot_rows, lru, host_rows, host_cache,
                                    device_cache, out_rows, 3, B, W, "B+W", dev);
  HS_CHECK(host_rows.size(0) == R, "host_rows must have R=" << R << " rows");
  HS_CHECK(host_cache.size(1) == ITEM && device_cache.size(1) == ITEM,
           "host_cache/device_cache rows must be " << ITEM << " bytes for this build");
  HS_CHECK(out_rows.size(0) == bs && out_rows.size(1) == W && out_rows.size(2) == K &&
               out_rows.stride(1) == K,
           "out_rows must be [bs, W, k] with a request's rows contiguous");
  check_launch_shape(block, ctas, bs);
  if (write_plan) check_plan(plan_src, plan_dst, plan_count, bs, W * K, "W*k", dev);
  if (bs == 0) return;
  check_arrivals(arrivals, bs, ctas, dev);
  if constexpr (POLICY == kPolicySlru) {
    check_tensor(policy_state, "policy_state", 2, kDLInt, 32);
    check_cuda(policy_state, "policy_state", dev);
    HS_CHECK(policy_state.size(0) == R && policy_state.size(1) == 1,
             "policy_state must be int32 [R=" << R << ", 1] (slru's word per request)");
  }

  VerifyArgs a;
  a.top_k = ptr<const int32_t>(top_k); a.topk_stride = top_k.stride(0);
  a.req_index = ptr<const void>(req_index); a.req64 = req64;
  a.seq_lens = ptr<const void>(seq_lens); a.len64 = seq_lens.dtype().bits == 64;
  a.len_stride = seq_lens.stride(0);
  a.num_real = ptr<const int32_t>(num_real);
  a.slot_tokens = ptr<int32_t>(slot_tokens); a.st_stride = slot_tokens.stride(0);
  a.slot_rows = ptr<const int32_t>(slot_rows); a.sr_stride = slot_rows.stride(0);
  a.lru = ptr<int16_t>(lru); a.lru_stride = lru.stride(0);
  a.host_rows = ptr<const int64_t>(host_rows); a.hr_stride = host_rows.stride(0);
  // Pinned memory is mapped at the same address on the device (UVA, 64-bit Linux).
  a.host_cache = ptr<const uint8_t>(host_cache); a.hc_stride = host_cache.stride(0);
  a.device_cache = ptr<uint8_t>(device_cache); a.dc_stride = device_cache.stride(0);
  a.out_rows = ptr<int32_t>(out_rows); a.out_stride = out_rows.stride(0);
  a.plan_src = write_plan ? ptr<int64_t>(plan_src) : nullptr;
  a.plan_dst = write_plan ? ptr<int32_t>(plan_dst) : nullptr;
  a.plan_count = write_plan ? ptr<int32_t>(plan_count) : nullptr;
  a.plan_stride = write_plan ? plan_src.stride(0) : 0;
  a.arrivals = ctas > 1 ? ptr<int32_t>(arrivals) : nullptr;
  a.ctas = static_cast<int>(ctas);
  a.pstate = POLICY == kPolicySlru ? ptr<int32_t>(policy_state) : nullptr;
  a.ps_stride = POLICY == kPolicySlru ? policy_state.stride(0) : 0;

  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev));
  if (write_plan && copy) launch_verify<K, B, W, ITEM, true, true, POLICY>(a, dev, bs, block, stream);
  else if (write_plan) launch_verify<K, B, W, ITEM, true, false, POLICY>(a, dev, bs, block, stream);
  else if (copy) launch_verify<K, B, W, ITEM, false, true, POLICY>(a, dev, bs, block, stream);
  else launch_verify<K, B, W, ITEM, false, false, POLICY>(a, dev, bs, block, stream);
}

}  // namespace hisparse
