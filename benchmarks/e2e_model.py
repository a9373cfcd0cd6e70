"""The benchmark's model: the harness's toy DSA content, batched, plus timed compute stand-ins.

Content (what the KV bytes and indexer keys ARE) is exactly :class:`ToyModel`'s: the
batched helpers below evaluate the same integer hash for a vector of request seeds, so a
row written by a batched call equals ``ToyModel.kv(seed, pos, layer)`` bit for bit (the
smoke test checks it). That keeps the harness's oracle: any KV row can be recomputed.

Per decode step and layer (``bs`` requests of one length ``n``; ``k`` top-k)::

    indexer (anchors)  keys float32 [bs, n, D] gathered by token id from the logical-space
                       key cache; score = <key, q(seed, n)> + recency * (pos / n)^4;
                       q = stable(seed) + churn * noise(seed, n): ``churn`` sets how much of
                       the top-k changes per step. Elementwise (no matmul) so a request's
                       scores, hence its top-k (ties broken by position), do not depend
                       on the batch it runs in.
    attention          ``bag`` (default): one ``embedding_bag`` sum over the k resolved rows
                       viewed as bf16 [I/2]: reads each selected row once, the traffic of a
                       fused sparse MLA kernel (the ~71 MFLOP of 16-head math per request and
                       layer is left out). ``gather``: materialises the rows uint8 [bs, k, I]
                       and runs MLA-shaped attention for ``heads`` heads with bmm (QK over
                       all I/2 dims, PV over the first 512): ~4x the traffic.
    dense              stand-in for the layer's weights: streams ``dense_mb`` of bf16 weights
                       once per layer (batch-independent, like MoE expert weights at decode)
                       and does ``dense_mflop`` MFLOP per token (the routed-expert GEMMs).

The exactness check uses the toy's own ``attend`` (a float32 sum, no NaNs) on a few
sampled requests; the timed attention above treats random bytes as bf16, so its values are
meaningless (NaNs included) but its cost is that of real attention over those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_hisparse.testing.toy_model import _MASK, ToyModel, _mix

#: hidden size of the dense stand-in's activations (DeepSeek-V3.x / GLM-5 hidden size)
HIDDEN = 7168


def _unit(x: torch.Tensor) -> torch.Tensor:
    """The toy's hash -> float in [-1, 1) (same formula as ``ToyModel._unit``)."""
    return (_mix(x) & 0xFFFF).to(torch.float32) / 32768.0 - 1.0


@dataclass(frozen=True)
class BenchModel:
    """toy: the content model (L, k, I, D, sharing); churn: query noise amplitude (drives
    top-k churn); heads: attention heads per GPU; attention: "bag" or "gather" (module
    docstring); dense_mb / dense_mflop: weight bytes streamed per layer and per-token MFLOP
    per layer of the dense stand-in."""

    def __post_init__(self) -> None:
        if self.attention not in ("bag", "gather"):
            raise ValueError(f"attention = {self.attention!r}; use 'bag' or 'gather'.")

    toy: ToyModel
    churn: float = 0.05
    heads: int = 16
    attention: str = "bag"
    dense_mb: float = 0.0
    dense_mflop: float = 0.0

    @property
    def anchors(self) -> list[int]:
        return [i for i, s in enumerate(self.toy.shared) if not s]

    # -- content (bit-identical to ToyModel) --------------------------------------------------
    def kv_rows(self, seeds: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        """uint8 [bs, I]: row ``i`` == ``toy.kv(seeds[i], pos[i:i+1], layer)[0]``."""
        m = self.toy
        s = seeds.to(torch.int64).reshape(-1, 1)
        p = pos.to(torch.int64).reshape(-1, 1)
        j = torch.arange(m.item_bytes // 8, dtype=torch.int64, device=p.device)
        # int64 products wrap mod 2^64; masking to 62 bits then equals the toy's Python-int
        # arithmetic (it keeps the low 62 bits of the exact product too).
        base = ((s * 1_000_003 + layer * 7_919) * 0x85EBCA77) & _MASK
        words = _mix(p * 0x9E3779B1 + base + j * 0xC2B2AE3D + 1)
        return words.contiguous().view(torch.uint8)[:, : m.item_bytes].contiguous()

    def index_key_rows(self, seeds: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        """float32 [bs, D]: row ``i`` == ``toy.index_keys(seeds[i], pos[i:i+1], layer)[0]``."""
        s = seeds.to(torch.int64).reshape(-1, 1)
        p = pos.to(torch.int64).reshape(-1, 1)
        d = torch.arange(self.toy.index_dim, dtype=torch.int64, device=p.device)
        seed_term = (s * 0xCC9E2D51) & _MASK
        return _unit(p * 0x632BE5AB + d * 0x1B873593 + seed_term + layer * 0x38495AB5)

    def queries(self, seeds: torch.Tensor, n: int, layer: int) -> torch.Tensor:
        """float32 [bs, D]: per-request stable direction + ``churn`` * per-step noise."""
        s = seeds.to(torch.int64).reshape(-1, 1)
        d = torch.arange(self.toy.index_dim, dtype=torch.int64, device=s.device)
        stable = _unit(d * 0x1B873593 + ((s * 0x2545F491) & _MASK) + layer * 0x9E3779B9)
        noise = _unit(d * 0x4CF5AD43 + (((s * 131 + n) * 0x2545F491) & _MASK) + layer)
        return stable + self.churn * noise

    def select(self, keys: torch.Tensor, q: torch.Tensor, n: int,
               forced: torch.Tensor | None = None) -> torch.Tensor:
        """Top-k positions int32 [bs, k] of ``keys`` float32 [bs, n, D] under ``q`` [bs, D].

        ``forced`` int32 [bs, k'] (distinct positions < n per row, k' <= k): these win, in
        their order, ahead of every scored position (the calibrated selections of
        ``e2e_selection``); the indexer's work is the same either way."""
        scores = keys[:, :, 0] * q[:, 0:1]
        for d in range(1, keys.shape[2]):
            scores = torch.addcmul(scores, keys[:, :, d], q[:, d : d + 1])
        pos = torch.arange(n, dtype=torch.int64, device=keys.device)
        scores = scores + self.toy.recency * (pos.to(torch.float32) / n) ** 4
        # NOTE: float ties would let topk order equal scores differently in different batch
        # shapes (and across runs), so full-KV and HiSparse could disagree on a column. Keys
        # (score quantised to 2^-20, position) are unique: one answer, whatever the batch.
        ranked = torch.round(scores * 2**20).to(torch.int64) * (1 << n.bit_length()) + pos
        if forced is not None:
            # |ranked| < 2^45 for |score| < 2^7 and n < 2^18, so 2^60 + rank lifts the forced
            # positions above all others; distinct positions: scatter_ has one writer each.
            kf = forced.shape[1]
            lift = (1 << 60) + torch.arange(kf, 0, -1, dtype=torch.int64, device=keys.device)
            ranked.scatter_(1, forced.to(torch.int64), lift.expand(forced.shape[0], kf))
        return torch.topk(ranked, self.toy.top_k, dim=1).indices.to(torch.int32)


class ComputeStandIn:
    """Timed per-layer compute shared by every mode (see the module docstring).

    Allocates the dense weights once (``min(num_layers, weight_buffers)`` x ``dense_mb``;
    outside the KV budget, like real model weights) and persistent activations for batches up
    to ``max_batch``. NOTE: layer l streams buffer ``l % weight_buffers``: 61-78 layers of
    1.4 GB would not fit next to the KV budget, and a buffer of 1.4 GB re-read a few layers
    later comes from HBM again (L2 is 50 MB), so the traffic and time are the same.
    """

    def __init__(self, model: BenchModel, *, max_batch: int, device: torch.device,
                 weight_buffers: int = 4) -> None:
        self.model, self.device = model, device
        L = model.toy.num_layers
        self.dim = model.toy.item_bytes // 2  # bf16 values per row (576 for 1152-byte MLA rows)
        self.v_dim = min(512, self.dim)
        dt = torch.bfloat16 if device.type == "cuda" else torch.float32
        g = torch.Generator(device="cpu").manual_seed(7)
        self.q = (torch.randn(max_batch, model.heads, self.dim, generator=g) * 0.02).to(device, dt)
        cols = int(model.dense_mb * 2**20) // (2 * HIDDEN)
        nbuf = min(L, weight_buffers)
        self.w_stream = [torch.zeros(cols, HIDDEN, dtype=dt, device=device) for _ in range(nbuf)] if cols else []
        self.v_stream = torch.ones(HIDDEN, 1, dtype=dt, device=device)
        tok_cols = int(model.dense_mflop * 1e6) // (2 * HIDDEN)
        self.w_tok = torch.zeros(HIDDEN, tok_cols, dtype=dt, device=device) if tok_cols else None
        self.x = torch.zeros(max_batch, HIDDEN, dtype=dt, device=device)
        self.dtype = dt
        #: False: ``dense`` does nothing (the benchmark's *_nodense modes)
        self.dense_enabled = True

    @property
    def weight_bytes(self) -> int:
        """Bytes streamed per step as if every layer had its own weights."""
        L = self.model.toy.num_layers
        per = self.w_stream[0].numel() * self.w_stream[0].element_size() if self.w_stream else 0
        n = per * L
        return n + (0 if self.w_tok is None else self.w_tok.numel() * self.w_tok.element_size())

    def attention(self, kv_layer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """MLA-shaped attention over ``kv_layer`` uint8 [rows_total, I] rows ``rows`` int [bs, k]."""
        bs, k = rows.shape
        if self.model.attention == "bag":
            # CPU: float32 view (bf16 bags are slow there); values are meaningless either way.
            table = kv_layer.view(torch.bfloat16 if self.device.type == "cuda" else torch.float32)
            return torch.nn.functional.embedding_bag(rows.clamp(min=0).to(torch.int64), table, mode="sum")
        flat = rows.reshape(-1).clamp(min=0).to(torch.int64)
        g = kv_layer.index_select(0, flat).view(bs, k, -1)
        kv = g.view(torch.bfloat16).view(bs, k, self.dim).to(self.dtype)
        s = torch.bmm(self.q[:bs], kv.transpose(1, 2))  # [bs, H, k]
        p = torch.softmax(s.float(), dim=-1).to(self.dtype)
        return torch.bmm(p, kv[:, :, : self.v_dim])  # [bs, H, v_dim]

    def dense(self, layer: int, bs: int) -> None:
        """The layer's weight stream and per-token GEMM (results unused; only cost matters)."""
        if not self.dense_enabled:
            return
        if self.w_stream:
            torch.mm(self.w_stream[layer % len(self.w_stream)], self.v_stream)
        if self.w_tok is not None:
            torch.mm(self.x[:bs], self.w_tok)
