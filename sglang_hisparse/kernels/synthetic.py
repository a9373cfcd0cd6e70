"""Synthetic hot-buffer states and top-k selections for kernel tests and benchmarks.

A state is what the coordinator keeps for one layer: ``slot_tokens`` [R, B+1] int32,
``slot_rows`` [R, B+1] int32, ``lru`` [R, B] int16, ``host_rows`` [R, max_ctx] int64, plus the
host/device KV arrays. Long requests (n > B) start in a "steady state": B distinct older
positions resident in a random LRU order, the newest in slot B. Short requests hold token p in
slot p. Selections are drawn with a controlled churn: the fraction of the top-k that is not
resident (the misses of the next resolve).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernel_limits import position_words


@dataclass
class HotState:
    """One layer's hot-buffer state plus KV arrays (all on ``device`` except ``host_cache``)."""

    slot_tokens: torch.Tensor
    slot_rows: torch.Tensor
    lru: torch.Tensor
    host_rows: torch.Tensor
    host_cache: torch.Tensor
    device_cache: torch.Tensor
    seq_lens: torch.Tensor  # int64 [R]
    resident: torch.Tensor | None = None  # int32 [R, ceil(max_ctx/32)] hint, if one is kept

    def clone(self) -> HotState:
        """Deep copy (host_cache is shared: resolve never writes it)."""
        return HotState(self.slot_tokens.clone(), self.slot_rows.clone(), self.lru.clone(),
                        self.host_rows.clone(), self.host_cache, self.device_cache.clone(),
                        self.seq_lens.clone(),
                        None if self.resident is None else self.resident.clone())

    def with_hint(self, kind: str = "exact", seed: int = 0) -> HotState:
        """A copy keeping a resident hint: ``exact`` (what the slots hold), ``noise`` (random
        bits: a hint gone wrong, which must cost time only) or ``empty`` (all clear)."""
        from .reference import resident_hint

        B, words = self.lru.shape[1], position_words(self.host_rows.shape[1])
        st = self.clone()
        if kind == "exact":
            st.resident = resident_hint(self.slot_tokens, B, words)
        elif kind == "noise":
            g = torch.Generator().manual_seed(seed)
            bits = torch.randint(-(2**31), 2**31, (self.lru.shape[0], words), generator=g)
            st.resident = bits.to(torch.int32).to(self.slot_tokens.device)
        elif kind == "empty":
            st.resident = torch.zeros(self.lru.shape[0], words, dtype=torch.int32,
                                      device=self.slot_tokens.device)
        else:
            raise ValueError(f"hint kind {kind!r}: use 'exact', 'noise' or 'empty'.")
        return st


def make_state(
    *, seq_lens: list[int], B: int, item: int, max_ctx: int | None = None,
    host_pool_rows: int | None = None, device: str | torch.device = "cpu", pin: bool = False,
    seed: int = 0,
) -> HotState:
    """Build a state for ``len(seq_lens)`` request slots.

    Device rows: slot s of request r uses row ``1 + r*(B+1) + s`` (row 0 is the padding row).
    Host rows: random over a pool of ``host_pool_rows`` rows (default ``R*max_ctx``), so that
    reads are scattered like a real host pool. KV bytes are random.
    """
    g = torch.Generator().manual_seed(seed)
    R = len(seq_lens)
    max_ctx = max_ctx or max(seq_lens)
    H = host_pool_rows or R * max_ctx
    slot_tokens = torch.full((R, B + 1), -1, dtype=torch.int32)
    lru = torch.empty(R, B, dtype=torch.int16)
    for r, n in enumerate(seq_lens):
        if n <= B:
            slot_tokens[r, :n] = torch.arange(n, dtype=torch.int32)
            lru[r] = torch.arange(B, dtype=torch.int16)
        else:
            slot_tokens[r, :B] = torch.randperm(n - 1, generator=g)[:B].to(torch.int32)
            slot_tokens[r, B] = n - 1
            lru[r] = torch.randperm(B, generator=g).to(torch.int16)
    slot_rows = (1 + torch.arange(R * (B + 1), dtype=torch.int32)).view(R, B + 1)
    host_rows = torch.randint(0, H, (R, max_ctx), generator=g, dtype=torch.int64)
    host_cache = torch.randint(0, 256, (H, item), generator=g, dtype=torch.uint8)
    device_cache = torch.randint(0, 256, (1 + R * (B + 1), item), generator=g, dtype=torch.uint8)
    if pin and torch.cuda.is_available():
        host_cache = host_cache.pin_memory()
    dev = torch.device(device)
    return HotState(slot_tokens.to(dev), slot_rows.to(dev), lru.to(dev), host_rows.to(dev),
                    host_cache, device_cache.to(dev), torch.tensor(seq_lens, dtype=torch.int64))


def make_topk(
    state: HotState, req_index: list[int], *, k: int, churn: float | list[float],
    dup_frac: float = 0.0, pad_entries: int = 0, seed: int = 0,
) -> torch.Tensor:
    """int32 [len(req_index), k] selections for the given request slots.

    Long request: the newest token, then ``round(churn*k)`` non-resident positions (misses),
    the rest drawn from resident positions (hits); ``dup_frac`` of the entries are replaced by
    copies of other entries, the last ``pad_entries`` are -1, then the row is shuffled.
    Short request: ``k`` positions (with repeats if n < k) of [0, n).
    """
    g = torch.Generator().manual_seed(seed)
    B = state.lru.shape[1]
    tokens = state.slot_tokens.cpu()
    out = torch.full((len(req_index), k), -1, dtype=torch.int32)
    churns = churn if isinstance(churn, list) else [churn] * len(req_index)
    for b, r in enumerate(req_index):
        n = int(state.seq_lens[r])
        if n <= B:
            row = torch.randint(0, n, (k,), generator=g) if n < k else torch.randperm(n, generator=g)[:k]
        else:
            resident = tokens[r, :B].long()
            is_res = torch.zeros(n, dtype=torch.bool)
            is_res[resident[resident >= 0]] = True
            is_res[n - 1] = True
            cold = (~is_res).nonzero().flatten()
            n_miss = min(round(churns[b] * k), cold.numel(), k - 1)
            miss = cold[torch.randperm(cold.numel(), generator=g)[:n_miss]]
            hot = resident[torch.randperm(B, generator=g)[: k - 1 - n_miss]]
            row = torch.cat([torch.tensor([n - 1]), miss, hot])
        n_dup = int(dup_frac * k)
        if n_dup:
            at = torch.randperm(k, generator=g)[:n_dup]
            row[at] = row[torch.randint(0, k, (n_dup,), generator=g)]
        if pad_entries:
            row[k - pad_entries:] = -1
        out[b] = row[torch.randperm(k, generator=g)].to(torch.int32)
    return out.to(state.slot_tokens.device)
