"""Capture what a logger says, for tests.

NOTE: not pytest's caplog: SGLang's argument pipeline reconfigures the root logger's handlers,
caplog's among them, so tests attach a handler to our logger directly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def captured_logs(name: str = "sglang_hisparse", level: int = logging.INFO) -> Iterator[list[str]]:
    """The messages ``name`` (and its children) log at ``level`` or above inside the block."""
    logs: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    lg = logging.getLogger(name)
    lg.addHandler(handler)
    old, lg.level = lg.level, level
    try:
        yield logs
    finally:
        lg.removeHandler(handler)
        lg.setLevel(old)
