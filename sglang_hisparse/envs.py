"""Every ``SGLANG_HISPARSE_*`` environment variable: its type, default and meaning.

One registry so that ``doctor`` can print the effective values, the docs table is generated
from the same source, and a typo in a value fails loudly instead of silently meaning "off".
Some switches also honour the name SGLang's in-tree HiSparse reads, so existing A/B scripts
keep working; :func:`source` tells which name supplied a value so the log can say so. A
variable set to an empty string counts as unset (its default). Numbers are checked against
their rule (finite, in range) whenever they are read, so ``doctor`` reports a bad value even
while the feature it tunes is off.

Usage::

    from sglang_hisparse import envs
    if envs.get("SGLANG_HISPARSE_DISABLE_PREFETCH"):
        ...
    envs.source("SGLANG_HISPARSE_DISABLE_PREFETCH")  # -> "SGLANG_DISABLE_HISPARSE_PREFETCH" or None
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class UnknownEnvVarError(KeyError, ValueError):
    """A name that is not in the registry (a ``KeyError`` for lookups, a ``ValueError`` like
    every other bad input; ``str()`` is the message itself, not its repr)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _seconds(value: float) -> str | None:
    if not math.isfinite(value) or value < 0:
        return "must be a finite number of seconds >= 0 (0 disables reporting), e.g. 30"
    return None


def _fraction(value: float) -> str | None:
    if not 0.0 <= value <= 1.0:  # false for nan too
        return "must be a fraction in [0, 1] of requests to record, e.g. 0.01"
    return None


def _count(value: int) -> str | None:
    if value < 0:
        return "must be an integer >= 0 (0 disables it), e.g. 128"
    return None


_INTEGER = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable. ``legacy`` lists older names read when ``name`` is unset;
    ``check`` returns the broken rule for a parsed value (None when it is fine)."""

    name: str
    kind: type
    default: Any
    meaning: str
    legacy: tuple[str, ...] = ()
    check: Callable[[Any], str | None] | None = None


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
            "0 disables both; a negative, nan or inf value is an error.",
            check=_seconds,
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
            "when SGLANG_HISPARSE_RECORD_TRACE is set; in [0, 1] (checked even when recording is off).",
            check=_fraction,
        ),
        EnvVar(
            "SGLANG_HISPARSE_RECORD_NEXT_BEST",
            int,
            0,
            "Next-best ranks (k+1..k+M) recorded per row beside each selection when "
            "SGLANG_HISPARSE_RECORD_TRACE is set: a version-2 trace, which the rank policy needs. "
            "0: selections only (version 1). Needs the indexer to hand over its ordered top-(k + M); "
            "until that hook exists the live recorder records version 1 and says so "
            "(docs/traces.md). An integer >= 0.",
            check=_count,
        ),
    )
}


def registry() -> dict[str, EnvVar]:
    """All known variables by name (a copy; for ``doctor`` and the docs table)."""
    return dict(_REGISTRY)


def _raw(var: EnvVar) -> tuple[str | None, str | None]:
    # NOTE: a set-but-empty variable (``VAR= cmd``) counts as unset, for every kind: it means
    # the default, never a silent "off" (the alternative, an error, would break launchers that
    # blank variables they do not use).
    for name in (var.name, *var.legacy):
        value = os.environ.get(name)
        if value is not None and value.strip():
            return name, value
    return None, None


def _lookup(name: str) -> EnvVar:
    var = _REGISTRY.get(name) if isinstance(name, str) else None
    if var is None:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UnknownEnvVarError(
            f"unknown sglang_hisparse environment variable {name!r}; {hint}known: {', '.join(sorted(_REGISTRY))}"
        )
    return var


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
            number = float(value)
        except ValueError:
            example = "0.01" if var.check is _fraction else "30"
            raise ValueError(f"{name}={value!r} is not a number; e.g. {name}={example}") from None
        if var.check is not None and (rule := var.check(number)) is not None:
            raise ValueError(f"{name}={value!r} {rule}")
        return number
    if var.kind is int:
        # NOTE: ASCII digits only: int() would also take "1_000" and non-ASCII digits, which
        # are more likely typos than intent.
        if not _INTEGER.fullmatch(value.strip()):
            raise ValueError(f"{name}={value!r} is not an integer; e.g. {name}=128")
        try:
            number = int(value)
        except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
            raise ValueError(f"{name}={value[:20]!r}... has too many digits; e.g. {name}=128") from None
        if var.check is not None and (rule := var.check(number)) is not None:
            raise ValueError(f"{name}={value!r} {rule}")
        return number
    return value


def get(name: str) -> Any:
    """Effective value of ``name`` (its own name first, then legacy names, then the default).

    Raises ``ValueError`` naming the variable, its value and the rule for a bad value, and
    :class:`UnknownEnvVarError` (a ``KeyError`` and a ``ValueError``) for an unknown name.
    """
    var = _lookup(name)
    used, value = _raw(var)
    if used is None:
        return var.default
    return _parse(var, used, value)


def source(name: str) -> str | None:
    """Which environment name supplied ``name``'s value (the name itself, a legacy one, or None)."""
    used, _ = _raw(_lookup(name))
    return used


def markdown_table() -> str:
    """The documentation table (docs/configuration.md embeds its output)."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for var in _REGISTRY.values():
        alias = f" (also read: `{'`, `'.join(var.legacy)}`)" if var.legacy else ""
        rows.append(f"| `{var.name}`{alias} | {var.kind.__name__} | `{var.default!r}` | {var.meaning} |")
    return "\n".join(rows)
