"""Property tests: random request lifecycles against DualSpaceAllocator.

Each example builds an allocator (random page size, ratio, device rows) and drives up to 60
random operations the way SGLang + the coordinator would: admit (prefill), extend (chunked
prefill), shrink (prompt safe on host), direct (PD admission, logical-only + hot buffer),
decode (logical id + grow/map), finish / abort / retract. ``check_integrity()`` runs after
every step; at the end everything is freed and both spaces must be whole again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_hisparse.memory.allocator import UNMAPPED, DualSpaceAllocator

OPS = ("admit", "extend", "shrink", "direct", "decode", "decode", "finish", "abort", "retract")


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


@dataclass
class Req:
    ids: list[int]
    hot: bool = False
    hot_size: int = 0
    slot_rows: list[int] = field(default_factory=list)


def _decode(a: DualSpaceAllocator, r: int, req: Req, via_alloc: bool) -> bool:
    """One decode step; returns False when the request had to be retracted.

    ``via_alloc``: SGLang's page_size-1 path, ``alloc(bs)`` (logical id + a temporary prefill
    row) followed by ``rebind`` onto the hot slot; otherwise ``alloc_decode`` (logical only).
    """
    n = len(req.ids)
    new = a.alloc(1) if via_alloc else a.alloc_decode(t(n + 1), t(req.ids[-1]))
    if new is None:
        return True  # no logical room: the scheduler would retract others; skip
    req.ids.append(int(new[0]))
    b = req.hot_size
    slot = n if n < b else b  # position n goes to slot n while short, else to slot B
    if req.slot_rows[slot] < 0:
        row = a.hot.grow(r)
        if row is None:
            return False
        req.slot_rows[slot] = int(row[0])
    a.unmap(t(req.ids[-2]))  # previous newest is on host (or stays in its slot)
    if via_alloc:
        a.rebind(new, t(req.slot_rows[slot]), logical_ids_cpu=a.last_alloc_cpu)
    else:
        a.map_tokens(new, t(req.slot_rows[slot]))
    return True


def run_sequence(data: st.DataObject, max_steps: int) -> None:
    page_size = data.draw(st.sampled_from([1, 2, 4]), label="page_size")
    ratio = data.draw(st.integers(1, 3), label="ratio")
    device_rows = data.draw(st.integers(2, 16), label="pages") * page_size
    a = DualSpaceAllocator(device_rows, host_to_device_ratio=ratio, page_size=page_size)
    reqs: dict[int, Req] = {}
    steps = data.draw(st.integers(1, max_steps), label="steps")
    for _ in range(steps):
        op = data.draw(st.sampled_from(OPS))
        free_slots = [s for s in range(6) if s not in reqs]
        prefilling = [r for r, q in reqs.items() if not q.hot]
        hot = [r for r, q in reqs.items() if q.hot]
        if op in ("admit", "direct") and free_slots:
            r = free_slots[0]
            n = data.draw(st.integers(1, 3 * page_size + 5))
            if op == "admit":
                ids = a.alloc_extend(t(0), t(n), t(-1))
                if ids is not None:
                    reqs[r] = Req(ids.tolist())
            else:
                ids = a.alloc_logical_extend(t(0), t(n), t(-1))
                if ids is not None:
                    b = data.draw(st.integers(1, 6))
                    rows = a.hot.alloc(r, n, b)
                    if rows is None:
                        a.free(ids)  # admission failed: give the logical ids back
                    else:
                        reqs[r] = Req(ids.tolist(), True, b, rows.tolist())
                        if n > b:
                            a.map_tokens(ids[-1:], rows[-1:])
        elif op == "extend" and prefilling:
            r = data.draw(st.sampled_from(prefilling))
            q, m = reqs[r], data.draw(st.integers(1, 6))
            n = len(q.ids)
            ids = a.alloc_extend(t(n), t(n + m), t(q.ids[-1]))
            if ids is not None:
                q.ids.extend(ids.tolist())
        elif op == "shrink" and prefilling:
            r = data.draw(st.sampled_from(prefilling))
            q = reqs[r]
            q.hot, q.hot_size = True, data.draw(st.integers(1, 6))
            rows = a.shrink_to_hot_buffer(r, t(*q.ids), q.hot_size)
            q.slot_rows = rows.tolist()
            k = min(len(q.ids), q.hot_size)
            assert (rows[:k] > 0).all() and (rows[k : q.hot_size] == -1).all()
            assert a.translate(t(q.ids[-1])).item() > 0
        elif op == "decode" and hot:
            r = data.draw(st.sampled_from(hot))
            via_alloc = page_size == 1 and data.draw(st.booleans())
            if not _decode(a, r, reqs[r], via_alloc):
                a.free_request(r, t(*reqs.pop(r).ids))  # retract: no device room to grow
        elif op in ("finish", "abort", "retract") and reqs:
            r = data.draw(st.sampled_from(sorted(reqs)))
            a.free_request(r, t(*reqs.pop(r).ids))
        a.check_integrity()
        # rows of live hot slots are distinct across requests
        live = [x for q in reqs.values() if q.hot for x in q.slot_rows if x >= 0]
        assert len(live) == len(set(live))
    for r in sorted(reqs):
        a.free_request(r, t(*reqs.pop(r).ids))
    a.check_integrity()
    assert a.logical.available_size() == a.size_full
    assert a.rows.available_size() == a.size_device
    assert a.hot.request_slots() == []
    assert (a.mapping[:-1] == UNMAPPED).all() and int(a.mapping[-1]) == -1


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_lifecycles_keep_integrity(data):
    run_sequence(data, max_steps=40)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_lifecycles_long_sweep(data):
    run_sequence(data, max_steps=120)
