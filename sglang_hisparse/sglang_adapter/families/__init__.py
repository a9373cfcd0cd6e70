"""The model families the SGLang coordinator serves, one module each, and their registry.

A family is detected once, when the coordinator is built: the first entry of :data:`FAMILIES`
whose ``detects(kvcache)`` holds for the pool SGLang built (``allocator.get_kvcache()``) is
constructed over that pool and the allocator, and the coordinator asks it every question on
which the families differ (``base.ModelFamily`` has the table). A new family is a module with
a ``ModelFamily`` subclass and a line here.

NOTE: each ``detects`` imports its pool classes inside the call rather than at module level,
so importing the coordinator loads none of SGLang's pool modules (seconds each). A server has
loaded them all when the plugin registered; a unit test's DSA coordinator, detected first,
never loads V4's.
"""

from __future__ import annotations

from typing import Any

from sglang_hisparse.sglang_adapter.families.base import ModelFamily, Selection, dual_allocator
from sglang_hisparse.sglang_adapter.families.dsa import DSAFamily
from sglang_hisparse.sglang_adapter.families.m3 import M3Family
from sglang_hisparse.sglang_adapter.families.v4 import V4Family

__all__ = ["FAMILIES", "ModelFamily", "Selection", "detect_family"]

#: checked in order; the pool types are disjoint, so the order only decides what is imported
FAMILIES: tuple[type[ModelFamily], ...] = (DSAFamily, M3Family, V4Family)


def detect_family(allocator: Any) -> ModelFamily:
    """The family of the pool behind SGLang's ``token_to_kv_pool_allocator`` (which must be
    ours: checked first, ``base.dual_allocator``)."""
    dual = dual_allocator(allocator)
    kvcache = allocator.get_kvcache()
    for family in FAMILIES:
        if family.detects(kvcache):
            return family(kvcache, allocator, dual)
    served = "; ".join(f"{f.label}: {f.pools}" for f in FAMILIES)
    raise ValueError(
        f"SGLangHiSparseCoordinator: the KV pool SGLang built ({type(kvcache).__name__}) is none that "
        f"sglang-hisparse serves ({served}); launch with the sglang-hisparse plugin installed so "
        f"SGLang builds our pools."
    )
