"""Next-best ranks of a selection trace (format version 2, docs/traces.md).

The indexer scores every token and keeps the top k; asked for the top ``k + m`` in score order,
its first k entries are the selection (exactly what attention reads) and the next m the
*next-best* tokens, ranked ``k + 1 .. k + m``: the likeliest picks of the next step. A version-2
trace keeps them per row, CSR-flattened like the selection::

    rank_offsets  int64 [S + 1]  row r's next-best are ranks[rank_offsets[r]:rank_offsets[r + 1]]
    ranks         int32 [M]      positions in rank order (uint16 on disk when all < 65536)

A row has at most the header's ``next_best`` = m of them (fewer when the context has fewer
tokens, or none at all), each an existing token ``[0, seq_len)`` that the row does not select,
no two alike. Version 1 (no ranks) loads unchanged; the rank-blind policies replay either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .format import Trace

RANK_ARRAYS = ("rank_offsets", "ranks")


def split_ranked(ordered: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``ordered`` int [..., k + m] (score order, ``-1`` padding allowed) -> (selection [..., k],
    next-best [..., m]): the first ``k`` columns and the rest."""
    ordered = np.asarray(ordered)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 < k <= ordered.shape[-1]:
        raise ValueError(
            f"selection width k={k!r} must be an integer in [1, {ordered.shape[-1]}] (the ordered row's "
            "width k + m): the first k entries are the selection, the rest the next-best ranks"
        )
    return ordered[..., :k], ordered[..., k:]


def check_row(selection: np.ndarray, next_best: np.ndarray | list[int], *, m: int, seq_len: int,
              where: str) -> np.ndarray:
    """One row's next-best (``-1`` padding dropped) as int32, or ``ValueError`` naming the rule.

    ``selection``: the row's selected positions (padding already dropped)."""
    nb = np.asarray(next_best)
    if nb.ndim > 1 or (nb.size and nb.dtype.kind not in "iu"):
        raise ValueError(f"{where}: next-best ranks must be a 1-D integer array, got {nb.dtype} of shape {nb.shape}")
    nb = nb.reshape(-1).astype(np.int64)
    nb = nb[nb >= 0]
    if nb.size > m:
        raise ValueError(
            f"{where}: {nb.size} next-best ranks, more than the header's next_best={m}; "
            "declare the width with make_header(next_best=M)"
        )
    if nb.size and int(nb.max()) >= seq_len:
        raise ValueError(f"{where}: next-best position {int(nb.max())} is outside [0, seq_len={seq_len})")
    if np.unique(nb).size != nb.size:
        raise ValueError(f"{where}: a next-best position repeats; ranks k+1..k+m are distinct tokens")
    both = np.intersect1d(nb, np.asarray(selection, dtype=np.int64))
    if both.size:
        raise ValueError(
            f"{where}: position {int(both[0])} is both selected and next-best; the next-best are the "
            "ranks after the selection (split the ordered top-(k + m) at k)"
        )
    return nb.astype(np.int32)


def check_trace(trace: Trace) -> None:
    """The rank arrays' invariants (module docstring) over a whole trace; ``ValueError`` names
    the first row that breaks one."""
    s = trace.num_rows
    ro, ranks = trace.rank_offsets, trace.ranks
    if ro is None or ranks is None:
        raise ValueError("a version-2 trace needs both 'rank_offsets' and 'ranks'; the file is damaged")
    if ro.shape != (s + 1,) or ro[0] != 0 or ro[-1] != ranks.size:
        raise ValueError(
            f"trace 'rank_offsets' must have {s + 1} entries from 0 to len(ranks)={ranks.size}; the file is "
            "truncated or was not written by TraceWriter"
        )
    widths = np.diff(ro)
    if np.any(widths < 0):
        raise ValueError("trace 'rank_offsets' must be non-decreasing; the file is corrupt")
    m = int(trace.header.get("next_best", 0))
    if widths.size and int(widths.max()) > m:
        r = int(np.argmax(widths))
        raise ValueError(f"trace row {r} has {int(widths[r])} next-best ranks, more than the header's next_best={m}")
    if not ranks.size:
        return
    row = np.repeat(np.arange(s, dtype=np.int64), widths)
    seq = trace.seq_len.astype(np.int64)[row]
    bad = np.flatnonzero((ranks < 0) | (ranks >= seq))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"trace next-best position {int(ranks[i])} (row {int(row[i])}) is outside [0, seq_len={int(seq[i])}); "
            "every next-best position must be an existing token of its step"
        )
    span = int(trace.seq_len.max()) + 1
    keys = row * span + ranks.astype(np.int64)
    uniq, first = np.unique(keys, return_index=True)
    if uniq.size != keys.size:
        dup = np.setdiff1d(np.arange(keys.size), first)[0]
        raise ValueError(f"trace row {int(row[dup])}: next-best position {int(ranks[dup])} repeats; ranks are distinct")
    sel_row = np.repeat(np.arange(s, dtype=np.int64), np.diff(trace.offsets))
    both = np.flatnonzero(np.isin(keys, sel_row * span + trace.positions.astype(np.int64)))
    if both.size:
        i = int(both[0])
        raise ValueError(
            f"trace row {int(row[i])}: position {int(ranks[i])} is both selected and next-best; the next-best "
            "are the ranks after the selection"
        )


def truncate(trace: Trace, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """New ``(rank_offsets, ranks)`` when each row keeps only the selected positions where
    ``keep`` (bool [N]) holds: the dropped tail of a score-sorted selection comes first among
    the next-best (its ranks are k'+1..k), then the recorded ranks."""
    assert trace.rank_offsets is not None and trace.ranks is not None
    s = trace.num_rows
    sel_row = np.repeat(np.arange(s, dtype=np.int64), np.diff(trace.offsets))
    rank_row = np.repeat(np.arange(s, dtype=np.int64), np.diff(trace.rank_offsets))
    rows = np.concatenate((sel_row[~keep], rank_row))
    vals = np.concatenate((trace.positions[~keep], trace.ranks)).astype(np.int32)
    order = np.argsort(rows, kind="stable")  # per row: the dropped tail, then the ranks, in order
    offs = np.zeros(s + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=s), out=offs[1:])
    return offs, vals[order]
