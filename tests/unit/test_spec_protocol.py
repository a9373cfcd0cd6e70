"""SpecWindow (speculative verify window) over the real allocator / pools, CPU, standalone.

Sizes: L = 2 layers, R = 6 request slots, B = 16 hot slots, W = 3 verify rows (n = 2 drafts),
k = 4, I = 16 bytes, page 1. A KV row holds int32 ``[uid, position, layer, salt]`` where salt
is the round that wrote it, so a stale or rejected row is told apart from the accepted one.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse_testing.device_pool import DeviceKVPool
from sglang_hisparse.coordinator.context import CoreContext
from sglang_hisparse.coordinator.lifecycle import Lifecycle
from sglang_hisparse.coordinator.spec import SpecWindow
from sglang_hisparse.coordinator.state import SlotState
from sglang_hisparse.coordinator.streams import Streams
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.memory.allocator import DualSpaceAllocator
from sglang_hisparse.memory.host_pool import HostKVPool
from sglang_hisparse.telemetry import Telemetry

L, R, B, W, K, ITEM, CTX = 2, 6, 16, 3, 4, 16, 160


def kv(uid: int, positions: list[int], layer: int, salt: int) -> torch.Tensor:
    t = torch.tensor([[uid, p, layer, salt] for p in positions], dtype=torch.int32)
    return t.view(torch.uint8).reshape(len(positions), ITEM)


class Rig:
    """Memory + lifecycle + SpecWindow, and the slice of SGLang's EAGLE loop the tests need."""

    def __init__(self) -> None:
        cpu = torch.device("cpu")
        self.alloc = DualSpaceAllocator(256, host_to_device_ratio=8)
        self.pool = DeviceKVPool(num_layers=L, item_bytes=ITEM, allocator=self.alloc)
        self.host = HostKVPool(num_layers=L, item_bytes=ITEM, capacity_tokens=256 * 8,
                               page_size=1, max_requests=R, max_context=CTX, pin=False)
        st = SlotState(num_layers=L, num_reqs=R, buffer_size=B, device=cpu, num_draft_tokens=W)
        self.ctx = CoreContext(top_k=K, buffer_size=B, item_bytes=ITEM, device=cpu,
                               allocator=self.alloc, host=self.host, device_kv=self.pool.kv,
                               host_kv=self.host.kv, state=st, streams=Streams(cpu),
                               telemetry=Telemetry(cpu))
        self.life = Lifecycle(self.ctx)
        self.spec = SpecWindow(self.ctx)
        self.ids: dict[int, list[int]] = {}
        self.uid: dict[int, int] = {}
        self.salt: dict[int, list[int]] = {}  # per request: salt of each committed position
        self.next_uid = 1

    def admit(self, r: int, n: int, *, staged: bool) -> None:
        uid, self.next_uid = self.next_uid, self.next_uid + 1
        self.uid[r], self.salt[r] = uid, [0] * n
        self.spec.reserve([r])
        if staged:  # co-located prefill: device rows for the prompt, staged to host
            ids = self.alloc.alloc_extend(torch.tensor([0]), torch.tensor([n]), torch.tensor([-1]))
            for layer in range(L):
                self.pool.write(layer, ids, kv(uid, list(range(n)), layer, 0))
            self.ids[r] = ids.tolist()
            self.life.admit_staging(r, ids)
            assert [e.req_slot for e in self.life.collect_ready()] == [r]
        else:  # PD: the KV arrives in host rows, logical ids only
            self.ids[r] = self.alloc.logical.alloc(n).tolist()
            self.host.bind(r, 0, torch.tensor(self.ids[r]))
            for layer in range(L):
                self.host.kv[layer, self.host.host_rows[r, :n]] = kv(uid, list(range(n)), layer, 0)
            self.life.admit_direct(r, n)
        self.spec.admit(r)

    def finish(self, r: int) -> None:
        self.spec.finish(r)
        self.life.finish(r)
        self.alloc.free(torch.tensor(self.ids.pop(r)))
        del self.uid[r], self.salt[r]

    def round(self, rs: list[int], accept: list[int], salt: int, rnd: random.Random) -> None:
        """prepare -> forward (KV writes + a resolve per layer, checked) -> commit."""
        ss = [len(self.salt[r]) for r in rs]
        new = [self.alloc.logical.alloc(W) for _ in rs]
        self.spec.prepare(req_index=torch.tensor(rs), req_index_cpu=rs, seq_lens_cpu=ss,
                          out_cache_loc=torch.cat(new))
        for layer in range(L):  # the verify forward writes the W tokens' KV via the mapping
            for r, s, ids in zip(rs, ss, new, strict=True):
                self.pool.write(layer, ids, kv(self.uid[r], list(range(s, s + W)), layer, salt))
        self.check_resolve(rs, ss, salt, rnd)
        acc = torch.full((len(rs), W), -1, dtype=torch.int32)
        for b, a in enumerate(accept):
            acc[b, : a + 1] = torch.arange(b * W, b * W + a + 1)
        self.spec.commit(accept_index=acc, validate=True)
        for r, s, a, ids in zip(rs, ss, accept, new, strict=True):
            self.salt[r] += [salt] * (a + 1)
            self.ids[r] += ids[: a + 1].tolist()
            self.alloc.free(ids[a + 1:])  # SGLang frees the rejected drafts' logical ids
            for layer in range(L):  # accepted tokens are on host now
                got = self.host.kv[layer, self.host.host_rows[r, s: s + a + 1]]
                assert torch.equal(got, kv(self.uid[r], list(range(s, s + a + 1)), layer, salt))

    def check_resolve(self, rs, ss, salt, rnd) -> None:
        """Each verify row j selects K positions < s+1+j; every row resolved must hold the
        exact KV (committed salt for history, this round's salt for the window)."""
        bs = len(rs)
        tk = torch.tensor([[[rnd.randrange(s + 1 + j) for _ in range(K)] for j in range(W)]
                           for s in ss], dtype=torch.int32)
        lens = torch.tensor(ss)[:, None] + 1 + torch.arange(W)
        st = self.ctx.state
        for layer in range(L):
            out = torch.empty(bs, W, K, dtype=torch.int32)
            ref.resolve_verify(
                top_k=tk, req_index=torch.tensor(rs), seq_lens=lens,
                num_real_reqs=torch.tensor([bs], dtype=torch.int32), slot_tokens=st.slot_tokens[layer],
                slot_rows=st.slot_rows, lru=st.lru[layer], host_rows=self.host.host_rows,
                host_cache=self.host.kv[layer], device_cache=self.pool.kv[layer], out_rows=out,
                validate=True)
            got = self.pool.kv[layer][out.reshape(-1).long()].view(torch.int32).view(bs, W, K, 4)
            for b, (r, s) in enumerate(zip(rs, ss, strict=True)):
                pos = tk[b].reshape(-1).tolist()
                want = [[self.uid[r], p, layer, self.salt[r][p] if p < s else salt] for p in pos]
                assert got[b].reshape(-1, 4).tolist() == want, f"request slot {r} layer {layer}"

    def assert_empty(self) -> None:
        self.alloc.check_integrity()
        self.host.check_integrity()
        assert self.alloc.logical.used_size() == 0 and self.alloc.rows.used_size() == 0
        assert int(self.host.allocated_lens.sum()) == 0
        assert int((self.alloc.mapping[:-1] != 0).sum()) == 0


def test_one_round_long_and_short_layouts():
    rig = Rig()
    rig.admit(0, 40, staged=True)   # long: window in slots B..B+2
    rig.admit(1, 5, staged=False)   # short: window in slots 5..7
    rnd = random.Random(0)
    rig.round([0, 1], accept=[1, 0], salt=1, rnd=rnd)
    st = rig.ctx.state
    # long: window emptied, history untouched by the verify tokens
    assert st.slot_tokens[:, 0, B:].tolist() == [[-1] * W] * L
    # short: the accepted token stays resident in slot 5, the rejected slots are emptied
    assert st.slot_tokens[:, 1, :8].tolist() == [[0, 1, 2, 3, 4, 5, -1, -1]] * L
    rig.spec.check_integrity()
    rig.round([1, 0], accept=[2, 0], salt=2, rnd=rnd)  # s: 6 and 42
    for r in (0, 1):
        rig.finish(r)
    rig.assert_empty()


def test_thousands_of_random_accept_lengths_leak_nothing():
    rig, rnd = Rig(), random.Random(7)
    for r in range(R):
        rig.admit(r, rnd.choice([3, 9, 14, 40, 90]), staged=r % 2 == 0)
    rounds = accepts = 0
    while accepts < 2000:
        rs = [r for r in rig.uid if rnd.random() < 0.8]
        rnd.shuffle(rs)
        if rs:
            rig.round(rs, [rnd.randrange(W) for _ in rs], salt=rounds + 1, rnd=rnd)
            accepts += len(rs)
        rounds += 1
        for r in list(rig.uid):
            if len(rig.salt[r]) + 2 * W > CTX or rnd.random() < 0.03:
                rig.finish(r)
        for r in range(R):
            if r not in rig.uid and rnd.random() < 0.5:
                rig.admit(r, rnd.choice([2, 7, 13, 30, 70]), staged=rnd.random() < 0.5)
        if rounds % 50 == 0:
            rig.spec.check_integrity()
            rig.alloc.check_integrity()
            rig.host.check_integrity()
    for r in list(rig.uid):
        rig.finish(r)
    rig.assert_empty()


def test_protocol_errors_name_the_problem():
    rig = Rig()
    rig.admit(0, 20, staged=True)
    ids = rig.alloc.logical.alloc(W)
    with pytest.raises(ValueError, match="committed length 21; expected 20..20"):
        rig.spec.prepare(req_index=torch.tensor([0]), req_index_cpu=[0], seq_lens_cpu=[21],
                         out_cache_loc=ids)
    rig.spec.prepare(req_index=torch.tensor([0]), req_index_cpu=[0], seq_lens_cpu=[20],
                     out_cache_loc=ids)
    with pytest.raises(ValueError, match="chain prefix"):
        rig.spec.commit(accept_index=torch.tensor([[0, 2, -1]]), validate=True)
    with pytest.raises(ValueError, match="not yet committed"):
        rig.spec.finish(0)
    rig.spec.commit(accept_index=torch.tensor([[0, 1, 2]]), validate=True)
    with pytest.raises(ValueError, match="expected 21..23"):
        rig.spec.prepare(req_index=torch.tensor([0]), req_index_cpu=[0], seq_lens_cpu=[24],
                         out_cache_loc=ids)
    st = SlotState(num_layers=L, num_reqs=R, buffer_size=B, device="cpu")
    ctx = CoreContext(**{**rig.ctx.__dict__, "state": st})
    with pytest.raises(ValueError, match="build SlotState with num_draft_tokens"):
        SpecWindow(ctx)
    st4 = SlotState(num_layers=L, num_reqs=R, buffer_size=B, device="cpu", num_draft_tokens=4)
    with pytest.raises(ValueError, match="'device_buffer_size' = 16 must be >= speculative_num_draft_tokens.*at least 20"):
        SpecWindow(CoreContext(**{**rig.ctx.__dict__, "top_k": 5, "state": st4}))
