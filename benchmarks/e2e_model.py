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
    attention          ``sparse_mla`` (default): a real sparse MLA decode
                       (``e2e_attention.SparseMLADecode``, Triton): per request, ``heads`` query
                       heads of 576 dims against the k resolved rows (K: all 576 bf16 dims, V:
                       the first 512), softmax and the weighted sum; each row read once for
                       all heads, as FlashMLA's sparse decode does.
                       ``bag``: one ``embedding_bag`` sum over the k resolved rows
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

DeepSeek-V4's stack (``--stack v4``, :func:`v4_model`): the toy's layers are V4's C4 layers
(the ones HiSparse serves), a KV row is one compressed entry of ``compress_ratio`` = 4 tokens
(592-byte host rows, device entries in FlashMLA's C4 pages, ``kernels.row_layout.C4_PAGED``),
positions are entry indices, and a new entry exists only every 4th decode step. What V4 keeps
on the device in both modes (the sliding window of every layer, the C128 layers' entries) is
:class:`V4Resident`: counted in each request's HBM and read by the timed attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hisparse_testing.toy_model import _MASK, ToyModel, _mix
from sglang_hisparse.kernels.row_layout import TOKEN, RowLayout
from sglang_hisparse.memory.paged import ceil_div

#: hidden size of the dense stand-in's activations (DeepSeek-V3.x / GLM-5 hidden size)
HIDDEN = 7168
#: timed attentions (module docstring): the real sparse MLA decode and two stand-ins
ATTENTIONS = ("sparse_mla", "bag", "gather")


def _layer_ids(layers: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """int64 [n, 1, 1] layer ids. Pass a device tensor inside a CUDA-graph capture: a list
    becomes a host-to-device copy of pageable memory, which a capture refuses."""
    t = layers if torch.is_tensor(layers) else torch.tensor(layers, dtype=torch.int64, device=device)
    return t.to(torch.int64).reshape(-1, 1, 1)


def _unit(x: torch.Tensor) -> torch.Tensor:
    """The toy's hash -> float in [-1, 1) (same formula as ``ToyModel._unit``)."""
    return (_mix(x) & 0xFFFF).to(torch.float32) / 32768.0 - 1.0


@dataclass(frozen=True)
class V4Resident:
    """DeepSeek-V4's device state outside HiSparse, per request (the same in both modes):
    every layer's sliding window of ``window`` tokens and the C128 layers' entries (one per 128
    tokens), rows of ``entry_bytes`` (a C4/C128 page is 64 entries in 37440 B: 585 B each).
    The C4 layers' indexer keys are the toy's own (``index_dim`` 33 float32 = 132 B, V4's fp8
    key + scale). DeepSeek-V4-Flash: 43 layers; 0 and 1 sliding window only, the even layers
    from 2 C4, the odd ones from 3 C128. ``partners[i]``: the non-C4 layers whose window (and
    C128 entries) C4 layer ``i``'s timed attention also reads, so one call per C4 layer covers
    all 43 layers."""

    layers: int = 43
    window: int = 128
    c4_layers: tuple[int, ...] = tuple(range(2, 43, 2))
    c128_layers: tuple[int, ...] = tuple(range(3, 43, 2))
    entry_bytes: int = 585
    partners: tuple[tuple[int, ...], ...] = field(
        default=((0, 1, 3),) + tuple((2 * i + 3,) for i in range(1, 20)) + ((),))

    def c128_entries(self, cap_tokens: int) -> int:
        return ceil_div(cap_tokens, 128)

    def rows(self, cap_tokens: int) -> int:
        """Resident rows per request: windows, then each C128 layer's entries."""
        return self.layers * self.window + len(self.c128_layers) * self.c128_entries(cap_tokens)

    def bytes_per_request(self, cap_tokens: int) -> int:
        return self.rows(cap_tokens) * self.entry_bytes

    def read_rows(self, c4_index: int, cap_tokens: int) -> list[int]:
        """A request's resident rows (offsets in its block) that C4 layer ``c4_index``'s step
        reads: its own window, then each partner's window and C128 entries."""
        w, c128 = self.window, {layer: i for i, layer in enumerate(self.c128_layers)}
        n128, base = self.c128_entries(cap_tokens), self.layers * self.window
        out: list[int] = []
        for layer in (self.c4_layers[c4_index],) + self.partners[c4_index]:
            out += range(layer * w, (layer + 1) * w)
            if layer in c128:
                out += range(base + c128[layer] * n128, base + (c128[layer] + 1) * n128)
        return out


@dataclass(frozen=True)
class BenchModel:
    """toy: the content model (L, k, I, D, sharing); churn: query noise amplitude (drives
    top-k churn); heads: attention heads per GPU; attention: "bag" or "gather" (module
    docstring); dense_mb / dense_mflop: weight bytes streamed per layer and per-token MFLOP
    per layer of the dense stand-in; compress_ratio: tokens per KV entry (V4: 4);
    row_layout: where an entry lives on the device; resident: V4's other device state;
    one_pass_scores: the indexer's scoring pass (the field's comment)."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention = {self.attention!r}; use one of {ATTENTIONS}.")
        if self.row_layout.paged and (self.attention != "bag" or self.toy.item_bytes != self.row_layout.host_item()):
            raise ValueError(f"the {self.row_layout.name} layout takes attention 'bag' and "
                             f"{self.row_layout.host_item()}-byte rows.")

    toy: ToyModel
    churn: float = 0.05
    heads: int = 16
    attention: str = "bag"
    dense_mb: float = 0.0
    dense_mflop: float = 0.0
    compress_ratio: int = 1
    row_layout: RowLayout = TOKEN
    resident: V4Resident | None = None
    #: score with one batched matmul (reads each gathered key once, as a fused indexer kernel
    #: does) when the calibrated selection forces all k winners, so the scores' rounding, which
    #: may depend on the batch shape, cannot change the answer; else the elementwise sum
    one_pass_scores: bool = False

    @property
    def anchors(self) -> list[int]:
        return [i for i, s in enumerate(self.toy.shared) if not s]

    @property
    def device_row_bytes(self) -> int:
        """HBM per device row: the row, or a paged layout's page share (C4: 37440 / 64)."""
        lay = self.row_layout
        return lay.page_bytes // lay.entries if lay.paged else self.toy.item_bytes

    def entries(self, tokens: int) -> int:
        """KV entries (positions of the index space) of a request of ``tokens`` tokens."""
        return tokens // self.compress_ratio

    def oracle_kv(self, seed: int, pos: torch.Tensor, layer: int) -> torch.Tensor:
        """``toy.kv`` as the device holds it: a paged layout does not store a row's padding."""
        return self._unpadded(self.toy.kv(seed, pos, layer))

    def _unpadded(self, rows: torch.Tensor) -> torch.Tensor:
        lay = self.row_layout
        if lay.paged:
            rows[..., lay.data + lay.tail:] = 0
        return rows

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
        return self._unpadded(words.contiguous().view(torch.uint8)[:, : m.item_bytes].contiguous())

    def kv_rows_layers(self, seeds: torch.Tensor, pos: torch.Tensor, layers: int) -> torch.Tensor:
        """uint8 [layers, bs, I]: ``[l] == kv_rows(seeds, pos, l)`` for every layer at once (one
        chain of launches per step instead of one per layer: a model writes a layer's KV in one
        kernel, the toy's hash takes ~40)."""
        m = self.toy
        s = seeds.to(torch.int64).reshape(1, -1, 1)
        p = pos.to(torch.int64).reshape(1, -1, 1)
        lay = torch.arange(layers, dtype=torch.int64, device=p.device).reshape(-1, 1, 1)
        j = torch.arange(m.item_bytes // 8, dtype=torch.int64, device=p.device)
        base = ((s * 1_000_003 + lay * 7_919) * 0x85EBCA77) & _MASK
        words = _mix(p * 0x9E3779B1 + base + j * 0xC2B2AE3D + 1)
        return self._unpadded(words.contiguous().view(torch.uint8)[..., : m.item_bytes].contiguous())

    def index_key_rows_layers(self, seeds: torch.Tensor, pos: torch.Tensor,
                              layers: list[int] | torch.Tensor) -> torch.Tensor:
        """float32 [len(layers), bs, D]: ``[i] == index_key_rows(seeds, pos, layers[i])``."""
        s = seeds.to(torch.int64).reshape(1, -1, 1)
        p = pos.to(torch.int64).reshape(1, -1, 1)
        d = torch.arange(self.toy.index_dim, dtype=torch.int64, device=p.device)
        lay = _layer_ids(layers, p.device)
        seed_term = (s * 0xCC9E2D51) & _MASK
        return _unit(p * 0x632BE5AB + d * 0x1B873593 + seed_term + lay * 0x38495AB5)

    def index_key_rows(self, seeds: torch.Tensor, pos: torch.Tensor, layer: int) -> torch.Tensor:
        """float32 [bs, D]: row ``i`` == ``toy.index_keys(seeds[i], pos[i:i+1], layer)[0]``."""
        s = seeds.to(torch.int64).reshape(-1, 1)
        p = pos.to(torch.int64).reshape(-1, 1)
        d = torch.arange(self.toy.index_dim, dtype=torch.int64, device=p.device)
        seed_term = (s * 0xCC9E2D51) & _MASK
        return _unit(p * 0x632BE5AB + d * 0x1B873593 + seed_term + layer * 0x38495AB5)

    def queries(self, seeds: torch.Tensor, n: int | torch.Tensor, layer: int) -> torch.Tensor:
        """float32 [bs, D]: per-request stable direction + ``churn`` * per-step noise
        (``n``: the step's token count, an int or an int64 [1] device tensor, so a compressed
        stack's query changes every step)."""
        s = seeds.to(torch.int64).reshape(-1, 1)
        d = torch.arange(self.toy.index_dim, dtype=torch.int64, device=s.device)
        stable = _unit(d * 0x1B873593 + ((s * 0x2545F491) & _MASK) + layer * 0x9E3779B9)
        noise = _unit(d * 0x4CF5AD43 + (((s * 131 + n) * 0x2545F491) & _MASK) + layer)
        return stable + self.churn * noise

    def queries_layers(self, seeds: torch.Tensor, n: int | torch.Tensor,
                       layers: list[int] | torch.Tensor) -> torch.Tensor:
        """float32 [len(layers), bs, D]: ``[i] == queries(seeds, n, layers[i])``, in one chain."""
        s = seeds.to(torch.int64).reshape(1, -1, 1)
        d = torch.arange(self.toy.index_dim, dtype=torch.int64, device=s.device)
        lay = _layer_ids(layers, s.device)
        stable = _unit(d * 0x1B873593 + ((s * 0x2545F491) & _MASK) + lay * 0x9E3779B9)
        noise = _unit(d * 0x4CF5AD43 + (((s * 131 + n) * 0x2545F491) & _MASK) + lay)
        return stable + self.churn * noise

    def select(self, keys: torch.Tensor, q: torch.Tensor, n: int | torch.Tensor,
               forced: torch.Tensor | None = None) -> torch.Tensor:
        """Top-k positions int32 [bs, k] of ``keys`` float32 [bs, w, D] under ``q`` [bs, D],
        over the first ``n`` of the ``w`` positions (an int, or an int64 [1] device tensor so a
        CUDA graph captured once serves every step: positions ``>= n`` rank below all others).

        ``forced`` int32 [bs, k'] (distinct positions < n per row, k' <= k): these win, in
        their order, ahead of every scored position (the calibrated selections of
        ``e2e_selection``); the indexer's work is the same either way."""
        if self.one_pass_scores and forced is not None and forced.shape[1] >= self.toy.top_k:
            scores = torch.bmm(keys, q[:, :, None])[:, :, 0]
        else:
            scores = keys[:, :, 0] * q[:, 0:1]
            for d in range(1, keys.shape[2]):
                scores = torch.addcmul(scores, keys[:, :, d], q[:, d : d + 1])
        w = keys.shape[1]
        pos = torch.arange(w, dtype=torch.int64, device=keys.device)
        n_f = n.to(torch.float32) if torch.is_tensor(n) else float(n)
        scores = scores + self.toy.recency * (pos.to(torch.float32) / n_f) ** 4
        # NOTE: float ties would let topk order equal scores differently in different batch
        # shapes (and across runs), so full-KV and HiSparse could disagree on a column. Keys
        # (score quantised to 2^-20, position) are unique: one answer, whatever the batch.
        ranked = torch.round(scores * 2**20).to(torch.int64) * (1 << w.bit_length()) + pos
        if torch.is_tensor(n) or n < w:
            ranked = torch.where(pos < n, ranked, torch.full_like(ranked, -(1 << 62)))
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
        self.mla = None
        if model.attention == "sparse_mla":
            from e2e_attention import SparseMLADecode

            # MLA rows: 512 latent + 64 rope dims; a smaller toy row splits in halves
            self.v_dim = 512 if self.dim > 512 else self.dim // 2
            self.mla = SparseMLADecode(max_batch=max_batch, heads=model.heads, top_k=model.toy.top_k,
                                       dim=self.dim, v_dim=self.v_dim, device=device)
            self.q_mla = self.q.to(torch.bfloat16).contiguous()

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
        lay = self.model.row_layout
        if self.mla is not None:
            return self.mla(self.q_mla[:bs], kv_layer.view(torch.bfloat16), rows)
        if self.model.attention == "bag":
            idx = rows.clamp(min=0).to(torch.int64)
            if lay.paged:
                # a C4 page is 65 x 576 B: entry r's data is row r + r // 64 of that view
                kv_layer = kv_layer.view(-1, lay.data)
                idx = idx + idx // lay.entries
            return self.bag(kv_layer, idx)
        flat = rows.reshape(-1).clamp(min=0).to(torch.int64)
        g = kv_layer.index_select(0, flat).view(bs, k, -1)
        kv = g.view(torch.bfloat16).view(bs, k, self.dim).to(self.dtype)
        s = torch.bmm(self.q[:bs], kv.transpose(1, 2))  # [bs, H, k]
        p = torch.softmax(s.float(), dim=-1).to(self.dtype)
        return torch.bmm(p, kv[:, :, : self.v_dim])  # [bs, H, v_dim]

    def bag(self, rows_table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Sum of rows ``idx`` int64 [bs, w] of ``rows_table`` uint8 [rows, bytes]: each row read once."""
        # CPU: float32 view (bf16 bags are slow there); values are meaningless either way.
        table = rows_table.view(torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        return torch.nn.functional.embedding_bag(idx, table, mode="sum")

    def dense(self, layer: int, bs: int) -> None:
        """The layer's weight stream and per-token GEMM (results unused; only cost matters)."""
        if self.w_stream:
            torch.mm(self.w_stream[layer % len(self.w_stream)], self.v_stream)
        if self.w_tok is not None:
            torch.mm(self.x[:bs], self.w_tok)
