"""Every ``SGLANG_HISPARSE_*`` environment variable: its type, default and meaning.

One registry so that ``doctor`` can print the effective values, the docs table is generated
from the same source, and a typo in a value fails loudly instead of silently meaning "off".
Some switches also honour the name SGLang's in-tree HiSparse reads, so existing A/B scripts
keep working; :func:`source` tells which name supplied a value so the log can say so.

Usage::

    from sglang_hisparse import envs
    if envs.get("SGLANG_HISPARSE_DISABLE_PREFETCH"):
        ...
    envs.source("SGLANG_HISPARSE_DISABLE_PREFETCH")  # -> "SGLANG_DISABLE_HISPARSE_PREFETCH" or None
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class EnvVar:
    """One environment variable. ``legacy`` lists older names read when ``name`` is unset."""

    name: str
    kind: type
    default: Any
    meaning: str
    legacy: tuple[str, ...] = ()


_REGISTRY: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "SGLANG_HISPARSE_DISABLE_PREFETCH",
            bool,
            False,
            "Resolve shared-index layers synchronously instead of replaying the anchor's miss "
            "plan on the prefetch stream (A/B switch for the prefetch).",
            legacy=("SGLANG_DISABLE_HISPARSE_PREFETCH",),
        ),
        EnvVar(
            "SGLANG_HISPARSE_SKIP_IO",
            bool,
            False,
            "Do all bookkeeping but copy no KV bytes host->device. Timing oracle only: "
            "model outputs are INVALID while it is set.",
            legacy=("SGLANG_DEBUG_HISPARSE_SKIP_IO",),
        ),
        EnvVar(
            "SGLANG_HISPARSE_EARLY_FETCH",
            bool,
            True,
            "Start fetching the rows of probable misses (selected positions the resident hint "
            "says no slot holds) before the resolve kernel's bookkeeping has proved them misses. "
            "Off: misses are fetched after it (A/B switch; outputs are the same either way).",
        ),
        EnvVar(
            "SGLANG_HISPARSE_VALIDATE",
            bool,
            False,
            "Check kernel inputs (shapes, dtypes, positions in [0, seq_len)) before each "
            "launch. Costs host syncs; never active inside CUDA-graph capture.",
        ),
        EnvVar(
            "SGLANG_HISPARSE_JIT_CACHE",
            str,
            "",
            "Directory for compiled kernels (default ~/.cache/sglang_hisparse/jit).",
        ),
        EnvVar(
            "SGLANG_HISPARSE_LOG_INTERVAL",
            float,
            30.0,
            "Seconds between HiSparse reports: the summary log line (hit rate, misses/step, "
            "GB moved) and, with --enable-metrics, the sglang:hisparse_* Prometheus series. "
            "0 disables both.",
        ),
        EnvVar(
            "SGLANG_HISPARSE_RECORD_TRACE",
            str,
            "",
            "Directory to record the top-k selections the coordinator resolves "
            "(see docs/traces.md). Empty: off, at no cost.",
        ),
        EnvVar(
            "SGLANG_HISPARSE_RECORD_SAMPLE",
            float,
            0.01,
            "Fraction of requests recorded, each at every decode step and resolved layer, "
            "when SGLANG_HISPARSE_RECORD_TRACE is set.",
        ),
    )
}


def registry() -> dict[str, EnvVar]:
    """All known variables by name (a copy; for ``doctor`` and the docs table)."""
    return dict(_REGISTRY)


def _raw(var: EnvVar) -> tuple[str | None, str | None]:
    for name in (var.name, *var.legacy):
        value = os.environ.get(name)
        if value is not None:
            return name, value
    return None, None


def _parse(var: EnvVar, name: str, value: str) -> Any:
    if var.kind is bool:
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(
            f"{name}={value!r} is not a boolean; use 1/0, true/false, yes/no or on/off."
        )
    if var.kind is float:
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a number; give seconds, e.g. {name}=30") from None
    return value


def get(name: str) -> Any:
    """Effective value of ``name`` (its own name first, then legacy names, then the default)."""
    var = _REGISTRY.get(name)
    if var is None:
        raise KeyError(f"unknown sglang_hisparse environment variable {name!r}; known: {sorted(_REGISTRY)}")
    used, value = _raw(var)
    if used is None:
        return var.default
    return _parse(var, used, value)


def source(name: str) -> str | None:
    """Which environment name supplied ``name``'s value (the name itself, a legacy one, or None)."""
    used, _ = _raw(_REGISTRY[name])
    return used


def markdown_table() -> str:
    """The documentation table (docs/configuration.md embeds its output)."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for var in _REGISTRY.values():
        alias = f" (also read: `{'`, `'.join(var.legacy)}`)" if var.legacy else ""
        rows.append(f"| `{var.name}`{alias} | {var.kind.__name__} | `{var.default!r}` | {var.meaning} |")
    return "\n".join(rows)
