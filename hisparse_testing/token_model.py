"""A token-level toy DSA model: every tensor is a pure function of token ids and positions.

The real-scheduler rig (``sglang_rig``) runs it inside SGLang's scheduler, where the
model sees only what a real model sees: token ids, positions and KV locations. So, unlike
``ToyModel`` (keyed by a request seed), everything here derives from the token sequence::

    KV row of (token t at position p, layer l)   bf16 [kv_dim], finite, from hash(t, p, l)
    index key of (t, p)                          int64, stored by logical location
    selection at length n, anchor layer l        top-k of score(key[p], query(n, token[n-1], l))
                                                 over p < n, unique integer scores (no ties),
                                                 a recency bonus so later steps reuse earlier picks
    next token                                   hash of the selected KV bytes of every layer,
                                                 weighted by top-k column, mod vocab

:func:`reference_generate` runs the same model with full KV (every row recomputed from the
tokens): what a HiSparse-off server produces under greedy sampling. A HiSparse run that
resolves any selected row to the wrong bytes, or a scheduler path that loses a token,
changes the generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hisparse_testing.toy_model import _mix

_MASK = (1 << 62) - 1


@dataclass(frozen=True)
class TokenModel:
    """num_layers: L; top_k: k; vocab: output token range; nope_dim / rope_dim: the MLA row
    halves (512 / 64 for DeepSeek-V3.2's bf16 layout: 1152 B); shared: per layer, True =
    reuse the previous anchor's selection (layer 0 must be False)."""

    num_layers: int
    top_k: int
    vocab: int = 1000
    nope_dim: int = 512
    rope_dim: int = 64
    shared: tuple[bool, ...] = field(default=())
    recency_window: int = 24
    #: block top-k (MiniMax-M3): the layers in ``block_layers`` select ``top_k / block_size``
    #: blocks of ``block_size`` positions (0: every layer selects positions)
    block_size: int = 0
    block_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        shared = self.shared or tuple([False] * self.num_layers)
        if len(shared) != self.num_layers or shared[0]:
            raise ValueError(
                f"shared = {shared} must have num_layers = {self.num_layers} entries with "
                f"shared[0] False (the first layer computes its own selection)."
            )
        object.__setattr__(self, "shared", tuple(bool(s) for s in shared))
        if self.block_size and (self.top_k % self.block_size or any(self.shared)):
            raise ValueError(
                f"block_size = {self.block_size} must divide top_k = {self.top_k}, with no shared "
                f"layers (MiniMax-M3 selects per layer)."
            )

    def selects_blocks(self, layer: int) -> bool:
        return bool(self.block_size) and layer in self.block_layers

    def select_blocks(self, keys: torch.Tensor, last_token: int, layer: int) -> torch.Tensor:
        """Block ids int32 [top_k / block_size] (-1 padded): the blocks of :meth:`select`'s
        positions in the order their first position appears there."""
        size, want = self.block_size, self.top_k // self.block_size
        out = torch.full((want,), -1, dtype=torch.int32)
        seen: list[int] = []
        for p in self.select(keys, last_token, layer).tolist():
            if p >= 0 and p // size not in seen:
                seen.append(p // size)
                if len(seen) == want:
                    break
        out[: len(seen)] = torch.tensor(seen, dtype=torch.int32)
        return out

    def expand(self, blocks: torch.Tensor, n: int) -> torch.Tensor:
        """Positions int32 [..., blocks x block_size] of ``blocks`` at length ``n`` (block ``b``:
        ``b * size .. b * size + size - 1``; -1 for a -1 block and at or past ``n``)."""
        size = self.block_size
        pos = blocks.to(torch.int64)[..., None] * size + torch.arange(size)
        pos = torch.where((blocks[..., None] >= 0) & (pos < n), pos, -1)
        return pos.reshape(*blocks.shape[:-1], -1).to(torch.int32)

    def positions(self, keys: torch.Tensor, last_token: int, layer: int) -> torch.Tensor:
        """The positions int32 [top_k] layer ``layer`` reads at length ``keys.shape[0]``."""
        if self.selects_blocks(layer):
            return self.expand(self.select_blocks(keys, last_token, layer), keys.shape[0])
        return self.select(keys, last_token, layer)

    @property
    def kv_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    def anchor_of(self, layer: int) -> int:
        while self.shared[layer]:
            layer -= 1
        return layer

    # -- content ------------------------------------------------------------------------------
    def kv(self, tokens: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """bf16 [n, kv_dim] KV of ``tokens`` at ``positions`` (int, same length) in ``layer``.

        Each value is sign and mantissa from the hash with the exponent pinned to [0.5, 1):
        finite, so the bits survive any bf16 copy unchanged."""
        t = tokens.to(torch.int64).reshape(-1, 1)
        p = positions.to(torch.int64).reshape(-1, 1)
        j = torch.arange(self.kv_dim, dtype=torch.int64, device=t.device)
        h = _mix(t * 0x9E3779B1 + p * 0x85EBCA77 + layer * 0xC2B2AE3D + j * 0x27D4EB2F + 7)
        bits = ((h & 0x807F) | 0x3F00).to(torch.int16)
        return bits.view(torch.bfloat16)

    def index_key(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """int64 [n] indexer key of each (token, position)."""
        return _mix(tokens.to(torch.int64) * 0x632BE5AB + positions.to(torch.int64) * 0x1B873593 + 3)

    def select(self, keys: torch.Tensor, last_token: int, layer: int) -> torch.Tensor:
        """Top-k positions int32 [k] over ``keys`` int64 [n] (positions 0..n-1), -1 padded.

        Scores are unique integers (position in the low bits) so the order is total; the
        ``recency_window`` newest positions get a bonus, as real indexers favour recent text."""
        n, k = keys.shape[0], self.top_k
        q = int(_mix(torch.tensor([(last_token * 0x2545F491 + n * 131 + layer * 0x9E3779B9) & _MASK]))[0])
        pos = torch.arange(n, dtype=torch.int64, device=keys.device)
        score = _mix(keys ^ q) & 0xFFFF
        score = score + torch.where(pos >= n - self.recency_window, 0x8000, 0)
        score = score * 65536 + pos
        out = torch.full((k,), -1, dtype=torch.int32, device=keys.device)
        take = min(k, n)
        out[:take] = torch.topk(score, take).indices.to(torch.int32)
        return out

    def next_token(self, gathered: list[torch.Tensor]) -> int:
        """The token sampled from the selected KV: ``gathered`` per layer bf16 [k, kv_dim]
        (rows in top-k column order; padding columns all zero)."""
        acc = 0
        for layer, rows in enumerate(gathered):
            words = rows.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
            col = torch.arange(1, rows.shape[0] + 1, dtype=torch.int64)[:, None]
            acc = (acc * 1_000_003 + int((words * col).sum()) + layer) & _MASK
        return int(_mix(torch.tensor([acc]))[0]) % self.vocab

    # -- one forward at length n, every row recomputed ----------------------------------------
    def full_kv_step(self, tokens: list[int]) -> int:
        """The next token after ``tokens`` (all of them with KV), reading full KV."""
        t = torch.tensor(tokens, dtype=torch.int64)
        pos = torch.arange(len(tokens), dtype=torch.int64)
        keys = self.index_key(t, pos)
        gathered, sel = [], None
        for layer in range(self.num_layers):
            if not self.shared[layer]:
                sel = self.positions(keys, tokens[-1], layer)
            rows = torch.zeros(self.top_k, self.kv_dim, dtype=torch.bfloat16)
            ok = sel >= 0
            picked = sel[ok].to(torch.int64)
            rows[ok] = self.kv(t[picked], picked, layer)
            gathered.append(rows)
        return self.next_token(gathered)


def reference_generate(model: TokenModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy output tokens of ``prompt`` with full KV (HiSparse off)."""
    tokens, out = list(prompt), []
    for _ in range(max_new_tokens):
        nxt = model.full_kv_step(tokens)
        out.append(nxt)
        tokens.append(nxt)
    return out
