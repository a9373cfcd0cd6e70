// Fused resolve (swap-in) kernel: bookkeeping + host->device copy of the misses, one launch.
//
// Semantics: sglang_hisparse/kernels/reference.py, bit for bit; design: docs/kernels.md.
// Compile-time K (top-k), B (hot slots), ITEM (host row bytes), POLICY, ROWL (device row layout,
// common.cuh store_piece: 0 token rows, 1 DeepSeek-V4's paged C4 entries, 2 those pages on the host side too,
// 3 token rows with the host's split in halves), BLK (selection layout: 0 =
// token positions, > 0 = block ids of BLK positions, expanded in the kernel); runtime batch, block size (any
// multiple of 32 up to 1024; 512 and 1024 also have builds with it fixed at compile time),
// CTAs per request, plan/copy flags; shared memory grows with host_rows' columns (the position
// bitmap, 3 B per 16 positions). COPY launches with a resident hint (the EARLY builds) put up to
// stage_cap probable misses per CTA in flight before the bookkeeping ends ("early fetch"):
// fetch warps hold the rows in registers and store them once the bookkeeping names their
// destinations.
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
  const uint8_t* host_cache; int64_t hc_stride, hc_voff;
  uint8_t* device_cache; int64_t dc_stride;
  int32_t* out_rows; int64_t out_stride;
  int64_t* plan_src; int32_t* plan_dst; int32_t* plan_count; int64_t plan_stride;
  int32_t* arrivals;  // [bs] zeros; the last CTA of a request to arrive resets its entry
  // Resident hint [R, words] (null: none): bit p of request r set iff some history slot holds
  // position p. Only decides which rows are fetched early; a wrong bit costs time, not output.
  uint32_t* resident; int64_t res_stride;
  // Fully resident requests (null flag: none): flag [R] int32, 1 = every position has a device
  // row, pages [R, cols] int32 its page table, ring [1] int32 the record block this step.
  const int32_t* rr_flag; const int32_t* rr_pages; int64_t rr_stride; const int32_t* rr_ring;
  int rr_page;
  int ctas;           // CTAs per request (gridDim.x)
  int words;          // position bitmap words: ceil(host_rows columns / 32)
  int stage_cap;      // rows the fetch warps of each CTA may hold (EARLY builds; else 0)
  bool write_plan, copy;
  // Replacement policy state (POLICY != 0 builds; null for lru), sglang_hisparse/kernel_policy.py:
  // fra one int32 word per history slot, [R, B]; slru one word per request, [R, 1].
  int32_t* pstate; int64_t ps_stride;
};

// Replacement policies (template parameter POLICY; sglang_hisparse/kernel_policy.py is the spec,
// whose constants these mirror): 0 = lru, the oldest evictables are the victims; 1 = fra, the
// evictables with the smallest (bucket, LRU position), bucket a 256-level score of the slot's
// word (hits: low 8 bits, saturating; last: the seq_len of its latest selection, 0 = none) and
// its token's distance from the newest; 2 = slru, the oldest evictables as for lru, the LRU array
// cut into three levels by two boundaries (one word per request: (B - b1) | (B - b2) << 16), a
// miss entering level 0 and a hit rising one level (the writer's permutation below); levels 1
// and 2 capped at kSlruCap1 and kSlruCap2 sixteenths of B.
// (the policy ids and slru's caps are in common.cuh: the verify kernel runs slru too)
constexpr int kFraBuckets = 256, kFraHitsMax = 255;
constexpr int kFraWHits = 13, kFraWGap = 16, kFraWAge = 5, kFraShift = 4, kFraOffset = 184;

// Piecewise linear log2 in 1/8 units of x >= 1: 8 * floor(log2 x) + the 3 bits after the
// leading one (integers only, so the reference and the simulator match it exactly).
__device__ __forceinline__ int fra_lg8(uint32_t x) {
  const int e = 31 - __clz(x);
  return 8 * e + static_cast<int>(((static_cast<uint64_t>(x) << 3) >> e) & 7u);
}

// fra's bucket of a slot holding position `pos` (-1: empty, bucket 0) at length n (< 2**23).
__device__ __forceinline__ int fra_bucket(int32_t word, int32_t pos, int64_t n) {
  if (pos < 0) return 0;
  const uint32_t hits = static_cast<uint32_t>(word) & 0xffu;
  const int64_t last = word >> 8, gap = n - last > 0 ? n - last : 0;  // (a later last: gap 0)
  const int64_t age = n - pos > 1 ? n - pos : 1;
  const int sc = kFraWHits * fra_lg8(1u + hits) - kFraWGap * fra_lg8(static_cast<uint32_t>(1 + gap)) -
                 kFraWAge * fra_lg8(static_cast<uint32_t>(age));
  const int b = (sc >> kFraShift) + kFraOffset;
  return b < 0 ? 0 : (b >= kFraBuckets ? kFraBuckets - 1 : b);
}

// Shared memory of one CTA: a compile-time part (Layout<K, B>, 16-byte aligned pieces), then a
// run-time part sized by the longest request the launch may hold (host_rows' columns, P): the
// position bitmap (one bit per position) and its per-word prefix counts. Mirrored by
// sglang_hisparse/kernel_limits.py:resolve_smem_bytes; keep both in step.
// `reuse` first holds the staged slot tokens (until the hit probes end), then the miss lists
// and the new LRU order, which are only written after that. `bits`: one word per 32 LRU
// positions (evictable flags), then one per 32 top-k entries (first-occurrence miss flags).
// Per selected position, dense id d = its rank among the selected positions (from the bitmap
// and the prefix counts): `first[d]` is its first top-k index, `dslot[d]` the slot holding it.
template <int K, int B, int POLICY = kPolicyLru>
struct Layout {
  static constexpr int kEvWords = (B + 31) / 32, kMissWords = (K + 31) / 32;
  static constexpr size_t a16(size_t x) { return (x + 15) / 16 * 16; }
  static constexpr size_t tk = 0, dk = a16(4 * K), first = a16(dk + 2 * K);
  static constexpr size_t dslot = a16(first + 4 * K), reuse = a16(dslot + 2 * K);
  static constexpr size_t src = reuse, dst = src + 8 * K, mix = dst + 4 * K, order = mix + 4 * K;
  static constexpr size_t reuse_bytes = a16(4 * B > 16 * K + 2 * B ? 4 * B : 16 * K + 2 * B);
  static constexpr size_t lru = reuse + reuse_bytes, bits = a16(lru + 2 * B);
  static constexpr size_t scan = a16(bits + 4 * (kEvWords + kMissWords));
  // Policy builds only, after the scan scratch. fra: per slot its bucket and hit count (uint8
  // [B] each), the evictables' bucket histogram (int32 [kFraBuckets]) and the per-warp counts of
  // the victim split (int32 [32]). slru: the per-warp evictable counts of levels 0 and 1 (int32
  // [32], packed). lru builds end at the scan scratch.
  static constexpr size_t pol = scan + 4 * kScanScratchInts, pol_hits = pol + B;
  static constexpr size_t pol_hist = a16(pol_hits + B), pol_split = pol_hist + 4 * kFraBuckets;
  static constexpr size_t bytes = POLICY == kPolicyFra ? a16(pol_split + 4 * 32)
                                : POLICY == kPolicySlru ? a16(pol + 4 * 32) : pol;
  // Run-time part for positions [0, 32 * words): bitmap words, then uint16 prefix counts.
  static constexpr size_t bitmap_bytes(size_t words) { return a16(4 * words); }
  static constexpr size_t total(size_t words) { return bytes + bitmap_bytes(words) + a16(2 * words); }
  // EARLY builds, after that: the staging slot of each top-k entry (int16, -1 if none), then per
  // slot its device row (int32, -1 while unclaimed); the rows themselves sit in the fetch warps'
  // registers.
  static constexpr size_t stage_dst = a16(2 * K);
  static constexpr size_t stage_bytes(size_t cap) { return cap ? stage_dst + a16(4 * cap) : 0; }
  // EARLY builds, after the staging area: the request's slot rows (int32 [B + 1]), its slot
  // tokens kept apart from `reuse` (int32 [B]: the writer's old tokens in step 5), then the host
  // row of each preloaded owned entry (int64 [hst]), so that the bookkeeping loads nothing
  // from global memory once the fetch warps' rows are in flight.
  static constexpr size_t keep_rows = 0, keep_toks = a16(4 * (B + 1)), keep_hst = keep_toks + a16(4 * B);
  static constexpr size_t keep_bytes(size_t hst) { return keep_hst + a16(8 * hst); }
};

// Independent global loads each thread keeps in flight in the miss-fetch and output loops.
// NOTE: loading kBatch values first, then using them, pays one L2/DRAM round trip (~0.5-1 us)
// per batch: a plain strided loop waits on each iteration's load (its smem side effects keep
// the compiler from hoisting), and the bookkeeping measured ~20 us that way (docs/kernels.md,
// "Design history"). The bulk inputs are staged with cp.async instead.
constexpr int kBatch = 4;
// Warp rounds (32 entries each) whose inputs the segment loops load before using them.
constexpr int kRounds = 4;
// 16-byte loads each thread keeps in flight in the direct copies (after the bookkeeping). Only
// launches with more direct pieces per CTA than 2 x its copying threads see a difference: the
// bulk of a high-churn step (batch 64 @15 %: ~120 direct rows per CTA), whose host reads are
// bound by the GPU's address translation of the pinned pool, not by the link. There, fewer
// reads in flight per thread move the rows faster. Build with -DHS_COPY_UNROLL=N for an A/B.
// NOTE: 2, not 4 (the replay kernel's kUnroll), 6 or 1: against 4, 2 measured 1.3-2.6 % faster
// (batch 64 @5 / 15 %, batch 128 @15 %) and 6 2.3-2.9 % slower; 1 measured 0.7-2.9 % slower
// than 2 (results/resolve_s18_copy_unroll_h200.json; docs/kernels.md).
#ifndef HS_COPY_UNROLL
#define HS_COPY_UNROLL 2
#endif
constexpr int kCopyUnroll = HS_COPY_UNROLL;

// Phase clocks for the bookkeeping study (benchmarks/probes/probe_resolve.py builds with
// HS_PHASE_PROFILE): thread 0 of each of the first kPhaseCtas CTAs records clock64() at each
// phase boundary. Compiled out otherwise.
#ifdef HS_PHASE_PROFILE
constexpr int kPhaseCtas = 4096, kPhases = 12;
__device__ long long hs_phase_clock[kPhaseCtas][kPhases];
__device__ unsigned long long hs_phase_ns[kPhaseCtas][kPhases];  // %globaltimer, GPU-wide
#define HS_PHASE(i)                                                                     \
  do {                                                                                  \
    const int cta_ = blockIdx.y * gridDim.x + blockIdx.x;                               \
    if (threadIdx.x == 0 && cta_ < kPhaseCtas) {                                        \
      hs_phase_clock[cta_][i] = clock64();                                              \
      unsigned long long ns_;                                                           \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns_));                           \
      hs_phase_ns[cta_][i] = ns_;                                                       \
    }                                                                                   \
  } while (0)
#else
#define HS_PHASE(i) do {} while (0)
#endif

// Fetch warps of an EARLY build: the last quarter of the CTA's warps (at least one). Each holds
// up to fetch_rows<ITEM>() rows in registers (ceil(ITEM / 512) int4 per lane and row): 4 rows
// of up to 1 KiB (656 B: 8 int4 per lane), 3 above (1152 B: 9 int4 per lane), so that a fetch
// warp's held rows take at most 36 32-bit registers per lane.
constexpr int kFetchRowsUpTo1K = 4, kFetchRowsAbove1K = 3;
__host__ __device__ constexpr int fetch_warps(int threads) { return threads >= 256 ? threads / 128 : 1; }
template <int ITEM>
__host__ __device__ constexpr int fetch_rows() { return ITEM <= 1024 ? kFetchRowsUpTo1K : kFetchRowsAbove1K; }

// Named barriers of an EARLY build (0 is __syncthreads): 1 among the bookkeeping warps; 2 the
// fetch warps' slots are written (they arrive, the bookkeeping waits); 3 the held rows'
// destinations are written (the bookkeeping arrives, the fetch warps wait).
__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// Early fetch: the hint word and host row of each preloaded position, loaded together (the host
// row is only used if the position's bit is clear); ~0 / -1 for an unselectable position.
__device__ __forceinline__ void load_hints(const int (&p0)[kBatch], int limit, const uint32_t* res,
                                           const int64_t* hrow, uint32_t (&w0)[kBatch],
                                           int64_t (&h0)[kBatch]) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const bool sel = p0[u] >= 0 && p0[u] < limit;
    w0[u] = sel ? res[p0[u] >> 5] : ~0u;
    h0[u] = sel ? hrow[p0[u]] : -1;
  }
}

// Codes stored per top-k entry in place of a dense id.
constexpr int kPadEntry = -1, kNewestEntry = -2;

// Short request (n <= B): token p lives in slot p; out = slot_rows[p], nothing moves.
// Top-k entry i of a batch row whose selection `tk` is in the build's layout (template BLK):
// BLK = 0, token positions (DSA, DeepSeek-V4's compressed entries); BLK > 0, block ids
// (MiniMax-M3), block j standing for positions j*BLK .. j*BLK+BLK-1, so entry i is position
// tk[i / BLK] * BLK + i % BLK, or -1 for a -1 block and at or past seq_len n
// (kernels/reference.py:expand_blocks, bit for bit). No expanded top-k is stored in HBM.
template <int BLK>
__device__ __forceinline__ int topk_at(const int32_t* tk, int i, int64_t n) {
  if constexpr (BLK == 0) {
    return tk[i];
  } else {
    const int blk = tk[i / BLK];
    const int p = blk * BLK + i % BLK;
    return blk >= 0 && p < n ? p : -1;
  }
}

template <int K, int BLK = 0>
__device__ __noinline__ void resolve_short(const int32_t* tk, const int32_t* rows, int64_t n,
                                              int32_t* out, int tid, int T) {
  for (int i0 = tid; i0 < K; i0 += T * kBatch) {
    int v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u * T;
      v[u] = i < K ? topk_at<BLK>(tk, i, n) : -1;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) v[u] = (v[u] >= 0 && v[u] < n) ? rows[v[u]] : -1;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u * T;
      if (i < K) out[i] = v[u];
    }
  }
}

// fra's victim split (POLICY builds, m > 0 misses; after the exchange that gave m): the m
// evictables with the smallest (bucket, LRU position) go to order[0, m) and the other evictables
// to order[m, n_evict), each in old LRU order; the hits to order[n_evict + ...] as for lru. So
// miss x takes order[x] and the writer's rotation gives remaining evictables | fresh misses |
// hits, as for lru. Every warp finds the threshold bucket tb (where the histogram's running
// count reaches m; `need` victims come from tb itself, its oldest) on its own; one exchange of
// per-warp counts (below tb, in tb) then gives each evictable its victim rank.
// NOTE: a 256-bin histogram and a threshold bucket, not a sort or radix select of exact scores:
// one pass and one barrier more than lru. Rejected: 16 or 32 coarser buckets (a ballot per
// bucket instead of shared atomics): they lost 3-8 points of the LRU->Belady gap on the
// tuning traces (docs/traces.md).
template <int B, typename Sync>
__device__ __forceinline__ void place_policy_victims(const uint8_t* pbucket, const int* phist,
                                                     int* psplit, const int16_t* lrus,
                                                     const uint32_t* evbits, int16_t* order, int m,
                                                     int n_evict, int jb, int je, int e, int lane,
                                                     int warp, int nw, unsigned below, Sync&& sync) {
  constexpr int kPer = kFraBuckets / 32;
  int cnt[kPer], sum = 0;
#pragma unroll
  for (int v = 0; v < kPer; ++v) {
    cnt[v] = phist[lane * kPer + v];
    sum += cnt[v];
  }
  const int incl = warp_inclusive_scan(sum);
  const int owner = __ffs(__ballot_sync(kFull, incl >= m)) - 1;  // m <= n_evict = the total
  int tb = 0, need = 0;
  if (lane == owner) {
    int run = incl - sum;
#pragma unroll
    for (int v = 0; v < kPer; ++v) {
      if (need == 0 && run + cnt[v] >= m) {
        tb = lane * kPer + v;
        need = m - run;
      }
      run += cnt[v];
    }
  }
  tb = __shfl_sync(kFull, tb, owner);
  need = __shfl_sync(kFull, need, owner);
  int lt = 0, eq = 0;
  for (int j0 = jb; j0 < je; j0 += 32) {
    const int j = j0 + lane;
    const bool ev = j < je && ((evbits[j0 >> 5] >> lane) & 1u);
    const int bk = ev ? pbucket[lrus[j]] : 0;
    lt += __popc(__ballot_sync(kFull, ev && bk < tb));
    eq += __popc(__ballot_sync(kFull, ev && bk == tb));
  }
  if (lane == 0) psplit[warp] = lt | (eq << 16);  // each < 2**15: no carry between halves
  sync();
  const int mine = lane < nw ? psplit[lane] : 0;
  const int both = warp_inclusive_scan(mine);
  const int off = __shfl_sync(kFull, both - mine, warp);
  int lt_run = off & 0xffff, eq_run = off >> 16;
  for (int j0 = jb; j0 < je; j0 += 32) {
    const int j = j0 + lane;
    const unsigned bal = evbits[j0 >> 5];
    const bool ev = j < je && ((bal >> lane) & 1u);
    const int sl = j < je ? lrus[j] : 0;
    const int bk = ev ? pbucket[sl] : 0;
    const unsigned ltb = __ballot_sync(kFull, ev && bk < tb), eqb = __ballot_sync(kFull, ev && bk == tb);
    if (j < je) {
      const int rank = e + __popc(bal & below);  // evictables before position j
      int at = n_evict + j - rank;               // a hit
      if (ev) {
        const int eq_before = eq_run + __popc(eqb & below);
        const int v = lt_run + __popc(ltb & below) + min(eq_before, need);  // victims before j
        at = bk < tb || (bk == tb && eq_before < need) ? v : m + rank - v;
      }
      order[at] = static_cast<int16_t>(sl);
    }
    e += __popc(bal);
    lt_run += __popc(ltb);
    eq_run += __popc(eqb);
  }
}

// First level, fully resident request: position p -> pages[p / page] * page + p % page; the
// selection (p < n-1, else -1) is recorded in slot-token block `ring` for a later shrink.
// Nothing else is read or written: no bitmap, no LRU, no host row.
template <int K, int BLK = 0>
__device__ __noinline__ void resolve_resident(const int32_t* tk, const int32_t* pages, int page,
                                              int64_t n, int32_t* out, int32_t* record, int tid,
                                              int T) {
  for (int i = tid; i < K; i += T) {
    const int p = topk_at<BLK>(tk, i, n);
    const bool ok = p >= 0 && p < n;
    out[i] = ok ? pages[p / page] * page + p % page : -1;
    record[i] = ok && p < n - 1 ? p : -1;
  }
}

// One grid row (blockIdx.y) per batch row, gridDim.x CTAs per request. Every CTA of a request
// does the (cheap, smem-only) bookkeeping; each copies its share of the misses and writes its
// share of out_rows and the plan; the CTA that arrives last after all have read the old state
// writes the new state (slot tokens, LRU).
// NOTE: the rejected alternative was one bookkeeping CTA handing misses to copy CTAs through
// global flags: that needs spin-waits (co-residency assumptions) or a second launch.
// TB: the block size when it is known at compile time (the launcher instantiates the common
// ones, so loop bounds and chunk sizes fold to constants), 0 for any multiple of 32 at run time;
// the code is the same either way.
// NOTE: membership is a bitmap over positions: selected positions set their bit, a prefix count
// per bitmap word turns a set bit into a dense id, and a slot's token is selected iff its bit
// is set. Rejected: an open-addressing hash table (CAS-loop inserts, probe chains; what
// resolve_verify.cuh still uses): NO_IO at batch 64 measured 14.4-14.6 us with it against
// 10.5-10.7 with the bitmap (results/resolve_ab_v6_v7.json). The bitmap's cost is shared memory
// that grows with the pool's context (3 B per 16 positions).
// EARLY (COPY with a resident hint and early rows): the last fetch_warps() warps are fetch
// warps. They look up their share of the CTA's top-k entries, put every probable miss's row in
// flight at once into registers (up to fetch_rows() each) and store each one when the
// bookkeeping has named its destination; they never join the bookkeeping's barriers, since a
// warp with host reads in flight stalls its later shared-memory work and barriers until they
// land (benchmarks/probes/probe_host_stall.cu). Holding a landed row until the bookkeeping
// names its destination measured no cost (probes/probe_gather_shape.py --handoff). The other
// warps do the bookkeeping alone, loading nothing global once the rows are out (the keep area).
// NOTE: rows in registers of warps outside the bookkeeping: held by the bookkeeping warps they
// measured 11-18 % slower at batch 16 @5 % (those warps' shared-memory work waits behind their
// own host reads), staged with cp.async slower at 656 B, and an in-line early fetch by the
// bookkeeping warps no faster on any COPY config (results/resolve_ab_v15_forced.json;
// docs/kernels.md, "Design history").
template <int K, int B, int ITEM, int TB, bool EARLY, int POLICY = kPolicyLru, int BLK = 0, int ROWL = 0>
__global__ void __launch_bounds__(TB ? TB : 1024) resolve_kernel(ResolveArgs a) {
  using L = Layout<K, B, POLICY>;
  static_assert(K <= 32767 && B <= 32767, "slot ids, top-k indices and ranks are 16-bit");
  static_assert(ITEM % 16 == 0, "rows are copied in 16-byte pieces");
  extern __shared__ __align__(16) uint8_t smem[];
  int32_t* tks = reinterpret_cast<int32_t*>(smem + L::tk);  // staged positions
  int16_t* dk = reinterpret_cast<int16_t*>(smem + L::dk);  // dense id (or code) per entry
  int32_t* first = reinterpret_cast<int32_t*>(smem + L::first);
  int16_t* dslot = reinterpret_cast<int16_t*>(smem + L::dslot);
  int32_t* stoks = reinterpret_cast<int32_t*>(smem + L::reuse);  // staged slot tokens ...
  // (EARLY: in the keep area below instead, which also holds the slot rows and host rows)
  int64_t* msrc = reinterpret_cast<int64_t*>(smem + L::src);     // ... then the miss lists
  int32_t* mdst = reinterpret_cast<int32_t*>(smem + L::dst);
  int32_t* mix = reinterpret_cast<int32_t*>(smem + L::mix);  // top-k index of each miss
  int16_t* order = reinterpret_cast<int16_t*>(smem + L::order);  // evictables, then hits
  int16_t* lrus = reinterpret_cast<int16_t*>(smem + L::lru);
  uint32_t* evbits = reinterpret_cast<uint32_t*>(smem + L::bits);
  uint32_t* missbits = evbits + L::kEvWords;
  int* scratch = reinterpret_cast<int*>(smem + L::scan);
  uint32_t* bm = reinterpret_cast<uint32_t*>(smem + L::bytes);
  uint16_t* prefix = reinterpret_cast<uint16_t*>(smem + L::bytes + L::bitmap_bytes(a.words));
  __shared__ int s_writer, s_direct;

  const int b = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
  const int T_all = TB ? TB : static_cast<int>(blockDim.x);
  const int T = EARLY ? T_all - 32 * fetch_warps(T_all) : T_all;  // bookkeeping threads
  const int FT = T_all - T;                                        // fetch threads
  if constexpr (TB > 0) __builtin_assume(tid < TB);
  const auto bk_sync = [&]() {
    if constexpr (EARLY) named_sync(1, T); else __syncthreads();
  };
  HS_PHASE(0);
  const int32_t* tk = a.top_k + b * a.topk_stride;
  int32_t* out = a.out_rows + b * a.out_stride;
  // Issued together (one round trip): every batch row's index entries are readable; the top-k
  // staging (cp.async group 0) is in flight meanwhile.
  const int n_real = *a.num_real;
  const int64_t r = load_index(a.req_index, a.req64, b);
  const int64_t n = load_index(a.seq_lens, a.len64, b);
  if constexpr (BLK == 0) {
    if (tid < T) stage_to_smem(tks, tk, 4 * K, tid, T);
  } else if (tid < T) {  // blocks: expanded into shared memory (read after the first barrier)
    for (int i = tid; i < K; i += T) tks[i] = topk_at<BLK>(tk, i, n);
  }
  cp_async_commit();
  // Early fetch (EARLY builds: COPY with a resident hint; the fetch warps, below): this CTA owns
  // top-k entries i = c + e * ctas. Preload u of lane l of fetch warp w takes
  // e = w + F * (l + 32 * u) (round robin over the warps, so that a CTA's few probable misses
  // fall on different warps; a bijection onto [0, kBatch * FT)). The first kBatch positions are
  // loaded now, in the same round trip as the indices.
  constexpr int kPieces = ITEM / 16;
  // Rows each fetch warp holds, and int4 per lane and row.
  constexpr int kHold = fetch_rows<ITEM>(), kHeld = (kPieces + 31) / 32;
  // The fetch warps take a share of the direct copies only where their held rows leave room
  // for the full unroll (656 B: 4 rows x 2 int4 per lane; not 1152 B: 3 x 3).
  // NOTE: not at 1152 B: copy_rows deals every row's pieces over all copying threads, so a share
  // copied 2 loads at a time paced every direct row (1228 misses in one CTA: 7-13 % slower,
  // measured while the others copied 4 at a time; docs/kernels.md, "Design history").
  constexpr int kHeldInt4Max = 8;  // held int4 per lane that still leave the fetch warps copying
  constexpr bool kFetchCopies = kHold * kHeld <= kHeldInt4Max;
  const int TC = EARLY && !kFetchCopies ? T : T_all;  // threads sharing the direct copies
  const int n_own = (K - c + a.ctas - 1) / a.ctas;
  const auto fetch_entry = [&](int u) { return ((tid - T) >> 5) + (FT >> 5) * ((tid & 31) + 32 * u); };
  int p0[kBatch];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int e = fetch_entry(u);
    p0[u] = EARLY && tid >= T && e < n_own ? topk_at<BLK>(tk, c + e * a.ctas, n) : -1;
  }
  const bool full = a.rr_flag != nullptr && b < n_real && a.rr_flag[r] != 0;
  if (b >= n_real || n <= B || full) cp_async_wait<0>();  // no copy may outlive the CTA's smem
  if (b >= n_real) {  // padding row: inert
    if (c == 0) {
      for (int i = tid; i < K; i += T) out[i] = -1;
      if (a.write_plan && tid == 0) a.plan_count[b] = 0;
    }
    return;
  }
  if (full) {  // every CTA of the row returns here, so none takes an arrival ticket
    if (c == 0) {
      resolve_resident<K, BLK>(tk, a.rr_pages + r * a.rr_stride, a.rr_page, n, out,
                          a.slot_tokens + r * a.st_stride + static_cast<int64_t>(*a.rr_ring) * K,
                          tid, T);
      if (a.write_plan && tid == 0) a.plan_count[b] = 0;
    }
    return;
  }
  const int32_t* rows = a.slot_rows + r * a.sr_stride;
  if (n <= B) {
    if (c == 0) {
      resolve_short<K, BLK>(tk, rows, n, out, tid, T);
      if (a.write_plan && tid == 0) a.plan_count[b] = 0;
    }
    return;
  }
  int32_t* stok = a.slot_tokens + r * a.st_stride;
  int16_t* lru = a.lru + r * a.lru_stride;
  const int newest = static_cast<int>(n - 1);
  // Selectable positions: [0, limit). limit < newest only when seq_len exceeds host_rows'
  // columns (a caller bug the Python op rejects): those positions resolve to -1.
  const int limit = newest < 32 * a.words ? newest : 32 * a.words;
  const int words = (limit + 31) / 32;
  HS_PHASE(1);
  const bool hint = a.resident != nullptr;
  uint32_t* res = hint ? a.resident + r * a.res_stride : nullptr;
  const int64_t* hrow = a.host_rows + r * a.hr_stride;
  uint8_t* stg = smem + L::total(a.words);
  int16_t* sidx = reinterpret_cast<int16_t*>(stg);
  int32_t* sdst = reinterpret_cast<int32_t*>(stg + L::stage_dst);
  uint8_t* keep = stg + L::stage_bytes(a.stage_cap);
  int32_t* srows = reinterpret_cast<int32_t*>(keep + L::keep_rows);
  int64_t* hst = reinterpret_cast<int64_t*>(keep + L::keep_hst);
  if constexpr (EARLY) stoks = reinterpret_cast<int32_t*>(keep + L::keep_toks);
  // The bookkeeping (every thread of a build without fetch warps), then the fetch warps' path.
  // NOTE: the bookkeeping is the `if` body, so that the fetch path follows the prologue in the
  // instruction stream: nvcc places the body of an `if` that returns after the code that
  // follows it, and the instruction cache starts every launch cold. Rejected: the fetch path as
  // the `if` body, behind the bookkeeping's ~74 KB of code: it measured 5x the no-instruction
  // stalls and 3.6x the instruction cache misses (results/resolve_s16_icache_h200.json;
  // docs/kernels.md, "Design decisions, measured").
  if (!EARLY || tid < T) {
    // 0. The slot tokens and the LRU are staged as cp.async group 1, which lands while the top-k
    //    (group 0) is marked; the bitmap and the per-id tables are cleared meanwhile.
    stage_to_smem(stoks, stok, 4 * B, tid, T);
    stage_to_smem(lrus, lru, 2 * B, tid, T);
    if constexpr (EARLY) stage_to_smem(srows, rows, 4 * (B + 1), tid, T);
    cp_async_commit();
    fill_smem(bm, (words + 3) / 4, make_int4(0, 0, 0, 0), tid, T);
    fill_smem(first, (K + 3) / 4, make_int4(0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff), tid, T);
    fill_smem(dslot, (K + 7) / 8, make_int4(-1, -1, -1, -1), tid, T);
    if (tid == 0) s_direct = 0;
    uint8_t* pbucket = smem + L::pol;
    uint8_t* phits = smem + L::pol_hits;
    int* phist = reinterpret_cast<int*>(smem + L::pol_hist);
    int* psplit = reinterpret_cast<int*>(smem + L::pol_split);
    // slru's level boundaries: loaded here, in flight while the staging lands; every CTA of the
    // request reads them before its arrival, and the writer rewrites them only after the last.
    int sl_b1 = B, sl_b2 = B;
    if constexpr (POLICY == kPolicySlru) {
      const int32_t w = a.pstate[r * a.ps_stride];
      sl_b1 = B - (w & 0xffff);
      sl_b2 = B - ((w >> 16) & 0xffff);
    }
    if constexpr (POLICY == kPolicyFra) {
      // 0p. Each slot's bucket and hit count, from its policy word and token (plain loads in
      //     flight while the staging lands; the writer rewrites the words only after every CTA
      //     of the request has arrived, so all compute the same buckets).
      fill_smem(phist, kFraBuckets / 4, make_int4(0, 0, 0, 0), tid, T);
      const int32_t* pst = a.pstate + r * a.ps_stride;
      for (int s0 = tid; s0 < B; s0 += T * kBatch) {
        int32_t w[kBatch], p[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int sl = s0 + u * T;
          w[u] = sl < B ? pst[sl] : 0;
          p[u] = sl < B ? stok[sl] : -1;
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int sl = s0 + u * T;
          if (sl < B) {
            pbucket[sl] = static_cast<uint8_t>(fra_bucket(w[u], p[u], n));
            phits[sl] = static_cast<uint8_t>(w[u] & 0xff);
          }
        }
      }
    }
    cp_async_wait<1>();
    bk_sync();
    HS_PHASE(2);
    // 1. Mark the selected positions (newest excluded). Lane l of a warp takes entries an odd
    //    stride S >= K/32 apart: a top-k that arrives sorted does not send a warp's 32 atomics to
    //    one bitmap word, and the lanes' loads of tks still hit 32 different banks.
    {
      constexpr int S = ((K + 31) / 32) | 1;
      for (int x = tid; x < 32 * S; x += T) {
        const int i = (x & 31) * S + (x >> 5);
        const int p = i < K ? tks[i] : -1;
        if (p >= 0 && p < limit) atomicOr(&bm[p >> 5], 1u << (p & 31));
      }
    }
    bk_sync();
    HS_PHASE(3);
    // 2. Prefix counts: prefix[w] = set bits in words < w (each thread a contiguous chunk, one
    //    exchange of warp totals). The staged slot tokens and LRU must have landed by the barrier.
    const int lane = tid & 31, warp = tid >> 5, nw = T >> 5;
    const unsigned below = lanemask_lt();
    {
      const int chunk = (words + T - 1) / T;
      const int w0 = min(words, tid * chunk), w1 = min(words, w0 + chunk);
      int cnt = 0;
      for (int w = w0; w < w1; ++w) cnt += __popc(bm[w]);
      const int incl = warp_inclusive_scan(cnt);
      if (lane == 31) scratch[warp] = incl;
      cp_async_wait<0>();
      bk_sync();
      const int own = lane < nw ? scratch[lane] : 0;
      const int tot = warp_inclusive_scan(own);
      int run = __shfl_sync(kFull, tot - own, warp) + incl - cnt;
      for (int w = w0; w < w1; ++w) {
        prefix[w] = static_cast<uint16_t>(run);
        run += __popc(bm[w]);
      }
    }
    bk_sync();
    HS_PHASE(4);
    // Every read of the mutable state (slot_tokens, lru) has landed: arrive now, decide whether
    // this CTA is the last (the writer) only before the exchange, so the atomic's round trip
    // overlaps the work in between.
    const int ticket = tid == 0 ? arrive_issue(a.arrivals, b, a.ctas, !EARLY) : 0;
    // 3a. Dense id of every entry, and the first top-k index of each id (kBatch entries' loads
    //     issued before their first store).
    for (int i0 = tid; i0 < K; i0 += T * kBatch) {
      int p[kBatch], code[kBatch];
      uint32_t w[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) p[u] = i0 + u * T < K ? tks[i0 + u * T] : -1;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const bool sel = p[u] >= 0 && p[u] < limit;
        w[u] = sel ? bm[p[u] >> 5] : 0u;
        code[u] = sel ? prefix[p[u] >> 5] : (p[u] == newest ? kNewestEntry : kPadEntry);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = i0 + u * T;
        if (i >= K) break;
        if (code[u] >= 0) {
          code[u] += __popc(w[u] & ((1u << (p[u] & 31)) - 1u));
          atomicMin(&first[code[u]], i);
        }
        dk[i] = static_cast<int16_t>(code[u]);
      }
    }
    // 3b. Hits, walking the old LRU: a slot whose token is selected is a hit (its slot goes to
    //     the token's id), every other LRU position is evictable. Each warp owns a contiguous
    //     segment of LRU positions, a multiple of 32 long, and records one ballot word per 32.
    const int seg_b = (B + 32 * nw - 1) / (32 * nw) * 32;
    const int jb = min(B, warp * seg_b), je = min(B, jb + seg_b);
    int n_ev = 0, sl_n0 = 0, sl_n1 = 0;
    for (int j0 = jb; j0 < je; j0 += 32) {  // rounds not batched: that measured slower (kernels.md)
      const int j = j0 + lane;
      bool ev = j < je;
      if (ev) {
        const int sl = lrus[j], t = stoks[sl];
        if (t >= 0 && t < limit) {
          const uint32_t w = bm[t >> 5];
          if ((w >> (t & 31)) & 1u) {
            dslot[prefix[t >> 5] + __popc(w & ((1u << (t & 31)) - 1u))] = static_cast<int16_t>(sl);
            ev = false;
          }
        }
        if constexpr (POLICY == kPolicyFra) if (ev) atomicAdd(&phist[pbucket[sl]], 1);
      }
      const unsigned bal = __ballot_sync(kFull, ev);
      if (lane == 0) evbits[j0 >> 5] = bal;
      n_ev += __popc(bal);
      if constexpr (POLICY == kPolicySlru) {  // evictables in levels 0 and 1
        sl_n0 += __popc(__ballot_sync(kFull, ev && j < sl_b1));
        sl_n1 += __popc(__ballot_sync(kFull, ev && j >= sl_b1 && j < sl_b2));
      }
    }
    bk_sync();
    HS_PHASE(5);
    // 4. Misses: first occurrences of selected positions that no slot holds, in top-k order
    //    (warp segments and ballot words as above). Then one exchange of the packed per-warp
    //    counts (each total <= 32767, so the low half never carries into the high one) places
    //    the new LRU order (evictables, then hits, each in old order) and the miss list.
    //    NOTE: these loops load kRounds rounds' inputs before their first shared-memory store:
    //    the compiler must assume a store may alias any later load from the same smem array, so
    //    a plain loop pays one latency chain per round.
    const int seg_k = (K + 32 * nw - 1) / (32 * nw) * 32;
    const int ib = min(K, warp * seg_k), ie = min(K, ib + seg_k);
    int n_miss = 0;
    // Without fetch warps, when each warp's segment is one pass (kRounds rounds), the host row of
    // each miss is loaded here and stored in the miss list below, after the exchange: its round
    // trip (host_rows is large and read at random, so mostly from DRAM) overlaps the exchange
    // instead of following it in step 5.
    // NOTE: NO_IO at batch 64 measured 3-7 % faster than loading them in step 5 (0 % churn
    // level). Rejected: staging the slot rows as well (16 KB more per CTA), so that steps 5 and 6
    // load nothing global either: 0.2-0.7 us slower (results/resolve_s17_miss_preload_h200.json).
    const bool pre = !EARLY && seg_k <= 32 * kRounds;  // uniform: seg_k is the same for all warps
    int64_t hpre[kRounds];
    for (int i0 = ib; i0 < ie; i0 += 32 * kRounds) {
      int d[kRounds], f[kRounds], s[kRounds];
#pragma unroll
      for (int u = 0; u < kRounds; ++u) {
        const int i = i0 + 32 * u + lane;
        d[u] = i < ie ? dk[i] : kPadEntry;
      }
#pragma unroll
      for (int u = 0; u < kRounds; ++u) {
        f[u] = d[u] >= 0 ? first[d[u]] : -1;
        s[u] = d[u] >= 0 ? dslot[d[u]] : 0;
      }
#pragma unroll
      for (int u = 0; u < kRounds; ++u) {
        const int ir = i0 + 32 * u;
        if (ir >= ie) break;
        const bool miss = d[u] >= 0 && s[u] < 0 && f[u] == ir + lane;
        if (pre) hpre[u] = miss ? hrow[tks[ir + lane]] : 0;
        const unsigned bal = __ballot_sync(kFull, miss);
        if (lane == 0) missbits[ir >> 5] = bal;
        n_miss += __popc(bal);
      }
    }
    int* slcnt = reinterpret_cast<int*>(smem + L::pol);  // (slru builds)
    if (lane == 0) scratch[warp] = n_ev | (n_miss << 16);
    if constexpr (POLICY == kPolicySlru) if (lane == 0) slcnt[warp] = sl_n0 | (sl_n1 << 16);
    if (tid == 0) s_writer = arrive_decide(ticket, a.arrivals, b, a.ctas);
    bk_sync();
    const int mine = lane < nw ? scratch[lane] : 0;
    int both = warp_inclusive_scan(mine);
    const int off = __shfl_sync(kFull, both - mine, warp);
    both = __shfl_sync(kFull, both, 31);
    const int n_evict = both & 0xffff, m = both >> 16;
    if constexpr (POLICY == kPolicySlru) {  // the levels' totals (each < 2**15: no carry)
      const int t = warp_inclusive_scan(lane < nw ? slcnt[lane] : 0);
      const int tot = __shfl_sync(kFull, t, 31);
      sl_n0 = tot & 0xffff;
      sl_n1 = tot >> 16;
    }
    int e = off & 0xffff, q = off >> 16;
    if (POLICY != kPolicyFra || m == 0) {  // (m is the same for every thread)
    for (int j0 = jb; j0 < je; j0 += 32 * kRounds) {
      unsigned bal[kRounds];
      int sl[kRounds];
#pragma unroll
      for (int u = 0; u < kRounds; ++u) {
        const int jr = j0 + 32 * u;
        bal[u] = jr < je ? evbits[jr >> 5] : 0u;
        sl[u] = jr + lane < je ? lrus[jr + lane] : 0;
      }
#pragma unroll
      for (int u = 0; u < kRounds; ++u) {
        const int j = j0 + 32 * u + lane;
        if (j < je) {
          const int rank = e + __popc(bal[u] & below);  // evictables before position j
          order[(bal[u] >> lane) & 1u ? rank : n_evict + j - rank] = static_cast<int16_t>(sl[u]);
        }
        e += __popc(bal[u]);
      }
    }
    } else {
      place_policy_victims<B>(pbucket, phist, psplit, lrus, evbits, order, m, n_evict, jb, je, e,
                              lane, warp, nw, below, bk_sync);
    }
    for (int i0 = ib; i0 < ie; i0 += 32 * kRounds) {
      unsigned bal[kRounds];
#pragma unroll
      for (int u = 0; u < kRounds; ++u) {
        const int ir = i0 + 32 * u;
        bal[u] = ir < ie ? missbits[ir >> 5] : 0u;
      }
#pragma unroll
      for (int u = 0; u < kRounds; ++u) {
        if ((bal[u] >> lane) & 1u) {
          const int x = q + __popc(bal[u] & below);
          mix[x] = i0 + 32 * u + lane;  // < n_evict: B >= K
          if (pre) msrc[x] = hpre[u];  // (the same thread's round u above: one pass)
        }
        q += __popc(bal[u]);
      }
    }
    const bool writer = s_writer;  // published by the barrier above
    bk_sync();
    HS_PHASE(6);
    // 5. Per miss: claim its victim for the id, fetch its host and device rows (kBatch loads in
    //    flight; the host rows are in the miss list already where step 4 preloaded them),
    //    record the new slot token (the writer; it also moves the hint bit from the evicted
    //    token to the new one: m atomics, none at 0 % churn). Miss x is copied by the CTA
    //    owning its first entry (i mod ctas): from its staged row if the early fetch took it,
    //    else directly (listed in `first`, free from here on).
    int32_t* direct = first;
    const bool hint_writer = hint && writer;
    if constexpr (EARLY) named_sync(2, T_all);  // the fetch warps' slots (sidx) are written
    for (int x0 = tid; x0 < m; x0 += T * kBatch) {
      int64_t src[kBatch];
      int32_t dst[kBatch], old[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int x = x0 + u * T;
        if (x < m) {
          if constexpr (EARLY) {  // all from shared memory; host rows only for owned misses
            const int i = mix[x], e = (i - c) / a.ctas;
            src[u] = i % a.ctas != c ? -1 : e < kBatch * FT ? hst[e] : a.host_rows[r * a.hr_stride + tks[i]];
            dst[u] = srows[order[x]];
            old[u] = hint_writer ? stoks[order[x]] : -1;
          } else {
            src[u] = pre ? -1 : a.host_rows[r * a.hr_stride + tks[mix[x]]];  // pre: listed
            dst[u] = rows[order[x]];
            old[u] = hint_writer ? stok[order[x]] : -1;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int x = x0 + u * T;
        if (x >= m) continue;
        const int i = mix[x], victim = order[x];
        dslot[dk[i]] = static_cast<int16_t>(victim);
        if (EARLY || !pre) msrc[x] = src[u];  // (pre: step 4 listed it already)
        mdst[x] = dst[u];
        if (writer) stok[victim] = tks[i];
        if (hint_writer) {  // the evicted token's bit off, the new one's on (hits keep theirs)
          if (old[u] >= 0 && old[u] < 32 * a.words) atomicAnd(&res[old[u] >> 5], ~(1u << (old[u] & 31)));
          atomicOr(&res[tks[i] >> 5], 1u << (tks[i] & 31));
        }
        if (i % a.ctas == c) {
          const int j = EARLY ? sidx[i] : -1;
          if (j >= 0) sdst[j] = dst[u];
          else direct[atomicAdd(&s_direct, 1)] = x;
        }
      }
    }
    bk_sync();
    if constexpr (EARLY) named_arrive(3, T_all);  // sdst is final: the held rows may be stored
    HS_PHASE(7);
    // 6. Outputs: each CTA writes its share of out_rows and of the plan (EARLY: the misses it
    //    owns, whose host rows it has); the writer the new LRU (order rotated left by m over the
    //    evictables, then the hits). EARLY reads the slot rows from shared memory.
    {
      const int32_t* orow = EARLY ? srows : rows;
      const int k0 = static_cast<int>(static_cast<int64_t>(K) * c / a.ctas);
      const int k1 = static_cast<int>(static_cast<int64_t>(K) * (c + 1) / a.ctas);
      for (int i0 = k0 + tid; i0 < k1; i0 += T * kBatch) {
        int row[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int i = i0 + u * T;
          const int code = i < k1 ? dk[i] : kPadEntry;
          row[u] = -1;
          if (code == kNewestEntry) row[u] = orow[B];
          else if (code >= 0) row[u] = orow[dslot[code]];
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) if (i0 + u * T < k1) out[i0 + u * T] = row[u];
      }
    }
    if (writer && POLICY == kPolicySlru) {
      slru_write(order, lru, B, n_evict, m, sl_n0, sl_n1, sl_b1, tid, T, a.pstate + r * a.ps_stride);
    } else if (writer) {
      for (int j = tid; j < B; j += T) {
        const int at = j >= n_evict ? j : (j + m < n_evict ? j + m : j + m - n_evict);
        lru[j] = order[at];
        if constexpr (POLICY == kPolicyFra) {
          // New LRU positions [n_evict - m, n_evict) are the fresh misses, [n_evict, B) the hits.
          if (j >= n_evict - m) {
            const int sl = order[at];
            const int hits = j >= n_evict ? min(phits[sl] + 1, kFraHitsMax) : 1;
            a.pstate[r * a.ps_stride + sl] = static_cast<int32_t>((n << 8) | hits);
          }
        }
      }
    }
    if (a.write_plan && EARLY) {
      for (int x = tid; x < m; x += T) {
        if (mix[x] % a.ctas != c) continue;
        a.plan_src[b * a.plan_stride + x] = msrc[x];
        a.plan_dst[b * a.plan_stride + x] = mdst[x];
      }
      if (c == 0 && tid == 0) a.plan_count[b] = m;
    } else if (a.write_plan) {
      const int x0 = static_cast<int>(static_cast<int64_t>(m) * c / a.ctas);
      const int x1 = static_cast<int>(static_cast<int64_t>(m) * (c + 1) / a.ctas);
      for (int x = x0 + tid; x < x1; x += T) {
        a.plan_src[b * a.plan_stride + x] = msrc[x];
        a.plan_dst[b * a.plan_stride + x] = mdst[x];
      }
      if (c == 0 && tid == 0) a.plan_count[b] = m;
    }
    HS_PHASE(8);
    HS_PHASE(9);
    HS_PHASE(10);
    if (a.copy)
      copy_rows<ITEM, kCopyUnroll, ROWL>(msrc, mdst, 0, s_direct, a.host_cache, a.hc_stride,
                                   a.device_cache, a.dc_stride, direct, tid, TC, a.hc_voff);
    HS_PHASE(11);
    return;
  }

  // 0b. Fetch warps: the hint words and host rows of the preloaded positions, loaded together.
  //     A selected position whose hint bit is clear is probably a miss: warp w takes its first
  //     fetch_rows() candidates (slots w * fetch_rows() + t, below stage_cap) and records each
  //     owned entry's slot (-1: copied directly if it is a miss) before any row is issued, so
  //     that its arrival at barrier 2 waits for nothing. Then every held row goes out at once;
  //     each is stored once barrier 3 has published its destination (sdst, -1: not a miss's
  //     first occurrence), whenever it lands. The bookkeeping stays authoritative.
  const int f = tid - T, lane = tid & 31, fw = f >> 5;
  const int quota = max(0, min(kHold, a.stage_cap - fw * kHold));
  uint32_t w0[kBatch];
  int64_t h0[kBatch];
  load_hints(p0, limit, res, hrow, w0, h0);
  // Each candidate below the quota takes the next slot of its warp (in u, then lane order) and
  // parks its entry there (sdst, until the reset below); every lane then reads the host rows
  // of its warp's slots back from shared memory.
  // NOTE: rejected: one shuffle per (u, slot) to hand each row over: ~300 instructions under
  // divergence guards, run from a cold instruction cache (ncu: 72 % of the fetch warps' stall
  // samples there were "no instruction").
  int taken = 0;
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int e = fetch_entry(u);
    // A candidate: its hint bit is clear (entries this lane does not preload have w0 = ~0u).
    const bool mine = !((w0[u] >> (p0[u] & 31)) & 1u) && h0[u] >= 0;
    const unsigned cand = __ballot_sync(kFull, mine);
    const int rank = taken + __popc(cand & lanemask_lt());
    const int slot = mine && rank < quota ? fw * kHold + rank : -1;
    if (e < n_own) {
      sidx[c + e * a.ctas] = static_cast<int16_t>(slot);
      hst[e] = h0[u];  // (step 5 takes the host rows of owned misses from here)
    }
    if (slot >= 0) sdst[slot] = e;
    taken = min(quota, taken + __popc(cand));
  }
#pragma unroll 1
  for (int e = kBatch * FT + f; e < n_own; e += FT) sidx[c + e * a.ctas] = -1;  // not preloaded
  __syncwarp();
  int64_t src_row[kHold];
#pragma unroll
  for (int t = 0; t < kHold; ++t) src_row[t] = t < taken ? hst[sdst[fw * kHold + t]] : 0;
  __syncwarp();
  if (lane < kHold && fw * kHold + lane < a.stage_cap) sdst[fw * kHold + lane] = -1;  // unclaimed
  named_arrive(2, T_all);
  int4 held[kHold][kHeld];
#pragma unroll
  for (int t = 0; t < kHold; ++t) {
    if (t < taken) {
#pragma unroll
      for (int v = 0; v < kHeld; ++v)
        if (lane + 32 * v < kPieces)
          held[t][v] = load_host_piece<ROWL, ITEM>(a.host_cache, a.hc_stride, src_row[t], lane + 32 * v, a.hc_voff);
    }
  }
  named_sync(3, T_all);
  // Their share of the direct copies first (issued while the held rows may still be on the
  // way), then the held rows.
  if constexpr (kFetchCopies)
    copy_rows<ITEM, kCopyUnroll, ROWL>(msrc, mdst, 0, s_direct, a.host_cache, a.hc_stride,
                                 a.device_cache, a.dc_stride, first, tid, T_all, a.hc_voff);
#pragma unroll
  for (int t = 0; t < kHold; ++t) {
    const int dst = t < taken ? sdst[fw * kHold + t] : -1;
    if (dst >= 0) {
#pragma unroll
      for (int v = 0; v < kHeld; ++v)
        if (lane + 32 * v < kPieces) store_piece<ROWL, ITEM>(a.device_cache, a.dc_stride, dst, lane + 32 * v, held[t][v]);
    }
  }
}

using tvm::ffi::TensorView;

// POLICY != kPolicyLru builds take the policy state (one layer's view): fra int32 [R, B], slru
// int32 [R, 1].
template <int K, int B, int ITEM, int POLICY = kPolicyLru, int BLK = 0, int ROWL = 0>
void resolve_launch(TensorView top_k, TensorView req_index, TensorView seq_lens,
                    TensorView num_real, TensorView slot_tokens, TensorView slot_rows,
                    TensorView lru, TensorView host_rows, TensorView host_cache,
                    TensorView device_cache, TensorView out_rows, TensorView plan_src,
                    TensorView plan_dst, TensorView plan_count, TensorView arrivals,
                    TensorView resident, TensorView rr_flag, TensorView rr_pages,
                    TensorView rr_ring, int64_t rr_page, int64_t ctas, int64_t block,
                    int64_t write_plan, int64_t copy, int64_t stage_rows,
                    const TensorView* policy_state = nullptr) {
  check_tensor(top_k, "top_k", 2, kDLInt, 32);
  const int dev = top_k.device().device_id;
  check_cuda(top_k, "top_k", dev);
  const int64_t bs = top_k.size(0);
  static_assert(BLK == 0 || K % BLK == 0, "a block build needs k = blocks x block size");
  if constexpr (BLK == 0) {
    HS_CHECK(top_k.size(1) == K, "top_k has " << top_k.size(1) << " columns; this build is for k=" << K);
  } else {
    HS_CHECK(top_k.size(1) == K / BLK, "top_k has " << top_k.size(1) << " block columns; this build is for "
             << K / BLK << " blocks of " << BLK << " (k=" << K << ")");
  }
  const int req64 = check_index(req_index, "req_index", bs, dev);
  const int len64 = check_index(seq_lens, "seq_lens", bs, dev);
  const int64_t R = check_hot_state(num_real, slot_tokens, slot_rows, lru, host_rows, host_cache,
                                    device_cache, out_rows, 2, B, 1, "B+1", dev);
  HS_CHECK(host_rows.size(0) == R, "host_rows must have R=" << R << " rows");
  constexpr int64_t kDevRow = device_row_bytes<ROWL, ITEM>(), kHostRow = host_row_bytes<ROWL, ITEM>();
  HS_CHECK(host_cache.size(1) == kHostRow && device_cache.size(1) == kDevRow,
           "host_cache rows must be " << kHostRow << " bytes and device_cache rows "
           << kDevRow << " bytes (" << (ROWL ? "one page of C4 entries" : "one KV row")
           << ") for this build");
  HS_CHECK(out_rows.size(0) == bs && out_rows.size(1) == K, "out_rows must be [bs, k]");
  check_launch_shape(block, ctas, bs);
  if (write_plan) check_plan(plan_src, plan_dst, plan_count, bs, K, "k", dev);
  check_arrivals(arrivals, bs, ctas, dev);
  // The position bitmap covers host_rows' columns (the longest request the pool holds).
  using L = Layout<K, B, POLICY>;
  const int64_t words = (host_rows.size(1) + 31) / 32;
  if constexpr (POLICY != kPolicyLru) {
    HS_CHECK(policy_state != nullptr, "this resolve build needs the policy state");
    check_tensor(*policy_state, "policy_state", 2, kDLInt, 32);
    check_cuda(*policy_state, "policy_state", dev);
    constexpr int64_t kWidth = POLICY == kPolicyFra ? B : 1;
    HS_CHECK(policy_state->size(0) == R && policy_state->size(1) == kWidth && policy_state->stride(1) == 1,
             "policy_state must be int32 [R=" << R << ", " << kWidth << "] with unit stride");
    // fra: `last` is a seq_len in the word's upper 23 bits.
    HS_CHECK(POLICY != kPolicyFra || host_rows.size(1) < (int64_t{1} << 23),
             "policy fra keeps seq_lens in 23 bits; host_rows has " << host_rows.size(1) << " columns");
  }
  const bool hint = stage_rows >= 0;
  if (hint) {
    check_tensor(resident, "resident", 2, kDLInt, 32);
    check_cuda(resident, "resident", dev);
    HS_CHECK(resident.size(0) == R && resident.size(1) == words,
             "resident must be int32 [R=" << R << ", " << words << "] (one bit per host_rows column)");
  }
  const bool full = rr_page > 0;
  if (full) {
    check_tensor(rr_flag, "resident_rows.flag", 1, kDLInt, 32);
    check_tensor(rr_pages, "resident_rows.pages", 2, kDLInt, 32);
    check_tensor(rr_ring, "resident_rows.ring", 1, kDLInt, 32);
    check_cuda(rr_flag, "resident_rows.flag", dev);
    check_cuda(rr_pages, "resident_rows.pages", dev);
    check_cuda(rr_ring, "resident_rows.ring", dev);
    HS_CHECK(rr_flag.size(0) == R && rr_pages.size(0) == R,
             "resident_rows.flag / .pages must have R=" << R << " rows");
    HS_CHECK(B >= K, "the resident selection record needs B >= k");
  }
  const size_t base = L::total(static_cast<size_t>(words));
  const SmemLimits lim = smem_limits(dev);
  // Fetch warps (the EARLY build) in COPY launches with a hint, early rows and two warps or
  // more: at most stage_rows rows per CTA, as many as the fetch warps hold, within what a CTA may
  // take: all its SM offers at 1024 threads (one CTA per SM anyway), half an SM below (two CTAs
  // per SM stay). NO_IO fetches no rows and reserves no shared memory for them.
  // Host rows kept per CTA (EARLY): its owned entries, as far as the fetch warps preload them.
  const int64_t hst = std::min<int64_t>((K + ctas - 1) / ctas, kBatch * 32 * fetch_warps(static_cast<int>(block)));
  int cap = 0;
  if (hint && copy && stage_rows > 0 && block >= 64) {
    const size_t budget = block > 512 ? static_cast<size_t>(lim.optin)
                                      : std::min<size_t>(lim.optin, lim.per_sm / 2 - kSmemReservedPerCta);
    const int64_t held = fetch_warps(static_cast<int>(block)) * fetch_rows<ITEM>();
    cap = static_cast<int>(std::min<int64_t>(stage_rows, held));
    while (cap > 0 && base + L::stage_bytes(cap) > budget) --cap;
    if (base + L::stage_bytes(cap) + L::keep_bytes(hst) > budget) cap = 0;
  }
  const bool early = cap > 0;
  const size_t smem = base + (early ? L::stage_bytes(cap) + L::keep_bytes(hst) : 0);
  HS_CHECK(base <= static_cast<size_t>(lim.optin),
           "resolve kernel for k=" << K << ", B=" << B << " with host_rows of " << host_rows.size(1)
           << " positions needs " << base << " B of shared memory per CTA; this GPU allows "
           << lim.optin << " B. Lower the pool's max_context (host_rows columns) or "
           "device_buffer_size (see sglang_hisparse/kernel_limits.py)");
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
  // ROWL 3: the second halves start half-way down host_cache's rows
  a.hc_voff = ROWL == 3 ? host_cache.size(0) / 2 * host_cache.stride(0) : 0;
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
  a.words = static_cast<int>(words);
  a.resident = hint ? ptr<uint32_t>(resident) : nullptr;
  a.res_stride = hint ? resident.stride(0) : 0;
  a.stage_cap = cap;
  a.pstate = nullptr;
  a.ps_stride = 0;
  if constexpr (POLICY != kPolicyLru) {
    a.pstate = ptr<int32_t>(*policy_state);
    a.ps_stride = policy_state->stride(0);
  }
  a.rr_flag = full ? ptr<const int32_t>(rr_flag) : nullptr;
  a.rr_pages = full ? ptr<const int32_t>(rr_pages) : nullptr;
  a.rr_stride = full ? rr_pages.stride(0) : 0;
  a.rr_ring = full ? ptr<const int32_t>(rr_ring) : nullptr;
  a.rr_page = static_cast<int>(rr_page);

  // The auto block sizes (kernels/ops.py:auto_block_size) get builds with the block size fixed
  // at compile time; any other multiple of 32 runs the run-time-sized build of the same code.
  constexpr int P = POLICY, Q = BLK, W = ROWL;
  auto kernel = block == 1024 ? (early ? resolve_kernel<K, B, ITEM, 1024, true, P, Q, W> : resolve_kernel<K, B, ITEM, 1024, false, P, Q, W>)
              : block == 512  ? (early ? resolve_kernel<K, B, ITEM, 512, true, P, Q, W> : resolve_kernel<K, B, ITEM, 512, false, P, Q, W>)
                              : (early ? resolve_kernel<K, B, ITEM, 0, true, P, Q, W> : resolve_kernel<K, B, ITEM, 0, false, P, Q, W>);
  ensure_smem(kernel, dev, smem);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev));
  kernel<<<dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(bs)),
           static_cast<unsigned>(block), smem, stream>>>(a);
  HS_CUDA(cudaGetLastError());
}

}  // namespace hisparse
