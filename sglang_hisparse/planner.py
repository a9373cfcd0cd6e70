"""Capacity planner behind ``python -m sglang_hisparse plan``: pure arithmetic, no torch, no sglang.

Per TP rank (every figure below is per GPU unless it says "node"):

    KV row       I = (kv_lora_rank + qk_rope_head_dim) * 2               bf16   (1152 B for 512+64)
                 I = kv_lora_rank + kv_lora_rank/128 * 4 + rope * 2      fp8    ( 656 B: 512 e4m3 latent,
                                                                                  4 fp32 scales, bf16 rope)
    index row    X = index_head_dim + index_head_dim/128 * 4                    ( 132 B: fp8 key + fp32 scale)
    full KV      per request = L * I * n   +  L_idx * X * n
    HiSparse     per request = L * I * min(n, B + 1)  +  L_idx * X * n  +  S
                 (the indexer scores every position each step, so index-K stays on the GPU in full;
                  B hot slots plus the reserved newest-token slot per layer)
    slot state   S = L * ((B+1)*4 + B*2 + ceil(n/32)*4)  +  (B+1)*4  +  n*8  +  k*16 + 12
                 (slot tokens, LRU and resident hint per layer; slot rows and host_rows shared;
                  ``state_bytes.slot_state_bytes`` with P = n, no speculative decoding; then the
                  resolver's out_rows, miss plan and counters per batch row, ``resolver_bytes``;
                  ``coordinator_state_bytes`` at R = 1, what the server reserves per request
                  slot out of its KV budget at startup)
    host         per request = L * I * n          (pinned; authoritative copy of every KV row)
    link         per request per step = L * k * m * I   host->device (m = miss rate, 0 while n <= B)

``L_idx`` is the number of layers that keep an index-K cache: all layers, or only the anchors
of an index-sharing model when the engine elides index-K for shared layers (SGLang 0.5.23 does
so without HiSparse and keeps all of them with ``--enable-hisparse``). Every layer, shared or
not, has its own KV rows and its own hot buffer, so ``L`` always counts all layers and shared
layers still move their own misses (replayed from the anchor's plan on the prefetch stream).

A request admitted with MLA keeps the same KV on every rank of its attention group: with plain
TP (no DP attention) all ``tp`` ranks hold every request; with DP attention each rank holds its
own. So the node serves ``per-rank batch * (tp if dp_attention else 1)`` requests and its host
pools hold ``tp * per-rank batch`` request copies either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sglang_hisparse.kernel_limits import (
    SM90_MAX_SMEM_PER_BLOCK,
    largest_buffer,
    resolve_smem_bytes,
)
from sglang_hisparse.kernel_policy import SERVING_POLICY
from sglang_hisparse.memory.state_bytes import coordinator_state_bytes
from sglang_hisparse.presets import KV_DTYPES, ModelSpec

GIB = 2**30
GB = 10**9
#: --mem-fraction-static of the published 8xH200 HiSparse commands: what weights + KV may take.
MEM_FRACTION_STATIC = 0.85
#: Used when the model's weight size is unknown (a --model-config without a preset).
FALLBACK_KV_SHARE = 0.25
#: HiSparse is recommended when it admits at least this many times the full-KV batch: below it
#: the per-step host IO and the resolve kernel eat most of the gain (the blog notes a net loss
#: at low concurrency).
DEFAULT_MIN_GAIN = 1.5
#: Upper bounds of the inputs (``PlanInputs.validate``): far past any machine, low enough
#: that every byte count stays an exact integer and every float finite.
MAX_GIB = float(2**20)
MAX_LINK_GBPS = 1e6
MAX_STEP_MS = 1e7
MAX_MIN_GAIN = 1e3
MAX_TP = 2**16
MAX_CONTEXT = 2**31 - 1


# ----------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class PlanInputs:
    """Everything ``plan`` reads. Memory in GiB (2**30 B), bandwidth in GB/s (1e9 B/s).

    ``kv_share``/``kv_budget_gib``: at most one; neither = derive the share from the model's
    weight size (``MEM_FRACTION_STATIC - weights/(tp * hbm)``) or fall back to
    ``FALLBACK_KV_SHARE``. ``buffer`` None = 2 * top_k (SGLang's default ``device_buffer_size``).
    ``hisparse_index_layers``: ``"all"`` (SGLang 0.5.23 keeps index-K on every layer under
    HiSparse) or ``"anchors"`` (an engine that elides shared layers' index-K).
    """

    model: ModelSpec
    contexts: tuple[int, ...] = (128 * 1024,)
    kv_dtype: str = "bf16"
    gpu_hbm_gib: float = 140.0
    kv_share: float | None = None
    kv_budget_gib: float | None = None
    tp: int = 8
    dp_attention: bool = True
    buffer: int | None = None
    host_dram_gib: float = 2048.0
    link_gbps: float = 50.0
    miss_rate: float = 0.134
    miss_rate_source: str = "default"
    target_step_ms: float = 50.0
    hisparse_index_layers: str = "all"
    min_gain: float = DEFAULT_MIN_GAIN
    #: the hot buffers' replacement policy (``--hisparse-config`` "policy"): its per-slot words
    #: count in the coordinator state, and a trace is simulated with it
    policy: str = SERVING_POLICY
    #: tokens of prompt prefix every request shares (a system prompt) with the radix cache on:
    #: its KV is held once per rank, in host DRAM for HiSparse and in HBM for full KV
    shared_prefix: int = 0

    @property
    def top_k(self) -> int:
        return self.model.index_topk

    @property
    def hot_slots(self) -> int:
        return 2 * self.top_k if self.buffer is None else self.buffer

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag, the value, the rule and the fix."""
        from sglang_hisparse.config import MAX_DEVICE_BUFFER_SIZE

        k = self.top_k
        # NOTE: every float is bounded above as well as checked finite: an inf, nan or 1e300
        # would reach int() of a byte count (OverflowError, "cannot convert NaN") instead of a
        # message naming its flag. The bounds are far beyond any machine.
        bounded = {"--gpu-hbm-gib": (self.gpu_hbm_gib, MAX_GIB, 140), "--host-dram-gib": (self.host_dram_gib, MAX_GIB, 2048),
                   "--link-gbps": (self.link_gbps, MAX_LINK_GBPS, 50),
                   "--target-step-ms": (self.target_step_ms, MAX_STEP_MS, 50)}
        for flag, (value, most, example) in bounded.items():
            if not 0 < value <= most:  # false for nan
                raise ValueError(f"{flag} {value} must be a number in (0, {most:.12g}]; e.g. {flag} {example}.")
        if not self.contexts:
            raise ValueError("--context: give at least one context length, e.g. --context 128K.")
        for n in self.contexts:
            if not 0 < n <= MAX_CONTEXT:
                raise ValueError(f"--context {n} must be in [1, {MAX_CONTEXT}] tokens (positions are int32); "
                                 f"e.g. --context 128K.")
        if not 0 <= self.shared_prefix < min(self.contexts):
            raise ValueError(
                f"--shared-prefix {self.shared_prefix} must be in [0, the shortest --context "
                f"{min(self.contexts)}): the tokens of prompt every request shares, e.g. --shared-prefix 25600.")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}.")
        if self.model.family == "deepseek-v4":
            self.model.kv_bytes(self.kv_dtype)  # fp8 only: raises naming --kv-dtype
            if self.shared_prefix:
                raise ValueError(f"--shared-prefix {self.shared_prefix} with {self.model.name}: sglang-hisparse "
                                 f"serves DeepSeek-V4 with the radix cache off, so no prefix is shared. "
                                 f"Drop --shared-prefix.")
        if self.model.family == "minimax-m3" and self.dp_attention:
            raise ValueError(
                f"--dp-attention with MiniMax-M3 ({self.model.name}): HiSparse holds one KV head per "
                f"attention rank, which DP attention does not give (each rank would hold every head). "
                f"Plan with --no-dp-attention and --tp >= the model's KV heads.")
        if not 1 <= self.tp <= MAX_TP:
            raise ValueError(f"--tp {self.tp} must be in [1, {MAX_TP}] (GPUs in the tensor-parallel group).")
        if self.hot_slots < k:
            raise ValueError(
                f"--buffer {self.hot_slots} must be >= the model's top-k {k}: every selected position "
                f"needs a hot slot in the same step. Use --buffer {2 * k} (2*k, the default) or more.")
        if self.hot_slots > MAX_DEVICE_BUFFER_SIZE:
            raise ValueError(f"--buffer {self.hot_slots} exceeds {MAX_DEVICE_BUFFER_SIZE} (slot ids are "
                             f"int16). Use 2-4x top-k, e.g. --buffer {2 * k}.")
        if self.kv_share is not None and self.kv_budget_gib is not None:
            raise ValueError("--kv-share and --kv-budget-gib both given; pass only one.")
        if self.kv_share is not None and not 0 < self.kv_share <= 1:
            raise ValueError(f"--kv-share {self.kv_share} must be in (0, 1] (fraction of GPU HBM for KV).")
        if self.kv_budget_gib is not None and not 0 < self.kv_budget_gib <= self.gpu_hbm_gib:
            raise ValueError(f"--kv-budget-gib {self.kv_budget_gib} must be in (0, --gpu-hbm-gib "
                             f"{self.gpu_hbm_gib}].")
        if not 0 <= self.miss_rate <= 1:
            raise ValueError(f"--miss-rate {self.miss_rate} must be in [0, 1] (fraction of top-k "
                             f"missing per step; 0.134 = 13.4 %).")
        if self.hisparse_index_layers not in ("all", "anchors"):
            raise ValueError(f"--hisparse-index-layers {self.hisparse_index_layers!r} must be all or anchors.")
        if not 1 <= self.min_gain <= MAX_MIN_GAIN:  # false for nan
            raise ValueError(f"--min-gain {self.min_gain} must be in [1, {MAX_MIN_GAIN:.12g}] (batch ratio "
                             f"HiSparse/full); e.g. --min-gain {DEFAULT_MIN_GAIN}.")

    def kv_budget(self) -> tuple[int, float, str]:
        """(KV bytes per GPU, share of HBM, where the share came from)."""
        hbm = self.gpu_hbm_gib * GIB
        if self.kv_budget_gib is not None:
            return int(self.kv_budget_gib * GIB), self.kv_budget_gib / self.gpu_hbm_gib, "--kv-budget-gib"
        if self.kv_share is not None:
            return int(self.kv_share * hbm), self.kv_share, "--kv-share"
        if self.model.weights_gib is None:
            return int(FALLBACK_KV_SHARE * hbm), FALLBACK_KV_SHARE, "fallback (weights unknown)"
        per_gpu = self.model.weights_gib / self.tp
        share = MEM_FRACTION_STATIC - per_gpu / self.gpu_hbm_gib
        if share <= 0.01:
            raise ValueError(
                f"--tp {self.tp}: {self.model.name} weights (~{per_gpu:.0f} GiB per GPU) leave no KV room "
                f"in {MEM_FRACTION_STATIC:.2f} x --gpu-hbm-gib {self.gpu_hbm_gib:g} GiB. Raise --tp or "
                f"--gpu-hbm-gib, or pass --kv-share.")
        return int(share * hbm), share, f"{MEM_FRACTION_STATIC} static - weights {per_gpu:.1f} GiB/GPU"


# ----------------------------------------------------------------------------- results
@dataclass(frozen=True)
class ContextPlan:
    """One context length. Bytes per GPU unless named ``node``; batches are request counts."""

    context: int
    full_bytes_per_request: int
    hisparse_kv_bytes_per_request: int      # hot buffers, all layers
    hisparse_index_bytes_per_request: int   # index-K for the whole context (stays on the GPU)
    hisparse_state_bytes_per_request: int   # slot state + host_rows + resolver buffers (state_bytes)
    host_bytes_per_request: int
    batch_full: int                         # per GPU, HBM-limited
    batch_hisparse_hbm: int                 # per GPU, HBM-limited
    batch_hisparse_host: int                # per GPU, host-DRAM-limited
    batch_hisparse: int                     # per GPU, min of the two
    limited_by: str                         # "hbm" | "host"
    node_batch_full: int
    node_batch_hisparse: int
    host_dram_node_bytes: int               # pinned host KV at node_batch_hisparse
    h2d_bytes_per_token: float              # per request per decode step (0 while context <= B)
    io_ms_per_step: float                   # all layers, at batch_hisparse, one GPU's link
    io_exposed_ms_per_step: float           # only anchors on the critical path (prefetch on)
    io_fits: bool                           # io_ms_per_step <= target step
    batch_io_fits: int | None               # largest per-GPU batch whose IO fits the step; None = no IO
    node_batch_link: int | None             # batch_io_fits per node; None = no IO
    node_batch_recommended: int             # min of the HBM, host DRAM and link bounds, per node
    bound_by: str                           # which of them binds: "hbm" | "host" | "link"
    gain: float                             # node_batch_hisparse / node_batch_full (inf if full is 0)
    turn_on: bool
    reason: str

    @property
    def hisparse_bytes_per_request(self) -> int:
        return (self.hisparse_kv_bytes_per_request + self.hisparse_index_bytes_per_request
                + self.hisparse_state_bytes_per_request)


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    kv_budget_bytes: int
    kv_share: float
    kv_share_source: str
    contexts: tuple[ContextPlan, ...]
    break_even_context: int | None          # smallest context where HBM alone gives >= min_gain
    suggested_config: dict[str, int | str]
    recommendation: str


def index_layers(inputs: PlanInputs, hisparse: bool) -> int:
    """Layers that keep an index-K cache on the GPU, without or with HiSparse."""
    model = inputs.model
    # SGLang elides shared layers' index-K only without HiSparse (see module docstring).
    if hisparse and inputs.hisparse_index_layers == "all":
        return model.layers
    return len(model.anchors)


def _hisparse_bytes(inputs: PlanInputs, n: int) -> tuple[int, int, int]:
    """HBM of one request of ``n`` tokens with HiSparse: (hot buffers, index-K, slot state)."""
    m, B = inputs.model, inputs.hot_slots
    e = m.entries(n)
    hot_kv = m.layers * m.kv_bytes(inputs.kv_dtype) * min(e, B + 1)
    # the index cache (and M3's dense layers, V4's C128 entries and windows) stay on the
    # device for the whole context
    hot_idx = index_layers(inputs, True) * m.index_bytes * e + m.device_bytes(n, inputs.kv_dtype)
    return hot_kv, hot_idx, _state_bytes(inputs, e)


def _state_bytes(inputs: PlanInputs, n: int) -> int:
    """Coordinator state of one request slot sized for ``n`` tokens (a server planned for n
    holds it per slot, whatever the request's length) plus its decode-batch row's resolver
    buffers (the planned batch is the request count). The server reserves the same formula per
    request slot out of its KV budget at startup (``sglang_adapter.budget``)."""
    m, B = inputs.model, inputs.hot_slots
    # the resident page table of "residency": "pressure" (the default) over SGLang's 64-token
    # DSA pages (its pool asserts that page size on CUDA)
    return coordinator_state_bytes(request_slots=1, num_layers=m.layers, buffer_size=B,
                                   max_context=n, top_k=inputs.top_k, policy=inputs.policy,
                                   residency_page_size=64)


def _plan_context(inputs: PlanInputs, n: int, budget: float) -> ContextPlan:
    m, B, k = inputs.model, inputs.hot_slots, inputs.top_k
    row, idx, host_row = m.kv_bytes(inputs.kv_dtype), m.index_bytes, m.host_row_bytes(inputs.kv_dtype)
    # HiSparse rows per layer: tokens, or DeepSeek-V4's C4 entries (one per 4 tokens)
    e, s = m.entries(n), inputs.shared_prefix
    es = m.entries(s)
    # A shared prefix (radix cache) is held once per rank: full KV shares its device rows,
    # HiSparse its host rows (a running request's device rows stay private, docs/prefix-cache.md).
    kv_dtype = inputs.kv_dtype
    dev = m.device_bytes(n, kv_dtype) - m.device_bytes(s, kv_dtype)  # M3's dense layers, V4's C128 + windows
    dev_shared = m.device_bytes(s, kv_dtype)
    full = (m.layers * row + index_layers(inputs, False) * idx) * (e - es) + dev
    full_shared = (m.layers * row + index_layers(inputs, False) * idx) * es + dev_shared
    hot_kv, hot_idx, state = _hisparse_bytes(inputs, n)
    hot_idx = index_layers(inputs, True) * idx * (e - es) + dev  # the prefix's index-K rows are shared too
    host = m.layers * host_row * (e - es)
    ranks_serving = inputs.tp if inputs.dp_attention else 1
    b_full = int(max(budget - full_shared, 0) // full)
    b_hbm = int(max(budget - (index_layers(inputs, True) * idx * es + dev_shared), 0) // (hot_kv + hot_idx + state))
    b_host = int(max(inputs.host_dram_gib * GIB / inputs.tp - m.layers * host_row * es, 0) // host) if host else 0
    b_hs = min(b_hbm, b_host)
    per_token = m.layers * k * inputs.miss_rate * host_row if e > B else 0.0
    link = inputs.link_gbps * GB
    io_ms = b_hs * per_token / link * 1e3
    # (a miss rate so small that the link never binds, down to a subnormal float: no link bound)
    io_bound = inputs.target_step_ms / 1e3 * link // per_token if per_token else math.inf
    b_io = int(io_bound) if math.isfinite(io_bound) else None
    node_full, node_hs = b_full * ranks_serving, b_hs * ranks_serving
    node_link = None if b_io is None else b_io * ranks_serving
    limited_by = "host" if b_host < b_hbm else "hbm"
    # The flags follow the binding constraint: past the link bound every extra request only
    # makes each step longer (decode is link-bound), so the batch to configure is the min.
    if node_link is not None and node_link < node_hs:
        node_rec, bound_by = node_link, "link"
    else:
        node_rec, bound_by = node_hs, limited_by
    gain = math.inf if node_full == 0 else node_hs / node_full
    step = inputs.target_step_ms
    io_note = (f"IO {io_ms:.1f} ms/step at {inputs.link_gbps:g} GB/s "
               f"({100 * io_ms / step:.0f} % of a {step:g} ms step)")
    unit = "tokens" if m.compress_ratio == 1 else f"C4 entries ({n} tokens)"
    if e <= B:
        on, why = False, (f"context {e} {unit} <= B = {B}: the whole request fits in its hot buffer, "
                          f"HiSparse only adds the host copy")
    elif (smem := resolve_smem_bytes(k, B, e, inputs.policy)) > SM90_MAX_SMEM_PER_BLOCK:
        most = largest_buffer(lambda b: resolve_smem_bytes(k, b, e, inputs.policy))
        on, why = False, (f"the resolve kernel needs {smem} B of shared "
                          f"memory per CTA at {e} {unit} (its position bitmap grows with the "
                          f"context), above sm_90's {SM90_MAX_SMEM_PER_BLOCK} B"
                          + (f"; use --buffer <= {most}" if most >= k else ""))
    elif b_hs == 0:
        short = "HBM" if b_hbm == 0 else "host DRAM"
        on, why = False, f"not one request fits in {short} with HiSparse"
    elif gain < inputs.min_gain:
        on, why = False, (f"HiSparse admits only {gain:.2f}x the full-KV batch "
                          f"({node_full} -> {node_hs}; below --min-gain {inputs.min_gain:g})")
    else:
        growth = f"{gain:.1f}x" if node_full else "full KV does not fit one request"
        on, why = True, f"batch {node_full} -> {node_hs} per node ({growth}); {io_note}"
        if b_hs == b_host < b_hbm:
            why += f"; host DRAM caps the batch (HBM alone allows {b_hbm * ranks_serving})"
        if io_ms > step:
            why += (f"; IO exceeds the step target: decode becomes link-bound "
                    f"(<= {link / per_token:.0f} tok/s per GPU) unless the batch is <= {b_io * ranks_serving}")
    return ContextPlan(
        context=n, full_bytes_per_request=full, hisparse_kv_bytes_per_request=hot_kv,
        hisparse_index_bytes_per_request=hot_idx, hisparse_state_bytes_per_request=state,
        host_bytes_per_request=host,
        batch_full=b_full, batch_hisparse_hbm=b_hbm, batch_hisparse_host=b_host, batch_hisparse=b_hs,
        limited_by=limited_by, node_batch_full=node_full,
        node_batch_hisparse=node_hs, host_dram_node_bytes=inputs.tp * (b_hs * host + (m.layers * host_row * es if b_hs else 0)),
        h2d_bytes_per_token=per_token, io_ms_per_step=io_ms,
        io_exposed_ms_per_step=io_ms * len(m.anchors) / m.layers, io_fits=io_ms <= step,
        batch_io_fits=b_io, node_batch_link=node_link, node_batch_recommended=node_rec, bound_by=bound_by,
        gain=gain, turn_on=on, reason=why,
    )


def break_even_context(inputs: PlanInputs) -> int | None:
    """Smallest context at which HiSparse's HBM per request is ``min_gain`` times smaller.

    Past B the two footprints are linear in n (the resident hint's 32-position words aside):
    full = a*n, HiSparse = c + d*n with a = L*I + L_idx_full*X, c = L*I*(B+1) + S(0),
    d = L_idx_hisparse*X + (S(32) - S(0))/32 (S = slot state). a*n >= g*(c + d*n) gives
    n >= g*c / (a - g*d), stepped on while the hint's rounding leaves HiSparse short (about
    g*4L/(a - g*d) steps); never when a <= g*d (the index cache alone is too large a share).
    """
    m, g, B = inputs.model, inputs.min_gain, inputs.hot_slots
    if m.compress_ratio != 1:
        return _break_even_search(inputs)
    row, idx = m.kv_bytes(inputs.kv_dtype), m.index_bytes

    dev = m.device_bytes_per_token(inputs.kv_dtype)
    a = m.layers * row + index_layers(inputs, False) * idx + dev
    c = m.layers * row * (B + 1) + _state_bytes(inputs, 0)
    d = index_layers(inputs, True) * idx + dev + (_state_bytes(inputs, 32) - _state_bytes(inputs, 0)) / 32
    if a <= g * d:
        return None
    n = max(B + 1, math.ceil(g * c / (a - g * d)))
    while a * n < g * sum(_hisparse_bytes(inputs, n)):
        n += 1
    return n


def _full_bytes(inputs: PlanInputs, n: int) -> int:
    m = inputs.model
    return ((m.layers * m.kv_bytes(inputs.kv_dtype) + index_layers(inputs, False) * m.index_bytes) * m.entries(n)
            + m.device_bytes(n, inputs.kv_dtype))


def _break_even_search(inputs: PlanInputs) -> int | None:
    """:func:`break_even_context` for a compressed layout (DeepSeek-V4: entries per 4 tokens,
    windows and C128 entries that are not linear in n): bisection on the ratio, which only grows
    with n past B entries, then a forward step over the rounding of ``n // 4``."""
    m, g = inputs.model, inputs.min_gain

    def worth(n: int) -> bool:
        return _full_bytes(inputs, n) >= g * sum(_hisparse_bytes(inputs, n))

    lo, hi = m.compress_ratio * (inputs.hot_slots + 1), MAX_CONTEXT
    if not worth(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if worth(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def plan(inputs: PlanInputs) -> Plan:
    """Validate ``inputs`` and compute every figure the ``plan`` command prints."""
    inputs.validate()
    budget, share, source = inputs.kv_budget()
    rows = tuple(_plan_context(inputs, n, budget) for n in inputs.contexts)
    # Sized for the context the flags are for: the longest that turns HiSparse on (a longer
    # context the verdict leaves off must not inflate the host pool), else the longest.
    longest = max((r.context for r in rows if r.turn_on), default=max(inputs.contexts))
    ratio = max(1, math.ceil(inputs.model.entries(longest) / (inputs.hot_slots + 1)))
    suggested: dict[str, int | str] = {"top_k": inputs.top_k, "device_buffer_size": inputs.hot_slots,
                                       "host_to_device_ratio": ratio}
    if inputs.policy != SERVING_POLICY:  # (the emitted config leaves the default out)
        suggested["policy"] = inputs.policy
    even = break_even_context(inputs)
    on = [r for r in rows if r.turn_on]
    below = f"not worth it below ~{even} tokens of context" if even else "never worth it for this model"
    if on:
        best = max(on, key=lambda r: r.context)
        text = f"turn it on at {best.context} tokens of context: {best.reason}; {below}"
    else:
        text = f"leave it off: {rows[-1].reason}; {below}"
    return Plan(inputs=inputs, kv_budget_bytes=budget, kv_share=share, kv_share_source=source,
                contexts=rows, break_even_context=even, suggested_config=suggested, recommendation=text)


def published_kv_bytes(layers: int, row_bytes: int, tokens: int) -> int:
    """The arithmetic behind the published GLM-5.1 figures (docs/planner.md): L * row * n."""
    return layers * row_bytes * tokens
