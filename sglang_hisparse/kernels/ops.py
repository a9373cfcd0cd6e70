"""Typed resolve/replay ops (placeholder until the CUDA dispatch lands: reference only)."""

from .reference import replay, resolve

__all__ = ["replay", "resolve"]
