"""A toy radix tree over whole pages of logical ids, with SGLang 0.5.23's call protocol.

It stands in for ``UnifiedRadixCache`` in the CPU harness (``engine.py``, radix mode):

```
match(keys)        longest run of whole pages already in the tree, capped so at least one
                   prompt token is computed (schedule_batch.py: the match stops at input_len-1)
lock / unlock      a request's matched path can not be evicted while it runs
checkpoint(keys, ids, start_page)
                   insert pages [start_page, len(keys) // ps): a page already in the tree is a
                   duplicate: the caller's ids of it are returned (SGLang frees them and repoints
                   the request's row to the tree's ids, unified_radix_cache.py:1295-1298)
evict(pages)       least recently used unlocked leaves first; returns their ids (the caller frees
                   them through the allocator, as FullComponent.evict_component does)
```

A page's key is the chain of its tokens' keys and every earlier page's (a radix path), so two
requests share a tree page exactly when their prompts agree up to the end of that page.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _Node:
    ids: torch.Tensor  # int64 [page_size] (CPU): the page's logical ids
    parent: int | None  # the previous page's path key
    children: int = 0
    locks: int = 0
    used: int = 0  # LRU clock of the last match / insert


@dataclass
class ToyRadixTree:
    page_size: int
    nodes: dict[int, _Node] = field(default_factory=dict)
    _clock: int = 0

    # -- keys -------------------------------------------------------------------------------
    def path_keys(self, token_keys: list[tuple]) -> list[int]:
        """One key per whole page of ``token_keys``: the hash of the page's path from the root."""
        ps, out, prev = self.page_size, [], 0
        for j in range(len(token_keys) // ps):
            prev = hash((prev, tuple(token_keys[j * ps : (j + 1) * ps])))
            out.append(prev)
        return out

    # -- queries ----------------------------------------------------------------------------
    def match(self, token_keys: list[tuple]) -> tuple[list[int], torch.Tensor]:
        """(path keys of the matched pages, their ids int64 [matched tokens]); the match leaves
        at least one token to compute."""
        keys = self.path_keys(token_keys[: max(len(token_keys) - 1, 0)])
        hit: list[int] = []
        for k in keys:
            if k not in self.nodes:
                break
            hit.append(k)
        self._clock += 1
        for k in hit:
            self.nodes[k].used = self._clock
        ids = torch.cat([self.nodes[k].ids for k in hit]) if hit else torch.empty(0, dtype=torch.int64)
        return hit, ids

    def evictable_pages(self) -> int:
        return sum(1 for n in self.nodes.values() if n.locks == 0)

    def size(self) -> int:
        return len(self.nodes) * self.page_size

    # -- mutation ---------------------------------------------------------------------------
    def lock(self, keys: list[int]) -> None:
        for k in keys:
            self.nodes[k].locks += 1

    def unlock(self, keys: list[int]) -> None:
        for k in keys:
            node = self.nodes[k]
            if node.locks <= 0:
                raise AssertionError(f"toy radix: unlock of an unlocked page (key {k})")
            node.locks -= 1

    def checkpoint(self, token_keys: list[tuple], ids: torch.Tensor, start_page: int) -> tuple[list[int], list[tuple[int, torch.Tensor]]]:
        """Insert the whole pages ``start_page..`` of a request (``ids`` int64 [len(token_keys)]
        CPU, its row). Returns (path keys of every whole page, now in the tree; duplicates:
        (page index, the tree's ids) for each page the tree already held)."""
        ps = self.page_size
        keys = self.path_keys(token_keys)
        dups: list[tuple[int, torch.Tensor]] = []
        self._clock += 1
        for j in range(start_page, len(keys)):
            k = keys[j]
            node = self.nodes.get(k)
            if node is not None:
                if not torch.equal(node.ids, ids[j * ps : (j + 1) * ps]):
                    dups.append((j, node.ids))
                node.used = self._clock
                continue
            parent = keys[j - 1] if j else None
            self.nodes[k] = _Node(ids=ids[j * ps : (j + 1) * ps].clone(), parent=parent, used=self._clock)
            if parent is not None:
                self.nodes[parent].children += 1
        return keys, dups

    def evict(self, pages: int) -> torch.Tensor:
        """Remove up to ``pages`` unlocked leaves, least recently used first (a parent becomes a
        leaf once its children are gone); returns their ids (CPU int64)."""
        out: list[torch.Tensor] = []
        while len(out) < pages:
            leaves = [(n.used, k) for k, n in self.nodes.items() if n.children == 0 and n.locks == 0]
            if not leaves:
                break
            _, k = min(leaves)
            node = self.nodes.pop(k)
            if node.parent is not None:
                self.nodes[node.parent].children -= 1
            out.append(node.ids)
        return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)

    def check(self) -> None:
        """No page is locked (the engine is idle)."""
        locked = [k for k, n in self.nodes.items() if n.locks]
        if locked:
            raise AssertionError(f"toy radix: {len(locked)} pages still locked at idle")
