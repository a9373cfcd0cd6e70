"""Synthetic hot-buffer states and top-k selections for kernel tests and benchmarks.

A state is what the coordinator keeps for one layer: ``slot_tokens`` [R, B+W] int32,
``slot_rows`` [R, B+W] int32, ``lru`` [R, B] int16, ``host_rows`` [R, max_ctx] int64, plus the
host/device KV arrays, with W = 1 for decode (:func:`make_state`, :func:`make_topk`) and the
verify window for a speculative verify step (:func:`make_verify_state`,
:func:`make_verify_topk`). Long requests start in a "steady state": distinct older positions
resident in a random LRU order, the window (decode: the newest token) in slots B.. . Short
requests hold token p in slot p. Selections are drawn with a controlled churn: the fraction of
the top-k that is not resident (the misses of the next resolve).
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


def make_verify_state(*, seq_lens: list[int], B: int, W: int, item: int, max_ctx: int | None = None,
                      device: str | torch.device = "cpu", pin: bool = False, seed: int = 0):
    """A :class:`~.synthetic.HotState` with ``[R, B+W]`` slots for rows-0 lengths ``seq_lens``.

    Long requests (``n0 + W - 1 > B``): history slots hold distinct positions ``< n0 - 1`` in a
    random LRU order (-1 when fewer exist), window slot ``B + j`` holds ``n0 - 1 + j``. Short
    ones hold token p in slot p. Device row of slot s of request r: ``1 + r*(B+W) + s``.
    """
    g = torch.Generator().manual_seed(seed)
    R = len(seq_lens)
    max_ctx = max_ctx or max(seq_lens) + W
    st = torch.full((R, B + W), -1, dtype=torch.int32)
    lru = torch.arange(B, dtype=torch.int16).repeat(R, 1)
    for r, n0 in enumerate(seq_lens):
        base, N = n0 - 1, n0 + W - 1
        if N <= B:
            st[r, :N] = torch.arange(N, dtype=torch.int32)
            continue
        h = min(base, B)
        st[r, :h] = torch.randperm(base, generator=g)[:h].to(torch.int32)
        st[r, B:] = torch.arange(base, N, dtype=torch.int32)
        lru[r] = torch.randperm(B, generator=g).to(torch.int16)
    rows = (1 + torch.arange(R * (B + W), dtype=torch.int32)).view(R, B + W)
    H = R * max_ctx
    host_rows = torch.randperm(H, generator=g).view(R, max_ctx)
    host_cache = torch.randint(0, 256, (H, item), generator=g, dtype=torch.uint8)
    device_cache = torch.randint(0, 256, (1 + R * (B + W), item), generator=g, dtype=torch.uint8)
    if pin:
        host_cache = host_cache.pin_memory()
    dev = torch.device(device)
    return HotState(st.to(dev), rows.to(dev), lru.to(dev), host_rows.to(dev), host_cache,
                    device_cache.to(dev), torch.tensor(seq_lens, dtype=torch.int64))


def make_verify_topk(state, req_index: list[int], *, W: int, k: int, churn: float,
                     spread: float = 0.5, pad_entries: int = 0, seed: int = 0) -> torch.Tensor:
    """int32 [bs, W, k] verify selections; ``state.seq_lens`` holds the rows-0 lengths.

    Long request, row j: the window positions it can see (``base .. base+j``), ``churn*k``
    misses drawn from a per-request pool of ``(1+spread)*churn*k`` cold positions (so rows
    overlap: the union misses ~``(1+spread)*churn*k``), the rest resident history positions;
    the last ``pad_entries`` are -1; then shuffled. Short request: random positions < length.
    """
    g = torch.Generator().manual_seed(seed)
    B = state.lru.shape[1]
    tokens = state.slot_tokens.cpu()
    out = torch.full((len(req_index), W, k), -1, dtype=torch.int32)
    for b, r in enumerate(req_index):
        n0 = int(state.seq_lens[r])
        base = n0 - 1
        if n0 + W - 1 <= B:
            for j in range(W):
                out[b, j] = torch.randint(0, n0 + j, (k,), generator=g).to(torch.int32)
            continue
        hist = tokens[r, :B].long()
        hist = hist[(hist >= 0) & (hist < base)]
        is_res = torch.zeros(base, dtype=torch.bool)
        is_res[hist] = True
        cold = (~is_res).nonzero().flatten()
        pool = cold[torch.randperm(cold.numel(), generator=g)[: round((1 + spread) * churn * k)]]
        for j in range(W):
            n_miss = min(round(churn * k), pool.numel(), k - 1 - j)
            miss = pool[torch.randperm(pool.numel(), generator=g)[:n_miss]]
            n_hot = k - 1 - j - n_miss
            pick = (torch.randperm(hist.numel(), generator=g)[:n_hot] if hist.numel() >= n_hot
                    else torch.randint(0, max(hist.numel(), 1), (n_hot,), generator=g))
            hot = hist[pick] if hist.numel() else torch.full((n_hot,), base, dtype=torch.long)
            row = torch.cat([torch.arange(base, base + j + 1), miss, hot])
            if pad_entries:
                row[k - pad_entries:] = -1
            out[b, j] = row[torch.randperm(k, generator=g)].to(torch.int32)
    return out.to(state.slot_tokens.device)
