"""Deprecated alias: host memory figures live in :mod:`sglang_hisparse.memory_budget`."""

from sglang_hisparse.memory_budget import GIB, available_host_bytes

__all__ = ["GIB", "available_host_bytes"]
