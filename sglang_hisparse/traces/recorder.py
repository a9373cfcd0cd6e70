"""Live trace recording inside a serving process (``SGLANG_HISPARSE_RECORD_TRACE=<dir>``).

The coordinator holds ``None`` when recording is off, so the off path costs nothing. When
on, it calls (see docs/traces.md)::

    recorder.begin_step(req_index_cpu, seq_lens_cpu)       # once per decode step, host lists
    recorder.record(layer_id=l, req_index=ri, seq_lens=sl, top_k=tk)   # per resolved layer
    recorder.record(..., top_k=ordered, k=k)  # or the ordered top-(k + m): selection + next-best
    recorder.release(r)                                   # request slot r finished (optional)
    recorder.close()                                      # teardown (also registered atexit)

Sampling is per *request*, not per step: a stream must hold every decode step of a request
for the simulator to replay its buffer, so each new request is recorded with probability
``SGLANG_HISPARSE_RECORD_SAMPLE`` and then completely. The host decides which batch rows
are sampled from the step's host lists (no device read-back); ``record`` gathers only
those rows on the device and copies them to pinned host memory with ``non_blocking``,
behind a CUDA event; finished copies are drained into a ``TraceWriter`` directory on later
calls. A step with no sampled request returns after one attribute check.

With ``next_best=m`` the trace is version 2 (``ranks.py``): ``record(..., top_k=ordered, k=k)``
takes the indexer's top-(k + m) in score order, [bs, k + m'] with m' <= m; its first k columns are
the selection and the rest the next-best ranks in rank order, both copied in the one gather.
``from_env(ranked=True)`` takes m from ``SGLANG_HISPARSE_RECORD_NEXT_BEST``; without ``ranked``
(the coordinator today: no hook hands it the indexer's top-(k + m) yet) it records version 1.

Not recorded: steps replayed from a CUDA graph (Python does not run; capture is detected
and skipped), so record with ``--disable-cuda-graph`` or above ``--cuda-graph-max-bs``.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .format import TraceWriter, make_header
from .ranks import split_ranked

logger = logging.getLogger(__name__)


def _env_settings() -> tuple[str, float, int]:
    """(directory, sample fraction, next-best ranks) from the env registry, or os.environ when
    it is absent."""
    try:
        from sglang_hisparse import envs

        return (
            str(envs.get("SGLANG_HISPARSE_RECORD_TRACE")),
            float(envs.get("SGLANG_HISPARSE_RECORD_SAMPLE")),
            int(envs.get("SGLANG_HISPARSE_RECORD_NEXT_BEST")),
        )
    except (ImportError, KeyError):
        return (
            os.environ.get("SGLANG_HISPARSE_RECORD_TRACE", ""),
            float(os.environ.get("SGLANG_HISPARSE_RECORD_SAMPLE", "0.01")),
            int(os.environ.get("SGLANG_HISPARSE_RECORD_NEXT_BEST") or 0),
        )


class LiveTraceRecorder:
    """Records the top-k selections of sampled requests into a trace directory.

    ``directory``: parent folder; this process writes ``<directory>/trace-<pid>-<time>/`` (``-1``,
    ``-2``, ... appended for further recorders within the same second).
    ``sample``: probability in [0, 1] that a new request is recorded. ``max_rows``: most
    sampled requests recorded at once (bounds the per-layer copy to ``max_rows × k`` ints).
    ``next_best``: m > 0 records the indexer's next-best ranks too (a version-2 trace; ``record``
    then takes the ordered top-(k + m) with ``k``); 0 (default) records selections only.
    """

    def __init__(self, directory: str, *, sample: float = 0.01, max_rows: int = 8, seed: int = 0,
                 source: dict[str, Any] | None = None, next_best: int = 0):
        if not 0.0 <= sample <= 1.0:
            raise ValueError(
                f"SGLANG_HISPARSE_RECORD_SAMPLE={sample} must be a fraction in [0, 1] of requests to record"
            )
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows} must be >= 1")
        if isinstance(next_best, bool) or not isinstance(next_best, int) or next_best < 0:
            raise ValueError(f"next_best={next_best!r} must be an integer >= 0 (next-best ranks recorded per row)")
        self.next_best = next_best
        self.sample = sample
        self.max_rows = max_rows
        self._rng = random.Random(seed)
        base = os.path.join(directory, f"trace-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}")
        # a second recorder of this process within the same second gets its own directory
        # (sharing one, its header would overwrite the first's and mislabel the parts)
        self.path, n = base, 1
        while os.path.exists(self.path):
            self.path, n = f"{base}-{n}", n + 1
        src = {"recorder": "live", "sample": sample, "pid": os.getpid(), **(source or {})}
        header = make_header(top_k=0, sorted_by_score=False, source=src, next_best=next_best or None)
        self.writer = TraceWriter(self.path, header)
        self.writer.flush()  # header.json now: a crashed server still leaves a loadable directory
        self._auto = True  # until begin_step is called from outside: read the batch back per step
        # slot r -> (stream id or -1 when not sampled, last seq_len)
        self._slots: dict[int, tuple[int, int]] = {}
        self._next_stream = 0
        self._live_sampled = 0
        self._rows: list[int] = []  # batch rows sampled this step
        self._row_streams: list[int] = []
        self._row_lens: list[int] = []
        self._rows_dev: torch.Tensor | None = None
        self._last_layer: int | None = None
        self._pending: deque = deque()
        self._warned_capture = False
        self._closed = False
        atexit.register(self.close)

    @classmethod
    def from_env(cls, *, ranked: bool = False) -> LiveTraceRecorder | None:
        """A recorder when ``SGLANG_HISPARSE_RECORD_TRACE`` is set, else ``None``.

        ``SGLANG_HISPARSE_RECORD_NEXT_BEST=m`` makes it record m next-best ranks (version 2) when
        the caller says it passes the ordered top-(k + m) to ``record(..., k=k)`` (``ranked``).
        A caller without ranks (today's coordinator: no SGLang hook hands over the indexer's
        k + m yet) gets a version-1 recorder and a warning, and the trace's ``source`` keeps
        the m that was asked for.
        """
        directory, sample, next_best = _env_settings()
        if not directory:
            return None
        # NOTE: version 1 rather than a version-2 trace whose rows carry no ranks: on such a
        # trace ``simulate --policy rank`` would replay as slru miss for miss and look like a
        # measurement of the rank policy when it is none.
        source: dict[str, Any] = {}
        if next_best and not ranked:
            logger.warning(
                "HiSparse: SGLANG_HISPARSE_RECORD_NEXT_BEST=%d is ignored: the indexer's ordered top-(k + m) "
                "does not reach the recorder yet (the SGLang hook is not in place), so this trace is version 1, "
                "selections only (docs/traces.md)", next_best,
            )
            source["next_best_requested"] = next_best
            next_best = 0
        rec = cls(directory, sample=sample, next_best=next_best, source=source)
        logger.info(
            "HiSparse: recording selection traces of %.2f%% of requests into %s%s", 100 * sample, rec.path,
            f" with {next_best} next-best ranks" if next_best else "",
        )
        return rec

    # -- host-side step bookkeeping -------------------------------------------------------
    def begin_step(self, req_index_cpu: Sequence[int], seq_lens_cpu: Sequence[int]) -> None:
        """Note the batch of this decode step (host lists, batch order as passed to resolve)."""
        self._auto = False
        self._begin(req_index_cpu, seq_lens_cpu)

    def _begin(self, req_index_cpu: Sequence[int], seq_lens_cpu: Sequence[int]) -> None:
        rows, streams, lens = [], [], []
        for b, (r, n) in enumerate(zip(req_index_cpu, seq_lens_cpu, strict=True)):
            r, n = int(r), int(n)
            sid, last = self._slots.get(r, (-2, 0))
            # Decode grows a request by exactly one token per step: anything else in slot r
            # is a new request life (the previous one finished without ``release``).
            if sid == -2 or n != last + 1:
                if sid >= 0:
                    self._live_sampled -= 1
                sid = -1
                if self._live_sampled < self.max_rows and self._rng.random() < self.sample:
                    sid = self._next_stream
                    self._next_stream += 1
                    self._live_sampled += 1
            self._slots[r] = (sid, n)
            if sid >= 0:
                rows.append(b)
                streams.append(sid)
                lens.append(n)
        self._rows, self._row_streams, self._row_lens = rows, streams, lens
        self._rows_dev = None
        self._last_layer = None

    def release(self, r: int) -> None:
        """Request slot ``r`` finished: its next occupant is a new stream."""
        sid, _ = self._slots.pop(int(r), (-1, 0))
        if sid >= 0:
            self._live_sampled -= 1

    # -- per layer --------------------------------------------------------------------------
    def record(self, *, layer_id: int, req_index: torch.Tensor, seq_lens: torch.Tensor,
               top_k: torch.Tensor, k: int | None = None) -> None:
        """Queue the sampled rows of ``top_k`` int32 [bs, k] (device or host) for writing; with
        ``k``, ``top_k`` is the ordered top-(k + m') [bs, k + m'] (m' <= ``next_best``): the first
        ``k`` columns the selection, the rest the next-best ranks (-1 padding in either).

        Without ``begin_step`` calls, a new step is detected by ``layer_id`` not increasing
        and the batch is read back with ``tolist()`` (a host sync: slower, still correct).
        """
        if self._closed:
            return
        if k is not None:
            if not self.next_best:
                raise ValueError(
                    "record(k=...): this recorder keeps no next-best ranks; create it with "
                    "LiveTraceRecorder(..., next_best=M) to record the ordered top-(k + m)"
                )
            width = int(top_k.shape[-1])
            split_ranked(np.zeros((0, width), np.int32), k)  # the width rule, before any work
            if width - k > self.next_best:
                raise ValueError(
                    f"record(k={k}): top_k has {width} columns, {width - k} next-best ranks, more than this "
                    f"recorder's next_best={self.next_best}"
                )
        if top_k.is_cuda and torch.cuda.is_current_stream_capturing():
            if not self._warned_capture:
                logger.warning("HiSparse trace recorder: CUDA-graph steps are not recorded (use --disable-cuda-graph).")
                self._warned_capture = True
            return
        if self._auto and (self._last_layer is None or layer_id <= self._last_layer):
            self._begin(req_index.tolist(), seq_lens.tolist())
        self._last_layer = layer_id
        self._drain(block=False)
        if not self._rows:
            return
        if self._rows_dev is None:
            self._rows_dev = torch.tensor(self._rows, dtype=torch.long).to(top_k.device, non_blocking=True)
        picked = top_k.index_select(0, self._rows_dev)
        if picked.is_cuda:
            host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
            host.copy_(picked, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = picked.clone(), None
        self._pending.append((layer_id, list(self._row_streams), list(self._row_lens), host, event, k))

    def _drain(self, block: bool) -> None:
        while self._pending:
            layer, streams, lens, host, event, k = self._pending[0]
            if event is not None and not event.query():
                if not block:
                    return
                event.synchronize()
            self._pending.popleft()
            arr = host.numpy()
            for i, (sid, n) in enumerate(zip(streams, lens, strict=True)):
                if k is None:
                    self.writer.add(sid, layer, n, np.asarray(arr[i]))
                else:
                    sel, nb = split_ranked(arr[i], k)
                    self.writer.add(sid, layer, n, sel, nb)

    def flush(self) -> None:
        """Wait for queued copies and write them (parts and header) to disk."""
        self._drain(block=True)
        self.writer.flush()

    def close(self) -> None:
        """Flush and stop recording (idempotent; also runs at interpreter exit)."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self.writer.close()
