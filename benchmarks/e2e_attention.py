"""Sparse MLA decode attention for the end-to-end benchmark: each request attends over its own
``k`` selected KV rows, all heads at once (MLA's absorbed decode form).

Shapes (DeepSeek MLA: a 512-dim latent ("nope") part plus 64 rope dims)::

    q     bf16 [bs, H, dim]     contiguous; dim = 576
    kv    bf16 [N, dim]         rows with unit column stride (the benchmark's uint8 [N, 1152]
                                pool viewed as bf16); a row is K (all ``dim`` dims) and, through
                                its first ``v_dim`` dims, V
    rows  int32/int64 [bs, k]   device row per selected entry; negative = invalid (masked out)
    out   bf16 [bs, H, v_dim]   softmax(scale * q . K^T over the valid rows) @ V; a request with
                                no valid row gets zeros

:class:`SparseMLADecode` is a Triton split-K ("flash-decoding") kernel pair: the first kernel
reads each selected row once per request for all (up to 16) heads, the second combines the
splits. It allocates every buffer in its constructor, so calls are CUDA-graph capturable.
:func:`sparse_mla_reference` is the float32 torch definition it is tested against;
:func:`attention_bytes` / :func:`attention_flops` give the roofline figures and
:func:`time_attention` the graph-replayed time per call.
"""

from __future__ import annotations

import statistics

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch fallback still runs
    triton = None

#: heads per program: tl.dot wants M >= 16; fewer heads are padded and masked
BLOCK_H = 16
#: SM count assumed when no CUDA device is at hand (H200)
DEFAULT_SMS = 132
_LOG2E = 1.4426950408889634


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sparse_mla_reference(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, *,
                         v_dim: int = 512, scale: float | None = None) -> torch.Tensor:
    """float32 [bs, H, v_dim]: ``softmax(scale * q . K^T) @ V`` over each request's valid rows
    (``rows >= 0``), K = ``kv[row]`` (all dims), V = its first ``v_dim`` dims; zeros for a
    request without valid rows. Pure torch, float32 math; CPU or CUDA. ``scale`` defaults to
    ``1/sqrt(dim)``."""
    dim = q.shape[-1]
    scale = dim ** -0.5 if scale is None else scale
    valid = rows >= 0  # [bs, k]
    g = kv[rows.clamp(min=0).long()].float()  # [bs, k, dim]
    g = g.masked_fill(~valid[..., None], 0.0)  # an invalid row's bytes never reach the math
    s = torch.einsum("bhd,bkd->bhk", q.float(), g) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all invalid: exp(-inf) = 0
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhk,bkd->bhd", p, g[..., :v_dim])
    return out / torch.where(denom > 0, denom, torch.ones_like(denom))


def attention_bytes(bs: int, k: int, dim: int = 576, heads: int = 16, splits: int = 1, *,
                    v_dim: int = 512, id_bytes: int = 4) -> int:
    """HBM bytes one :class:`SparseMLADecode` call must move: the selected bf16 rows once per
    request and head block of 16 (once for heads <= 16), q, the bf16 output and the row ids;
    with ``splits`` > 1 also the float32 partials (and log-sum-exps) written then read back."""
    head_blocks = _cdiv(heads, BLOCK_H)
    n = bs * k * dim * 2 * head_blocks + bs * heads * (dim + v_dim) * 2 + bs * k * id_bytes
    if splits > 1:
        n += 2 * bs * splits * heads * (v_dim + 1) * 4
    return n


def attention_flops(bs: int, heads: int, k: int, dim: int = 576, v_dim: int = 512) -> int:
    """FLOPs of one call: q . K^T over ``dim`` and p @ V over ``v_dim``, a multiply-add each."""
    return 2 * bs * heads * k * (dim + v_dim)


if triton is not None:

    @triton.jit
    def _sparse_mla_split(Q, KV, ROWS, ACC, LSE, OUT,
                      stride_qb, stride_qh, stride_kv, stride_rb, stride_rk,
                      stride_ab, stride_as, stride_ah, stride_lb, stride_ls,
                      stride_ob, stride_oh,
                      H, K, rows_per_split, qk_scale,
                      D_V: tl.constexpr, D_R: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                      UPCAST: tl.constexpr):
        """Program (request b, split s, head block hb): online softmax over rows
        [s * rows_per_split, min((s + 1) * rows_per_split, K)) of request b for BLOCK_H heads.
        Writes the normalised partial output to ACC and its log2-sum-exp to LSE, or, when
        DIRECT (a single split), the final bf16 output to OUT (ACC, LSE untouched). UPCAST (interpreter only: it
        computes bf16 ops on their uint16 bit patterns) feeds tl.dot float32 copies of the
        same bf16 values."""
        b = tl.program_id(0)
        s = tl.program_id(1)
        hb = tl.program_id(2)
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        dv = tl.arange(0, D_V)
        dr = tl.arange(0, D_R)

        q_row = Q + b * stride_qb + heads[:, None] * stride_qh
        q_nope = tl.load(q_row + dv[None, :], mask=hmask[:, None], other=0.0)  # [BH, D_V]
        q_rope = tl.load(q_row + D_V + dr[None, :], mask=hmask[:, None], other=0.0)  # [BH, D_R]
        if UPCAST:
            q_nope = q_nope.to(tl.float32)
            q_rope = q_rope.to(tl.float32)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (log2 units)
        l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2
        acc = tl.zeros([BLOCK_H, D_V], tl.float32)

        start = s * rows_per_split
        end = tl.minimum(start + rows_per_split, K)
        id_ptr = ROWS + b * stride_rb
        offs = start + tl.arange(0, BLOCK_N)
        r_next = tl.load(id_ptr + offs * stride_rk, mask=offs < end, other=-1)
        for n0 in range(start, end, BLOCK_N):
            # the next tile's ids load one iteration ahead, so the gather's addresses never
            # wait on a load issued in the same iteration (the pipeliner can prefetch it)
            r = r_next.to(tl.int64)
            offs = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
            r_next = tl.load(id_ptr + offs * stride_rk, mask=offs < end, other=-1)
            valid = r >= 0
            base = KV + tl.where(valid, r, 0) * stride_kv  # [BN] row starts
            # one gather per row: D_V + D_R contiguous bf16; V is the first D_V of it
            k_nope = tl.load(base[:, None] + dv[None, :], mask=valid[:, None], other=0.0)
            k_rope = tl.load(base[:, None] + D_V + dr[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                k_nope = k_nope.to(tl.float32)
                k_rope = k_rope.to(tl.float32)

            qk = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_rope, tl.trans(k_rope))
            qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))  # [BH, BN]

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(qk - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p_v = p.to(KV.dtype.element_ty)  # p @ V in bf16 on the tensor cores
            if UPCAST:
                p_v = p_v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_v, k_nope)
            m_i = m_new

        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if DIRECT:
            o_ptr = OUT + b * stride_ob + heads[:, None] * stride_oh + dv[None, :]
            tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=hmask[:, None])
        else:
            a_ptr = ACC + b * stride_ab + s * stride_as + heads[:, None] * stride_ah + dv[None, :]
            tl.store(a_ptr, out, mask=hmask[:, None])
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(LSE + b * stride_lb + s * stride_ls + heads, lse, mask=hmask)

    @triton.jit
    def _sparse_mla_combine(ACC, LSE, OUT,
                        stride_ab, stride_as, stride_ah, stride_lb, stride_ls,
                        stride_ob, stride_oh, splits,
                        D_V: tl.constexpr, BLOCK_S: tl.constexpr):
        """Program (request b, head h): out = sum_s w_s * ACC[b, s, h] / sum_s w_s with
        w_s = exp2(LSE[b, s, h] - max_s LSE); zeros when every split is empty (LSE = -inf)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        so = tl.arange(0, BLOCK_S)
        lse_base = LSE + b * stride_lb + h
        lse = tl.load(lse_base + so * stride_ls, mask=so < splits, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp2(lse - m), 0)

        dv = tl.arange(0, D_V)
        acc = tl.zeros([D_V], tl.float32)
        a_base = ACC + b * stride_ab + h * stride_ah + dv
        for s in range(0, splits):
            w = tl.exp2(tl.load(lse_base + s * stride_ls) - m)
            acc += w * tl.load(a_base + s * stride_as)
        out = acc / tl.where(total > 0, total, 1.0)
        tl.store(OUT + b * stride_ob + h * stride_oh + dv, out.to(OUT.dtype.element_ty))

    #: True when Triton was imported with TRITON_INTERPRET=1: the kernels run on CPU tensors
    INTERPRETED = type(_sparse_mla_split).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


class SparseMLADecode:
    """Sparse MLA decode attention with buffers sized once for ``max_batch`` requests of at most
    ``top_k`` rows and ``heads`` heads (see the module docstring for the tensor contract).

    ``__call__(q, kv, rows)`` returns ``out[:bs]``, a view of the module's bf16 output buffer
    (overwritten by the next call). On CUDA (or CPU tensors under TRITON_INTERPRET=1) it runs
    the Triton split-K kernels: grid (bs, splits, head_blocks), each program a contiguous chunk
    of whole ``block_n``-row tiles for 16 heads, then a combine over the splits (skipped with
    one split). ``splits_for(bs)`` fixes the split count from (bs, k) alone, so a call's launch
    configuration, and hence a captured graph, is the same every time. For CPU tensors without
    the interpreter (or anywhere without Triton) it writes the float32 reference, cast to bf16,
    into the same buffer.

    Defaults: ``block_n`` 64, 4 warps, 2 stages and ``target_ctas`` = 2 x the SM count were
    the fastest of the settings tried on an H200 (bs 38-64, k 2048: ~2.4-2.6 TB/s of rows);
    block_n 32 needs 3 stages to come close, 8 warps is slower.
    """

    def __init__(self, *, max_batch: int, heads: int, top_k: int, dim: int = 576,
                 v_dim: int = 512, device, block_n: int = 64, target_ctas: int | None = None,
                 scale: float | None = None, num_warps: int = 4, num_stages: int = 2):
        rope = dim - v_dim
        for name, v in (("v_dim", v_dim), ("dim - v_dim", rope), ("block_n", block_n)):
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} = {v}: must be a power of two >= 16 (tl.dot tiles)")
        if min(max_batch, heads, top_k) < 1:
            raise ValueError(f"max_batch, heads, top_k = {max_batch}, {heads}, {top_k}: must be >= 1")
        self.device = torch.device(device)
        self.max_batch, self.heads, self.top_k = max_batch, heads, top_k
        self.dim, self.v_dim, self.block_n = dim, v_dim, block_n
        self.scale = dim ** -0.5 if scale is None else scale
        self.num_warps, self.num_stages = num_warps, num_stages
        self.head_blocks = _cdiv(heads, BLOCK_H)
        if target_ctas is None:
            sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                   if self.device.type == "cuda" else DEFAULT_SMS)
            target_ctas = 2 * sms
        self.target_ctas = target_ctas
        # Split slots: request b's splits are slots [b * splits, (b + 1) * splits) of one flat
        # buffer, so the partials scale with max(bs * splits) (~target_ctas + max_batch), not
        # max_batch * max(splits).
        self.max_splits = self._split_bound(1)
        self.slots = max(bs * self._split_bound(bs) for bs in range(1, max_batch + 1))
        self.out = torch.empty(max_batch, heads, v_dim, dtype=torch.bfloat16, device=self.device)
        self.partial = torch.empty(self.slots, heads, v_dim, dtype=torch.float32, device=self.device)
        self.lse = torch.empty(self.slots, heads, dtype=torch.float32, device=self.device)
        self.block_s = triton.next_power_of_2(self.max_splits) if triton is not None else 1

    def _split_bound(self, bs: int) -> int:
        """Upper bound on ``splits_for(bs, k)`` for every k <= top_k."""
        return max(1, min(_cdiv(self.target_ctas, bs * self.head_blocks),
                          _cdiv(self.top_k, self.block_n)))

    def plan(self, bs: int, k: int | None = None) -> tuple[int, int]:
        """(splits, rows per split) for ``bs`` requests of ``k`` rows (default ``top_k``): about
        ``target_ctas`` programs in all, each split a whole number (>= 1) of tiles."""
        k = self.top_k if k is None else k
        tiles = max(1, _cdiv(k, self.block_n))
        want = _cdiv(self.target_ctas, bs * self.head_blocks)
        per = _cdiv(tiles, max(1, min(want, tiles)))  # tiles per split
        return _cdiv(tiles, per), per * self.block_n

    def splits_for(self, bs: int, k: int | None = None) -> int:
        """Splits per request for ``bs`` requests of ``k`` rows (default ``top_k``)."""
        return self.plan(bs, k)[0]

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        bs, k = rows.shape
        if q.shape != (bs, self.heads, self.dim) or not q.is_contiguous():
            raise ValueError(f"q {tuple(q.shape)}: want contiguous ({bs}, {self.heads}, {self.dim})")
        if kv.dim() != 2 or kv.shape[1] != self.dim or kv.stride(1) != 1:
            raise ValueError(f"kv {tuple(kv.shape)} stride {kv.stride()}: want [N, {self.dim}] rows")
        if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
            raise ValueError(f"q, kv dtypes {q.dtype}, {kv.dtype}: want bfloat16")
        if rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"rows dtype {rows.dtype}: want int32 or int64")
        if bs > self.max_batch or k > self.top_k:
            raise ValueError(f"bs, k = {bs}, {k}: exceeds max_batch {self.max_batch}, top_k {self.top_k}")
        out = self.out[:bs]
        if bs == 0:
            return out
        if triton is None or (q.device.type == "cpu" and not INTERPRETED):
            out.copy_(sparse_mla_reference(q, kv, rows, v_dim=self.v_dim, scale=self.scale))
            return out
        splits, rows_per_split = self.plan(bs, k)
        H, dv = self.heads, self.v_dim
        # partial slot of (request b, split s) is b * splits + s
        sab, sas, sah = splits * H * dv, H * dv, dv
        slb, sls = splits * H, H
        _sparse_mla_split[(bs, splits, self.head_blocks)](
            q, kv, rows, self.partial, self.lse, out,
            q.stride(0), q.stride(1), kv.stride(0), rows.stride(0), rows.stride(1),
            sab, sas, sah, slb, sls, out.stride(0), out.stride(1),
            H, k, rows_per_split, self.scale * _LOG2E,
            D_V=dv, D_R=self.dim - dv, BLOCK_H=BLOCK_H, BLOCK_N=self.block_n,
            DIRECT=splits == 1, UPCAST=INTERPRETED, num_warps=self.num_warps, num_stages=self.num_stages)
        if splits > 1:
            _sparse_mla_combine[(bs, H)](
                self.partial, self.lse, out, sab, sas, sah, slb, sls,
                out.stride(0), out.stride(1), splits,
                D_V=dv, BLOCK_S=self.block_s, num_warps=4)
        return out


def time_attention(module: SparseMLADecode, q: torch.Tensor, kv: torch.Tensor,
                   rows: torch.Tensor, reps: int = 20) -> float | None:
    """Median microseconds per ``module(q, kv, rows)`` call, from 5 replays of one CUDA graph
    holding ``reps`` calls (captured after a warm-up call that compiles the kernels); None for
    CPU tensors."""
    if q.device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        module(q, kv, rows)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            module(q, kv, rows)
    graph.replay()  # the first replay pays one-off upload costs
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0 / reps)
    return statistics.median(times)


__all__ = ["BLOCK_H", "INTERPRETED", "SparseMLADecode", "attention_bytes", "attention_flops",
           "sparse_mla_reference", "time_attention"]
