"""Side streams and events of the coordinator; inert stand-ins on CPU.

The coordinator overlaps three kinds of copies with the forward pass:

```
staging stream   prompt KV device → host after prefill (one event per request)
backup stream    write-through to host: the previous newest token each decode step, the
                 accepted tokens each verify round; one fence (``Streams.backup_fence``)
prefetch stream  copy-only replays of an anchor layer's miss plan for its shared layers
                 (one event per shared layer)
```

Every device → host copy goes through ``transfer.to_host_async``: order the side stream after
the work that wrote the rows, copy on it, record the copy's event, keep the row tensors alive.

On CPU every operation runs eagerly on the caller's thread, so the stand-ins make
``record``/``wait``/``synchronize`` no-ops and ``query`` always true. The coordinator code
is then identical on both devices, which is what lets the exactness harness run in CPU tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class NullEvent:
    """CPU stand-in for ``torch.cuda.Event``: work is already complete when recorded."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class NullStream:
    """CPU stand-in for ``torch.cuda.Stream``."""

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> NullEvent:
        return NullEvent()


class Fence:
    """The latest copy on one side stream, for a consumer stream to wait on once.

    ``record`` (called on the side stream, after the copy) arms it; ``wait(stream)`` orders
    ``stream`` after that copy and disarms it. NOTE: disarming is what makes the wait once per
    copy: everything later on the waiting stream is ordered after it, and the next copy arms
    the fence again. Waiting every time would be correct but stale, and ``event.query()`` to
    skip it would cost a driver call per step for the same answer.
    """

    def __init__(self, streams: Streams) -> None:
        self._streams = streams
        self.event = streams.new_event()
        self.armed = False

    def record(self) -> None:
        self.event.record()
        self.armed = True

    def wait(self, stream: Any) -> None:
        """Order ``stream`` after the latest recorded copy (no-op when none is pending; on CPU
        the copy already ran)."""
        if not self.armed:
            return
        if self._streams.is_cuda:
            stream.wait_event(self.event)
        self.armed = False


class Streams:
    """The three side streams plus helpers that hide the CPU/CUDA difference.

    ``producer`` is the stream that writes KV during the forward pass (SGLang's
    ``forward_stream``, set through ``set_producer``); copies that read KV written by the
    forward must wait on it. When unset, the caller's current stream is used.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:
            self.staging: Any = torch.cuda.Stream(device=self.device)
            self.backup: Any = torch.cuda.Stream(device=self.device)
            # the compute stream's priority: a high-priority prefetch stream measured no faster
            # end to end under graphs (0.999-1.001x, benchmarks/E2E.md "Results")
            self.prefetch: Any = torch.cuda.Stream(device=self.device)
        else:
            self.staging = NullStream()
            self.backup = NullStream()
            self.prefetch = NullStream()
        self.producer: Any = None
        #: the last write-through copy on the backup stream; the forward that reuses the rows
        #: it reads waits on it (``StepMapper.wait_for_pending_backup``, ``SpecWindow.prepare``)
        self.backup_fence = Fence(self)

    def new_event(self) -> Any:
        return torch.cuda.Event() if self.is_cuda else NullEvent()

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.is_cuda else NullStream()

    def set_producer(self, stream: Any) -> None:
        self.producer = stream

    def after_producer(self, side: Any) -> None:
        """Order ``side`` after the forward pass's KV writes and the caller's current work."""
        if not self.is_cuda:
            return
        side.wait_stream(self.current())
        if self.producer is not None:
            side.wait_stream(self.producer)

    def after_current(self, side: Any) -> None:
        """Order ``side`` after the caller's current work only (not the forward pass): for
        copies of KV the host has already seen written (see ``Lifecycle.admit_staging``)."""
        if self.is_cuda:
            side.wait_stream(self.current())

    def current_after(self, *sides: Any) -> None:
        """Order the caller's current stream after the forward stream and ``sides`` (before it
        frees or moves rows that work in flight there may still read)."""
        if not self.is_cuda:
            return
        current = self.current()
        if self.producer is not None:
            current.wait_stream(self.producer)
        for side in sides:
            current.wait_stream(side)

    @contextlib.contextmanager
    def on(self, side: Any) -> Iterator[None]:
        """Run the body's kernels on ``side`` (no-op on CPU)."""
        if self.is_cuda:
            with torch.cuda.stream(side):
                yield
        else:
            yield

    def keep_alive(self, tensor: torch.Tensor, side: Any) -> None:
        """Tell the caching allocator ``tensor`` is used on ``side`` (no-op on CPU)."""
        if self.is_cuda and tensor.is_cuda:
            tensor.record_stream(side)

    def drain(self) -> None:
        """Block the host until every side stream is idle (finish/abort/destroy paths)."""
        for side in (self.staging, self.backup, self.prefetch):
            side.synchronize()
