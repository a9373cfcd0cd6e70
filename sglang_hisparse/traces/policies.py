"""Replacement policies for one request-layer hot buffer of ``B`` slots (the simulator's unit).

Every policy sees the same protocol (docs/architecture.md, hot-buffer rules), driven by
``simulator.simulate_stream``: at the first step with ``seq_len > B`` the slots hold tokens
``0..B-1`` (slot ``s`` = token ``s``, LRU order ``s0..s(B-1)``; or empty, see ``clear``);
then, per step, ``step(t, sel, n)`` gets the sequence length and the unique selected
positions in top-k order *without* the newest token (it lives in the reserved slot and
always hits) and returns the number of misses. Hits stay;
misses must land in slots whose token is not selected this step ("evictable"); which
evictable slots, and how the order/state changes, is the policy.

Orders are kept as integer stamps (``key``; smaller = older) instead of explicit lists: the
kernel's "remaining evictables | fresh misses | hits" becomes "misses get the next stamps in
top-k order, then hits get the following stamps in their old relative order".
"""

from __future__ import annotations

import numpy as np

from ..kernel_policy import FRA_HITS_MAX, fra_bucket, slru_caps, slru_next


class Policy:
    """Shared bookkeeping: ``tok`` [B] token per slot (-1 empty), ``where`` token → slot."""

    name = "base"
    #: a policy that reads the indexer's next-best ranks (``use_ranks``): version-2 traces only
    needs_ranks = False

    def __init__(self, seed: int = 0):
        self.seed = seed

    def reset(self, B: int, max_pos: int, sels: list[np.ndarray]) -> None:
        """Start a stream: ``sels`` are all upcoming ``step`` arguments (for offline policies)."""
        self.B = B
        self.tok = np.arange(B, dtype=np.int64)
        self.where = np.full(max(max_pos, B), -1, dtype=np.int64)
        self.where[:B] = np.arange(B)
        self.key = np.arange(B, dtype=np.int64)
        self.clock = B

    def clear(self) -> None:
        """Empty every slot (PD direct admission of a long request starts this way)."""
        self.where[self.tok[self.tok >= 0]] = -1
        self.tok[:] = -1

    def step(self, t: int, sel: np.ndarray, n: int) -> int:
        """Step ``t`` (0 = first long step) with ``seq_len n``; returns its miss count."""
        self.n = n
        slots = self.where[sel]
        hit = slots >= 0
        hit_slots = slots[hit]
        miss_tok = sel[~hit]
        m = int(miss_tok.size)
        victims = np.zeros(0, dtype=np.int64)
        if m:
            evictable = np.ones(self.B, dtype=bool)
            evictable[hit_slots] = False
            cand = np.flatnonzero(evictable)
            if cand.size < m:
                raise ValueError(
                    f"step selects {sel.size} distinct positions besides the newest, more than the "
                    f"buffer's {self.B} slots; use --buffer >= top-k (or --top-k <= buffer)"
                )
            empty = cand[self.tok[cand] < 0]
            if empty.size:
                # Empty slots are filled first, in LRU order (the kernel's order puts them
                # oldest, since every filled slot got a newer stamp); the policy ranks the rest.
                empty = empty[np.argsort(self.key[empty], kind="stable")][:m]
                rest = m - empty.size
                full = cand[self.tok[cand] >= 0]
                victims = empty if not rest else np.concatenate(
                    (empty, self.victims(t, full, rest, miss_tok[empty.size:]))
                )
            else:
                victims = self.victims(t, cand, m, miss_tok)
            old = self.tok[victims]
            self.where[old[old >= 0]] = -1
            self.tok[victims] = miss_tok
            self.where[miss_tok] = victims
        self.update(t, sel, hit_slots, victims)
        return m

    def _oldest(self, cand: np.ndarray, m: int, key: np.ndarray) -> np.ndarray:
        """The ``m`` candidates with the smallest ``key``, smallest first."""
        k = key[cand]
        if m < cand.size:
            part = np.argpartition(k, m - 1)[:m]
            return cand[part[np.argsort(k[part], kind="stable")]]
        return cand[np.argsort(k, kind="stable")]

    def victims(self, t: int, cand: np.ndarray, m: int, miss_tok: np.ndarray) -> np.ndarray:
        return self._oldest(cand, m, self.key)

    def update(self, t: int, sel: np.ndarray, hit_slots: np.ndarray, victims: np.ndarray) -> None:
        pass

    def _stamp_kernel_order(self, hit_slots: np.ndarray, victims: np.ndarray) -> None:
        # misses (top-k order) then hits (old relative order) become the newest entries.
        m = victims.size
        self.key[victims] = self.clock + np.arange(m)
        if hit_slots.size:
            hs = hit_slots[np.argsort(self.key[hit_slots], kind="stable")]
            self.key[hs] = self.clock + m + np.arange(hs.size)
        self.clock += m + hit_slots.size


class LRU(Policy):
    """The kernel's order: remaining evictables | fresh misses (top-k order) | hits (old order)."""

    name = "lru"

    def update(self, t, sel, hit_slots, victims):
        self._stamp_kernel_order(hit_slots, victims)


class LRUPlain(Policy):
    """Textbook LRU over the step's accesses: hits and misses renewed together in top-k order."""

    name = "lru-plain"

    def update(self, t, sel, hit_slots, victims):
        slots = self.where[sel]
        self.key[slots] = self.clock + np.arange(slots.size)
        self.clock += slots.size


class FIFO(Policy):
    """Evict the longest-resident evictable slot; hits do not refresh."""

    name = "fifo"

    def update(self, t, sel, hit_slots, victims):
        self.key[victims] = self.clock + np.arange(victims.size)
        self.clock += victims.size


class Random(Policy):
    """Evict uniformly random evictable slots (seeded per stream: reproducible)."""

    name = "random"

    def reset(self, B, max_pos, sels):
        super().reset(B, max_pos, sels)
        self.rng = np.random.default_rng(self.seed)

    def victims(self, t, cand, m, miss_tok):
        return self.rng.choice(cand, size=m, replace=False)


class TopKOnly(Policy):
    """Only the current selection survives a step (a buffer of exactly the last top-k)."""

    name = "topk-only"

    def update(self, t, sel, hit_slots, victims):
        keep = np.zeros(self.B, dtype=bool)
        keep[self.where[sel]] = True
        drop = np.flatnonzero(~keep & (self.tok >= 0))
        self.where[self.tok[drop]] = -1
        self.tok[drop] = -1


class Belady(Policy):
    """Offline optimum: evict the evictable token whose next selection is furthest away."""

    name = "belady"
    NEVER = np.iinfo(np.int64).max

    def reset(self, B, max_pos, sels):
        super().reset(B, max_pos, sels)
        # Backward pass: next_use[t][i] = next step after t selecting sels[t][i].
        last = np.full(max(max_pos, B), self.NEVER, dtype=np.int64)
        self.next_use: list[np.ndarray] = [np.zeros(0, np.int64)] * len(sels)
        for t in range(len(sels) - 1, -1, -1):
            self.next_use[t] = last[sels[t]]
            last[sels[t]] = t
        self.key = last[:B].copy()  # first use of the initial tokens 0..B-1

    def victims(self, t, cand, m, miss_tok):
        return self._oldest(cand, m, -self.key)

    def update(self, t, sel, hit_slots, victims):
        self.key[self.where[sel]] = self.next_use[t]


class LRFU(Policy):
    """OUR policy: LRU refined by frequency (a combined recency/frequency value per slot).

    Per slot: ``crf`` (float) and ``last`` (step of the last selection). A selection at step
    ``t`` sets ``crf = crf * 2**(-lam * (t - last)) + 1``; a fresh miss starts at 1. The
    victim is the evictable slot with the smallest decayed value ``crf * 2**(-lam*(t-last))``,
    ties broken by the kernel's LRU order. ``lam = 1`` is step-granular LRU; smaller ``lam``
    lets tokens that were selected on many recent steps outlive one-off selections. Kernel
    cost: two words per slot and one extra multiply per evictable slot in the victim scan.
    """

    name = "lrfu"

    def __init__(self, seed: int = 0, lam: float = 0.25):
        super().__init__(seed)
        self.lam = lam

    def reset(self, B, max_pos, sels):
        super().reset(B, max_pos, sels)
        self.crf = np.zeros(B, dtype=np.float64)
        self.last = np.zeros(B, dtype=np.int64)

    def victims(self, t, cand, m, miss_tok):
        value = self.crf[cand] * np.exp2(-self.lam * (t - self.last[cand]))
        # Lexicographic: smallest value first, ties in the kernel's LRU order.
        order = np.lexsort((self.key[cand], value))
        return cand[order[:m]]

    def update(self, t, sel, hit_slots, victims):
        if hit_slots.size:
            self.crf[hit_slots] = self.crf[hit_slots] * np.exp2(-self.lam * (t - self.last[hit_slots])) + 1.0
            self.last[hit_slots] = t
        self.crf[victims] = 1.0
        self.last[victims] = t
        self._stamp_kernel_order(hit_slots, victims)


class LRU2(Policy):
    """OUR alternative: LRU-2 — evict by the second-most-recent selection step (tokens seen
    once go first), ties by the kernel's LRU order. Two step counters per slot."""

    name = "lru-2"

    def reset(self, B, max_pos, sels):
        super().reset(B, max_pos, sels)
        self.prev = np.full(B, -1, dtype=np.int64)
        self.last = np.full(B, -1, dtype=np.int64)

    def victims(self, t, cand, m, miss_tok):
        order = np.lexsort((self.key[cand], self.prev[cand]))
        return cand[order[:m]]

    def update(self, t, sel, hit_slots, victims):
        self.prev[hit_slots] = self.last[hit_slots]
        self.last[hit_slots] = t
        self.prev[victims] = -1
        self.last[victims] = t
        self._stamp_kernel_order(hit_slots, victims)


class FRA(Policy):
    """OUR policy, the resolve kernel's ``"policy": "fra"``: frequency, recency and token age.

    The integer rule of ``sglang_hisparse.kernel_policy`` (bit for bit what the kernel does):
    per slot ``hits`` (selections since the token entered, saturating at 255; the prefix tokens
    placed at the first long step 0) and ``last`` (the seq_len of its latest selection, 0 =
    never). The victims are the evictable slots with the smallest ``(bucket, LRU position)``,
    ``bucket`` a 256-level score that rises with ``log2(1 + hits)`` and falls with
    ``log2(1 + n - last)`` and ``log2(n - position)`` (weights 13/16, 1, 5/16); they take the
    misses in LRU order. Kernel cost: one int32 word per slot and layer, and a 256-bin
    histogram of the evictables' buckets in the bookkeeping.
    """

    name = "fra"

    def reset(self, B, max_pos, sels):
        super().reset(B, max_pos, sels)
        self.hits = np.zeros(B, dtype=np.int64)  # the prefix tokens 0..B-1: never selected yet
        self.last = np.zeros(B, dtype=np.int64)

    def clear(self):
        super().clear()
        self.hits[:] = 0
        self.last[:] = 0

    def victims(self, t, cand, m, miss_tok):
        bucket = fra_bucket(self.hits[cand], self.last[cand], self.tok[cand], self.n)
        chosen = cand[np.lexsort((self.key[cand], bucket))[:m]]
        return chosen[np.argsort(self.key[chosen], kind="stable")]  # the kernel's LRU order

    def update(self, t, sel, hit_slots, victims):
        self.hits[hit_slots] = np.minimum(self.hits[hit_slots] + 1, FRA_HITS_MAX)
        self.last[hit_slots] = self.n
        self.hits[victims] = 1
        self.last[victims] = self.n
        self._stamp_kernel_order(hit_slots, victims)


class SLRU(Policy):
    """OUR policy, the resolve kernel's ``"policy": "slru"``: segmented LRU in three levels.

    ``kernel_policy`` is the spec (bit for bit the kernel's): the LRU array is cut into levels
    0 | 1 | 2 by two boundaries; the victims are the oldest evictables (as lru); a miss enters
    level 0, a hit rises one level, each level keeps its remaining evictables ahead of what
    enters it, and levels 1 and 2 are capped at 3/16 and 10/16 of B. Kernel cost: no per-slot
    state, two counts and a different permutation in the writer.
    """

    name = "slru"

    def reset(self, B, max_pos, sels):
        super().reset(B, max_pos, sels)
        self.order = np.arange(B, dtype=np.int64)  # the slot at each LRU position
        self.b1 = self.b2 = B

    def clear(self):
        super().clear()
        self.order = np.arange(self.B, dtype=np.int64)
        self.b1 = self.b2 = self.B

    def _take_oldest(self, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """lru's victims: the step's misses (top-k order) go into the oldest evictable slots of
        ``self.order``. Returns, per LRU position, whether it holds a hit and whether it is an
        evictable the misses left, and the victim slots (oldest first)."""
        slots = self.where[sel]
        hit = slots >= 0
        miss_tok = sel[~hit]
        m = int(miss_tok.size)
        is_hit = np.zeros(self.B, dtype=bool)
        is_hit[slots[hit]] = True
        hit_at = is_hit[self.order]
        ev_pos = np.flatnonzero(~hit_at)
        if ev_pos.size < m:
            raise ValueError(
                f"step selects {sel.size} distinct positions besides the newest, more than the "
                f"buffer's {self.B} slots; use --buffer >= top-k (or --top-k <= buffer)"
            )
        victims = self.order[ev_pos[:m]]
        old = self.tok[victims]
        self.where[old[old >= 0]] = -1
        self.tok[victims] = miss_tok
        self.where[miss_tok] = victims
        left = ~hit_at
        left[ev_pos[:m]] = False
        return hit_at, left, victims

    def step(self, t, sel, n):
        order = self.order
        hit_at, left, victims = self._take_oldest(sel)
        m = int(victims.size)
        pos = np.arange(self.B)
        level = (pos >= self.b1).astype(np.int64) + (pos >= self.b2)
        ev_at = ~hit_at
        n0 = int(np.count_nonzero(ev_at & (level == 0)))
        n1 = int(np.count_nonzero(ev_at & (level == 1)))
        h0 = int(np.count_nonzero(hit_at & (level == 0)))
        self.order = np.concatenate((
            order[left & (level == 0)], victims, order[left & (level == 1)],
            order[hit_at & (level == 0)], order[left & (level == 2)], order[hit_at & (level > 0)]))
        self.b1, self.b2 = slru_next(n0=n0, n1=n1, h0=h0, m=m, buffer=self.B)
        return m


class FRAFloat(Policy):
    """The first proposal (kept for comparison): fra's score in floating point, recency in
    steps, weights 0.8 / 1 / 0.3, no buckets::

        score = 0.8 * log2(1 + hits) - log2(1 + t - last) - 0.3 * log2(max(n - position, 1))
    """

    name = "fra-float"

    def __init__(self, seed: int = 0, wc: float = 0.8, wa: float = 0.3):
        super().__init__(seed)
        self.wc, self.wa = wc, wa

    def reset(self, B, max_pos, sels):
        super().reset(B, max_pos, sels)
        self.hits = np.zeros(B, dtype=np.int64)
        self.last = np.full(B, -1, dtype=np.int64)

    def victims(self, t, cand, m, miss_tok):
        age = np.maximum(self.n - self.tok[cand], 1)
        score = (self.wc * np.log2(1 + self.hits[cand]) - np.log2(1 + t - self.last[cand])
                 - self.wa * np.log2(age))
        return cand[np.lexsort((self.key[cand], score))[:m]]

    def update(self, t, sel, hit_slots, victims):
        self.hits[hit_slots] += 1
        self.last[hit_slots] = t
        self.hits[victims] = 1
        self.last[victims] = t
        self._stamp_kernel_order(hit_slots, victims)


class Rank(SLRU):
    """OUR policy (issue 49; simulator model, no kernel yet): slru that keeps what the indexer is
    about to pick. Each step's victims are chosen among the resident tokens that are neither
    selected nor among the step's next-best ranks (k+1..k+m), oldest first in slru's order; only
    when those run out, the next-best themselves, oldest first. A next-best token is otherwise an
    evictable like any other: it keeps its level and place (no promotion; it was not read). With
    no next-best this is slru, miss for miss. ``rank:M`` uses the first M ranks of each step.

    The boundaries follow slru's rule with the victims counted where they were taken (``v0``,
    ``v1`` from levels 0 and 1): ``b1 = n0 - v0 + m``, ``b2 = b1 + n1 - v1 + h0``, then slru's
    caps; with victims taken oldest first (``v0 = min(m, n0)``, ...) this is ``slru_next``.
    NOTE: the kernel would mark next-best slots as it marks hits (one more lookup of m positions
    in the slot table) and take victims in two passes of slru's victim scan; this rule moves to
    ``kernel_policy`` as its spec once a kernel implements it.
    """

    name = "rank"
    needs_ranks = True

    def __init__(self, seed: int = 0, m: int | None = None):
        super().__init__(seed)
        self.m = m
        self.ranks: list[np.ndarray] = []

    def use_ranks(self, ranks: list[np.ndarray]) -> None:
        """The next-best of every upcoming step (int64, rank order, the step's selection and its
        newest token excluded), aligned with ``step``'s ``t``."""
        self.ranks = ranks

    def step(self, t, sel, n):
        B, order = self.B, self.order
        slots = self.where[sel]
        hit = slots >= 0
        miss_tok = sel[~hit]
        m = int(miss_tok.size)
        is_hit = np.zeros(B, dtype=bool)
        is_hit[slots[hit]] = True
        nb = self.ranks[t] if self.m is None else self.ranks[t][: self.m]
        nb_slots = self.where[nb]
        is_nb = np.zeros(B, dtype=bool)
        is_nb[nb_slots[nb_slots >= 0]] = True
        hit_at, nb_at = is_hit[order], is_nb[order] & ~is_hit[order]
        free = np.flatnonzero(~hit_at & ~nb_at)  # LRU positions, oldest first
        if free.size + int(np.count_nonzero(nb_at)) < m:
            raise ValueError(
                f"step selects {sel.size} distinct positions besides the newest, more than the "
                f"buffer's {B} slots; use --buffer >= top-k (or --top-k <= buffer)"
            )
        vpos = free[:m] if free.size >= m else np.concatenate((free, np.flatnonzero(nb_at)[: m - free.size]))
        victims = order[vpos]
        old = self.tok[victims]
        self.where[old[old >= 0]] = -1
        self.tok[victims] = miss_tok
        self.where[miss_tok] = victims
        pos = np.arange(B)
        level = (pos >= self.b1).astype(np.int64) + (pos >= self.b2)
        left = ~hit_at
        left[vpos] = False
        n0 = int(np.count_nonzero(~hit_at & (level == 0)))
        n1 = int(np.count_nonzero(~hit_at & (level == 1)))
        h0 = int(np.count_nonzero(hit_at & (level == 0)))
        v0 = int(np.count_nonzero(level[vpos] == 0))
        v1 = int(np.count_nonzero(level[vpos] == 1))
        self.order = np.concatenate((
            order[left & (level == 0)], victims, order[left & (level == 1)],
            order[hit_at & (level == 0)], order[left & (level == 2)], order[hit_at & (level > 0)]))
        cap1, cap2 = slru_caps(B)
        b1 = n0 - v0 + m
        b2 = max(b1 + n1 - v1 + h0, B - cap2)
        self.b1, self.b2 = max(b1, b2 - cap1), b2
        return m


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (LRU, LRUPlain, FIFO, Random, TopKOnly, Belady, FRA, SLRU, FRAFloat, LRFU, LRU2)
}
#: policies that read next-best ranks: only traces of version 2 (kept out of POLICIES, which
#: every trace can replay)
RANK_POLICIES: dict[str, type[Policy]] = {Rank.name: Rank}


def make_policy(name: str, seed: int = 0) -> Policy:
    """A fresh policy by CLI name; ``ValueError`` lists the known names."""
    if name.startswith("lrfu:"):
        try:
            return LRFU(seed, lam=float(name.split(":", 1)[1]))
        except ValueError:
            raise ValueError(f"--policy {name!r}: use lrfu:LAMBDA with a number, e.g. lrfu:0.25") from None
    if name.startswith("rank:"):
        arg = name.split(":", 1)[1]
        if not arg.isdigit():
            raise ValueError(f"--policy {name!r}: use rank:M with M >= 0 next-best ranks, e.g. rank:256") from None
        return Rank(seed, m=int(arg))
    cls = POLICIES.get(name) or RANK_POLICIES.get(name)
    if cls is None:
        known = sorted(POLICIES) + sorted(RANK_POLICIES)
        raise ValueError(f"--policy {name!r} is unknown; choose one of {known} (or lrfu:LAMBDA, rank:M)")
    return cls(seed)
