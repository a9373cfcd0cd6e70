"""KV-write locations translated once per forward instead of once per layer.

Every layer of a forward writes its new tokens' KV at the same logical locations (SGLang 0.5.23:
the DSA backend's ``forward_decode`` / ``forward_extend`` call
``token_to_kv_pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, ...)`` per layer with
the one ``out_cache_loc`` tensor of the batch), and the pool translates them through the
logical -> device ``mapping``: ``where(loc >= 0, mapping[loc.clamp(0)], loc)``, four launches
a layer for int64 locations (five for int32), 244 / 312 per step at 61 / 78 layers. Indexer keys live in logical space
(``HiSparseDSAPool``, ``hisparse_testing.device_pool``): their writes need no translation.

:class:`ForwardTranslation` keeps the translation of the first layer and hands it to the later
layers of the same forward.

NOTE (invalidation): a kept translation of ``loc`` is reused only when all of these hold:

* the same tensor object (the entry holds it, so its ``id`` cannot be reused by another), with
  the same data pointer, shape and strides;
* the same ``mapping`` object, and the same version counter of ``loc`` and of ``mapping``
  where torch keeps one (tensors created under ``inference_mode``, as SGLang's batches are,
  keep none; the mapping is created outside it and counts every in-place write);
* the same CUDA-graph capture state of the current stream;
* a layer id greater than every layer that used the entry so far.

The last rule is what makes a new forward start afresh even when it reuses the same tensor: a
forward visits its layers in increasing order, so its first layer is never greater than the
last layer of the forward before it. That covers SGLang's CUDA-graph runner, which runs one
``ForwardBatch`` (one ``out_cache_loc`` object) eagerly for warm-up and again under capture:
the capture's first layer recomputes, so the translation is a node of the graph (replayed
every step from the static ``out_cache_loc`` buffer), never a tensor from the warm-up. Within
one forward nothing rewrites ``out_cache_loc``, and the mapping is written only between
forwards (``map_last_loc``, ``prepare_spec``, the allocator's frees and prefill allocation),
which the version counter sees where torch keeps one. The rejected alternative, a
translation per layer fused into one launch, still costs a launch per layer; keeping the
result costs none past the first layer. Against translating in every layer it measured 4
launches per forward instead of 244 / 312 and 1.3-1.7 % of the GPU time
(``benchmarks/results/step_overhead_h200.json``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["ForwardTranslation", "translate_locations"]


def translate_locations(mapping: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    """int64, ``loc``'s shape: the device row of each logical location; negative entries
    (padding, SGLang's ``-1`` = no prefix) pass through unchanged."""
    loc = loc.to(torch.int64)
    return torch.where(loc >= 0, mapping[loc.clamp(min=0)], loc)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass
class _Entry:
    loc: torch.Tensor
    mapping: torch.Tensor
    key: tuple
    last_layer: int
    rows: torch.Tensor


class ForwardTranslation:
    """Per-forward cache of ``translate(mapping, loc)`` (the rules are the module's NOTE).

    translate: the translation to cache (default :func:`translate_locations`); entries: how
    many ``loc`` tensors are kept at once (interleaved micro-batches each keep theirs).
    """

    def __init__(
        self,
        translate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = translate_locations,
        *,
        entries: int = 4,
    ) -> None:
        self._translate = translate
        self._max = max(1, entries)
        self._entries: list[_Entry] = []
        #: translations computed / served from an entry (host-side counters, for tests and
        #: ``benchmarks/bench_step_overhead.py``)
        self.computed = 0
        self.reused = 0

    def __call__(self, mapping: torch.Tensor, loc: torch.Tensor, layer_id: int) -> torch.Tensor:
        """``translate(mapping, loc)`` for layer ``layer_id`` of the current forward."""
        # under torch.compile tracing the cache's Python state (identity, version counters)
        # is not part of the graph; translate plainly and let the compiler see the ops
        if torch.compiler.is_compiling():
            self.computed += 1
            return self._translate(mapping, loc)
        key = (loc.data_ptr(), tuple(loc.shape), loc.stride(), loc.dtype, _version(loc),
               _version(mapping), _capturing(loc))
        for e in self._entries:
            if e.loc is loc and e.mapping is mapping and e.key == key and layer_id > e.last_layer:
                e.last_layer = layer_id
                self.reused += 1
                return e.rows
        rows = self._translate(mapping, loc)
        self.computed += 1
        kept = [e for e in self._entries if e.loc is not loc]
        self._entries = kept[max(0, len(kept) - self._max + 1):] + [
            _Entry(loc, mapping, key, layer_id, rows)
        ]
        return rows

    def clear(self) -> None:
        """Drop every kept translation (and the tensors it holds)."""
        self._entries = []
