"""Side streams and events of the coordinator; inert stand-ins on CPU.

The coordinator overlaps three kinds of copies with the forward pass:

```
staging stream   prompt KV device → host after prefill (one event per request)
backup stream    previous newest token device → host each decode step (one event per step)
prefetch stream  copy-only replays of an anchor layer's miss plan for its shared layers
                 (one event per shared layer)
```

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
            self.prefetch: Any = torch.cuda.Stream(device=self.device)
        else:
            self.staging = NullStream()
            self.backup = NullStream()
            self.prefetch = NullStream()
        self.producer: Any = None

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
