"""Selection-trace format: which logical positions each decode step selected, per layer.

A trace is a set of *rows*. One row is one (stream, layer, decode step): the sequence length
``seq_len`` at that step (newest token included, so valid positions are ``[0, seq_len)``)
and the selected positions in the order they were produced (score order when the header
says ``sorted_by_score``; then ``--top-k K`` may keep the first K). ``-1`` padding is dropped
on write. A *stream* is one request's life; its rows for one layer, ordered by ``seq_len``,
are what the simulator replays. The arrays are CSR-flattened::

    stream    int64 [S]     request / stream id (unique per request life)
    layer     int32 [S]     layer id
    seq_len   int32 [S]     sequence length at the step (strictly increasing per stream+layer)
    offsets   int64 [S + 1] row r selected positions[offsets[r]:offsets[r + 1]]
    positions int32 [N]     selected logical positions (stored as uint16 when all < 65536)

Two containers, same arrays (numpy ``.npz``, no pickle):
  * ``name.npz``  one file; the JSON header is the 0-d string array ``header``.
  * ``name/``     a directory: ``header.json`` plus ``part-00000.npz``, ``part-00001.npz``, ...
                  each holding a slice of the rows (what a streaming writer produces).

Header keys: ``format`` (= "sglang-hisparse-trace"), ``version`` (1, or 2 with ranks),
``top_k`` (widest selection recorded), ``sorted_by_score`` (bool), ``source`` (free-form dict:
model, text, recorder settings).

Version 2 adds the indexer's next-best ranks per row (``ranks.py``: the arrays
``rank_offsets`` and ``ranks``, header key ``next_best`` = m, the widest a row may carry). A
writer writes version 1 unless the header declares ``next_best``; a reader takes both, and a
version-1 trace loads exactly as before (no ranks: the rank-blind policies replay it).
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import ranks as _ranks

FORMAT_NAME = "sglang-hisparse-trace"
#: the version of a trace without ranks; RANKED_VERSION adds the next-best ranks
FORMAT_VERSION = 1
RANKED_VERSION = 2
VERSIONS = (FORMAT_VERSION, RANKED_VERSION)
_ARRAYS = ("stream", "layer", "seq_len", "offsets", "positions")


@dataclass(frozen=True)
class Stream:
    """One (stream, layer) replay unit: ``T`` steps in increasing ``seq_len`` order.

    ``seq_lens`` int32 [T]; ``offsets`` int64 [T + 1] (starts at 0); ``positions`` int32 [N];
    with ranks (version 2) ``rank_offsets`` int64 [T + 1] and ``ranks`` int32 [M], else None.
    """

    stream: int
    layer: int
    seq_lens: np.ndarray
    offsets: np.ndarray
    positions: np.ndarray
    rank_offsets: np.ndarray | None = None
    ranks: np.ndarray | None = None

    def selection(self, t: int) -> np.ndarray:
        """Selected positions of step ``t`` (int32, trace order)."""
        return self.positions[self.offsets[t] : self.offsets[t + 1]]

    @property
    def has_ranks(self) -> bool:
        return self.ranks is not None

    def next_best(self, t: int) -> np.ndarray:
        """Next-best positions of step ``t`` (int32, rank order); ``ValueError`` without ranks."""
        if self.rank_offsets is None or self.ranks is None:
            raise ValueError(f"stream {self.stream} layer {self.layer} has no next-best ranks (a version-1 trace)")
        return self.ranks[self.rank_offsets[t] : self.rank_offsets[t + 1]]

    def __len__(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass
class Trace:
    """A loaded trace: the header dict plus the flattened row arrays (see module docstring)."""

    header: dict[str, Any]
    stream: np.ndarray
    layer: np.ndarray
    seq_len: np.ndarray
    offsets: np.ndarray
    positions: np.ndarray
    rank_offsets: np.ndarray | None = None
    ranks: np.ndarray | None = None
    _order: np.ndarray | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return int(self.stream.shape[0])

    @property
    def has_ranks(self) -> bool:
        """Whether rows carry next-best ranks (version 2)."""
        return self.ranks is not None

    @property
    def layers(self) -> list[int]:
        return sorted(int(x) for x in np.unique(self.layer))

    def streams(self) -> Iterator[Stream]:
        """Each (stream, layer) in (stream, layer) order, its steps sorted by ``seq_len``."""
        if self._order is None:
            self._order = np.lexsort((self.seq_len, self.layer, self.stream))
        order = self._order
        if order.size == 0:
            return
        key_s, key_l = self.stream[order], self.layer[order]
        cut = np.flatnonzero((key_s[1:] != key_s[:-1]) | (key_l[1:] != key_l[:-1])) + 1
        bounds = np.concatenate(([0], cut, [order.size]))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            rows = order[a:b]
            offs, pos = _gather(self.offsets, self.positions, rows)
            rank_offs = rank_pos = None
            if self.rank_offsets is not None and self.ranks is not None:
                rank_offs, rank_pos = _gather(self.rank_offsets, self.ranks, rows)
            yield Stream(int(key_s[a]), int(key_l[a]), self.seq_len[rows], offs, pos, rank_offs, rank_pos)

    def validate(self) -> None:
        """Check the invariants; raise ``ValueError`` naming the first broken rule."""
        s = self.num_rows
        for name, arr in (("layer", self.layer), ("seq_len", self.seq_len)):
            if arr.shape != (s,):
                raise ValueError(f"trace array {name!r} has shape {arr.shape}, expected ({s},) like 'stream'")
        if self.offsets.shape != (s + 1,) or self.offsets[0] != 0 or self.offsets[-1] != self.positions.size:
            raise ValueError(
                f"trace 'offsets' must have {s + 1} entries from 0 to len(positions)={self.positions.size}; "
                "the file is truncated or was not written by TraceWriter"
            )
        if np.any(np.diff(self.offsets) < 0):
            raise ValueError("trace 'offsets' must be non-decreasing; the file is corrupt")
        if self.positions.size:
            row_len = np.repeat(self.seq_len.astype(np.int64), np.diff(self.offsets))
            bad = np.flatnonzero((self.positions < 0) | (self.positions >= row_len))
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"trace position {int(self.positions[i])} (entry {i}) is outside [0, seq_len={int(row_len[i])}); "
                    "every selected position must be an existing token of its step"
                )
        if self.header.get("version") == RANKED_VERSION or self.has_ranks:
            _ranks.check_trace(self)  # before streams(), which slices the rank arrays
        for st in self.streams():
            if np.any(np.diff(st.seq_lens) <= 0):
                raise ValueError(
                    f"stream {st.stream} layer {st.layer} repeats a seq_len; steps of one stream and layer "
                    "must have strictly increasing seq_len (give each request life its own stream id)"
                )

    def truncated(self, k: int) -> Trace:
        """A copy keeping the first ``k`` selected positions of every row (``--top-k``). With
        ranks, the dropped tail of each selection becomes the first of its next-best (so the
        trace must be score-sorted)."""
        if k <= 0:
            raise ValueError(f"top_k={k} must be positive; pass --top-k K with K >= 1 or omit it")
        lens = np.minimum(np.diff(self.offsets), k)
        offs = np.zeros_like(self.offsets)
        np.cumsum(lens, out=offs[1:])
        keep = np.arange(self.positions.size) - np.repeat(self.offsets[:-1], np.diff(self.offsets))
        keep = keep < np.repeat(lens, np.diff(self.offsets))
        old_k = int(self.header.get("top_k", k))
        header = dict(self.header, top_k=min(old_k, k))
        if not self.has_ranks:
            return Trace(header, self.stream, self.layer, self.seq_len, offs, self.positions[keep])
        if not self.header.get("sorted_by_score"):
            raise ValueError(
                f"--top-k {k}: this trace has next-best ranks but its selections are not in score order "
                "(sorted_by_score false), so the dropped positions have no rank; replay it without --top-k"
            )
        rank_offs, rank_pos = _ranks.truncate(self, keep)
        header["next_best"] = int(self.header.get("next_best", 0)) + max(old_k - k, 0)
        return Trace(header, self.stream, self.layer, self.seq_len, offs, self.positions[keep], rank_offs, rank_pos)


def _gather(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR ``(offsets, values)`` of ``rows`` (in that order), offsets from 0."""
    n = offsets[rows + 1] - offsets[rows]
    offs = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(n, out=offs[1:])
    if rows.size and np.all(rows[1:] == rows[:-1] + 1):
        # Rows already contiguous (the usual case): one slice, no gather.
        return offs, values[offsets[rows[0]] : offsets[rows[-1] + 1]]
    return offs, np.concatenate([values[offsets[r] : offsets[r + 1]] for r in rows])


def make_header(*, top_k: int, sorted_by_score: bool, source: dict[str, Any] | None = None,
                next_best: int | None = None) -> dict[str, Any]:
    """A trace header; ``next_best=m`` (the indexer's ranks k+1..k+m per row) makes it version 2."""
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION if next_best is None else RANKED_VERSION,
        "top_k": int(top_k),
        "sorted_by_score": bool(sorted_by_score),
        "source": dict(source or {}),
    }
    if next_best is not None:
        header["next_best"] = next_best
    return header


def _check_header(header: Any, where: str) -> dict[str, Any]:
    """The header's rules: a JSON object of this format and version whose ``top_k`` is an
    integer >= 0 (0: nothing recorded yet) and ``sorted_by_score`` a boolean, where present."""
    if not isinstance(header, dict):
        raise ValueError(
            f"{where}: the header is a JSON {type(header).__name__}, expected an object with 'format', "
            "'version' and 'top_k'; this is not a sglang-hisparse trace (record it again)"
        )
    if header.get("format") != FORMAT_NAME:
        raise ValueError(f"{where}: header 'format' is {header.get('format')!r}, expected {FORMAT_NAME!r}")
    version = header.get("version")
    if isinstance(version, bool) or version not in VERSIONS:
        raise ValueError(
            f"{where}: trace version {version!r} is not supported (this reader: {', '.join(map(str, VERSIONS))}); "
            "re-record the trace or use the matching sglang-hisparse version"
        )
    next_best = header.get("next_best")
    if version == RANKED_VERSION and (isinstance(next_best, bool) or not isinstance(next_best, int) or next_best < 0):
        raise ValueError(
            f"{where}: a version-2 trace needs header 'next_best' = m, an integer >= 0 (the next-best ranks a "
            f"row may carry), got {next_best!r}; the header is damaged: record the trace again"
        )
    if version == FORMAT_VERSION and next_best is not None:
        raise ValueError(
            f"{where}: header 'next_best' = {next_best!r} in a version-1 trace (which has no ranks); "
            "a trace with ranks is version 2: write it with make_header(next_best=M)"
        )
    top_k = header.get("top_k")
    # NOTE: bool is an int subclass; `true` as a width is damage, not 1.
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(
            f"{where}: header 'top_k' = {top_k!r} must be an integer >= 0 (the widest selection recorded); "
            "the header is damaged: record the trace again"
        )
    sorted_by_score = header.get("sorted_by_score")
    if sorted_by_score is not None and not isinstance(sorted_by_score, bool):
        raise ValueError(
            f"{where}: header 'sorted_by_score' = {sorted_by_score!r} must be true or false; "
            "the header is damaged: record the trace again"
        )
    return header


def _parse_header(text: str, where: str) -> dict[str, Any]:
    try:
        return _check_header(json.loads(text), where)
    except RecursionError:
        raise ValueError(f"{where}: the header JSON is nested too deeply; record the trace again") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: the header is not valid JSON ({e.msg}); record the trace again") from None


class TraceWriter:
    """Append rows, then ``close()``. ``path`` ending in ``.npz`` → one file (rows kept in
    memory until close); any other path → a directory written in parts of ``part_rows`` rows,
    so a long recording never holds more than one part in memory."""

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any], *, part_rows: int = 4096):
        self.path = os.fspath(path)
        self.header = _check_header(dict(header), "TraceWriter")
        self.single = self.path.endswith(".npz")
        self.part_rows = part_rows
        self._rows: list[tuple[int, int, int, np.ndarray]] = []
        self._ranked = self.header["version"] == RANKED_VERSION
        self._next_best = int(self.header.get("next_best", 0))
        self._rank_rows: list[np.ndarray] = []  # one per row when ranked
        self._parts = 0
        self._top_k = int(header.get("top_k", 0))
        self._closed = False
        if not self.single:
            os.makedirs(self.path, exist_ok=True)

    def add(self, stream: int, layer: int, seq_len: int, positions: np.ndarray | list[int],
            next_best: np.ndarray | list[int] | None = None) -> None:
        """Record one row; ``positions`` may carry ``-1`` padding (dropped). ``next_best``: the
        row's ranks k+1..k+m in rank order (``-1`` padding dropped), only in a version-2 trace
        (``make_header(next_best=m)``); checked here (``ranks.check_row``)."""
        pos = np.asarray(positions, dtype=np.int32).reshape(-1)
        pos = pos[pos >= 0]
        if next_best is not None and not self._ranked:
            raise ValueError(
                f"TraceWriter {self.path!r}: next-best ranks given to a trace without ranks (version 1); "
                "declare their width with make_header(..., next_best=M)"
            )
        if self._ranked:
            where = f"TraceWriter {self.path!r}, stream {int(stream)} layer {int(layer)} seq_len {int(seq_len)}"
            self._rank_rows.append(_ranks.check_row(pos, [] if next_best is None else next_best,
                                                    m=self._next_best, seq_len=int(seq_len), where=where))
        self._top_k = max(self._top_k, int(pos.size))
        self._rows.append((int(stream), int(layer), int(seq_len), pos))
        if not self.single and len(self._rows) >= self.part_rows:
            self._flush_part()

    def add_batch(self, streams, layer: int, seq_lens, top_k: np.ndarray, next_best: np.ndarray | None = None) -> None:
        """Record one layer of one step for a batch: ``top_k`` int [bs, k] with -1 padding, and in a
        version-2 trace ``next_best`` int [bs, m] (ranks k+1..k+m, -1 padding)."""
        top_k = np.asarray(top_k)
        nb = None if next_best is None else np.asarray(next_best)
        if nb is not None and (nb.ndim != 2 or nb.shape[0] != top_k.shape[0]):
            raise ValueError(
                f"next_best has shape {nb.shape}, expected [{top_k.shape[0]}, m]: one row of ranks per batch row"
            )
        for b in range(top_k.shape[0]):
            self.add(int(streams[b]), layer, int(seq_lens[b]), top_k[b], None if nb is None else nb[b])

    def _arrays(self) -> dict[str, np.ndarray]:
        rows = self._rows
        lens = np.array([r[3].size for r in rows], dtype=np.int64)
        offs = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=offs[1:])
        out = {
            "stream": np.array([r[0] for r in rows], dtype=np.int64),
            "layer": np.array([r[1] for r in rows], dtype=np.int32),
            "seq_len": np.array([r[2] for r in rows], dtype=np.int32),
            "offsets": offs,
            "positions": _compact(np.concatenate([r[3] for r in rows]) if rows else np.zeros(0, np.int32)),
        }
        if self._ranked:
            rank_offs = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum([r.size for r in self._rank_rows], out=rank_offs[1:])
            out["rank_offsets"] = rank_offs
            out["ranks"] = _compact(np.concatenate(self._rank_rows) if rows else np.zeros(0, np.int32))
        return out

    def _flush_part(self) -> None:
        if not self._rows:
            return
        name = os.path.join(self.path, f"part-{self._parts:05d}.npz")
        np.savez_compressed(name, **self._arrays())
        self._parts += 1
        self._rows = []
        self._rank_rows = []

    def flush(self) -> None:
        """Directory mode: write the pending rows as a part and (re)write ``header.json``, so
        the directory is loadable now. Single-file mode writes only on ``close``."""
        if self.single:
            return
        self.header["top_k"] = self._top_k
        self._flush_part()
        tmp = os.path.join(self.path, "header.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.header, f, indent=1)
        os.replace(tmp, os.path.join(self.path, "header.json"))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.header["top_k"] = self._top_k
        if self.single:
            np.savez_compressed(self.path, header=np.array(json.dumps(self.header)), **self._arrays())
        else:
            self.flush()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _compact(positions: np.ndarray) -> np.ndarray:
    # Positions below 65536 are stored as uint16: half the bytes, and the loader widens back.
    if positions.size and int(positions.max()) < 65536:
        return positions.astype(np.uint16)
    return positions


def _load_npz(path: str) -> dict[str, np.ndarray]:
    # NOTE: the zip magic is checked first: on any other bytes numpy's loader falls through to
    # pickle and, with allow_pickle=False, suggests allow_pickle=True, which is wrong advice
    # for a file that is simply not a trace.
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":
        raise ValueError(
            f"trace file {path!r} is not a .npz (zip) archive; pass a trace written by TraceWriter "
            "or `record-trace` (docs/traces.md)"
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [a for a in _ARRAYS if a not in z.files]
            if missing:
                raise _NotATrace(f"trace file {path!r} lacks arrays {missing}; it is not a sglang-hisparse trace")
            out = {a: z[a] for a in _ARRAYS}
            for a in _ranks.RANK_ARRAYS:
                if a in z.files:
                    out[a] = z[a]
            if "header" in z.files:
                out["header"] = z["header"]
    except _NotATrace as e:
        raise ValueError(str(e)) from None
    except (zipfile.BadZipFile, EOFError, zlib.error, OSError, ValueError, NotImplementedError, RuntimeError) as e:
        # ValueError: numpy's refusals of a damaged member (bad .npy header, object arrays);
        # its own advice (allow_pickle=True) is wrong for a trace, so it is not repeated.
        # NotImplementedError: zipfile's for a damaged header's version or compression method;
        # RuntimeError: zipfile's "is encrypted, password required" for a flipped flag bit.
        raise ValueError(
            f"trace file {path!r} is a damaged .npz archive ({type(e).__name__}); it is probably "
            "truncated: copy or record it again"
        ) from None
    for name in (*_ARRAYS, *(a for a in _ranks.RANK_ARRAYS if a in out)):
        arr = out[name]
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(
                f"trace file {path!r}: array {name!r} is {arr.dtype} of shape {arr.shape}, expected 1-D "
                "integers; it was not written by TraceWriter"
            )
    if out["offsets"].size == 0:
        raise ValueError(f"trace file {path!r}: 'offsets' is empty (it has one entry more than rows); the file is damaged")
    return out


class _NotATrace(Exception):
    """A readable archive that is not a trace (kept apart from numpy's own ValueErrors)."""


def load_trace(path: str | os.PathLike[str], *, validate: bool = True) -> Trace:
    """Load a ``.npz`` trace file or a trace directory (parts are concatenated)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        hdr_path = os.path.join(path, "header.json")
        if not os.path.exists(hdr_path):
            raise ValueError(
                f"trace directory {path!r} has no header.json; the recording was not closed "
                "(the recorder writes it on close/flush) or this is not a trace directory"
            )
        try:
            with open(hdr_path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise ValueError(f"{hdr_path}: not a text file; the header must be UTF-8 JSON (record the trace again)") from None
        header = _parse_header(text, path)
        names = sorted(n for n in os.listdir(path) if n.startswith("part-") and n.endswith(".npz"))
        parts = [_load_npz(os.path.join(path, n)) for n in names]
    elif os.path.isfile(path):
        part = _load_npz(path)
        if "header" not in part:
            raise ValueError(f"trace file {path!r} has no 'header' array; write it with TraceWriter")
        header = _parse_header(str(part["header"]), path)
        parts = [part]
    else:
        raise ValueError(f"trace path {path!r} does not exist; pass a .npz trace file or a trace directory")
    ranked = header["version"] == RANKED_VERSION
    if not parts:
        names = (*_ARRAYS, *_ranks.RANK_ARRAYS) if ranked else _ARRAYS
        empty = {a: np.zeros(0, np.int64 if a in ("stream", "offsets") else np.int32) for a in names}
        empty["offsets"] = np.zeros(1, np.int64)
        if ranked:
            empty["rank_offsets"] = np.zeros(1, np.int64)
        parts = [empty]
    for p in parts:
        present = [a for a in _ranks.RANK_ARRAYS if a in p]
        if ranked and len(present) < 2:
            raise ValueError(
                f"trace {path!r} is version 2 (next-best ranks) but a part lacks "
                f"{[a for a in _ranks.RANK_ARRAYS if a not in p]}; the file is damaged: record it again"
            )
        if not ranked and present:
            raise ValueError(
                f"trace {path!r} holds {present} but its header is version 1 (no ranks); the header is "
                "damaged or was not written by TraceWriter: record it again"
            )
    rank_offsets = ranks = None
    if ranked:
        rank_offsets = _concat_offsets([p["rank_offsets"] for p in parts])
        ranks = np.concatenate([p["ranks"] for p in parts]).astype(np.int32, copy=False)
    trace = Trace(
        header=header,
        stream=np.concatenate([p["stream"] for p in parts]).astype(np.int64, copy=False),
        layer=np.concatenate([p["layer"] for p in parts]).astype(np.int32, copy=False),
        seq_len=np.concatenate([p["seq_len"] for p in parts]).astype(np.int32, copy=False),
        offsets=_concat_offsets([p["offsets"] for p in parts]),
        positions=np.concatenate([p["positions"] for p in parts]).astype(np.int32, copy=False),
        rank_offsets=rank_offsets,
        ranks=ranks,
    )
    if validate:
        trace.validate()
    return trace


def _concat_offsets(parts: list[np.ndarray]) -> np.ndarray:
    """One offsets array from the parts' (each from 0 to its values' length)."""
    out, base = [np.zeros(1, np.int64)], 0
    for offs in parts:
        if offs.size == 0:
            raise ValueError("a trace part's offsets array is empty (it has one entry more than rows); the file is damaged")
        out.append(offs[1:].astype(np.int64) + base)
        base += int(offs[-1])
    return np.concatenate(out)
