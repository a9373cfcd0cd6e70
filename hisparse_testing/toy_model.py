"""A toy DSA-like model whose every tensor is a pure function of (request seed, position, layer).

Nothing is stored: KV bytes, index keys and queries come from an integer hash evaluated on
the fly, on any device. That makes the "all KV resident" oracle free (recompute the bytes of
the selected positions) and lets a retracted request re-prefill bit-identical KV.

Per layer ``l`` and decode step (request of length ``n``):

```
indexer (anchor layers only)   keys read from the device pool's logical-space key cache;
                               scores[p] = <key[p], query(seed, n, anchor)> + recency bonus;
                               top-k positions (int32 [k], -1 padded if n < k)
shared layers                  reuse the anchor's top-k (index_topk_freq-style sharing)
attention                      gathers the k selected KV rows (uint8 [k, I]) and reduces them
                               to float32 [I] with position-in-top-k weights
```

The engine computes the top-k once and feeds the same positions to the HiSparse path (rows
resolved by the coordinator) and to the oracle (bytes recomputed here), so any difference in
the attention output is a difference in the bytes the device rows hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MASK = (1 << 62) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A cheap integer hash on int64 tensors (wrapping arithmetic; values stay >= 0)."""
    x = x & _MASK
    x = (x ^ (x >> 31)) * 0x5BD1E995 & _MASK
    x = (x ^ (x >> 29)) * 0x27D4EB2F & _MASK
    x = (x ^ (x >> 32)) * 0x165667B1 & _MASK
    return (x ^ (x >> 27)) & _MASK


def _scalar(a: int, b: int) -> int:
    """``a * b`` folded into the hash's 62-bit range (Python ints do not wrap; torch's do)."""
    return (a * b) & _MASK


@dataclass(frozen=True)
class ToyModel:
    """num_layers: L; top_k: k; item_bytes: I (multiple of 16); index_dim: indexer key width;
    shared: per layer, True = reuse the previous anchor's top-k (layer 0 must be False);
    recency: weight of the score bonus for recent positions (drives the hit rate)."""

    num_layers: int
    top_k: int
    item_bytes: int
    index_dim: int = 8
    shared: tuple[bool, ...] = field(default=())
    recency: float = 1.5

    def __post_init__(self) -> None:
        shared = self.shared or tuple([False] * self.num_layers)
        if len(shared) != self.num_layers or shared[0]:
            raise ValueError(
                f"shared = {shared} must have num_layers = {self.num_layers} entries with "
                f"shared[0] False (the first layer computes its own index)."
            )
        object.__setattr__(self, "shared", tuple(bool(s) for s in shared))

    def anchor_of(self, layer: int) -> int:
        """The layer whose top-k ``layer`` uses (itself for anchors)."""
        while self.shared[layer]:
            layer -= 1
        return layer

    # -- content ------------------------------------------------------------------------------
    def kv(self, seed: int, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """KV bytes uint8 [len(positions), I] of ``positions`` (int, any device) at ``layer``."""
        p = positions.to(torch.int64).reshape(-1, 1)
        j = torch.arange(self.item_bytes // 8, dtype=torch.int64, device=p.device)
        base = _scalar(seed * 1_000_003 + layer * 7_919, 0x85EBCA77)
        words = _mix(p * 0x9E3779B1 + base + j * 0xC2B2AE3D + 1)
        return words.contiguous().view(torch.uint8)[:, : self.item_bytes].contiguous()

    def kv_salted(self, seed: int, positions: torch.Tensor, salts: torch.Tensor, layer: int) -> torch.Tensor:
        """Like :meth:`kv` with a per-position ``salts`` int tensor (salt 0 == :meth:`kv`):
        the KV a verify round computed for a token; a different salt is a different draft."""
        p = positions.to(torch.int64).reshape(-1, 1)
        salt = salts.to(torch.int64, copy=False).to(p.device).reshape(-1, 1) * 0x27D4EB2F
        j = torch.arange(self.item_bytes // 8, dtype=torch.int64, device=p.device)
        base = _scalar(seed * 1_000_003 + layer * 7_919, 0x85EBCA77)
        words = _mix(p * 0x9E3779B1 + base + j * 0xC2B2AE3D + 1 + salt)
        return words.contiguous().view(torch.uint8)[:, : self.item_bytes].contiguous()

    def _unit(self, x: torch.Tensor) -> torch.Tensor:
        return (_mix(x) & 0xFFFF).to(torch.float32) / 32768.0 - 1.0

    def index_keys(self, seed: int, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """float32 [len(positions), index_dim] indexer keys (stored in logical space)."""
        p = positions.to(torch.int64).reshape(-1, 1)
        d = torch.arange(self.index_dim, dtype=torch.int64, device=p.device)
        return self._unit(p * 0x632BE5AB + d * 0x1B873593 + _scalar(seed, 0xCC9E2D51) + layer * 0x38495AB5)

    def query(self, seed: int, n: int, layer: int, device: torch.device) -> torch.Tensor:
        """float32 [index_dim] query at length ``n``: a per-request direction plus step noise."""
        d = torch.arange(self.index_dim, dtype=torch.int64, device=device)
        stable = self._unit(d * 0x1B873593 + _scalar(seed, 0x2545F491) + layer * 0x9E3779B9)
        noise = self._unit(d * 0x4CF5AD43 + _scalar(seed * 131 + n, 0x2545F491) + layer)
        return stable + 0.5 * noise

    def select(self, keys: torch.Tensor, seed: int, layer: int) -> torch.Tensor:
        """The indexer's top-k over ``keys`` float32 [n, index_dim] (positions 0..n-1, read
        from the logical-space key cache) at anchor ``layer``: int32 [k], positions in
        [0, n), -1 padded when n < k (as SGLang's unfused top-k returns)."""
        n, k, device = keys.shape[0], self.top_k, keys.device
        scores = keys @ self.query(seed, n, layer, device)
        pos = torch.arange(n, dtype=torch.float32, device=device)
        scores = scores + self.recency * (pos / n) ** 4
        out = torch.full((k,), -1, dtype=torch.int32, device=device)
        take = min(k, n)
        out[:take] = torch.topk(scores, take).indices.to(torch.int32)
        return out

    # -- attention ----------------------------------------------------------------------------
    def attend(self, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Reduce gathered KV bytes uint8 [bs, k, I] (``valid`` bool [bs, k]) to float32 [bs, I].

        Weights depend on the top-k column, so the reduction is sensitive to which bytes sit
        in which column, and the same inputs give the same bits on every run.
        """
        k = rows.shape[1]
        w = torch.linspace(1.0, 2.0, k, device=rows.device)[None, :, None]
        vals = rows.to(torch.float32) * w * valid[:, :, None]
        return vals.sum(dim=1)
