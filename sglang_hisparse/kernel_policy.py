"""Replacement policies of the resolve kernel: names, state and the ``fra`` and ``slru`` rules.

Stdlib only at import (numpy inside the two array functions), so the simulator, the planner
and the config share it with the
kernel's pure-torch reference (``kernels/reference.py``) and ``jit_kernels/resolve.cuh``,
which implement the same integer arithmetic bit for bit.

``lru`` (default, id 0): victims are the oldest evictable slots in LRU order; no extra state.

``fra`` (id 1): frequency, recency and token age. One int32 word of state per history slot
(``policy_state [L, R, B]``)::

    word = (last << 8) | hits      hits: selections since the token entered (saturates at 255)
                                   last: seq_len n of the step of its latest selection, 0 = none

Per long step of length ``n`` each evictable slot (holding position ``p``) gets a bucket::

    s      = 13 * lg(1 + hits) - 16 * lg(1 + max(n - last, 0)) - 5 * lg(max(n - p, 1))  (1/128 log2)
    bucket = clamp((s >> 4) + 184, 0, 255)                                         (1/8 log2)

with ``lg(x) = 8 * floor(log2 x) + the 3 bits after x's leading one`` (a piecewise linear
log2 in 1/8 units: exact in integers). The victims are the ``m`` evictable slots with the
smallest ``(bucket, LRU position)``: whole buckets from the lowest up, the oldest slots of the
last bucket. They take the misses in LRU order (miss ``x`` in top-k order -> the ``x``-th
victim from the oldest), and the LRU order is updated as for ``lru``: remaining evictables |
fresh misses | hits. A hit sets ``hits += 1`` (saturating) and ``last = n``; a fresh miss
``hits = 1``, ``last = n``; every other slot keeps its word. A request's word is 0 while its
slots hold the prefix tokens ``0..B-1`` (never selected yet), as ``SlotState`` starts them.

Why it beats recency on attention selections (docs/traces.md): whether a resident token not
selected this step is selected again soon rises steeply with how often it was picked
(heavy hitters), falls with the gap since its last pick like a power law (a token that missed
one step is far likelier to return than LRU's strict order assumes relative to one that
missed many), and falls with its distance from the newest token (local attention).

``slru`` (id 2): segmented LRU in three levels over the kernel's LRU array, no per-slot state.
The array (oldest first) is cut into level 0 ``[0, b1)``, level 1 ``[b1, b2)`` and level 2
``[b2, B)``; one int32 per request and layer (``policy_state [L, R, 1]``) holds
``(B - b1) | (B - b2) << 16``, so the zeroed word means "everything in level 0". The victims
are the ``m`` oldest evictable slots, as for ``lru`` (level 0 first). With ``n0``, ``n1``,
``n2`` the evictables and ``h0``, ``h12`` the hits in levels 0 and 1-2 (each in old order),
the new array is::

    level-0 evictables left | fresh misses | level-1 evictables left | level-0 hits
                            | level-2 evictables left | level-1 and level-2 hits

i.e. a miss enters level 0, a hit rises one level (at most to 2), and every level keeps its
remaining evictables in their old order ahead of what enters it. The new boundaries are
``b1 = max(n0, m)`` and ``b2 = max(m, n0 + n1) + h0``, then the caps: level 2 keeps at most
``SLRU_CAP2 * B // 16`` slots (``b2 = max(b2, B - cap2)``: its oldest drop to level 1) and
level 1 at most ``SLRU_CAP1 * B // 16`` (``b1 = max(b1, b2 - cap1)``). Kernel cost: two
ballots a round in the hit walk, two counts in the exchange, and a different permutation in
the writer; no words per slot.

Why it works on attention selections: a token selected once (a one-off miss) rarely returns
soon, one re-selected while resident usually does (heavy hitters and sinks); LRU lets each
step's burst of one-off misses push re-selected tokens out, while here a miss must be selected
again before it outranks them, and being selected twice more (level 2) protects a token for
up to ``cap2`` further slots of churn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

POLICIES: tuple[str, ...] = ("lru", "fra", "slru")
#: what the kernel ops and ``SlotState`` assume when they are not told a policy
DEFAULT_POLICY = "lru"
#: what a server runs when ``--hisparse-config`` names no policy: fewer misses than lru on every
#: recorded trace for +0.6-1.0 us of bookkeeping a resolve, +4-8 %, on the H200 (docs/traces.md),
#: with and without speculative decoding
SERVING_POLICY = "slru"
#: the policies the verify kernel (speculative decoding) implements
VERIFY_POLICIES: tuple[str, ...] = ("lru", "slru")
#: policy ids (``resolve.cuh`` kPolicyLru / kPolicyFra / kPolicySlru)
POLICY_LRU, POLICY_FRA, POLICY_SLRU = 0, 1, 2

#: fra's integer weights (units of 1/16) and bucket mapping; ``resolve.cuh`` has the same
#: constants (kFra*), kept in step by tests/unit/test_kernel_policy.py.
FRA_W_HITS, FRA_W_GAP, FRA_W_AGE = 13, 16, 5
FRA_SHIFT, FRA_OFFSET, FRA_BUCKETS = 4, 184, 256
FRA_HITS_MAX = 255
#: ``last`` lives in the word's upper 24 bits (23 usable: the word is a signed int32).
FRA_MAX_SEQ_LEN = (1 << 23) - 1


def policy_id(name: str) -> int:
    """The kernel's template id of a policy name (``ValueError`` lists the names)."""
    if name not in POLICIES:
        raise ValueError(f"replacement policy {name!r} is unknown; choose one of {list(POLICIES)}")
    return POLICIES.index(name)


#: slru's level caps in sixteenths of B (``resolve.cuh`` kSlruCap1/kSlruCap2).
SLRU_CAP1, SLRU_CAP2 = 3, 10


def state_width(name: str, buffer: int) -> int:
    """int32 words of policy state per request slot and layer: 0 (lru), ``buffer`` (fra: one
    per history slot), 1 (slru: the packed level boundaries)."""
    return (0, buffer, 1)[policy_id(name)]


def slru_caps(buffer: int) -> tuple[int, int]:
    """slru's (level-1, level-2) caps in slots for a hot buffer of ``buffer`` slots."""
    return SLRU_CAP1 * buffer // 16, SLRU_CAP2 * buffer // 16


def slru_unpack(word: int, buffer: int) -> tuple[int, int]:
    """Boundaries ``(b1, b2)`` of an slru word (0 = all level 0)."""
    return buffer - (word & 0xFFFF), buffer - ((word >> 16) & 0xFFFF)


def slru_next(*, n0: int, n1: int, h0: int, m: int, buffer: int) -> tuple[int, int]:
    """The new slru boundaries after a long step (module docstring), caps applied."""
    cap1, cap2 = slru_caps(buffer)
    b1, b2 = max(n0, m), max(m, n0 + n1) + h0
    b2 = max(b2, buffer - cap2)
    return max(b1, b2 - cap1), b2


def slru_pack(b1: int, b2: int, buffer: int) -> int:
    """The word of boundaries ``(b1, b2)``."""
    return (buffer - b1) | ((buffer - b2) << 16)


def lg8(x: np.ndarray) -> np.ndarray:
    """Piecewise linear log2 in 1/8 units of int64 ``x >= 1``: ``8 * e + ((x << 3) >> e & 7)``
    with ``e = floor(log2 x)``."""
    import numpy as np

    x = np.asarray(x, dtype=np.int64)
    e = np.frexp(x.astype(np.float64))[1].astype(np.int64) - 1  # exact for x < 2**53
    return 8 * e + (((x << 3) >> e) & 7)


def fra_bucket(hits: np.ndarray, last: np.ndarray, pos: np.ndarray, n: int) -> np.ndarray:
    """fra's bucket (int64, 0..255) of slots with ``hits``, ``last`` holding ``pos`` at length ``n``
    (the simulator's slots are never empty here: it fills empty slots before asking)."""
    import numpy as np

    s = (FRA_W_HITS * lg8(1 + np.asarray(hits, np.int64))
         - FRA_W_GAP * lg8(1 + np.maximum(n - np.asarray(last, np.int64), 0))
         - FRA_W_AGE * lg8(np.maximum(n - np.asarray(pos, np.int64), 1)))
    return np.clip((s >> FRA_SHIFT) + FRA_OFFSET, 0, FRA_BUCKETS - 1)
